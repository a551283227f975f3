"""The rank side of ``python -m ds_canzona.bench step``: build every engine, step them in turn, measure.

``_rank_main`` runs in each gloo rank (``_ranks.run_ranks``); it returns per case the timed
records of every step, the optimizer state and memory of the engine, and the collectives alone.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from .step_systems import BENCH_OPTIMIZERS, SYSTEMS, ModelShape, System, _build_model, _client_optimizer, _engine_config


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
    from ..standins._memory import measure_step_memory

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

    from ..standins._instrument import CollectiveMeter, NewtonSchulzMeter, force_deepspeed_ns_dtype

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
        for optimizer in BENCH_OPTIMIZERS:
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
