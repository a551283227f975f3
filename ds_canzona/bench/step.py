"""``python -m ds_canzona.bench step``: real training steps on gloo ranks of this machine.

Every system trains the same Qwen3-architecture model (``transformers.Qwen3ForCausalLM``, fp32,
one torch thread per rank) on the same batches at the same DP sizes. All systems of one optimizer
live in the same rank processes at once and take their steps in turn (step s of each between
steps s-1 and s+1 of the others), so a burst of load on the shared machine hits all of them
alike. Each is timed per phase:

- forward-backward: the forward and ``engine.backward`` (DeepSpeed's Muon orthogonalises here, in
  its ZeRO gradient epilogue);
- optimizer step: ``engine.step()`` (ds_canzona orthogonalises here, on the owner);
- iteration: both.

Each number is the median over the timed steps (after warm-up) of the slowest rank of that step
(for Shampoo, whose refresh steps are far slower, the mean over a preconditioner period); ranks
start every step together (a barrier outside the timed region). Bytes are counted the same
way for every system by wrapping ``deepspeed.comm``'s collectives (see ``_instrument``), and so
are Newton-Schulz runs (DeepSpeed's ``muon_update``, ds_canzona's ``orthogonalize``). After the
timed steps every system takes two more, profiled, for memory per rank (``_memory``): what the
engine holds between steps by category, and the peak of a step.

Systems (Muon): ds_canzona ZeRO-1 and ZeRO-2; DeepSpeed 0.19.8's own Muon at ZeRO-1 and ZeRO-2,
with ``reduce_scatter`` on and off; the synchronous scheme and the layer-wise scheme
(``baselines``); at ZeRO-3, DeepSpeed's own Muon (``reduce_scatter`` off, as it requires) and
ds_canzona's owner placement with the same config (a system whose config ds_canzona refuses at
``deepspeed.initialize`` is reported "not available: <the error>"), and the same with the
embedding and head (AdamW tensors) owned in 8 canonical pieces each (``canzona-z3-pieces``),
whose tables ``step_zero3`` prints. Shampoo: ds_canzona ZeRO-1 and ZeRO-2 against the
synchronous and layer-wise schemes. Every system runs the same Newton-Schulz method (Gram by
default) in fp32: DeepSpeed's would pick fp16 on this CPU (oneDNN reports fp16 support) and is
held at fp32, and its ``torch.compile`` wrapper is switched off (``TORCHDYNAMO_DISABLE=1`` in the
ranks; ``--compile`` keeps it), so that only the distribution differs.

``--json`` writes every number; ``--from-json a.json,b.json`` prints (and ``--plot`` draws) earlier
runs together without running anything, e.g. one run per DP size.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..cli import Command, OneLineParser
from .step_zero3 import memory_summary, memory_table, zero3_checks, zero3_table

__all__ = ["STEP", "ModelShape", "System", "SYSTEMS", "main", "run_step_bench"]


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The Qwen3 config of the benchmark model and the micro-batch it trains on."""

    hidden: int = 256
    layers: int = 8
    intermediate: int = 1024
    vocab: int = 8192
    heads: int = 4
    kv_heads: int = 1
    head_dim: int = 64
    seq: int = 128
    micro_batch: int = 2

    def qwen3_config(self) -> dict[str, Any]:
        return {"hidden_size": self.hidden, "num_hidden_layers": self.layers, "intermediate_size": self.intermediate,
                "vocab_size": self.vocab, "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads,
                "head_dim": self.head_dim, "max_position_embeddings": max(256, self.seq),
                "tie_word_embeddings": False, "attention_bias": False}

    def describe(self) -> str:
        return (f"Qwen3 architecture: hidden {self.hidden}, {self.layers} layers, intermediate {self.intermediate}, "
                f"vocab {self.vocab}, {self.heads} heads / {self.kv_heads} KV heads of {self.head_dim}, untied head; "
                f"fp32; micro-batch {self.micro_batch} x {self.seq} tokens per rank")


@dataclass(frozen=True, kw_only=True)
class System:
    key: str
    label: str
    runtime: str  # "canzona", "deepspeed", "synchronous", "layerwise"
    stage: int
    reduce_scatter: bool = True
    optimizers: tuple[str, ...] = ("muon",)
    # ds_canzona only: cut each vocab x hidden tensor (the embedding, the untied head) into this many
    # canonical pieces, by ``canzona.split_numel`` = vocab x hidden / pieces of the benchmark model.
    vocab_pieces: int | None = None


SYSTEMS: dict[str, System] = {s.key: s for s in (
    System(key="canzona-z1", label="ds_canzona ZeRO-1", runtime="canzona", stage=1, optimizers=("muon", "shampoo")),
    System(key="canzona-z2", label="ds_canzona ZeRO-2", runtime="canzona", stage=2, optimizers=("muon", "shampoo")),
    System(key="deepspeed-z1", label="DeepSpeed Muon ZeRO-1", runtime="deepspeed", stage=1),
    System(key="deepspeed-z1-ar", label="DeepSpeed Muon ZeRO-1, reduce_scatter off", runtime="deepspeed", stage=1,
           reduce_scatter=False),
    System(key="deepspeed-z2", label="DeepSpeed Muon ZeRO-2", runtime="deepspeed", stage=2),
    System(key="deepspeed-z2-ar", label="DeepSpeed Muon ZeRO-2, reduce_scatter off", runtime="deepspeed", stage=2,
           reduce_scatter=False),
    System(key="deepspeed-z3", label="DeepSpeed Muon ZeRO-3 (reduce_scatter off)", runtime="deepspeed", stage=3,
           reduce_scatter=False),
    System(key="canzona-z3", label="ds_canzona ZeRO-3", runtime="canzona", stage=3, reduce_scatter=False),
    System(key="canzona-z3-pieces", label="ds_canzona ZeRO-3, AdamW tensors in pieces", runtime="canzona", stage=3,
           reduce_scatter=False, vocab_pieces=8),
    System(key="synchronous", label="synchronous (every rank, every matrix)", runtime="synchronous", stage=0,
           optimizers=("muon", "shampoo")),
    System(key="layerwise", label="layer-wise (all-reduce, LPT owners, broadcast)", runtime="layerwise", stage=0,
           optimizers=("muon", "shampoo")),
)}

COLLECTIVE_NAMES = ("all_reduce", "reduce_scatter", "all_gather_into_tensor", "broadcast")
MUON_PARAMS = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0, "ns_method": "gram", "adam_lr": 3e-4,
               "betas": [0.9, 0.95], "eps": 1e-10}
SHAMPOO_PARAMS = {"lr": 1e-3, "adam_lr": 3e-4, "precondition_frequency": 5, "start_preconditioning_step": 1,
                  "max_preconditioner_dim": 1024}


# --------------------------------------------------------------------------------------------
# Rank side
# --------------------------------------------------------------------------------------------


def model_numel(shape: ModelShape) -> int:
    """Parameters of the benchmark model (built on the meta device: no memory, no time)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in Qwen3ForCausalLM(Qwen3Config(**shape.qwen3_config())).parameters())


def _build_model(shape: ModelShape, seed: int = 0):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(**shape.qwen3_config())
    config._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(config)


def _engine_config(system: System, optimizer: str, settings: dict[str, Any], world_size: int) -> dict[str, Any]:
    shape: ModelShape = settings["shape"]
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": shape.micro_batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": shape.micro_batch * world_size,
        "gradient_clipping": 1.0,
        "steps_per_print": 1_000_000,
        "zero_optimization": {"stage": system.stage, "reduce_bucket_size": settings["bucket_numel"],
                              "allgather_bucket_size": settings["bucket_numel"]},
    }
    params = dict(MUON_PARAMS if optimizer == "muon" else SHAMPOO_PARAMS)
    params["ns_method"] = settings["ns_method"] if optimizer == "muon" else None
    params = {k: v for k, v in params.items() if v is not None}
    if system.runtime in ("canzona", "deepspeed"):
        config["optimizer"] = {"type": "Muon" if optimizer == "muon" else "Shampoo", "params": params}
    if system.runtime == "canzona":
        config["canzona"] = {"log_plan": False, "kernels": "torch"}
        if system.vocab_pieces:
            # Below the default split_numel on this model, so the other rows own these tensors whole.
            config["canzona"]["split_numel"] = -(-shape.vocab * shape.hidden // system.vocab_pieces)
    if system.runtime == "deepspeed" or system.stage == 3:
        # DeepSpeed's ZeRO-3 Muon refuses reduce_scatter; ds_canzona's ZeRO-3 row takes the same config.
        config["zero_optimization"]["reduce_scatter"] = system.reduce_scatter
    if system.stage == 3:
        # DeepSpeed keeps tensors under 1e5 elements gathered on every rank, which on this small
        # model is every attention matrix; 10 x hidden (the HuggingFace integration's "auto")
        # keeps only the norms, as 1e5 does on a model of real size.
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 10 * shape.hidden
    return config


def _client_optimizer(system: System, optimizer: str, model, settings: dict[str, Any]):
    """The synchronous and layer-wise schemes: ds_canzona's single-process optimizer as DeepSpeed sees it."""
    if system.runtime not in ("synchronous", "layerwise"):
        return None
    from ds_canzona import optim
    from ds_canzona.zero.build import translate_optimizer_params

    params = dict(MUON_PARAMS if optimizer == "muon" else SHAMPOO_PARAMS)
    if optimizer == "muon":
        params["ns_method"] = settings["ns_method"]
    cls = {"muon": optim.Muon, "shampoo": optim.Shampoo}[optimizer]
    inner = cls([(n, p) for n, p in model.named_parameters() if p.requires_grad],
                **translate_optimizer_params(optimizer, params))
    if system.runtime == "synchronous":
        return inner
    from .baselines import LayerwiseOptimizer
    return LayerwiseOptimizer(inner)


def _tensor_bytes(values) -> int:
    import torch
    return sum(v.numel() * v.element_size() for v in values if torch.is_tensor(v))


def _state_bytes(engine, system: System) -> dict[str, int]:
    """Optimizer state on this rank: the matrix optimizer's, AdamW's, and DeepSpeed's extra copies."""
    out = {"matrix": 0, "adamw": 0, "fp32_master": 0}
    optimizer = engine.optimizer
    if system.runtime == "canzona":
        if not hasattr(optimizer, "owned_tensors"):  # a runtime without the per-tensor view: memory has the totals
            return out
        param_storages = {p.untyped_storage().data_ptr() for p in engine.module.parameters()}
        for t in optimizer.owned_tensors():
            out["adamw" if t.group["kind"] == "adamw" else "matrix"] += _tensor_bytes(t.state.values())
            if t.master.untyped_storage().data_ptr() not in param_storages:  # fp32 models update in place
                out["fp32_master"] += _tensor_bytes([t.master])
        return out
    if system.runtime == "deepspeed" and system.stage == 3:
        # ZeRO-3 hands the base optimizer one fp32 flat partition per sub-group only inside step().
        base = optimizer.optimizer
        for i, flat in enumerate(optimizer.fp32_partitioned_groups_flat):
            key = "matrix" if optimizer.sub_groups_using_muon[i] else "adamw"
            out[key] += _tensor_bytes(base.state.get(flat, {}).values())
            out["fp32_master"] += _tensor_bytes([flat])
        return out
    if system.runtime == "deepspeed":
        base = optimizer.optimizer
        for group in base.param_groups:
            key = "matrix" if group.get("use_muon") else "adamw"
            for p in group["params"]:
                out[key] += _tensor_bytes(base.state.get(p, {}).values())
        # The staging copy of the momentum that muon_update writes before the step commits it.
        out["matrix"] += sum(_tensor_bytes([staged]) for staged, _ in getattr(optimizer, "_muon_pending_momentum",
                                                                               {}).values())
        out["fp32_master"] += _tensor_bytes(getattr(optimizer, "single_partition_of_fp32_groups", []))
        return out
    for group in optimizer.param_groups:
        key = "adamw" if group["kind"] == "adamw" else "matrix"
        for p in group["params"]:
            out[key] += _tensor_bytes(optimizer.state.get(p, {}).values())
    return out


def _batch(shape: ModelShape, step: int, rank: int):
    import torch
    generator = torch.Generator().manual_seed(10_007 * step + rank)
    return torch.randint(0, shape.vocab, (shape.micro_batch, shape.seq), generator=generator)


@dataclass
class _Case:
    system: System
    optimizer: str
    engine: Any = None
    records: list = field(default_factory=list)
    losses: list = field(default_factory=list)
    build_seconds: float = 0.0
    memory: dict[str, int] | None = None
    unavailable: str | None = None  # why deepspeed.initialize refused this system's config


def _build_case(case: _Case, settings: dict[str, Any], world_size: int) -> None:
    """Build the case's engine; a config ds_canzona refuses (say stage 3 before its runtime exists)
    leaves the case unavailable with the error's text instead of failing the benchmark."""
    import deepspeed
    from ds_canzona.config import CanzonaConfigError

    model = _build_model(settings["shape"])
    config = _engine_config(case.system, case.optimizer, settings, world_size)
    client = _client_optimizer(case.system, case.optimizer, model, settings)
    started = time.perf_counter()
    try:
        case.engine, *_ = deepspeed.initialize(model=model, optimizer=client, config=config)
    except CanzonaConfigError as error:
        case.unavailable = str(error)
    case.build_seconds = time.perf_counter() - started


def _train_step(case: _Case, tokens, meter, ns, *, timed: bool) -> None:
    import torch.distributed

    engine = case.engine
    torch.distributed.barrier()
    meter.reset()
    meter.active = timed
    ns.runs = 0
    start = time.perf_counter()
    loss = engine(input_ids=tokens, labels=tokens).loss
    engine.backward(loss)
    middle = time.perf_counter()
    engine.step()
    end = time.perf_counter()
    meter.active = False
    case.losses.append(float(loss.detach()))
    if timed:
        case.records.append({"fwd_bwd": middle - start, "step": end - middle, "iteration": end - start,
                             "ns_runs": ns.runs, "comm": meter.snapshot()})


def _run_cases(cases: list[_Case], settings: dict[str, Any], rank: int, world_size: int, meter, ns) -> list[dict]:
    """Build every engine of ``cases``, then step them in turn, so each sees the same machine load.

    Step s of every system runs between step s-1 and step s+1 of every other one; the order rotates
    from one step to the next, so no system always follows the same neighbour.
    """
    from ._memory import measure_step_memory

    shape: ModelShape = settings["shape"]
    warmup, steps = settings["warmup"], settings["steps"][cases[0].optimizer]
    for case in cases:
        _build_case(case, settings, world_size)
    unavailable = [case for case in cases if case.unavailable is not None]
    cases = [case for case in cases if case.unavailable is None]
    for step in range(warmup + steps):
        tokens = _batch(shape, step, rank)
        shift = step % max(1, len(cases))
        for case in cases[shift:] + cases[:shift]:
            _train_step(case, tokens, meter, ns, timed=step >= warmup)
    # Memory: two more (untimed, profiled) steps per system, one system after the other.
    for case in cases:
        case.memory = measure_step_memory(case.engine, lambda k, case=case: _train_step(
            case, _batch(shape, warmup + steps + k, rank), meter, ns, timed=False))
    out = []
    for case in cases:
        out.append({"system": case.system.key, "optimizer": case.optimizer, "rank": rank, "records": case.records,
                    "state": _state_bytes(case.engine, case.system), "memory": case.memory, "losses": case.losses,
                    "build_seconds": case.build_seconds, "max_rss_mb": _max_rss_mb()})
        if hasattr(case.engine, "destroy"):
            case.engine.destroy()
        case.engine = None
    out.extend({"system": case.system.key, "optimizer": case.optimizer, "rank": rank,
                "unavailable": case.unavailable} for case in unavailable)
    gc.collect()
    return out


def _max_rss_mb() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rank_main(rank: int, world_size: int, settings: dict[str, Any]) -> list[dict[str, Any]]:
    import logging

    import torch
    import deepspeed
    import ds_canzona  # noqa: F401  (installs the engine hook)

    from ._instrument import CollectiveMeter, NewtonSchulzMeter, force_deepspeed_ns_dtype

    for name in ("DeepSpeed", "deepspeed", "ds_canzona"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if settings["ns_fp32"]:
        force_deepspeed_ns_dtype(torch.float32)
    meter = CollectiveMeter(world_size).install()
    ns = NewtonSchulzMeter().install()
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    model_numel = sum(p.numel() for p in _build_model(settings["shape"]).parameters())
    collectives = _collective_speeds(model_numel, world_size)
    results = []
    for _ in range(settings["rounds"]):
        for optimizer in ("muon", "shampoo"):
            keys = [key for key, opt in settings["cases"] if opt == optimizer]
            if keys:
                results.extend(_run_cases([_Case(SYSTEMS[key], optimizer) for key in keys], settings, rank,
                                          world_size, meter, ns))
    return {"cases": results, "collectives": collectives}


def _collective_speeds(numel: int, world_size: int, repeats: int = 5) -> dict[str, Any]:
    """Seconds of each collective on a buffer the size of the model (fp32), on this backend: the
    building blocks every system's step is made of, measured alone (median; barrier before each)."""
    import torch
    import torch.distributed
    import deepspeed.comm as dist

    numel -= numel % world_size
    flat = torch.randn(numel)
    size = numel // world_size
    rank = dist.get_rank()
    shard = flat.narrow(0, rank * size, size)
    out_shard = torch.empty(size)
    cases = {
        "all_reduce": lambda: dist.all_reduce(flat),
        "reduce_scatter": lambda: dist.reduce_scatter(out_shard, list(flat.split(size))),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(flat, shard.clone()),
        "broadcast": lambda: dist.broadcast(flat, src=0),
    }
    seconds = {}
    for name, call in cases.items():
        samples = []
        for _ in range(repeats):
            torch.distributed.barrier()
            started = time.perf_counter()
            call()
            samples.append(time.perf_counter() - started)
        seconds[name] = statistics.median(samples[1:])
    return {"bytes": numel * 4, "seconds": seconds}


# --------------------------------------------------------------------------------------------
# Parent side: aggregation and tables
# --------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class CaseResult:
    """One (system, optimizer, DP) cell, aggregated over ranks and timed steps."""

    system: str
    label: str
    optimizer: str
    dp: int
    stage: int
    steps: int
    iteration_s: float
    fwd_bwd_s: float
    step_s: float
    iteration_mean_s: float
    ns_runs_total: int
    ns_runs_max_rank: int
    comm_calls: dict[str, float]
    comm_payload_bytes: dict[str, float]
    comm_input_bytes: dict[str, float]
    comm_wire_bytes: dict[str, float]
    matrix_state_bytes_max: int
    matrix_state_bytes_total: int
    adamw_state_bytes_max: int
    fp32_master_bytes_max: int
    final_loss: float
    max_rss_mb: float
    per_rank_iteration_s: list[float] = field(default_factory=list)
    fwd_bwd_mean_s: float | None = None
    step_mean_s: float | None = None
    samples_iteration_s: list[float] = field(default_factory=list)
    # Per category of step_zero3.memory_summary: {"max": bytes, "avg": bytes, "per_rank": [...]}.
    memory: dict[str, dict[str, Any]] | None = None


def _aggregate(dp: int, per_rank: list[dict[str, Any]]) -> tuple[list[CaseResult], list[dict[str, Any]]]:
    """The measured cells, and the cells whose engine was refused ({system, optimizer, dp, error})."""
    cases: dict[tuple[str, str], list[list[dict[str, Any]]]] = {}
    unavailable: dict[tuple[str, str], str] = {}
    for rank_results in per_rank:
        for item in rank_results["cases"]:
            if "unavailable" in item:
                unavailable.setdefault((item["system"], item["optimizer"]), item["unavailable"])
                continue
            cases.setdefault((item["system"], item["optimizer"]), [[] for _ in range(dp)])[item["rank"]].append(item)
    out = []
    for (key, optimizer), ranks in cases.items():
        system = SYSTEMS[key]
        # Pool the rounds: step i of round k on every rank is one sample.
        samples: list[list[dict[str, Any]]] = []  # [sample][rank]
        for round_index in range(len(ranks[0])):
            for step_index in range(len(ranks[0][round_index]["records"])):
                samples.append([ranks[r][round_index]["records"][step_index] for r in range(dp)])

        def slowest(phase: str) -> list[float]:
            return [max(rec[phase] for rec in sample) for sample in samples]

        rank0 = [sample[0]["comm"] for sample in samples]

        def mean_counter(field_name: str) -> dict[str, float]:
            kinds = sorted({k for c in rank0 for k in c[field_name]})
            return {k: statistics.fmean(c[field_name].get(k, 0) for c in rank0) for k in kinds}

        states = [ranks[r][-1]["state"] for r in range(dp)]
        out.append(CaseResult(
            system=key, label=system.label, optimizer=optimizer, dp=dp, stage=system.stage, steps=len(samples),
            iteration_s=statistics.median(slowest("iteration")), fwd_bwd_s=statistics.median(slowest("fwd_bwd")),
            step_s=statistics.median(slowest("step")), iteration_mean_s=statistics.fmean(slowest("iteration")),
            fwd_bwd_mean_s=statistics.fmean(slowest("fwd_bwd")), step_mean_s=statistics.fmean(slowest("step")),
            samples_iteration_s=slowest("iteration"),
            ns_runs_total=max(sum(rec["ns_runs"] for rec in sample) for sample in samples),
            ns_runs_max_rank=max(rec["ns_runs"] for sample in samples for rec in sample),
            comm_calls=mean_counter("calls"), comm_payload_bytes=mean_counter("payload"),
            comm_input_bytes=mean_counter("input"), comm_wire_bytes=mean_counter("wire"),
            matrix_state_bytes_max=max(s["matrix"] for s in states),
            matrix_state_bytes_total=sum(s["matrix"] for s in states),
            adamw_state_bytes_max=max(s["adamw"] for s in states),
            fp32_master_bytes_max=max(s["fp32_master"] for s in states),
            final_loss=ranks[0][-1]["losses"][-1],
            max_rss_mb=max(ranks[r][-1]["max_rss_mb"] for r in range(dp)),
            per_rank_iteration_s=[statistics.median(rec["iteration"] for item in ranks[r] for rec in item["records"])
                                  for r in range(dp)],
            memory=memory_summary([ranks[r][-1]["memory"] for r in range(dp)]),
        ))
    refused = [{"system": key, "label": SYSTEMS[key].label, "optimizer": optimizer, "dp": dp, "error": error}
               for (key, optimizer), error in unavailable.items()]
    return out, refused


def _reference(result: CaseResult, results: Sequence[CaseResult]) -> CaseResult | None:
    """The ds_canzona row a row is compared with: same stage, or ZeRO-1 for the ZeRO-0 schemes."""
    stage = result.stage if result.stage in (1, 2, 3) else 1
    for other in results:
        if other.system == f"canzona-z{stage}" and other.optimizer == result.optimizer and other.dp == result.dp:
            return other
    return None


def _mb(value: float) -> str:
    return f"{value / 2**20:.1f}"


def step_table(results: Sequence[CaseResult], optimizer: str, dp: int, *, amortised: bool = False) -> str:
    rows = [r for r in results if r.optimizer == optimizer and r.dp == dp]
    if not rows:
        return ""
    unit = "s (mean)" if amortised else "s"
    lines = [
        f"| system | iteration {unit} | fwd-bwd {unit} | step {unit} | iteration / ds_canzona's "
        "| NS runs/step (all ranks / busiest) "
        "| comm MB/step: payload / wire per rank | matrix-opt state MB/rank (max) | state / ds_canzona's "
        "| AdamW state MB/rank |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ref = _reference(r, results)
        iteration = r.iteration_mean_s if amortised else r.iteration_s
        fwd_bwd = r.fwd_bwd_mean_s if amortised and r.fwd_bwd_mean_s is not None else r.fwd_bwd_s
        step = r.step_mean_s if amortised and r.step_mean_s is not None else r.step_s
        ref_iteration = (ref.iteration_mean_s if amortised else ref.iteration_s) if ref else None
        ratio = (f"{iteration / ref_iteration:.2f}x (vs Z{ref.stage})" if ref and ref is not r
                 else "1.00x" if ref else "-")
        state_ratio = (f"{r.matrix_state_bytes_max / ref.matrix_state_bytes_max:.2f}x"
                       if ref and ref.matrix_state_bytes_max else "")
        ns = f"{r.ns_runs_total} / {r.ns_runs_max_rank}" if optimizer == "muon" else "-"
        lines.append(
            f"| {r.label} | {iteration:.3f} | {fwd_bwd:.3f} | {step:.3f} | {ratio} | {ns} "
            f"| {_mb(sum(r.comm_payload_bytes.values()))} / {_mb(sum(r.comm_wire_bytes.values()))} "
            f"| {_mb(r.matrix_state_bytes_max)} | {state_ratio} | {_mb(r.adamw_state_bytes_max)} |")
    return "\n".join(lines)


def comm_table(results: Sequence[CaseResult], optimizer: str, dp: int) -> str:
    rows = [r for r in results if r.optimizer == optimizer and r.dp == dp]
    kinds = sorted({k for r in rows for k in r.comm_calls})
    if not kinds:
        return ""
    lines = ["| system | " + " | ".join(f"{k}: calls, MB" for k in kinds) + " |",
             "|---|" + "---:|" * len(kinds)]
    for r in rows:
        cells = [f"{r.comm_calls.get(k, 0):.0f}, {_mb(r.comm_payload_bytes.get(k, 0))}" for k in kinds]
        lines.append(f"| {r.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def checks(results: Sequence[CaseResult]) -> list[str]:
    """The done-means comparisons, as lines of text (benchmarks never fail on time)."""
    lines = []
    by = {(r.system, r.optimizer, r.dp): r for r in results}
    for dp in sorted({r.dp for r in results}):
        ours = [by.get((f"canzona-z{s}", "muon", dp)) for s in (1, 2)]
        for stage, mine in zip((1, 2), ours):
            if mine is None:
                continue
            for key in (f"deepspeed-z{stage}", f"deepspeed-z{stage}-ar"):
                other = by.get((key, "muon", dp))
                if other is None:
                    continue
                speed = other.iteration_s / mine.iteration_s
                memory = (mine.matrix_state_bytes_max / other.matrix_state_bytes_max
                          if other.matrix_state_bytes_max else 0.0)
                lines.append(f"DP={dp} {mine.label} vs {other.label}: {speed:.2f}x faster per iteration "
                             f"({'ok' if speed >= 1.0 else 'SLOWER'}); NS runs {mine.ns_runs_total} vs "
                             f"{other.ns_runs_total}; Muon state {memory:.2f} of DeepSpeed's (busiest rank), "
                             f"{mine.matrix_state_bytes_total / max(1, other.matrix_state_bytes_total):.2f} in total")
        sync = by.get(("synchronous", "muon", dp))
        best = [r for r in ours if r is not None]
        if sync is not None and best:
            fastest = min(best, key=lambda r: r.iteration_s)
            lines.append(f"DP={dp} {fastest.label} vs synchronous: {sync.iteration_s / fastest.iteration_s:.2f}x faster"
                         + (" (target at DP=2: >= 1.25x)" if dp == 2 else ""))
        sync = by.get(("synchronous", "shampoo", dp))
        best = [by.get((f"canzona-z{s}", "shampoo", dp)) for s in (1, 2)]
        best = [r for r in best if r is not None]
        if sync is not None and best:
            fastest = min(best, key=lambda r: r.iteration_mean_s)
            lines.append(f"DP={dp} Shampoo: {fastest.label} vs synchronous: "
                         f"{sync.iteration_mean_s / fastest.iteration_mean_s:.2f}x faster "
                         "(mean over a preconditioner period)")
    return lines


def machine_info() -> dict[str, Any]:
    import deepspeed
    import torch
    import transformers

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "deepspeed": deepspeed.__version__, "transformers": transformers.__version__,
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None}


def _deepspeed_emulated_runs(shape: ModelShape, dp: int) -> int:
    """NS runs per step DeepSpeed's equal partitions imply for this model (a cross-check of the count)."""
    from ds_canzona.plan import qwen3_specs
    from .baselines import deepspeed_muon_loads

    specs = qwen3_specs(shape.qwen3_config())
    _, runs = deepspeed_muon_loads(specs, [1.0] * len(specs), dp)
    return runs


def run_step_bench(*, dps: Sequence[int], systems: Sequence[str], optimizers: Sequence[str], shape: ModelShape,
                   warmup: int, steps: int, shampoo_steps: int, rounds: int, ns_method: str, compile: bool,
                   bucket_numel: int, timeout: float,
                   log=print) -> tuple[list[CaseResult], list[dict[str, Any]], dict[int, Any]]:
    """Every (system, optimizer) at every DP size: the measured cells, the refused ones, the collectives alone."""
    from ._ranks import run_ranks

    cases = [(key, opt) for opt in optimizers for key in systems if opt in SYSTEMS[key].optimizers]
    settings = {"shape": shape, "warmup": warmup, "steps": {"muon": steps, "shampoo": shampoo_steps},
                "rounds": rounds, "cases": cases, "ns_method": ns_method, "ns_fp32": True,
                "bucket_numel": bucket_numel}
    env = {"DS_ACCELERATOR": "cpu", "TRANSFORMERS_VERBOSITY": "error", "DS_CANZONA_KERNELS": "torch"}
    if not compile:
        env["TORCHDYNAMO_DISABLE"] = "1"
    results: list[CaseResult] = []
    unavailable: list[dict[str, Any]] = []
    collectives: dict[int, Any] = {}
    for dp in dps:
        started = time.perf_counter()
        load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        per_rank = run_ranks(_rank_main, dp, settings, timeout=timeout, env=env)
        measured, refused = _aggregate(dp, per_rank)
        results.extend(measured)
        unavailable.extend(refused)
        collectives[dp] = {**per_rank[0]["collectives"], "load_average_before": load_before,
                           "load_average_after": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
                           "wall_seconds": time.perf_counter() - started}
        log(f"DP={dp}: {len(cases)} cases in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return results, unavailable, collectives


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    shape = ModelShape()
    parser.add_argument("--dp", default="2,3,4", help="comma-separated DP sizes (gloo ranks on this machine)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, from {', '.join(SYSTEMS)}")
    parser.add_argument("--optimizers", default="muon,shampoo", help="muon, shampoo or both")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per system")
    parser.add_argument("--steps", type=int, default=8, help="timed Muon steps per system and round")
    parser.add_argument("--shampoo-steps", type=int, default=5,
                        help="timed Shampoo steps (a multiple of precondition_frequency=5 gives the amortised mean)")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the whole sequence of systems this many times")
    parser.add_argument("--ns-method", choices=("gram", "standard"), default="gram")
    parser.add_argument("--compile", action="store_true", help="leave DeepSpeed's torch.compile of muon_update on")
    parser.add_argument("--bucket-numel", type=lambda text: int(float(text)), default=None,
                        help="reduce/all-gather bucket in elements (default: the model's parameter count, one "
                        "bucket, as DeepSpeed's default 5e8 gives, without DeepSpeed allocating 5e8-element "
                        "bucket buffers)")
    for name in ("hidden", "layers", "intermediate", "vocab", "heads", "kv_heads", "head_dim", "seq", "micro_batch"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(shape, name))
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per DP size before the ranks are killed")
    parser.add_argument("--json", metavar="FILE", help="also write every number as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="also draw the iteration times (needs matplotlib)")
    parser.add_argument("--from-json", metavar="FILES",
                        help="comma-separated JSON files of earlier runs: print (and plot) them together, run nothing")


def run(args: argparse.Namespace) -> int:
    if args.from_json:
        payloads = []
        for path in args.from_json.split(","):
            with open(path.strip(), encoding="utf-8") as handle:
                payloads.append(json.load(handle))
        payload = merge_payloads(payloads)
    else:
        payload = _measure(args)
    report(payload)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(payload, handle, indent=1)
    if args.plot:
        plot_step(payload, args.plot)
        print(f"plot written to {args.plot}")
    return 0


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    dps = [int(v) for v in args.dp.split(",") if v.strip()]
    systems = [v.strip() for v in args.systems.split(",") if v.strip()]
    optimizers = [v.strip().lower() for v in args.optimizers.split(",") if v.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown systems {unknown}: choose from {', '.join(SYSTEMS)}")
    if any(o not in ("muon", "shampoo") for o in optimizers):
        raise ValueError(f"--optimizers takes muon and/or shampoo, got {args.optimizers!r}")
    if any(d < 1 for d in dps):
        raise ValueError(f"--dp sizes must be >= 1, got {args.dp!r}")
    if args.steps < 1 or args.shampoo_steps < 1 or args.warmup < 0 or args.rounds < 1:
        raise ValueError("--steps, --shampoo-steps and --rounds must be >= 1 and --warmup >= 0")
    shape = ModelShape(**{name: getattr(args, name) for name in ModelShape.__dataclass_fields__})
    if args.bucket_numel is None:
        args.bucket_numel = model_numel(shape)
    if args.bucket_numel < 1:
        raise ValueError(f"--bucket-numel must be >= 1, got {args.bucket_numel}")
    started = time.perf_counter()
    results, unavailable, collectives = run_step_bench(dps=dps, systems=systems, optimizers=optimizers, shape=shape,
                                          warmup=args.warmup, steps=args.steps, shampoo_steps=args.shampoo_steps,
                                          rounds=args.rounds, ns_method=args.ns_method, compile=args.compile,
                                          bucket_numel=args.bucket_numel, timeout=args.timeout)
    argv = sys.argv[2:] if sys.argv[1:2] == ["step"] else sys.argv[1:]
    return {"command": "python -m ds_canzona.bench step " + " ".join(argv), "machine": machine_info(),
            "model": asdict(shape),
            "settings": {"warmup": args.warmup, "steps": args.steps, "shampoo_steps": args.shampoo_steps,
                         "rounds": args.rounds, "ns_method": args.ns_method, "compile": args.compile,
                         "bucket_numel": args.bucket_numel, "muon": MUON_PARAMS, "shampoo": SHAMPOO_PARAMS},
            "results": [asdict(r) for r in results], "unavailable": unavailable,
            "checks": checks(results) + zero3_checks(results, unavailable),
            "collectives": {str(dp): c for dp, c in collectives.items()},
            "wall_seconds": time.perf_counter() - started}


def merge_payloads(payloads: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One payload from the JSON of several runs (say one per DP size), for one report and one plot."""
    merged = dict(payloads[0])
    merged["command"] = [p.get("command") for p in payloads]
    merged["results"] = [r for p in payloads for r in p["results"]]
    # A cell refused in one run and measured in another (a later runtime) is the measured one.
    measured = {(r["system"], r["optimizer"], r["dp"]) for r in merged["results"]}
    merged["unavailable"] = [u for p in payloads for u in p.get("unavailable", [])
                             if (u["system"], u["optimizer"], u["dp"]) not in measured]
    merged["collectives"] = {dp: c for p in payloads for dp, c in p.get("collectives", {}).items()}
    results = [CaseResult(**r) for r in merged["results"]]
    merged["checks"] = checks(results) + zero3_checks(results, merged["unavailable"])
    return merged


def report(payload: dict[str, Any]) -> None:
    results = [CaseResult(**r) for r in payload["results"]]
    shape = ModelShape(**payload["model"])
    info, settings = payload["machine"], payload["settings"]
    dps = sorted({r.dp for r in results})
    optimizers = [o for o in ("muon", "shampoo") if any(r.optimizer == o for r in results)]
    print(f"Model: {shape.describe()}.")
    print(f"Machine: {info['cpu']}, {info['cores']} cores; torch {info['torch']}, deepspeed {info['deepspeed']}, "
          f"transformers {info['transformers']}; gloo, one thread per rank.")
    print(f"Newton-Schulz: {settings['ns_method']}, fp32, 5 steps, everywhere. Muon: medians over "
          f"{settings['steps']} timed steps x {settings['rounds']} round(s) after {settings['warmup']} warm-up; "
          f"Shampoo: means over {settings['shampoo_steps']} timed steps; slowest rank per step.")
    for optimizer in optimizers:
        for dp in dps:
            table = step_table(results, optimizer, dp, amortised=optimizer == "shampoo")
            if not table:
                continue
            title = "Muon" if optimizer == "muon" else "Shampoo (mean over one preconditioner period)"
            extra = (f"; DeepSpeed's equal partitions imply {_deepspeed_emulated_runs(shape, dp)} NS runs"
                     if optimizer == "muon" else "")
            print(f"\n{title}, DP={dp}{extra}:\n")
            print(table)
    collectives = payload.get("collectives", {})
    if collectives:
        print("\nThe collectives alone on this machine (a buffer the size of the model, fp32; median seconds):\n")
        print("| DP | MB | " + " | ".join(COLLECTIVE_NAMES) + " | load average before / after |")
        print("|---:|---:|" + "---:|" * len(COLLECTIVE_NAMES) + "---|")
        for dp, c in sorted(collectives.items(), key=lambda item: int(item[0])):
            cells = " | ".join(f"{c['seconds'][n]:.3f}" for n in COLLECTIVE_NAMES)
            print(f"| {dp} | {c['bytes'] / 2**20:.1f} | {cells}"
                  + f" | {c['load_average_before']:.1f} / {c['load_average_after']:.1f} |")
    for dp in dps:
        table = comm_table(results, "muon", dp)
        if table:
            print(f"\nCollectives per step, Muon, DP={dp} (calls, payload MB):\n")
            print(table)
    unavailable = payload.get("unavailable", [])
    labels = {key: system.label for key, system in SYSTEMS.items()}
    for dp in sorted({*dps, *(u["dp"] for u in unavailable)}):
        table = zero3_table(results, unavailable, dp, labels)
        if table:
            print(f"\nZeRO-3, Muon, DP={dp}: time and payload MB per step, by collective:\n")
            print(table)
    for optimizer in optimizers:
        for dp in dps:
            table = memory_table(results, dp, list(SYSTEMS), optimizer)
            if table:
                print(f"\nMemory per rank, {optimizer.capitalize()}, DP={dp} (MB, max / average over ranks; "
                      "held between steps, and the peak of a step):\n")
                print(table)
    print()
    for line in checks(results) + zero3_checks(results, unavailable):
        print(line)


def plot_step(payload: dict[str, Any], path: str) -> None:
    """Iteration time per system, grouped by DP, one panel per optimizer."""
    from ..plan.report import _pyplot

    pyplot = _pyplot()
    results = [CaseResult(**r) for r in payload["results"]]
    optimizers = [o for o in ("muon", "shampoo") if any(r.optimizer == o for r in results)]
    figure, axes = pyplot.subplots(1, len(optimizers), figsize=(6.5 * len(optimizers), 3.6), squeeze=False)
    for axis, optimizer in zip(axes[0], optimizers):
        rows = [r for r in results if r.optimizer == optimizer]
        dps = sorted({r.dp for r in rows})
        keys = [k for k in SYSTEMS if any(r.system == k for r in rows)]
        width = 0.8 / len(keys)
        for index, key in enumerate(keys):
            values = []
            for dp in dps:
                cell = [r for r in rows if r.system == key and r.dp == dp]
                values.append((cell[0].iteration_mean_s if optimizer == "shampoo" else cell[0].iteration_s)
                              if cell else 0.0)
            hatch = "" if key.startswith("canzona") else ("//" if key.startswith("deepspeed") else "..")
            axis.bar([d + (index - (len(keys) - 1) / 2) * width for d in range(len(dps))], values, width,
                     label=SYSTEMS[key].label, hatch=hatch)
        axis.set_xticks(range(len(dps)), [f"DP={dp}" for dp in dps])
        axis.set_ylabel("iteration, s" + (" (mean)" if optimizer == "shampoo" else " (median)"))
        axis.set_title(f"{optimizer.capitalize()}: one training iteration, slowest rank", fontsize=9)
        axis.legend(fontsize=6)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)


STEP = Command(description="Real training steps on gloo ranks: ds_canzona vs DeepSpeed's Muon and the "
               "synchronous and layer-wise schemes (time, bytes, Newton-Schulz runs, optimizer state).",
               add_arguments=add_arguments, run=run)


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m ds_canzona.bench step", description=STEP.description)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
