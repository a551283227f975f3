"""``python -m ds_canzona.bench zero3-memory``: memory per rank at ZeRO-3, between steps and at the step's peak.

Systems, on the same Qwen3-architecture model and batches as ``bench step`` (fp32, gloo ranks):
ds_canzona ZeRO-3 (owner placement), DeepSpeed 0.19.8's own ZeRO-3 Muon (``reduce_scatter:
false``, which its ZeRO-3 Muon requires) and ds_canzona ZeRO-2, all with the same
``reduce_bucket_size``. Each system runs in fresh rank processes; each trains one warm-up step and
then the measured steps.

How it is measured: the bytes the process holds through ``malloc`` (glibc's ``mallinfo2``:
``uordblks + hblkhd``, every arena, every thread; torch's CPU tensors are malloc'd), minus the
same number taken before the model was built (after the process group was set up). "Between steps" is that after ``engine.step()``
returns (and a ``gc.collect()``); "step peak" and "iteration peak" are the largest values a
sampling thread saw during ``engine.step()`` and during the whole forward + backward + step (a
sample every ~0.2 ms; the true peak can only be higher). So the numbers cover everything the
system keeps (parameters, gradients, optimizer state, masters, communication staging) and,
at the peaks, activations and temporaries. For the ds_canzona systems the tensors they keep are
also counted exactly by kind (parameters, gradients, optimizer state with fp32 masters).
Reported per rank as max and average over ranks. Linux with glibc only.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any

from ...cli import Command

__all__ = ["ZERO3_MEMORY", "SYSTEMS", "run_memory_bench"]

SYSTEMS = {
    "canzona-z3": "ds_canzona ZeRO-3 (owner placement)",
    "deepspeed-z3": "DeepSpeed 0.19.8 ZeRO-3 Muon (reduce_scatter off)",
    "canzona-z2": "ds_canzona ZeRO-2",
}
MUON_PARAMS = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0, "ns_method": "gram", "adam_lr": 3e-4,
               "betas": [0.9, 0.95], "eps": 1e-10}


class _Malloc(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def _malloc_in_use():
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Malloc

    def in_use() -> int:
        info = libc.mallinfo2()
        return int(info.uordblks + info.hblkhd)

    return in_use


class PeakSampler:
    """A thread that samples ``in_use()`` while active and keeps the largest value."""

    def __init__(self, in_use) -> None:
        self._in_use = in_use
        self._active = threading.Event()
        self._stop = threading.Event()
        self.peak = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._active.wait(0.05):
                self.peak = max(self.peak, self._in_use())
                time.sleep(0.0002)

    def start(self) -> None:
        self.peak = self._in_use()
        self._active.set()

    def stop(self) -> int:
        self._active.clear()
        self.peak = max(self.peak, self._in_use())
        return self.peak

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def _engine_config(system: str, micro_batch: int, world_size: int, bucket: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": micro_batch * world_size,
        "gradient_clipping": 1.0,
        "steps_per_print": 1_000_000,
        "optimizer": {"type": "Muon", "params": dict(MUON_PARAMS)},
        "zero_optimization": {"stage": 3 if system.endswith("z3") else 2, "reduce_bucket_size": bucket},
    }
    if system.startswith("canzona"):
        config["canzona"] = {"log_plan": False, "kernels": "torch"}
    else:
        config["zero_optimization"]["reduce_scatter"] = False
    return config


def _nbytes(tensors) -> int:
    import torch
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def _kept_by_kind(engine, system: str) -> dict[str, int] | None:
    """The tensors a ds_canzona system keeps between steps, by kind (None for DeepSpeed's)."""
    zero = engine.optimizer
    if system == "canzona-z3":
        params = _nbytes(p.ds_tensor for p in engine.module.parameters())
        grads = _nbytes(g for g in zero._accumulated if g is not None)
    elif system == "canzona-z2":
        params = _nbytes(zero.param_flat)
        grads = _nbytes([f for f in zero.grad_flat if f is not None] + list(zero.grad_segment))
    else:
        return None
    state = sum(_nbytes(t.state.values()) for t in zero.owned_tensors())
    # fp32 models update their parameters in place; lower precision keeps separate fp32 masters.
    masters = sum(t.master.numel() * t.master.element_size() for t in zero.owned_tensors()
                  if t.master.dtype != zero.dtype)
    return {"params": params, "grads": grads, "state": state + masters}


def _rank_main(rank: int, world_size: int, settings: dict[str, Any]) -> list[dict[str, Any]]:
    import torch

    import deepspeed
    import ds_canzona  # noqa: F401  (the engine hook)

    from .step import ModelShape, _batch, _build_model

    shape = ModelShape(**settings["shape"])
    # The process group and its buffers exist before the baseline, so no system is charged for them.
    deepspeed.init_distributed(dist_backend="gloo")
    in_use = _malloc_in_use()
    sampler = PeakSampler(in_use)
    out = []
    for system in settings["systems"]:
        gc.collect()
        baseline = in_use()
        engine, _, _, _ = deepspeed.initialize(model=_build_model(shape), config=_engine_config(
            system, shape.micro_batch, world_size, settings["bucket_numel"]))
        between, step_peak, iteration_peak = [], [], []
        for step in range(settings["steps"] + 1):
            tokens = _batch(shape, step, rank)
            sampler.start()
            loss = engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
            before_step = sampler.stop()
            sampler.start()
            engine.step()
            step_max = sampler.stop()
            del loss
            gc.collect()
            if step == 0:
                continue  # warm-up: the first step allocates the optimizer state
            between.append(in_use() - baseline)
            step_peak.append(step_max - baseline)
            iteration_peak.append(max(before_step, step_max) - baseline)
        out.append({"system": system, "between": max(between), "step_peak": max(step_peak),
                    "iteration_peak": max(iteration_peak), "kept": _kept_by_kind(engine, system)})
        if hasattr(engine, "destroy"):
            engine.destroy()
        del engine
        gc.collect()
        torch.distributed.barrier()
    sampler.close()
    return out


def run_memory_bench(*, dps: Sequence[int], systems: Sequence[str], shape: dict[str, Any], steps: int,
                     bucket_numel: int) -> dict[str, Any]:
    from ..standins._ranks import run_ranks

    payload: dict[str, Any] = {"shape": shape, "steps": steps, "bucket_numel": bucket_numel, "results": {}}
    for dp in dps:
        # One spawn per system: each starts from a fresh process (no allocator state left by another).
        per_system = []
        for system in systems:
            settings = {"shape": shape, "systems": [system], "steps": steps, "bucket_numel": bucket_numel}
            per_system.append(run_ranks(_rank_main, dp, settings, timeout=1800, env={"TORCHDYNAMO_DISABLE": "1"}))
        payload["results"][str(dp)] = [[rows[rank][0] for rows in per_system] for rank in range(dp)]
    return payload


def _mb(value: float) -> str:
    return f"{value / 2**20:.1f}"


def report(payload: dict[str, Any]) -> str:
    lines = []
    for dp, per_rank in payload["results"].items():
        lines.append(f"DP={dp}: MiB per rank, max / avg over ranks (malloc'd bytes above the pre-model baseline)")
        lines.append(f"  {'system':52s} {'between steps':>15s} {'step peak':>15s} {'iteration peak':>15s}   "
                     "kept: params / grads / state+masters (max)")
        for index, system in enumerate(payload["results"][dp][0]):
            rows = [rank[index] for rank in per_rank]
            cells = []
            for key in ("between", "step_peak", "iteration_peak"):
                values = [row[key] for row in rows]
                cells.append(f"{_mb(max(values))} / {_mb(statistics.mean(values))}")
            kept = ""
            if rows[0]["kept"] is not None:
                kept = " / ".join(_mb(max(row["kept"][k] for row in rows)) for k in ("params", "grads", "state"))
            lines.append(f"  {SYSTEMS[system['system']]:52s} {cells[0]:>15s} {cells[1]:>15s} {cells[2]:>15s}   {kept}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dp", default="2,4", help="comma-separated DP sizes (default 2,4)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    parser.add_argument("--steps", type=int, default=2, help="measured steps after one warm-up step (default 2)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--bucket-numel", type=int, default=1_000_000,
                        help="reduce_bucket_size of every system (DeepSpeed's ZeRO-3 holds buffers of this size)")
    parser.add_argument("--json", help="also write every number to this file")


def run(args: argparse.Namespace) -> int:
    systems = [s for s in args.systems.split(",") if s]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise SystemExit(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    shape = {"hidden": args.hidden, "layers": args.layers, "intermediate": args.intermediate, "vocab": args.vocab}
    payload = run_memory_bench(dps=[int(d) for d in args.dp.split(",")], systems=systems, shape=shape,
                               steps=args.steps, bucket_numel=args.bucket_numel)
    print(report(payload))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(payload, handle, indent=1)
    return 0


ZERO3_MEMORY = Command(description="Memory per rank at ZeRO-3 (between steps, step and iteration peaks): ds_canzona "
                       "owner placement vs DeepSpeed's ZeRO-3 Muon and ds_canzona ZeRO-2.",
                       add_arguments=add_arguments, run=run)
