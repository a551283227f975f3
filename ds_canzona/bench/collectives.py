"""``python -m ds_canzona.bench collectives``: collectives per training step at DP 8 to 1024, counted by running.

For a model (a shipped Qwen3 name or a HuggingFace ``config.json``), each data-parallel size and
ZeRO stage, and each system (ds_canzona, and DeepSpeed 0.19.8's own ZeRO with its Muon), one
process builds the real DeepSpeed engine as rank 0 of a world of that size on torch's fake process
group (``fake_world``) and takes two training steps (forward, backward, ``engine.step()``,
gradient accumulation 1, a micro-batch of 1 x 8 tokens). Every collective of the second step is
recorded (``collective_log``) as NCCL would launch it, without sending anything. The fake backend
is not gloo, so the runtimes take their NCCL paths. Per cell:

- ``launches``: collective launches in the step (a coalesced block counts once);
- ``p2p_ops``: NCCL operations inside them (an uneven reduce-scatter or all-gather is P);
- ``sent``: bytes each rank sends, on NCCL's ring algorithms (``collective_log``);
- ``padding``: payload beyond the data. At stages 1 and 2 every gradient is reduced once and every
  parameter gathered once per step, so it is the payload of the reduce-scatters and reduces beyond
  the model's gradients in the communication dtype, plus that of the all-gathers and broadcasts
  beyond its parameters (all-reduces, such as the norm's, are not part of either). At stage 3
  DeepSpeed's fetches (``all_gather_coalesced`` of the parameters it fetches) and gradient
  reduce-scatters (``reduce_scatter_coalesced``) are wrapped with the bytes of their data;
  ds_canzona's broadcasts and reduces carry whole pieces, with no room for padding.

``--real`` builds the model with real storage: every rank of a stage-1/2 world holds the whole model,
so only models that fit in this machine's memory run that way. By default the engines run under
torch's ``FakeTensorMode`` (see ``fake_engine``), which allocates nothing, so Qwen3-8B and 32B run
on a laptop; ``fake_engine`` lists what it has to patch for that.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..cli import Command

__all__ = ["COLLECTIVES", "SYSTEMS", "CellResult", "build_engine", "count_steps", "format_markdown", "format_table",
           "merge_documents", "run_cell", "run_world", "summarise"]

DEFAULT_DP = (8, 64, 256, 1024)
DEFAULT_BUCKET_NUMEL = 500_000_000  # DeepSpeed's default reduce_bucket_size
TOKENS = 8


@dataclass(frozen=True, kw_only=True)
class System:
    key: str
    label: str
    runtime: str  # "canzona" or "deepspeed"
    stages: tuple[int, ...]


SYSTEMS = {s.key: s for s in (
    System(key="canzona", label="ds_canzona", runtime="canzona", stages=(1, 2, 3)),
    System(key="deepspeed", label="DeepSpeed Muon", runtime="deepspeed", stages=(1, 2, 3)),
)}


@dataclass(kw_only=True)
class CellResult:
    """The collectives of one steady-state step of one (system, stage, DP) cell, on rank 0."""

    system: str
    stage: int
    dp: int
    launches: int
    p2p_ops: int
    sent: int
    padding: int
    by_kind: dict[str, dict[str, int]]
    seconds: float
    unavailable: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


# --------------------------------------------------------------------------- rank side
def model_config(source: dict[str, Any]) -> dict[str, Any]:
    """The HuggingFace config dict of ``source`` ({"model": name} or {"hf_config": path}), layers overridden."""
    if source.get("hf_config"):
        from pathlib import Path
        path = Path(source["hf_config"])
        config = json.loads((path / "config.json" if path.is_dir() else path).read_text())
    else:
        from ds_canzona.plan.models import load_model_config
        config = load_model_config(source["model"])
    if source.get("layers"):
        config = {**config, "num_hidden_layers": int(source["layers"])}
    return config


def _build_model(config: dict[str, Any]):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = AutoConfig.for_model(**{k: v for k, v in config.items() if k not in ("architectures", "torch_dtype")})
    hf._attn_implementation = "sdpa"
    hf.use_cache = False
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(hf, dtype=torch.bfloat16)


def engine_config(system: System, stage: int, dp: int, bucket_numel: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": dp,
        "gradient_clipping": 1.0,
        "steps_per_print": 1_000_000_000,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket_numel,
                              "allgather_bucket_size": bucket_numel},
        "optimizer": {"type": "Muon", "params": {"lr": 0.02, "momentum": 0.95, "adam_lr": 3e-4,
                                                  "weight_decay": 0.0}},
    }
    if stage == 3:
        # DeepSpeed's ZeRO-3 Muon refuses reduce_scatter; ds_canzona takes the same config.
        config["zero_optimization"]["reduce_scatter"] = False
    if system.runtime == "canzona":
        config["canzona"] = {"log_plan": False, "kernels": "torch"}
    return config


def _model_bytes(engine) -> tuple[int, int]:
    """(elements, bytes per element) of the engine's trainable parameters."""
    params = [p for p in engine.module.parameters() if p.requires_grad]
    numel = sum(int(getattr(p, "ds_numel", p.numel())) for p in params)
    return numel, params[0].element_size()


def _communication_bytes(engine) -> int:
    return engine.communication_data_type.itemsize


@contextlib.contextmanager
def _deepspeed_zero3_data_stated(engine, log) -> Iterator[None]:
    """State the data of DeepSpeed's ZeRO-3 fetches and gradient reduce-scatters, so their padding shows."""
    import deepspeed.runtime.zero.stage3 as ds_stage3

    for param in engine.module.parameters():
        original = getattr(param, "all_gather_coalesced", None)
        if original is None:
            continue

        def all_gather_coalesced(params, *args, _original=original, **kwargs):
            data = sum(int(p.ds_numel) * p.ds_tensor.element_size() for p in params)
            with log.carrying(data):
                return _original(params, *args, **kwargs)

        param.all_gather_coalesced = all_gather_coalesced

    original_reduce = ds_stage3.reduce_scatter_coalesced

    def reduce_scatter_coalesced(tensors, *args, **kwargs):
        with log.carrying(sum(t.numel() * t.element_size() for t in tensors)):
            return original_reduce(tensors, *args, **kwargs)

    ds_stage3.reduce_scatter_coalesced = reduce_scatter_coalesced
    try:
        yield
    finally:
        ds_stage3.reduce_scatter_coalesced = original_reduce


_REDUCE_KINDS = ("reduce_scatter", "reduce_scatter_tensor", "reduce")
_GATHER_KINDS = ("all_gather", "all_gather_into_tensor", "broadcast")


def summarise(calls, *, stage: int, model_numel: int, param_bytes: int, comm_bytes: int, stated_padding: int) -> dict[str, Any]:
    by_kind: dict[str, dict[str, int]] = {}
    for call in calls:
        row = by_kind.setdefault(call.kind, {"calls": 0, "launches": 0, "p2p_ops": 0, "payload": 0, "sent": 0})
        row["calls"] += 1
        row["launches"] += call.launches
        row["p2p_ops"] += call.p2p_ops
        row["payload"] += call.payload
        row["sent"] += call.sent
    for row in by_kind.values():
        row["sent"] = int(round(row["sent"]))
    if stage in (1, 2):
        reduced = sum(by_kind.get(k, {}).get("payload", 0) for k in _REDUCE_KINDS)
        gathered = sum(by_kind.get(k, {}).get("payload", 0) for k in _GATHER_KINDS)
        padding = max(0, reduced - model_numel * comm_bytes) + max(0, gathered - model_numel * param_bytes)
    else:
        padding = stated_padding
    return {"launches": sum(c.launches for c in calls), "p2p_ops": sum(c.p2p_ops for c in calls),
            "sent": int(round(sum(c.sent for c in calls))), "padding": int(padding), "by_kind": by_kind}


def build_engine(system_key: str, stage: int, dp: int, source: dict[str, Any], *, bucket_numel: int):
    """The DeepSpeed engine of one cell, in the current fake world (and fake tensor mode, if on)."""
    import deepspeed

    model = _build_model(model_config(source))
    engine, *_ = deepspeed.initialize(model=model, config=engine_config(SYSTEMS[system_key], stage, dp, bucket_numel))
    return engine


def count_steps(engine, log, *, stage: int, steps: int = 2) -> list[list]:
    """Take ``steps`` training steps on 1 x ``TOKENS`` tokens; the recorded calls of each step after the first."""
    import torch

    vocab = int(engine.module.config.vocab_size)
    tokens = (torch.arange(TOKENS) * 7919 % vocab).view(1, TOKENS)
    recorded = []
    system_is_deepspeed = not hasattr(engine.optimizer, "plan")
    data_stated = (_deepspeed_zero3_data_stated(engine, log) if system_is_deepspeed and stage == 3
                   else contextlib.nullcontext())
    with data_stated:
        for step in range(steps):
            log.reset()
            log.active = step > 0  # the first step warms up (state allocation, DeepSpeed's ZeRO-3 trace)
            loss = engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
            engine.step()
            log.active = False
            if step > 0:
                recorded.append((list(log.calls), log.padding))
    return recorded


def run_cell(system_key: str, stage: int, dp: int, source: dict[str, Any], *, bucket_numel: int, log,
             fake: bool) -> CellResult:
    """Build the engine of one cell in the current fake world, take two steps, summarise the second."""
    from ds_canzona.config import CanzonaConfigError

    from .fake_engine import fake_tensors

    started = time.perf_counter()
    with fake_tensors(enabled=fake):
        try:
            engine = build_engine(system_key, stage, dp, source, bucket_numel=bucket_numel)
        except CanzonaConfigError as error:
            return CellResult(system=system_key, stage=stage, dp=dp, launches=0, p2p_ops=0, sent=0, padding=0,
                              by_kind={}, seconds=time.perf_counter() - started, unavailable=str(error))
        [(calls, padding)] = count_steps(engine, log, stage=stage)
        numel, param_bytes = _model_bytes(engine)
        summary = summarise(calls, stage=stage, model_numel=numel, param_bytes=param_bytes,
                            comm_bytes=_communication_bytes(engine), stated_padding=padding)
        if hasattr(engine, "destroy"):
            engine.destroy()
    return CellResult(system=system_key, stage=stage, dp=dp, seconds=time.perf_counter() - started, **summary)


def run_world(rank: int, world_size: int, cells: list[tuple[str, int]], source: dict[str, Any], bucket_numel: int,
              fake: bool) -> list[dict[str, Any]]:
    """Every (system, stage) of ``cells`` at DP ``world_size``, in this (fresh) process as rank 0."""
    import logging

    import ds_canzona  # noqa: F401  (installs the engine hook)
    from .collective_log import CollectiveLog
    from .fake_world import fake_world

    for name in ("DeepSpeed", "deepspeed", "ds_canzona"):
        logging.getLogger(name).setLevel(logging.ERROR)
    log = CollectiveLog().install()  # before deepspeed.comm starts: its backend keeps references
    with fake_world(0, world_size):
        return [run_cell(system, stage, world_size, source, bucket_numel=bucket_numel, log=log, fake=fake).to_dict()
                for system, stage in cells]


# --------------------------------------------------------------------------- parent side
def run_collectives(args: argparse.Namespace) -> int:
    if args.from_json:
        document = merge_documents([json.loads(open(path).read()) for path in args.from_json.split(",")])
    else:
        document = _count(args)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(document, out)
            out.write("\n")
    print(format_markdown(document) if args.markdown else format_table(document))
    return 0


def _count(args: argparse.Namespace) -> dict[str, Any]:
    from ._ranks import run_ranks

    unknown = [name for name in args.systems if name not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown --systems {', '.join(unknown)}: choose from {', '.join(SYSTEMS)}")
    source = {"model": args.model, "hf_config": args.hf_config, "layers": args.layers}
    name = args.model or args.hf_config
    if args.layers:
        name += f" ({args.layers} layers)"
    cells = [(system, stage) for stage in args.stages for system in args.systems if stage in SYSTEMS[system].stages]
    if args.cells:
        cells = [(cell.split(":")[0], int(cell.split(":")[1])) for cell in args.cells.split(",")]
        unknown = [f"{system}:{stage}" for system, stage in cells if system not in SYSTEMS]
        if unknown:
            raise ValueError(f"unknown --cells {', '.join(unknown)}: systems are {', '.join(SYSTEMS)}")
    results = []
    for dp in args.dp:
        started = time.perf_counter()
        results += _one_world(run_ranks, dp, cells, source, args)
        print(f"  DP {dp}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return {"model": name, "tensors": "real" if args.real else "fake (FakeTensorMode)",
            "bucket_numel": args.bucket_numel, "tokens": TOKENS, "cells": results}


def merge_documents(documents: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs of one model and setting (say one per DP range) as one document."""
    first = documents[0]
    for other in documents[1:]:
        for key in ("model", "tensors", "bucket_numel", "tokens"):
            if other[key] != first[key]:
                raise ValueError(f"--from-json: the runs differ in {key} ({first[key]!r} vs {other[key]!r})")
    return {**first, "cells": [cell for document in documents for cell in document["cells"]]}


def _one_world(run_ranks, dp: int, cells, source, args) -> list[dict[str, Any]]:
    # One fresh process per world size: DeepSpeed keeps its groups for the rest of a process.
    # DeepSpeed's Muon wraps its update in torch.compile, which would trace fake tensors; it changes no collective.
    return run_ranks(_world_entry, 1, dp, cells, source, args.bucket_numel, not args.real, timeout=args.timeout,
                     env={"TORCHDYNAMO_DISABLE": "1"})[0]


def _world_entry(rank: int, world_size: int, dp: int, cells, source, bucket_numel: int, fake: bool):
    return run_world(rank, dp, cells, source, bucket_numel, fake)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.1f}"


def _title(document: dict[str, Any]) -> str:
    return (f"Collectives per step: {document['model']}, {document['tensors']} tensors, bf16, buckets of "
            f"{document['bucket_numel']:,} elements, micro-batch 1 x {document['tokens']} tokens, rank 0")


def _sorted_cells(document: dict[str, Any]) -> list[dict[str, Any]]:
    return sorted(document["cells"], key=lambda c: (c["dp"], c["stage"], list(SYSTEMS).index(c["system"])))


def format_table(document: dict[str, Any]) -> str:
    lines = [_title(document), f"{'DP':>5} {'stage':>5}  {'system':<16} {'launches':>9} {'p2p ops':>9} "
             f"{'sent MiB/rank':>14} {'padding MiB':>12}"]
    for cell in _sorted_cells(document):
        label = SYSTEMS[cell["system"]].label
        if cell.get("unavailable"):
            lines.append(f"{cell['dp']:>5} {cell['stage']:>5}  {label:<16} not available: {cell['unavailable']}")
            continue
        lines.append(f"{cell['dp']:>5} {cell['stage']:>5}  {label:<16} {cell['launches']:>9,} {cell['p2p_ops']:>9,} "
                     f"{_mib(cell['sent']):>14} {_mib(cell['padding']):>12}")
    return "\n".join(lines)


def format_markdown(document: dict[str, Any]) -> str:
    """One row per (DP, stage): ds_canzona against DeepSpeed side by side, "-" where a cell did not run."""
    rows: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
    for cell in _sorted_cells(document):
        rows.setdefault((cell["dp"], cell["stage"]), {})[cell["system"]] = cell

    def pair(row, key, show) -> str:
        return " / ".join("-" if row.get(s) is None or row[s].get("unavailable") else show(row[s][key])
                          for s in SYSTEMS)

    lines = [f"*{_title(document)}; each cell: ds_canzona / DeepSpeed*", "",
             "| DP | stage | launches | NCCL ops | sent MiB per rank | padding MiB |",
             "|---:|---:|---:|---:|---:|---:|"]
    for (dp, stage), row in rows.items():
        lines.append(f"| {dp} | {stage} | {pair(row, 'launches', '{:,}'.format)} | "
                     f"{pair(row, 'p2p_ops', '{:,}'.format)} | {pair(row, 'sent', _mib)} | "
                     f"{pair(row, 'padding', _mib)} |")
    return "\n".join(lines)


def _positive_list(text: str) -> tuple[int, ...]:
    values = tuple(int(v) for v in text.split(","))
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be a positive integer")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ds_canzona.plan.models import shipped_models

    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", metavar="NAME", help=f"a shipped config: {', '.join(shipped_models())}")
    source.add_argument("--hf-config", metavar="PATH", help="a HuggingFace config.json (file or folder)")
    source.add_argument("--from-json", metavar="A.json,B.json", help="print earlier --json runs (of one model) "
                        "together, running nothing")
    parser.add_argument("--layers", type=int, default=None, metavar="L", help="override num_hidden_layers")
    parser.add_argument("--dp", type=_positive_list, default=DEFAULT_DP, metavar="R,R,...",
                        help="data-parallel sizes (default 8,64,256,1024)")
    parser.add_argument("--stages", type=_positive_list, default=(1, 2, 3), metavar="S,S", help="ZeRO stages")
    parser.add_argument("--systems", type=lambda t: tuple(t.split(",")), default=tuple(SYSTEMS),
                        metavar="NAME,NAME", help=f"of {', '.join(SYSTEMS)}")
    parser.add_argument("--cells", metavar="SYSTEM:STAGE,...", help="exactly these (system, stage) pairs, instead "
                        "of --systems x --stages (e.g. canzona:2,deepspeed:2,canzona:3)")
    parser.add_argument("--bucket-numel", type=int, default=DEFAULT_BUCKET_NUMEL, metavar="N",
                        help="reduce_bucket_size and allgather_bucket_size (default 5e8)")
    parser.add_argument("--real", action="store_true", help="real tensors (the model must fit in memory) "
                        "instead of FakeTensorMode")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per DP size")
    parser.add_argument("--json", metavar="FILE", help="also write every number to FILE")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown, the two systems "
                        "side by side")


COLLECTIVES = Command(description="Collective launches, NCCL operations, bytes and padding per training step, "
                      "counted by running the engines on a fake process group.",
                      add_arguments=add_arguments, run=run_collectives)
