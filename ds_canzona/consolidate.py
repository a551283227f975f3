"""Whole-model files from a ds_canzona checkpoint, for one process (like DeepSpeed's zero_to_fp32).

``ds-canzona consolidate CKPT_DIR OUT`` (or :func:`consolidate_checkpoint`) reads the per-rank
shards of a checkpoint written by ``engine.save_checkpoint`` and writes, into the directory OUT:

    model.safetensors          every trained tensor's fp32 master under its parameter name, the
                               module's buffers and frozen parameters as saved, and tied names
                               (aliases) as copies: ``model.load_state_dict(...)`` takes it strictly
    optimizer.safetensors      with --optimizer-states: every optimizer state tensor, keyed
                               "<param name>/<state key>"
    training_state.json        what the checkpoint says besides tensors: kinds and param groups,
                               engine counters, lr scheduler and loss scaler state, client state
    config.json                when the trained module was a HuggingFace model: its config (and
    generation_config.json     generation config), so ``from_pretrained(OUT)`` loads the trained
                               model; ``dtype`` names the exported weights' dtype (fp32)

With ``--max-shard-size`` the two safetensors files are split HuggingFace-style
(``model-00001-of-00003.safetensors`` and ``model.safetensors.index.json``).
:func:`load_consolidated_model` and :func:`load_consolidated_optimizer` read either layout; the
latter's result goes straight into a single-process ``ds_canzona.optim`` optimizer's
``load_state_dict_by_name``.

Nothing is executed from the checkpoint: shards are safetensors, the manifest is read with
``torch.load(weights_only=True)``. Tensors are read lazily and one output shard is held in
memory at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ds_canzona.cli import Command
from ds_canzona.zero.checkpoint import Checkpoint, CheckpointError, atomic_write
from ds_canzona.zero.checkpoint.hf_config import CONFIG_FILE, config_for_export

__all__ = ["COMMAND", "consolidate_checkpoint", "fp32_state_dict_from_checkpoint", "load_consolidated_model",
           "load_consolidated_optimizer", "optimizer_state_from_checkpoint"]

MODEL_STEM = "model"
OPTIMIZER_STEM = "optimizer"
TRAINING_STATE = "training_state.json"

# (output key, bytes, read) for every tensor of one output file, in order.
_Item = tuple[str, int, Callable[[], torch.Tensor]]


def _model_items(ckpt: Checkpoint) -> list[_Item]:
    items: list[_Item] = []
    for name in ckpt.tensor_names:
        nbytes = sum(ckpt.nbytes(item) for item in ckpt.items_of(name))
        items.append((name, nbytes, lambda name=name: ckpt.tensor_master(name)))
    for key, tensor in (ckpt.meta.get("module_extra") or {}).items():
        items.append((key, tensor.numel() * tensor.element_size(), lambda tensor=tensor: tensor))
    for alias, name in (ckpt.meta.get("aliases") or {}).items():
        nbytes = sum(ckpt.nbytes(item) for item in ckpt.items_of(name))
        items.append((alias, nbytes, lambda name=name: ckpt.tensor_master(name)))
    return items


def _optimizer_items(ckpt: Checkpoint) -> list[_Item]:
    items: list[_Item] = []
    for name in ckpt.tensor_names:
        pieces = ckpt.items_of(name)
        if len(pieces) > 1 and ckpt.is_stack(name):
            # A stack in pieces of whole experts: the whole stack's keys, each expert's from its piece.
            sizes = ckpt.stack_state_nbytes(name)
        else:
            sizes = {key: None if shape is None else sum(ckpt.nbytes(piece, key) for piece in pieces)
                     for key, shape in ckpt.state_shapes(pieces[0]).items()}
        for key, nbytes in sizes.items():
            if nbytes is None:
                raise CheckpointError(f"optimizer state {name!r}[{key!r}] is not a tensor; consolidation writes "
                                      "tensors only")
            if len(pieces) == 1:
                items.append((f"{name}/{key}", nbytes, lambda name=name, key=key: ckpt.state_tensor(name, key)))
            else:
                items.append((f"{name}/{key}", nbytes, lambda name=name, key=key: ckpt.tensor_state(name)[key]))
    return items


def fp32_state_dict_from_checkpoint(checkpoint: str, tag: str | None = None) -> dict[str, torch.Tensor]:
    """The full model state (fp32 masters, buffers, frozen parameters, tied names) in memory."""
    ckpt = Checkpoint.open(checkpoint, tag)
    ckpt.validate()
    return {key: read().clone() for key, _, read in _model_items(ckpt)}


def optimizer_state_from_checkpoint(checkpoint: str, tag: str | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """``{param name: {state key: tensor}}`` for a single-process ``load_state_dict_by_name``."""
    ckpt = Checkpoint.open(checkpoint, tag)
    ckpt.validate()
    return {name: ckpt.tensor_state(name) for name in ckpt.tensor_names}


def _shards(items: list[_Item], max_bytes: int | None) -> list[list[_Item]]:
    shards: list[list[_Item]] = [[]]
    size = 0
    for item in items:
        if max_bytes is not None and shards[-1] and size + item[1] > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += item[1]
    return shards


def _write(out_dir: str, stem: str, items: list[_Item], max_bytes: int | None, metadata: dict[str, str]) -> list[str]:
    shards = _shards(items, max_bytes)
    names = ([f"{stem}.safetensors"] if len(shards) == 1 else
             [f"{stem}-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    written = []
    weight_map: dict[str, str] = {}
    for name, shard in zip(names, shards):
        # clone: a tensor that arrives twice (an alias) must not share storage within one file
        tensors = {key: read().contiguous().clone() for key, _, read in shard}
        path = os.path.join(out_dir, name)
        atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))
        written.append(path)
        weight_map.update({key: name for key in tensors})
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(item[1] for item in items), **metadata}, "weight_map": weight_map}
        path = os.path.join(out_dir, f"{stem}.safetensors.index.json")
        atomic_write(path, _write_text(json.dumps(index, indent=1)))
        written.append(path)
    return written


def _write_text(text: str) -> Callable[[str], None]:
    def write(path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    return write


def _jsonable(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.tolist()
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return repr(value)


def _training_state(ckpt: Checkpoint) -> dict[str, Any]:
    meta = ckpt.meta
    return {
        "checkpoint": os.path.abspath(ckpt.directory),
        "format": meta["format"],
        "save_id": meta["save_id"],
        "saved_world_size": meta["world_size"],
        "stage": meta.get("stage"),
        "plan": meta.get("plan"),
        "versions": meta.get("versions"),
        "engine": meta.get("engine"),
        "tensors": {name: {"kind": ckpt.tensor_entry(name)["kind"], "group": ckpt.tensor_entry(name)["group"],
                           "shape": ckpt.tensor_shape(name)} for name in ckpt.tensor_names},
        "aliases": meta.get("aliases") or {},
        "param_groups": meta["param_groups"],
        "lr_scheduler": meta.get("lr_scheduler"),
        "loss_scaler": meta.get("loss_scaler"),
        "client_state": meta.get("client_state"),
    }


def _clear(out_dir: str) -> None:
    """Earlier outputs of ours in ``out_dir`` (a stale shard or index would mix with the new files)."""
    pattern = re.compile(rf"^({MODEL_STEM}|{OPTIMIZER_STEM})(-\d{{5}}-of-\d{{5}})?\.safetensors(\.index\.json)?$")
    for entry in os.listdir(out_dir):
        if pattern.match(entry) or entry == TRAINING_STATE:
            os.remove(os.path.join(out_dir, entry))


def consolidate_checkpoint(checkpoint: str, out_dir: str, *, tag: str | None = None, optimizer_states: bool = False,
                           max_shard_bytes: int | None = None) -> list[str]:
    """Write the consolidated files of ``checkpoint`` (a save dir or a tag dir) into ``out_dir``.

    Every shard file is checked (present, full size, from this save, holding what the manifest
    says) before anything is written. Returns the paths written.
    """
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    ckpt = Checkpoint.open(checkpoint, tag)
    ckpt.validate()
    model_items = _model_items(ckpt)
    optimizer_items = _optimizer_items(ckpt) if optimizer_states else []
    os.makedirs(out_dir, exist_ok=True)
    _clear(out_dir)
    metadata = {"format": "pt", "source": ckpt.meta["format"], "save_id": ckpt.meta["save_id"]}
    written = _write(out_dir, MODEL_STEM, model_items, max_shard_bytes, metadata)
    if optimizer_states:
        written += _write(out_dir, OPTIMIZER_STEM, optimizer_items, max_shard_bytes, metadata)
    written += _write_hf_configs(ckpt, out_dir)
    path = os.path.join(out_dir, TRAINING_STATE)
    text = json.dumps(_training_state(ckpt), indent=1, default=_jsonable)
    atomic_write(path, _write_text(text))
    return written + [path]


def _write_hf_configs(ckpt: Checkpoint, out_dir: str) -> list[str]:
    """config.json (its dtype: the exported masters') and generation_config.json, when the save had them.

    A config.json already in ``out_dir`` is left alone when the checkpoint has none: the user may
    have put it there (as the command's note asks).
    """
    written = []
    for name, text in sorted((ckpt.meta.get("hf_config_files") or {}).items()):
        if name == CONFIG_FILE:
            text = config_for_export(text, ckpt.master_dtype(ckpt.items_of(ckpt.tensor_names[0])[0]))
        path = os.path.join(out_dir, name)
        atomic_write(path, _write_text(text))
        written.append(path)
    return written


def _read_files(out_dir: str, stem: str) -> Iterator[tuple[str, torch.Tensor]]:
    index = os.path.join(out_dir, f"{stem}.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(out_dir, f"{stem}.safetensors")):
        files = [f"{stem}.safetensors"]
    else:
        raise FileNotFoundError(f"no {stem}.safetensors or {stem}.safetensors.index.json in {out_dir}")
    for name in files:
        yield from load_file(os.path.join(out_dir, name)).items()


def load_consolidated_model(out_dir: str) -> dict[str, torch.Tensor]:
    """The model state written by :func:`consolidate_checkpoint` (one file or sharded)."""
    return dict(_read_files(out_dir, MODEL_STEM))


def load_consolidated_optimizer(out_dir: str) -> dict[str, dict[str, torch.Tensor]]:
    """``{param name: {state key: tensor}}``, for ``load_state_dict_by_name``."""
    states: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in _read_files(out_dir, OPTIMIZER_STEM):
        name, _, state_name = key.rpartition("/")
        states.setdefault(name, {})[state_name] = tensor
    return states


# ----------------------------------------------------------------------------- command line

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """'5GB', '500MiB', '1e9' -> bytes."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    try:
        value = float(match.group(1)) * _UNITS[unit] if match else -1.0
    except (ValueError, KeyError):
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (e.g. 5GB, 500MiB, 1000000)")
    return int(value)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CKPT_DIR",
                        help="the save_dir of engine.save_checkpoint (its 'latest' tag is used) or one tag directory")
    parser.add_argument("out", metavar="OUT", help="output directory (created; earlier outputs there are replaced)")
    parser.add_argument("--tag", default=None, help="the tag to read inside CKPT_DIR (default: the one in 'latest')")
    parser.add_argument("--optimizer-states", action="store_true",
                        help="also write optimizer.safetensors: every optimizer state tensor by parameter name")
    parser.add_argument("--max-shard-size", type=parse_size, default=None, metavar="SIZE",
                        help="split outputs into files of at most SIZE (e.g. 5GB), HuggingFace-style "
                             "(default: one file)")


def _run(args: argparse.Namespace) -> int:
    try:
        written = consolidate_checkpoint(args.checkpoint, args.out, tag=args.tag,
                                         optimizer_states=args.optimizer_states, max_shard_bytes=args.max_shard_size)
    except CheckpointError as error:
        raise ValueError(str(error)) from None
    for path in written:
        sys.stdout.write(f"wrote {path}\n")
    if not any(os.path.basename(path) == CONFIG_FILE for path in written):
        sys.stdout.write(_missing_config_note(args.out))
    return 0


def _missing_config_note(out_dir: str) -> str:
    existing = os.path.join(out_dir, CONFIG_FILE)
    if os.path.isfile(existing):
        return (f"note: the checkpoint holds no HuggingFace config; {existing} was not written from it, so check "
                "that it describes the trained model before from_pretrained\n")
    return (f"note: the checkpoint holds no HuggingFace config (the trained module had none, or the checkpoint "
            f"predates saving it), so {out_dir} has weights only. To load it with from_pretrained, add the model's "
            f"{CONFIG_FILE} "
            f"(model.config.save_pretrained({out_dir!r})); without it transformers builds its default-sized model. "
            "Or build the model in code and load the weights with "
            f"model.load_state_dict(ds_canzona.consolidate.load_consolidated_model({out_dir!r}))\n")


COMMAND = Command(
    description="Write the full fp32 model state (and, optionally, the optimizer state by parameter name) of a "
                "ds_canzona checkpoint as safetensors, for one process.",
    add_arguments=_add_arguments,
    run=_run,
)
