"""A byte-level tokenizer and the shipped training corpus: language-model data with no download.

The corpus (``ds_canzona/data/corpus/village.txt``) is synthetic English written by
``generate_corpus`` from a fixed seed: short stories about a made-up village, simple sums and
weather reports, repetitive enough that a tiny model's loss falls within a few dozen steps, and
free of anyone's copyright. ``python -m ds_canzona.data_utils --write`` regenerates the file; a
test checks that the shipped file equals the generator's output.

The tokenizer maps UTF-8 bytes to ids 0..255 and adds three specials (pad, bos, eos), so its
vocabulary is 259; a model's embedding may be larger (the tiny Qwen3 config uses 320).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

CORPUS_DIR = Path(__file__).resolve().parent / "data" / "corpus"
DEFAULT_CORPUS = CORPUS_DIR / "village.txt"
CORPUS_SEED = 1234
CORPUS_CHARS = 90_000


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then ``<pad>`` = 256, ``<bos>`` = 257, ``<eos>`` = 258."""

    pad_token_id = 256
    bos_token_id = 257
    eos_token_id = 258
    vocab_size = 259

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        if add_bos:
            ids.insert(0, self.bos_token_id)
        if add_eos:
            ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: Any) -> str:
        """Text of ``ids`` (a list or a 1-D tensor); specials are dropped, broken UTF-8 is replaced."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def load_corpus(path: str | Path | None = None) -> str:
    """The text of ``path`` (default: the shipped corpus). A missing file raises FileNotFoundError."""
    path = Path(path) if path is not None else DEFAULT_CORPUS
    if not path.is_file():
        raise FileNotFoundError(f"corpus file not found: {path}")
    return path.read_text(encoding="utf-8")


def token_blocks(text: str, seq_len: int, tokenizer: ByteTokenizer | None = None):
    """The corpus as a [num_blocks, seq_len] int64 tensor of consecutive, non-overlapping blocks.

    Each block starts with ``<bos>``; the tail that does not fill a block is dropped. For a causal
    LM the labels are the inputs themselves (HuggingFace models shift them inside).
    """
    import torch

    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    tokenizer = tokenizer or ByteTokenizer()
    ids = tokenizer.encode(text)
    body = seq_len - 1
    count = len(ids) // body
    if count == 0:
        raise ValueError(f"the corpus ({len(ids)} bytes) is shorter than one block of {seq_len} tokens")
    data = torch.tensor(ids[:count * body], dtype=torch.long).view(count, body)
    bos = torch.full((count, 1), tokenizer.bos_token_id, dtype=torch.long)
    return torch.cat([bos, data], dim=1)


class BlockDataset:
    """A map-style dataset of ``{"input_ids", "labels"}`` blocks (what HF's Trainer expects)."""

    def __init__(self, blocks):
        self.blocks = blocks

    def __len__(self) -> int:
        return int(self.blocks.shape[0])

    def __getitem__(self, index: int) -> dict:
        block = self.blocks[index]
        return {"input_ids": block, "labels": block.clone()}


# --------------------------------------------------------------------------- corpus generator

_NAMES = ["Mira", "Tobin", "Ansel", "Petra", "Olek", "Wren", "Dalia", "Corin", "Hesper", "Jory", "Lune", "Bram"]
_TRADES = ["the baker", "the ferryman", "the miller", "the potter", "the weaver", "the smith", "the shepherd",
           "the teacher", "the lamplighter", "the beekeeper"]
_PLACES = ["the mill by the river", "the north field", "the old lighthouse", "the market square", "the orchard",
           "the stone bridge", "the school house", "the harbour", "the hill above the village", "the bakery"]
_THINGS = ["a copper kettle", "a lantern", "a map of the hills", "a basket of pears", "a wooden flute",
           "a blue scarf", "a jar of honey", "a small brown dog", "a letter with a red seal", "a bag of flour",
           "a fishing net", "a book of songs"]
_WEATHER = ["rain", "fog", "snow", "wind", "sun", "storm"]
_FEELINGS = ["glad", "tired", "curious", "worried", "proud", "sleepy", "surprised", "calm"]
_TIMES = ["In the morning", "At noon", "In the evening", "Late at night", "Before dawn", "After supper"]
_ACTIONS = ["mended the fence", "baked fresh bread", "counted the sheep", "swept the floor", "lit the lamps",
            "fed the chickens", "sang an old song", "painted the door green", "carried water from the well",
            "wrote a long letter"]
_SAYINGS = ["We should go home before dark.", "The river is higher than last year.",
            "Nobody has seen the ferry since Tuesday.", "Bread tastes better when it is shared.",
            "The bees are quiet today.", "I will finish the work tomorrow.", "Look, the lamps are lit already.",
            "Every road in this valley leads to the bridge."]
_NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
            "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen"]


def _person(rng: random.Random) -> str:
    return rng.choice(_NAMES) if rng.random() < 0.6 else rng.choice(_TRADES)


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def _sentence(rng: random.Random) -> str:
    who, other = _person(rng), _person(rng)
    kind = rng.randrange(8)
    if kind == 0:
        return f"{_cap(who)} walked to {rng.choice(_PLACES)} with {rng.choice(_THINGS)}."
    if kind == 1:
        return f"{rng.choice(_TIMES)}, {who} {rng.choice(_ACTIONS)}."
    if kind == 2:
        return f"When the {rng.choice(_WEATHER)} came, {who} felt {rng.choice(_FEELINGS)}."
    if kind == 3:
        return f"\"{rng.choice(_SAYINGS)[:-1]},\" said {who}."
    if kind == 4:
        return f"{_cap(who)} gave {rng.choice(_THINGS)} to {other}, and {other} said thank you."
    if kind == 5:
        a, b = rng.randrange(10), rng.randrange(9)
        return (f"{_cap(who)} had {_NUMBERS[a]} apples and found {_NUMBERS[b]} more, "
                f"so now there were {_NUMBERS[a + b]}.")
    if kind == 6:
        return f"{_cap(who)} and {other} met at {rng.choice(_PLACES)} and talked about the {rng.choice(_WEATHER)}."
    return f"{_cap(who)} was {rng.choice(_FEELINGS)}, because {other} {rng.choice(_ACTIONS)}."


def generate_corpus(seed: int = CORPUS_SEED, num_chars: int = CORPUS_CHARS) -> str:
    """Deterministic synthetic stories, about ``num_chars`` characters, in chapters and paragraphs."""
    rng = random.Random(seed)
    parts: list[str] = []
    size, chapter = 0, 0
    while size < num_chars:
        chapter += 1
        title = f"Chapter {chapter}: {_cap(rng.choice(_PLACES))}\n\n"
        paragraphs = []
        for _ in range(rng.randint(3, 6)):
            paragraphs.append(" ".join(_sentence(rng) for _ in range(rng.randint(3, 7))))
        text = title + "\n\n".join(paragraphs) + "\n\n"
        parts.append(text)
        size += len(text)
    return "".join(parts)


def _main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Regenerate or check the shipped synthetic corpus.")
    parser.add_argument("--write", action="store_true", help=f"write {DEFAULT_CORPUS}")
    args = parser.parse_args(argv)
    text = generate_corpus()
    if args.write:
        DEFAULT_CORPUS.parent.mkdir(parents=True, exist_ok=True)
        DEFAULT_CORPUS.write_text(text, encoding="utf-8")
        print(f"wrote {len(text.encode('utf-8'))} bytes to {DEFAULT_CORPUS}")
        return 0
    same = DEFAULT_CORPUS.is_file() and DEFAULT_CORPUS.read_text(encoding="utf-8") == text
    print("shipped corpus matches the generator" if same else "shipped corpus differs from the generator")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(_main())
