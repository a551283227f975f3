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
  reduce-scatters (``reduce_scatter_coalesced``) are wrapped with the bytes of their data, and
  so are ds_canzona's padded fetches and gradient buckets; its other forms (broadcasts, reduces,
  all-reduces) carry whole pieces, with no room for padding.

At stage 3 DeepSpeed's parameter coordinator decides, for both systems, when a module's parameters
are fetched and how many at once; the launches it issues are counted apart (``fetches``): under one
config they are the same for both (tests/test_bench_collectives.py), so they bound from below what
any runtime under that coordinator can reach. ``--zero KEY=JSON`` sets a ``zero_optimization`` key
in both systems' configs (the prefetch bucket, the ZeRO-3 leaf modules, ...).

With ``--tp T`` a cell is rank 0 of a world of T x DP ranks with AutoTP (``tensor_parallel.autotp_size``)
in both configs. Every call is labelled with its process group (``group_labeller``: "tp", "dp", or
"world" for both) and the phase that issued it (forward, backward, step), and each cell keeps its
counts per group and phase (``by_group``) and the commit of the code that counted it.

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
from dataclasses import dataclass, field
from typing import Any

from ...cli import Command

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
    tp: int = 1
    # per process group ("dp", "tp", "world"): launches, NCCL operations, bytes sent, and per phase
    by_group: dict[str, dict[str, Any]] = field(default_factory=dict)
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


def engine_config(system: System, stage: int, dp: int, bucket_numel: int, tp: int = 1) -> dict[str, Any]:
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
    if tp > 1:
        # AutoTP shards the model at deepspeed.initialize over a (DP, TP) mesh, TP innermost; for
        # DeepSpeed's own Muon each rank then orthogonalises its TP shard of a matrix.
        config["tensor_parallel"] = {"autotp_size": tp}
        # DeepSpeed's batch check reads the whole world at this point: let it derive the batch.
        del config["train_batch_size"]
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


@contextlib.contextmanager
def _canzona_zero3_data_stated(engine, log) -> Iterator[None]:
    """State the data of ds_canzona's padded ZeRO-3 launches (fetches and gradient buckets), so their padding shows.

    Its other forms carry their pieces and nothing else (an all-reduce moves them twice: that is
    in ``sent``, not padding).
    """
    zero, layout = engine.optimizer, engine.optimizer.layout
    fetch_padded, reduce_padded = layout._fetch_padded, zero._reduce_scatter_padded

    def fetch(params, buffers):
        with log.carrying(sum(int(b.numel()) * b.element_size() for b in buffers)):
            return fetch_padded(params, buffers)

    def reduce(pieces):
        with log.carrying(sum(int(piece.numel()) * zero.reduction.communicate_dtype.itemsize for _, piece in pieces)):
            return reduce_padded(pieces)

    layout._fetch_padded, zero._reduce_scatter_padded = fetch, reduce
    try:
        yield
    finally:
        del layout._fetch_padded, zero._reduce_scatter_padded


_REDUCE_KINDS = ("reduce_scatter", "reduce_scatter_tensor", "reduce")
_GATHER_KINDS = ("all_gather", "all_gather_into_tensor", "broadcast")


def _by_group(calls) -> dict[str, dict[str, Any]]:
    """Launches, NCCL operations and bytes sent per process group; per phase launches, operations, and
    the launches of DeepSpeed's ZeRO-3 parameter coordinator (its fetches: ``CollectiveCall.fetch``)."""
    groups: dict[str, dict[str, Any]] = {}
    for call in calls:
        row = groups.setdefault(call.group, {"launches": 0, "p2p_ops": 0, "sent": 0.0, "phases": {}})
        row["launches"] += call.launches
        row["p2p_ops"] += call.p2p_ops
        row["sent"] += call.sent
        phase = row["phases"].setdefault(call.phase, {"launches": 0, "p2p_ops": 0, "fetch_launches": 0})
        phase["launches"] += call.launches
        phase["p2p_ops"] += call.p2p_ops
        phase["fetch_launches"] += call.launches if call.fetch else 0
    for row in groups.values():
        row["sent"] = int(round(row["sent"]))
    return groups


def summarise(calls, *, stage: int, model_numel: int, param_bytes: int, comm_bytes: int, stated_padding: int) -> dict[str, Any]:
    """Totals of one step's calls. ``model_numel``: this rank's trainable elements (its TP slices under AutoTP)."""
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
        # Gradients are reduced and parameters gathered over data parallelism only.
        over_dp = [call for call in calls if call.group == "dp"]
        reduced = sum(call.payload for call in over_dp if call.kind in _REDUCE_KINDS)
        gathered = sum(call.payload for call in over_dp if call.kind in _GATHER_KINDS)
        padding = max(0, reduced - model_numel * comm_bytes) + max(0, gathered - model_numel * param_bytes)
    else:
        padding = stated_padding
    return {"launches": sum(c.launches for c in calls), "p2p_ops": sum(c.p2p_ops for c in calls),
            "sent": int(round(sum(c.sent for c in calls))), "padding": int(padding), "by_kind": by_kind,
            "by_group": _by_group(calls)}


def build_engine(system_key: str, stage: int, dp: int, source: dict[str, Any], *, bucket_numel: int, tp: int = 1,
                 zero_overrides: dict[str, Any] | None = None):
    """The DeepSpeed engine of one cell, in the current fake world (and fake tensor mode, if on).

    ``zero_overrides``: keys of ``zero_optimization`` to set on top of the cell's (tests use it).
    """
    import deepspeed

    model = _build_model(model_config(source))
    config = engine_config(SYSTEMS[system_key], stage, dp, bucket_numel, tp)
    config["zero_optimization"].update(zero_overrides or {})
    engine, *_ = deepspeed.initialize(model=model, config=config)
    if getattr(engine, "first_dataloader_check", None) is not None:
        # AutoTP's check that the TP ranks got the same batch runs in the first forward only (not
        # counted) and all-reduces a flag it expects to sum to TP: stand-in collectives do not sum.
        engine.first_dataloader_check.remove()
        engine.first_dataloader_check = None
    return engine


@contextlib.contextmanager
def _vocab_shards_as_this_rank() -> Iterator[None]:
    """DeepSpeed's vocabulary-parallel loss checks its shard bounds with the same all-gather, then trusts them.

    The check reads every TP rank's (start, end, size) from an all-gather; on the fake world every
    slot holds this rank's, which is no partition of the vocabulary. The collective is issued
    as before (same size, same group) and the vocabulary is taken to be TP equal shards of this
    rank's size: what AutoTP cuts from Qwen3's vocabularies (151,936 = 8 x 18,992) and the tiny config's.
    """
    import torch

    import deepspeed.comm as dist
    import deepspeed.sequence.cross_entropy as cross_entropy

    original = cross_entropy._validate_vocab_shard_bounds

    def validate(local_vocab_size, vocab_start_index, vocab_end_index, tp_group, device):
        tp = dist.get_world_size(tp_group) if tp_group is not None else 1
        if tp == 1:
            return original(local_vocab_size, vocab_start_index, vocab_end_index, tp_group, device)
        bounds = torch.tensor([vocab_start_index, vocab_end_index, local_vocab_size], dtype=torch.long, device=device)
        gathered = torch.empty(tp * bounds.numel(), dtype=bounds.dtype, device=device)
        dist.all_gather_into_tensor(gathered, bounds, group=tp_group)
        return tp * local_vocab_size

    cross_entropy._validate_vocab_shard_bounds = validate
    try:
        yield
    finally:
        cross_entropy._validate_vocab_shard_bounds = original


def count_steps(engine, log, *, stage: int, steps: int = 2) -> list[list]:
    """Take ``steps`` training steps on 1 x ``TOKENS`` tokens; the recorded calls of each step after the first."""
    import torch

    vocab = int(engine.module.config.vocab_size)
    tokens = (torch.arange(TOKENS) * 7919 % vocab).view(1, TOKENS)
    recorded = []
    system_is_deepspeed = not hasattr(engine.optimizer, "plan")
    data_stated = contextlib.nullcontext()
    if stage == 3:
        data_stated = (_deepspeed_zero3_data_stated if system_is_deepspeed else _canzona_zero3_data_stated)(engine, log)
    with data_stated, _vocab_shards_as_this_rank():
        for step in range(steps):
            log.reset()
            log.active = step > 0  # the first step warms up (state allocation, DeepSpeed's ZeRO-3 trace)
            log.phase = "forward"
            loss = engine(input_ids=tokens, labels=tokens).loss
            log.phase = "backward"
            engine.backward(loss)
            log.phase = "step"
            engine.step()
            log.active = False
            log.phase = ""
            if step > 0:
                recorded.append((list(log.calls), log.padding))
    return recorded


def run_cell(system_key: str, stage: int, dp: int, source: dict[str, Any], *, bucket_numel: int, log,
             fake: bool, tp: int = 1, zero_overrides: dict[str, Any] | None = None) -> CellResult:
    """Build the engine of one cell in the current fake world, take two steps, summarise the second."""
    from ds_canzona.config import CanzonaConfigError

    from ..standins.fake_engine import fake_tensors

    started = time.perf_counter()
    with fake_tensors(enabled=fake):
        try:
            engine = build_engine(system_key, stage, dp, source, bucket_numel=bucket_numel, tp=tp,
                                  zero_overrides=zero_overrides)
        except CanzonaConfigError as error:
            return CellResult(system=system_key, stage=stage, dp=dp, tp=tp, launches=0, p2p_ops=0, sent=0, padding=0,
                              by_kind={}, seconds=time.perf_counter() - started, unavailable=str(error))
        [(calls, padding)] = count_steps(engine, log, stage=stage)
        numel, param_bytes = _model_bytes(engine)
        summary = summarise(calls, stage=stage, model_numel=numel, param_bytes=param_bytes,
                            comm_bytes=_communication_bytes(engine), stated_padding=padding)
        if hasattr(engine, "destroy"):
            engine.destroy()
    return CellResult(system=system_key, stage=stage, dp=dp, tp=tp, seconds=time.perf_counter() - started, **summary)


def group_labeller(world_size: int, tp: int):
    """Names a process group of a (DP, TP) mesh with TP innermost: "tp", "dp", "world" (both), or its size."""
    import torch.distributed as tdist

    def label(group) -> str:
        ranks = list(range(world_size)) if group is None else tdist.get_process_group_ranks(group)
        if len(ranks) == world_size:
            return "dp" if tp == 1 else "world"
        if len(ranks) == tp and ranks == list(range(ranks[0], ranks[0] + tp)):
            return "tp"
        if len(ranks) == world_size // tp and ranks == list(range(ranks[0], world_size, tp)):
            return "dp"
        return f"{len(ranks)} ranks"

    return label


def run_world(rank: int, world_size: int, cells: list[tuple[str, int]], source: dict[str, Any], bucket_numel: int,
              fake: bool, tp: int = 1, zero_overrides: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every (system, stage) of ``cells`` at DP ``world_size // tp`` x TP ``tp``, in this (fresh) process as rank 0."""
    import logging

    import ds_canzona  # noqa: F401  (installs the engine hook)
    from ..standins.collective_log import CollectiveLog
    from ..standins.fake_world import fake_world

    for name in ("DeepSpeed", "deepspeed", "ds_canzona"):
        logging.getLogger(name).setLevel(logging.ERROR)
    if world_size % tp:
        raise ValueError(f"a world of {world_size} ranks has no TP={tp} mesh")
    log = CollectiveLog().install()  # before deepspeed.comm starts: its backend keeps references
    log.label_groups(group_labeller(world_size, tp))
    with fake_world(0, world_size):
        if tp > 1:
            # DeepSpeed builds its (DP, TP) mesh once per process, from an arange of the ranks: made
            # here with real tensors (under FakeTensorMode every rank in it would read as 0).
            from deepspeed.utils import groups
            groups._init_tp_mesh_device(tensor_model_parallel_size=tp)
        return [_cell_or_failure(system, stage, world_size // tp, source, bucket_numel=bucket_numel, log=log,
                                 fake=fake, tp=tp, zero_overrides=zero_overrides).to_dict()
                for system, stage in cells]


def _cell_or_failure(system_key: str, stage: int, dp: int, source, *, tp: int, **kwargs) -> CellResult:
    """``run_cell``, or a cell that says why it failed (traceback on stderr), so the world's other cells still count."""
    import traceback

    started = time.perf_counter()
    try:
        return run_cell(system_key, stage, dp, source, tp=tp, **kwargs)
    except Exception as error:  # noqa: BLE001  (any failure of a third-party engine is reported, not hidden)
        traceback.print_exc(file=sys.stderr)
        reason = f"failed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
        return CellResult(system=system_key, stage=stage, dp=dp, tp=tp, launches=0, p2p_ops=0, sent=0, padding=0,
                          by_kind={}, seconds=time.perf_counter() - started, unavailable=reason)


# --------------------------------------------------------------------------- parent side
def run_collectives(args: argparse.Namespace) -> int:
    if args.from_json:
        document = merge_documents([_read_run(path) for path in args.from_json.split(",")])
    else:
        document = _count(args)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(document, out)
            out.write("\n")
    print(format_markdown(document) if args.markdown else format_table(document))
    return 0


def _count(args: argparse.Namespace) -> dict[str, Any]:
    from ..standins._ranks import run_ranks

    unknown = [name for name in args.systems if name not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown --systems {', '.join(unknown)}: choose from {', '.join(SYSTEMS)}")
    if args.reduce_bucket_size is not None:
        args.zero = list(args.zero) + [("reduce_bucket_size", args.reduce_bucket_size)]
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
    commit = _source_commit()  # before counting: the worlds import the code as it is when they start
    results = []
    for tp in args.tp:
        for dp in args.dp:
            started = time.perf_counter()
            results += _one_world(run_ranks, dp, tp, cells, source, args)
            print(f"  TP {tp} x DP {dp}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return {"model": name, "tensors": "real" if args.real else "fake (FakeTensorMode)",
            "bucket_numel": args.bucket_numel, "zero_overrides": dict(args.zero), "tokens": TOKENS, "commit": commit,
            "cells": [{**cell, "commit": commit} for cell in results]}


def _source_commit() -> str:
    """The commit of the code that counted (short hash, "+changes" if ds_canzona/ differs from it), or "?"."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=root, capture_output=True, text=True,
                                check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--", "ds_canzona"], cwd=root, capture_output=True,
                                 text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return commit + ("+changes" if changed else "")


def _read_run(path: str) -> dict[str, Any]:
    """An earlier --json run; runs written before cells carried their commit take it from the file name."""
    import re

    document = json.loads(open(path).read())
    named = re.search(r"-([0-9a-f]{7})\.json$", path)
    commit = document.get("commit") or (named.group(1) if named else "?")
    return {**document, "cells": [{"commit": commit, **cell} for cell in document["cells"]]}


def merge_documents(documents: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs of one model and setting (say one per DP range) as one document.

    A (system, stage, TP, DP) cell counted in more than one run is kept from the last run given.
    """
    # Runs written before --zero existed ran without overrides.
    documents = [{"zero_overrides": {}, **document} for document in documents]
    first = documents[0]
    for other in documents[1:]:
        for key in ("model", "tensors", "bucket_numel", "zero_overrides", "tokens"):
            if other[key] != first[key]:
                raise ValueError(f"--from-json: the runs differ in {key} ({first[key]!r} vs {other[key]!r})")
    cells: dict[tuple, dict[str, Any]] = {}
    for document in documents:
        for cell in document["cells"]:
            cells[(cell["system"], cell["stage"], cell.get("tp", 1), cell["dp"])] = cell
    merged = {**first, "cells": list(cells.values())}
    merged.pop("commit", None)  # each cell carries its own
    return merged


def _one_world(run_ranks, dp: int, tp: int, cells, source, args) -> list[dict[str, Any]]:
    # One fresh process per world: DeepSpeed keeps its groups (and its TP mesh) for the rest of a process.
    # DeepSpeed's Muon wraps its update in torch.compile, which would trace fake tensors; it changes no collective.
    return run_ranks(_world_entry, 1, dp * tp, tp, cells, source, args.bucket_numel, not args.real,
                     dict(args.zero), timeout=args.timeout, env={"TORCHDYNAMO_DISABLE": "1"})[0]


def _world_entry(rank: int, world_size: int, world: int, tp: int, cells, source, bucket_numel: int, fake: bool,
                 zero_overrides: dict[str, Any]):
    return run_world(rank, world, cells, source, bucket_numel, fake, tp=tp, zero_overrides=zero_overrides)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.1f}"


def _title(document: dict[str, Any]) -> str:
    overrides = "".join(f", {key}={json.dumps(value)}" for key, value in document.get("zero_overrides", {}).items())
    return (f"Collectives per step: {document['model']}, {document['tensors']} tensors, bf16, buckets of "
            f"{document['bucket_numel']:,} elements{overrides}, micro-batch 1 x {document['tokens']} tokens, rank 0")


def _sorted_cells(document: dict[str, Any]) -> list[dict[str, Any]]:
    return sorted(document["cells"], key=lambda c: (c.get("tp", 1), c["dp"], c["stage"],
                                                    list(SYSTEMS).index(c["system"])))


def _group_launches(cell: dict[str, Any]) -> str:
    """Launches per process group, the TP group's split into the model's (forward, backward) and the step's."""
    parts = []
    for group, row in sorted(cell.get("by_group", {}).items()):
        if group == "tp":
            step = row["phases"].get("step", {}).get("launches", 0)
            parts.append(f"tp {row['launches'] - step}+{step}")
        else:
            parts.append(f"{group} {row['launches']}")
    return ", ".join(parts)


def _fetch_launches(cell: dict[str, Any]) -> str:
    """The launches DeepSpeed's ZeRO-3 parameter coordinator issued (its module fetches), "?" for older runs."""
    phases = [phase for row in cell.get("by_group", {}).values() for phase in row.get("phases", {}).values()]
    if not phases or any("fetch_launches" not in phase for phase in phases):
        return "?"
    return f"{sum(phase['fetch_launches'] for phase in phases):,}"


def format_table(document: dict[str, Any]) -> str:
    lines = [_title(document), f"{'TP':>3} {'DP':>5} {'stage':>5}  {'system':<16} {'launches':>9} {'fetches':>8} "
             f"{'p2p ops':>9} {'sent MiB/rank':>14} {'padding MiB':>12}  launches by group (tp: model+step)"]
    for cell in _sorted_cells(document):
        label = SYSTEMS[cell["system"]].label
        head = f"{cell.get('tp', 1):>3} {cell['dp']:>5} {cell['stage']:>5}  {label:<16}"
        if cell.get("unavailable"):
            lines.append(f"{head} not available: {cell['unavailable']}")
            continue
        lines.append(f"{head} {cell['launches']:>9,} {_fetch_launches(cell):>8} {cell['p2p_ops']:>9,} "
                     f"{_mib(cell['sent']):>14} {_mib(cell['padding']):>12}  {_group_launches(cell)}")
    return "\n".join(lines)


def _tp_launches(cell: dict[str, Any], phases: tuple[str, ...]) -> int:
    return sum(cell.get("by_group", {}).get("tp", {}).get("phases", {}).get(p, {}).get("launches", 0) for p in phases)


def format_markdown(document: dict[str, Any]) -> str:
    """One row per (TP, DP, stage): ds_canzona against DeepSpeed side by side, "-" where a cell did not run.

    With TP above 1 two columns more: the launches on the TP group in forward and backward (AutoTP's
    own all-reduces, the model's) and in the optimizer step. With a stage-3 row one more: the launches
    of DeepSpeed's parameter coordinator (its module fetches), which it times for both systems.
    """
    rows: dict[tuple[int, int, int], dict[str, dict[str, Any]]] = {}
    for cell in _sorted_cells(document):
        rows.setdefault((cell.get("tp", 1), cell["dp"], cell["stage"]), {})[cell["system"]] = cell
    with_tp = any(tp > 1 for tp, _, _ in rows)

    def pair(row, show) -> str:
        return " / ".join("-" if row.get(s) is None or row[s].get("unavailable") else show(row[s]) for s in SYSTEMS)

    def count(key):
        return lambda cell: f"{cell[key]:,}"

    columns = [("launches", count("launches"))]
    if any(stage == 3 for _, _, stage in rows):
        columns += [("of them ZeRO-3 fetches", _fetch_launches)]
    if with_tp:
        columns += [("TP launches: forward + backward", lambda c: f"{_tp_launches(c, ('forward', 'backward')):,}"),
                    ("TP launches: step", lambda c: f"{_tp_launches(c, ('step',)):,}")]
    columns += [("NCCL ops", count("p2p_ops")), ("sent MiB per rank", lambda c: _mib(c["sent"])),
                ("padding MiB", lambda c: _mib(c["padding"]))]
    keys = (["TP"] if with_tp else []) + ["DP", "stage"]
    lines = [f"*{_title(document)}; each cell: ds_canzona / DeepSpeed*", "",
             "| " + " | ".join(keys + [name for name, _ in columns]) + " |",
             "|" + "---:|" * (len(keys) + len(columns))]
    for (tp, dp, stage), row in rows.items():
        lead = ([str(tp)] if with_tp else []) + [str(dp), str(stage)]
        lines.append("| " + " | ".join(lead + [pair(row, show) for _, show in columns]) + " |")
    return "\n".join(lines + ["", _provenance(document)])


def _provenance(document: dict[str, Any]) -> str:
    """Which code counted which cells: every cell is a run of the whole model, at the commit named."""
    where: dict[str, list[str]] = {}
    for cell in _sorted_cells(document):
        label = f"{SYSTEMS[cell['system']].label} stage {cell['stage']}" + (f" TP {cell['tp']}" if cell.get("tp", 1) > 1
                                                                              else "")
        commit = cell.get("commit", document.get("commit", "?"))
        if label not in where.setdefault(commit, []):
            where[commit].append(label)
    return "Counted (every cell a run of the whole model, all layers) at: " + "; ".join(
        f"{commit}: {', '.join(labels)}" for commit, labels in where.items()) + "."


def _positive_list(text: str) -> tuple[int, ...]:
    values = tuple(int(v) for v in text.split(","))
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be a positive integer")
    return values


def _positive_int(text: str) -> int:
    (value,) = _positive_list(text)
    return value


def _zero_override(text: str) -> tuple[str, Any]:
    key, separator, value = text.partition("=")
    if not separator or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=JSON")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"{text!r}: the value is not JSON ({error})") from None


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
    parser.add_argument("--tp", type=_positive_list, default=(1,), metavar="T,T,...",
                        help="AutoTP sizes (default 1); a cell's world is TP x DP ranks")
    parser.add_argument("--stages", type=_positive_list, default=(1, 2, 3), metavar="S,S", help="ZeRO stages")
    parser.add_argument("--systems", type=lambda t: tuple(t.split(",")), default=tuple(SYSTEMS),
                        metavar="NAME,NAME", help=f"of {', '.join(SYSTEMS)}")
    parser.add_argument("--cells", metavar="SYSTEM:STAGE,...", help="exactly these (system, stage) pairs, instead "
                        "of --systems x --stages (e.g. canzona:2,deepspeed:2,canzona:3)")
    parser.add_argument("--bucket-numel", type=int, default=DEFAULT_BUCKET_NUMEL, metavar="N",
                        help="reduce_bucket_size and allgather_bucket_size (default 5e8)")
    parser.add_argument("--reduce-bucket-size", type=_positive_int, default=None, metavar="N",
                        help="reduce_bucket_size alone (the gradient buckets; same as --zero reduce_bucket_size=N)")
    parser.add_argument("--zero", type=_zero_override, action="append", default=[], metavar="KEY=JSON",
                        help="a zero_optimization key for both systems' configs, its value in JSON (repeatable; "
                             "e.g. stage3_prefetch_bucket_size=5e8, or leaf_module='{\"classes\": [...]}')")
    parser.add_argument("--real", action="store_true", help="real tensors (the model must fit in memory) "
                        "instead of FakeTensorMode")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per DP size")
    parser.add_argument("--json", metavar="FILE", help="also write every number to FILE")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown, the two systems "
                        "side by side")


COLLECTIVES = Command(description="Collective launches, NCCL operations, bytes and padding per training step, "
                      "counted by running the engines on a fake process group.",
                      add_arguments=add_arguments, run=run_collectives)
