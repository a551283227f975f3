"""Train a Qwen3-architecture causal LM with DeepSpeed and ds_canzona on the shipped corpus.

One machine (N ranks; on a CPU-only machine also set LOCAL_SIZE=N)::

    deepspeed --num_gpus 2 examples/train_qwen3.py --deepspeed_config ds_configs/zero2_muon.hjson --steps 50

The model is built from ``--model-config`` (default: the tiny ``examples/configs/qwen3-tiny.json``;
any Qwen3 ``config.json`` works, e.g. ``ds_canzona/data/qwen3/qwen3-0.6b.json``) with random
weights; the data is the byte-tokenized corpus of ``ds_canzona.data_utils`` (``--corpus`` for your
own UTF-8 text file). The DeepSpeed config may be JSON or commented HJSON: this script parses it
and hands ``deepspeed.initialize`` a dict (DeepSpeed itself only reads JSON files).

Checkpoints: ``--save-dir DIR --save-every K`` writes ``engine.save_checkpoint`` every K steps and
at the end; ``--resume`` loads the latest checkpoint in DIR and trains on up to ``--steps`` (the
total step count, not the number of further steps). The data order is a function of the global
step, so a resumed run sees exactly the batches an uninterrupted run would have seen.

Several machines: DeepSpeed's usual hostfile and passwordless ssh, nothing ds_canzona-specific.
Every node needs the same code, Python environment and data paths. ``hostfile``::

    node-a slots=8
    node-b slots=8

then, on node-a::

    deepspeed --hostfile hostfile --master_addr node-a --master_port 29500 \\
        examples/train_qwen3.py --deepspeed_config ds_configs/zero2_muon.hjson --save-dir /shared/ckpt

``--save-dir`` should be on storage every node can reach (each rank writes its own optimizer
state). Without ssh, start ``deepspeed --no_ssh --node_rank R ...`` on each node yourself.

Wrong paths and malformed config files end with a one-line error and exit status 2.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_CONFIG = REPO / "examples" / "configs" / "qwen3-tiny.json"
PROG = "train_qwen3.py"


class UsageError(Exception):
    """A mistake in the command line or an input file: reported in one line, exit status 2."""


def _rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def fail(message: str) -> None:
    if _rank0():
        print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config", required=True,
                        help="DeepSpeed config, JSON or HJSON (comments allowed)")
    parser.add_argument("--model-config", default=str(DEFAULT_MODEL_CONFIG),
                        help="a Qwen3 config.json (default: the tiny test model)")
    parser.add_argument("--corpus", default=None, help="UTF-8 text file (default: the shipped corpus)")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default 64)")
    parser.add_argument("--steps", type=int, default=20, help="train until this global optimizer step")
    parser.add_argument("--save-dir", default=None, help="checkpoint directory")
    parser.add_argument("--save-every", type=int, default=0, help="save every K steps (0: only at the end)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --save-dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    parser.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=-1,
                        help=argparse.SUPPRESS)  # passed by DeepSpeed's launcher; LOCAL_RANK is used instead
    parser.add_argument("--deepspeed", action="store_true", help=argparse.SUPPRESS)  # DeepSpeed's own flag
    args = parser.parse_args(argv)
    if args.seq_len < 2:
        parser.error(f"--seq-len must be >= 2, got {args.seq_len}")
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.save_every < 0:
        parser.error(f"--save-every must be >= 0, got {args.save_every}")
    if args.resume and not args.save_dir:
        parser.error("--resume needs --save-dir")
    return args


# --------------------------------------------------------------------------- inputs, checked up front


def find_autos(node, prefix: str = "") -> list[str]:
    """Dotted keys holding HF's "auto" placeholder."""
    if isinstance(node, dict):
        return [hit for key, value in node.items() for hit in find_autos(value, f"{prefix}{key}.")]
    return [prefix.rstrip(".")] if node == "auto" else []


def load_inputs(args: argparse.Namespace) -> tuple[dict, dict, str]:
    """(DeepSpeed config dict, model config dict, corpus text); UsageError for anything wrong."""
    from ds_canzona.data_utils import load_corpus
    from ds_canzona.hf import ConfigFileError, load_ds_config

    try:
        ds_config = load_ds_config(args.deepspeed_config)
    except ConfigFileError as error:
        raise UsageError(str(error)) from None
    if "train_batch_size" in ds_config and "train_micro_batch_size_per_gpu" not in ds_config:
        raise UsageError(f"{args.deepspeed_config}: set train_micro_batch_size_per_gpu (this script leaves "
                         "train_batch_size to DeepSpeed)")
    autos = find_autos(ds_config)
    if autos:
        raise UsageError(f"{args.deepspeed_config}: 'auto' values ({', '.join(autos)}) are for the HF Trainer; "
                         "give concrete numbers for the launcher")

    path = Path(args.model_config)
    if not path.is_file():
        raise UsageError(f"model config not found: {path}")
    try:
        model_config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UsageError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(model_config, dict):
        raise UsageError(f"{path}: expected a JSON object")
    if model_config.get("model_type", "qwen3") != "qwen3":
        raise UsageError(f"{path}: model_type is {model_config.get('model_type')!r}, this script builds 'qwen3'")

    try:
        text = load_corpus(args.corpus)
    except FileNotFoundError as error:
        raise UsageError(str(error)) from None
    except UnicodeDecodeError:
        raise UsageError(f"{args.corpus}: not UTF-8 text") from None
    return ds_config, model_config, text


def validate_canzona(ds_config: dict, path: str) -> None:
    """The canzona section's own check, before any rank starts a collective."""
    import deepspeed  # noqa: F401  (before ds_canzona.config: see the import-order note in the report)
    import ds_canzona  # noqa: F401
    from ds_canzona.config import CanzonaConfigError, parse_canzona_section

    try:
        parse_canzona_section(ds_config)
    except CanzonaConfigError as error:
        raise UsageError(f"{path}: {error}") from None


# --------------------------------------------------------------------------- data


@functools.lru_cache(maxsize=2)
def epoch_order(num_blocks: int, seed: int, epoch: int) -> list[int]:
    """The shuffled block order of one pass over the corpus (the same on every rank)."""
    import torch

    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_blocks, generator=generator).tolist()


def sample_indices(num_blocks: int, step: int, micro: int, rank: int, world: int, micro_batch: int, ga: int,
                   seed: int) -> list[int]:
    """Block indices of one micro-batch: global sample g of the run is epoch_order(g // N)[g % N]."""
    first = ((step * ga + micro) * world + rank) * micro_batch
    return [epoch_order(num_blocks, seed, sample // num_blocks)[sample % num_blocks]
            for sample in range(first, first + micro_batch)]


# --------------------------------------------------------------------------- training


def build_model(model_config: dict, seed: int, path: str):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    try:
        config = Qwen3Config(**model_config)
        return Qwen3ForCausalLM(config)
    except (TypeError, ValueError) as error:
        raise UsageError(f"{path}: not a usable Qwen3 config ({error})") from None


def mean_across_ranks(value: float) -> float:
    import torch
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator

    tensor = torch.tensor([value], dtype=torch.float64, device=get_accelerator().current_device_name())
    dist.all_reduce(tensor)
    return float(tensor.item()) / dist.get_world_size()


def initialize(model, ds_config: dict, path: str):
    """deepspeed.initialize; a config DeepSpeed or ds_canzona rejects becomes a one-line UsageError.

    Every rank checks the same config the same way, so all ranks fail together (no hang).
    """
    import deepspeed
    from pydantic import ValidationError
    from ds_canzona.config import CanzonaConfigError

    try:
        engine, _, _, _ = deepspeed.initialize(model=model, config=ds_config)
    except CanzonaConfigError as error:
        raise UsageError(f"{path}: {error}") from None
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise UsageError(f"{path}: invalid DeepSpeed config: {error.title}.{where}: {first['msg']}") from None
    return engine


def single_process_env() -> None:
    """Started as plain ``python train_qwen3.py``: one rank, without DeepSpeed's MPI discovery."""
    if "RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ:
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def show_canzona_log() -> None:
    """Show ds_canzona's INFO messages (which kernel backend runs) on rank 0; the plan summary prints itself.

    Every rank chooses the same kernels, so one copy is enough. They are chosen at the first
    optimizer step, which runs before the progress bar is drawn; a later message goes above the bar.
    """
    import logging

    from tqdm import tqdm

    class AboveTheBar(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            tqdm.write(self.format(record), file=sys.stdout)

    log = logging.getLogger("ds_canzona")
    if _rank0() and not log.handlers:
        log.addHandler(AboveTheBar())
        log.setLevel(logging.INFO)


def train(args: argparse.Namespace) -> None:
    single_process_env()
    show_canzona_log()
    ds_config, model_config, text = load_inputs(args)
    validate_canzona(ds_config, args.deepspeed_config)

    import ds_canzona  # noqa: F401  (registers the DeepSpeed engine hook)
    from deepspeed.accelerator import get_accelerator
    from ds_canzona.data_utils import ByteTokenizer, token_blocks

    tokenizer = ByteTokenizer()
    vocab = int(model_config.get("vocab_size", 0))
    if vocab < tokenizer.vocab_size:
        raise UsageError(f"{args.model_config}: vocab_size {vocab} is smaller than the byte tokenizer's "
                         f"{tokenizer.vocab_size}")
    blocks = token_blocks(text, args.seq_len, tokenizer)
    model = build_model(model_config, args.seed, args.model_config)

    engine = initialize(model, ds_config, args.deepspeed_config)
    rank, world = engine.global_rank, engine.world_size
    micro_batch = engine.train_micro_batch_size_per_gpu()
    ga = engine.gradient_accumulation_steps()
    device = engine.device

    start_step = 0
    # The loss of the training's first step, carried through checkpoints, so that "start" in the
    # last line means the same after a resume (NaN until known).
    first_loss, first_step = math.nan, 1
    if args.resume:
        path, client_state = engine.load_checkpoint(args.save_dir)
        if path is None:
            raise UsageError(f"no checkpoint to resume from in {args.save_dir}")
        client_state = client_state or {}
        start_step = int(client_state.get("step", engine.global_steps))
        first_loss = float(client_state.get("first_loss", math.nan))
        if rank == 0:
            at_save = f", loss {client_state['loss']:.3f} at that step" if "loss" in client_state else ""
            print(f"resumed from {path} at step {start_step}{at_save}", flush=True)
    if math.isnan(first_loss):
        first_step = start_step + 1
    if start_step >= args.steps:
        raise UsageError(f"the checkpoint is at step {start_step}, nothing to do for --steps {args.steps}")

    # The bar is drawn after the first step, so that what the first step prints (which kernels
    # run) comes before it rather than through it.
    progress = None
    show_progress = rank == 0 and not args.no_progress

    tokens_per_step = micro_batch * ga * world * args.seq_len
    run_first_loss = last_loss = math.nan
    engine.train()
    for step in range(start_step, args.steps):
        started = time.perf_counter()
        losses = []
        step_seconds = 0.0
        for micro in range(ga):
            index = sample_indices(len(blocks), step, micro, rank, world, micro_batch, ga, args.seed)
            input_ids = blocks[index].to(device)
            loss = engine(input_ids=input_ids, labels=input_ids).loss
            engine.backward(loss)
            boundary = engine.is_gradient_accumulation_boundary()
            if boundary:
                get_accelerator().synchronize()
                step_started = time.perf_counter()
            engine.step()
            if boundary:
                get_accelerator().synchronize()
                step_seconds = time.perf_counter() - step_started
            losses.append(float(loss.detach().float().item()))
        loss_value = mean_across_ranks(sum(losses) / len(losses))
        elapsed = time.perf_counter() - started
        run_first_loss = loss_value if math.isnan(run_first_loss) else run_first_loss
        first_loss = loss_value if math.isnan(first_loss) else first_loss
        last_loss = loss_value
        done = step + 1
        if rank == 0:
            stats = dict(loss=f"{loss_value:.3f}", tok_s=f"{tokens_per_step / elapsed:,.0f}",
                         opt_ms=f"{step_seconds * 1e3:.1f}")
            if show_progress and progress is None:
                from tqdm import tqdm
                progress = tqdm(total=args.steps, initial=done, desc="train", dynamic_ncols=True)
                progress.set_postfix(stats)
            elif show_progress:
                progress.set_postfix(stats, refresh=False)
                progress.update(1)
            else:
                print(f"step {done}/{args.steps} " + " ".join(f"{k} {v}" for k, v in stats.items()), flush=True)
        if args.save_dir and ((args.save_every and done % args.save_every == 0) or done == args.steps):
            state = {"step": done, "loss": loss_value}
            if first_step == 1:
                state["first_loss"] = first_loss
            engine.save_checkpoint(args.save_dir, tag=f"step{done}", client_state=state)
    if progress is not None:
        progress.close()
    if rank == 0:
        line = f"final loss {last_loss:.3f} (start {first_loss:.3f}) over steps {first_step}-{args.steps}"
        if start_step:
            line += f", resumed at step {start_step}"
            if first_step == 1:
                line += f" (step {start_step + 1}: {run_first_loss:.3f})"
        print(line, flush=True)
    # Leaving with the process group alive lets gloo's threads be torn down at interpreter exit,
    # which can abort the process ("terminate called without an active exception").
    import deepspeed.comm as dist
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        train(args)
    except UsageError as error:
        fail(str(error))
    return 0


if __name__ == "__main__":
    sys.exit(main())
