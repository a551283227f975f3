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

The code: ``step_systems`` (the model and the rows), ``step_worker`` (what each rank runs),
``step_report`` (aggregation, tables, plot), ``step_zero3`` (the ZeRO-3 and memory tables); this
module drives the ranks and holds the command line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from ...cli import Command, OneLineParser
from .step_report import CaseResult, _aggregate, checks, merge_payloads, plot_step, report
from .step_systems import (BENCH_OPTIMIZERS, MUON_PARAMS, SHAMPOO_PARAMS, SYSTEMS, ModelShape, System,  # noqa: F401
                           _build_model, model_numel)
from .step_worker import _batch, _rank_main  # noqa: F401  (memory3 builds its model and batches from here)
from .step_zero3 import zero3_checks

__all__ = ["STEP", "ModelShape", "System", "SYSTEMS", "main", "run_step_bench"]


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


def run_step_bench(*, dps: Sequence[int], systems: Sequence[str], optimizers: Sequence[str], shape: ModelShape,
                   warmup: int, steps: int, shampoo_steps: int, rounds: int, ns_method: str, compile: bool,
                   bucket_numel: int, timeout: float,
                   log=print) -> tuple[list[CaseResult], list[dict[str, Any]], dict[int, Any]]:
    """Every (system, optimizer) at every DP size: the measured cells, the refused ones, the collectives alone."""
    from ..standins._ranks import run_ranks

    cases = [(key, opt) for opt in optimizers for key in systems if opt in SYSTEMS[key].optimizers]
    settings = {"shape": shape, "warmup": warmup,
                "steps": {"muon": steps, "normuon": steps, "adamuon": steps, "shampoo": shampoo_steps},
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
    parser.add_argument("--optimizers", default="muon,shampoo",
                        help="comma-separated from muon, normuon, adamuon, shampoo (NorMuon and AdaMuon: ds_canzona's "
                             "ZeRO-1/2 rows and the ZeRO-0 schemes; timed like Muon, --steps)")
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
    parser.add_argument("--ops", action="store_true",
                        help="count kernel launches and bytes allocated per owned item in one steady-state step of "
                        "the ds_canzona rows (default canzona-z1,canzona-z2, Muon, the first --dp size), beside the "
                        "recorded counts of the step before its per-item overhead was removed; times nothing")


def run(args: argparse.Namespace) -> int:
    if args.ops:
        return _run_ops(args)
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


def _run_ops(args: argparse.Namespace) -> int:
    from .step_ops import BEFORE, measure_ops, ops_table, summed

    dp = int(args.dp.split(",")[0])
    given = args.systems != ",".join(SYSTEMS)
    systems = [v.strip() for v in args.systems.split(",") if v.strip()] if given else ["canzona-z1", "canzona-z2"]
    if any(not key.startswith("canzona") or key not in SYSTEMS for key in systems):
        raise ValueError(f"--ops counts ds_canzona rows only, got {systems}")
    optimizer = args.optimizers.split(",")[0].strip().lower() if args.optimizers != "muon,shampoo" else "muon"
    shape = ModelShape(**{name: getattr(args, name) for name in ModelShape.__dataclass_fields__})
    bucket_numel = args.bucket_numel if args.bucket_numel is not None else model_numel(shape)
    rows = summed(measure_ops(dp=dp, systems=systems, optimizer=optimizer, shape=shape, bucket_numel=bucket_numel,
                              ns_method=args.ns_method, warmup=max(1, args.warmup), timeout=args.timeout))
    setting = {"dp": dp, "optimizer": optimizer, "model": asdict(shape), "bucket_numel": bucket_numel}
    same = BEFORE and {k: BEFORE.get(k) for k in setting} == setting
    print(f"Model: {shape.describe()}. DP={dp}, {optimizer}, bucket {bucket_numel} elements; one steady-state "
          "step per row, counted by a dispatch mode (ds_canzona.bench.benchmarks.step_ops).")
    print("before: " + (f"recorded at commit {BEFORE['commit']} on the same setting" if same else
                        "not recorded for this setting (the record is for the default model, DP=2, Muon)") + "\n")
    print(ops_table(rows, BEFORE if same else None))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({**setting, "systems": rows, "before": BEFORE if same else None}, handle, indent=1)
    return 0


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    dps = [int(v) for v in args.dp.split(",") if v.strip()]
    systems = [v.strip() for v in args.systems.split(",") if v.strip()]
    optimizers = [v.strip().lower() for v in args.optimizers.split(",") if v.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown systems {unknown}: choose from {', '.join(SYSTEMS)}")
    if not optimizers or any(o not in BENCH_OPTIMIZERS for o in optimizers):
        raise ValueError(f"--optimizers takes some of {', '.join(BENCH_OPTIMIZERS)}, got {args.optimizers!r}")
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
                         "bucket_numel": args.bucket_numel,
                         **{name: params for name, (_, params) in BENCH_OPTIMIZERS.items()}},
            "results": [asdict(r) for r in results], "unavailable": unavailable,
            "checks": checks(results) + zero3_checks(results, unavailable),
            "collectives": {str(dp): c for dp, c in collectives.items()},
            "wall_seconds": time.perf_counter() - started}


STEP = Command(description="Real training steps on gloo ranks: ds_canzona vs DeepSpeed's Muon and the "
               "synchronous and layer-wise schemes (time, bytes, Newton-Schulz runs, optimizer state).",
               add_arguments=add_arguments, run=run)


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m ds_canzona.bench step", description=STEP.description)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
