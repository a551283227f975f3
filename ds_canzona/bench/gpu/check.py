"""``python -m ds_canzona.bench gpu-check PHASE``: the checks of the prepared GPU session.

scripts/gpu_session.sh runs each phase in its own process (a compile error or a poisoned CUDA
context in one cannot stop the next):

* ``env``: the versions, the device, the commit and which checkout's code runs, as one JSON line;
* ``validate``: every kernel through its public function against float64 (``gpu.validate``),
  with the backend forced to ``triton``, then under ``default``; the text of
  ``kernels.backend_report()`` when the kernels provide one;
* ``engine``: DeepSpeed engine steps on one device, ZeRO-1/2/3 x Muon/Shampoo/SOAP (``gpu.engine``);
* ``ns-time``: Muon's Newton-Schulz with the Triton kernels against torch at the model's shapes.

Each prints one line per case, a ``RESULT`` line, and writes ``OUT/<phase>.json``, rewritten
after every case (``bench._record.JsonRecord``: ``"complete": false`` until the phase ends), so a
phase stopped at its time limit leaves the cases it finished; the exit status is 0 when every
case passed, 1 otherwise. ``--dry-run`` (or ``GPU_SESSION_DRY_RUN=1``)
runs the same code on the CPU: tiny shapes, Triton's interpreter, a 2-layer model, gloo.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Any

from ...cli import Command, OneLineParser
from .._record import JsonRecord

__all__ = ["GPU_CHECK", "main"]

PHASES = ("env", "validate", "engine", "ns-time")
DRY_RUN_VAR = "GPU_SESSION_DRY_RUN"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("phase", choices=PHASES, help="which phase to run")
    parser.add_argument("--dry-run", action="store_true", default=os.environ.get(DRY_RUN_VAR) == "1",
                        help=f"CPU, tiny shapes, Triton's interpreter (default: {DRY_RUN_VAR}=1)")
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_out"), help="folder for <phase>.json "
                        "(default: $OUT, else gpu_out)")
    parser.add_argument("--ops", default=None, help="validate: comma-separated kernel functions (default: all)")
    parser.add_argument("--dtypes", default=None, help="validate: comma-separated float16,bfloat16,float32")
    parser.add_argument("--workers", type=int, default=None, help="validate: processes at a time, one dtype each "
                        "(default: one per dtype on a GPU, 2 in the dry run; 1: all in this process)")
    parser.add_argument("--layers", type=int, default=None, help="engine, ns-time: decoder layers "
                        "(default 28, the 0.6B model's; 2 in the dry run)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="engine: seconds after which the remaining cases are skipped (default 180; dry 120)")
    parser.add_argument("--repeats", type=int, default=None, help="ns-time: timed runs per median (default 10; dry 1)")


# --------------------------------------------------------------------------- the environment


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def environment() -> dict[str, Any]:
    """Versions, device and commit (``GPU_SESSION_COMMIT``, set by scripts/gpu_session.sh)."""
    import torch

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": _version("triton"),
        "deepspeed": _version("deepspeed"),
        "transformers": _version("transformers"),
        "commit": os.environ.get("GPU_SESSION_COMMIT", "unknown"),
        # Which checkout's code runs, and the path it was imported by (the session's package view).
        "package": str(Path(__file__).resolve().parents[2]),
        "imported_from": str(Path(__file__).parents[2]),
        "triton_interpret": os.environ.get("TRITON_INTERPRET", ""),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(device=props.name, capability=f"sm_{props.major}{props.minor}",
                   memory_gib=round(props.total_memory / 2**30, 1), device_count=torch.cuda.device_count())
    else:
        env.update(device="cpu", cores=os.cpu_count())
    return env


def _record(out: Path, phase: str, header: dict[str, Any]) -> JsonRecord:
    return JsonRecord(out / f"{phase.replace('-', '_')}.json", header)


def _print(text: str) -> None:
    print(text, flush=True)


def _result(phase: str, rows: Sequence[dict[str, Any]], seconds: float, path: Path) -> int:
    failed = [r for r in rows if not r["passed"]]
    skipped = [r for r in rows if r.get("skipped")]
    _print(f"RESULT {phase}: {len(rows) - len(failed) - len(skipped)} passed, {len(failed)} failed"
           + (f", {len(skipped)} skipped" if skipped else "") + f" in {seconds:.1f} s; wrote {path}")
    for row in failed:
        name = row.get("case") or " ".join(str(row.get(k, "")) for k in ("stage", "optimizer", "variant", "matrix", "method"))
        _print(f"  FAILED {row.get('backend', '')} {name.strip()}: {row.get('reason', '')}")
    return 1 if failed or not rows else 0


def _backend_report() -> str | None:
    import ds_canzona.kernels as K

    report = getattr(K, "backend_report", None)
    return report() if callable(report) else None


def _device(dry: bool) -> str:
    import torch

    if dry:
        return "cpu"
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device here; on a machine without a GPU run with --dry-run")
    return "cuda"


# --------------------------------------------------------------------------- the phases


def validate_dtypes(dtypes: Sequence[str], ops: Sequence[str] | None, *, dry: bool, device: str,
                    on_row: Callable[[dict[str, Any]], None] | None = None, row_queue=None
                    ) -> tuple[list[dict[str, Any]], str | None]:
    """The validation cases of ``dtypes``, backend ``triton`` then ``default``, in this process;
    the rows and the kernels' backend report. A worker process runs this for its dtype and puts
    each row on ``row_queue`` as it is judged (the parent records it at once)."""
    if row_queue is not None:
        on_row = row_queue.put
    import torch

    from . import validate

    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # torch's fp32 yardstick in IEEE fp32, as the kernels' default
    import ds_canzona.kernels as K
    from ds_canzona.kernels._common import is_interpreted

    if dry and K.TRITON_AVAILABLE and not is_interpreted(K.syrk_kernel):
        raise RuntimeError("the dry run needs TRITON_INTERPRET=1 set before ds_canzona.kernels is imported")
    selected = validate.cases(dry=dry, ops=ops, dtypes=dtypes)
    rows = []
    for backend in ("triton", "default"):
        with _cpu_as_cuda_for_default() if dry and backend == "default" else contextlib.nullcontext():
            rows += validate.run_cases(selected, backend=backend, device=device,
                                       report=lambda row: (_print(validate.format_row(row)), on_row and on_row(row)))
    return rows, _backend_report()


@contextlib.contextmanager
def _cpu_as_cuda_for_default():
    """The dry run's ``default`` pass takes the GPU's route: the dispatch calls the CPU tensors CUDA
    ones (the stand-in tests/test_kernel_validation.py uses), so every case goes through the
    first-use check under the interpreter, and the check's cap is lowered to 4096 elements, so the
    dry shapes' stacks are checked on a slice as a GPU's large calls are (kernels/validation.py)."""
    from ds_canzona.kernels import dispatch, validation

    saved = dispatch.device_type, validation.CHECK_MAX_ELEMENTS
    dispatch.device_type = lambda tensor: "cuda"
    validation.CHECK_MAX_ELEMENTS = 4096
    try:
        yield
    finally:
        dispatch.device_type, validation.CHECK_MAX_ELEMENTS = saved


def _validate_in_workers(dtypes: Sequence[str], ops: Sequence[str] | None, *, workers: int, dry: bool, device: str,
                         on_rows: Callable[[list[dict[str, Any]]], None]) -> tuple[list[dict[str, Any]], list[str]]:
    """Each dtype in a spawned process of its own, ``workers`` at a time: Triton compiles each
    process's kernels on its own CPU core (compilation, not the GPU, is most of this phase), and a
    crash or a poisoned CUDA context costs only that dtype's remaining cases, which are then failed
    rows. Every row reaches ``on_rows`` as soon as it is judged (through a queue), so a phase
    stopped at its limit keeps the rows its workers finished."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    from . import validate

    rows: list[dict[str, Any]] = []
    reports = []
    spawn = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
    streamed: dict[str, list[dict[str, Any]]] = {dtype: [] for dtype in dtypes}

    def drain(queue) -> None:
        for row in iter(queue.get, None):
            streamed[row["dtype"]].append(row)
            on_rows([row])

    with spawn.Manager() as manager:
        queue = manager.Queue()
        reader = threading.Thread(target=drain, args=(queue,), daemon=True)
        reader.start()
        with ProcessPoolExecutor(max_workers=min(workers, len(dtypes)), mp_context=spawn) as pool:
            futures = {pool.submit(validate_dtypes, [dtype], ops, dry=dry, device=device, row_queue=queue): dtype
                       for dtype in dtypes}
            outcomes = {}
            for future in as_completed(futures):
                try:
                    outcomes[futures[future]] = future.result()
                except Exception as error:  # the worker died or raised
                    outcomes[futures[future]] = error
        queue.put(None)
        reader.join()
    for dtype in dtypes:  # in dtype order: the final file does not depend on which worker finished first
        outcome = outcomes[dtype]
        if isinstance(outcome, Exception):
            reason = f"worker for {dtype} failed: {type(outcome).__name__}: {' '.join(str(outcome).split())[:300]}"
            done = {(r["case"], r["backend"]) for r in streamed[dtype]}
            lost = [{"case": case.name, "op": case.op, "dtype": dtype, "shape": list(case.shape),
                     "variant": case.variant, "backend": backend, "passed": False, "reason": reason}
                    for backend in ("triton", "default")
                    for case in validate.cases(dry=dry, ops=ops, dtypes=[dtype]) if (case.name, backend) not in done]
            on_rows(lost)
            rows += streamed[dtype] + lost
            continue
        group_rows, report = outcome
        rows += group_rows
        if report:
            reports.append(f"[{dtype} worker]\n{report}")
    return rows, reports


def _run_validate(args: argparse.Namespace) -> int:
    from . import validate

    started = time.perf_counter()
    device = _device(args.dry_run)
    ops = _split(args.ops)
    dtypes = _split(args.dtypes) or list(validate.DTYPES)
    validate.cases(dry=args.dry_run, ops=ops, dtypes=dtypes)  # unknown names fail here, before any work
    # The dry run takes the worker path too (it is the GPU's), with two processes for the two cores.
    workers = args.workers if args.workers is not None else (2 if args.dry_run else len(dtypes))
    where = "in this process" if workers <= 1 else f"a process per dtype, {min(workers, len(dtypes))} at a time"
    _print(f"validate: {len(validate.cases(dry=args.dry_run, ops=ops, dtypes=dtypes))} cases x backends "
           f"triton, default on {device} ({where}); "
           f"a case passes when err <= its fixed bound and the largest error <= {validate.MAX_OF_BOUND:g} x "
           f"that bound, and on a GPU err <= {validate.K_TORCH:g} x torch + {validate.FLOOR_U:g} u and the "
           f"largest error <= {validate.K_MAX:g} x torch's + u (u: the output dtype's unit roundoff)")
    record = _record(Path(args.out), "validate", {
        "env": environment(), "k_torch": validate.K_TORCH, "floor_u": validate.FLOOR_U, "k_max": validate.K_MAX,
        "max_of_bound": validate.MAX_OF_BOUND, "bound_u": validate.BOUND_U})
    if workers <= 1:
        rows, report = validate_dtypes(dtypes, ops, dry=args.dry_run, device=device, on_row=record.add)
        reports = [report] if report else []
    else:
        rows, reports = _validate_in_workers(dtypes, ops, workers=workers, dry=args.dry_run, device=device,
                                             on_rows=record.extend)
    report = "\n".join(reports) or None
    _print("backend report:\n" + report if report else "backend report: kernels.backend_report() not available")
    record.rows = rows  # as streamed, then in dtype order
    return _result("validate", rows, time.perf_counter() - started, record.finish(backend_report=report))


def _run_engine(args: argparse.Namespace) -> int:
    from . import engine

    started = time.perf_counter()
    device = _device(args.dry_run)
    settings = engine.EngineSettings.for_run(dry=args.dry_run, layers=args.layers, budget_s=args.budget_s)
    depth = ("" if args.dry_run or settings.layers == engine.FULL_LAYERS
             else f" (FEWER LAYERS than the 0.6B model's {engine.FULL_LAYERS})")
    _print(f"engine: Qwen3-0.6B-shaped{' (dry run: cut down)' if args.dry_run else ''}, {settings.layers} layers"
           f"{depth}, bf16, micro-batch {settings.micro_batch} x {settings.seq} tokens, DP=1 on {device}; "
           f"{settings.warmup} warm-up + {settings.steps} timed steps + 1 step counting host syncs per case")
    record = _record(Path(args.out), "engine", {"env": environment(), "settings": asdict(settings),
                                                "model_config": engine.model_config(settings)})
    rows = engine.run_engines(settings, dist_backend="gloo" if device == "cpu" else "nccl",
                              report=lambda row: (_print(engine.format_engine_row(row)), record.add(row)))
    for row in rows:
        for phase, sites in row.get("sync_sites", {}).items():
            for site, count in sorted(sites.items(), key=lambda kv: -kv[1])[:8]:
                _print(f"  sync ZeRO-{row['stage']} {row['optimizer']} {row.get('variant') or ''} {phase}: {count} x {site}")
    report = _backend_report()
    _print("backend report:\n" + report if report else "backend report: kernels.backend_report() not available")
    return _result("engine", rows, time.perf_counter() - started, record.finish(backend_report=report))


def _run_ns_time(args: argparse.Namespace) -> int:
    from . import engine

    started = time.perf_counter()
    device = _device(args.dry_run)
    settings = engine.EngineSettings.for_run(dry=args.dry_run, layers=args.layers)
    repeats = args.repeats or (1 if args.dry_run else 10)
    _print(f"ns-time: Muon's orthogonalize (5 steps), triton vs torch kernels backend, median of {repeats} on {device}")
    record = _record(Path(args.out), "ns-time", {"env": environment(), "repeats": repeats})
    rows = engine.time_newton_schulz(settings, device=device, repeats=repeats,
                                     report=lambda row: (_print(engine.format_ns_row(row)), record.add(row)))
    return _result("ns-time", rows, time.perf_counter() - started, record.finish())


def _split(text: str | None) -> list[str] | None:
    return None if text is None else [part.strip() for part in text.split(",") if part.strip()]


def run(args: argparse.Namespace) -> int:
    if args.dry_run:
        # Before the kernels are first imported: Triton chooses the interpreter when a kernel is defined.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.phase == "env":
        _print("ENV " + json.dumps(environment()))
        return 0
    try:
        return {"validate": _run_validate, "engine": _run_engine, "ns-time": _run_ns_time}[args.phase](args)
    except RuntimeError as error:  # a phase that cannot start here (no GPU, no interpreter)
        _print(f"RESULT {args.phase}: not run: {error}")
        return 1


GPU_CHECK = Command(description="The GPU session's checks, one phase per call: env, validate (kernels against "
                    "float64), engine (ZeRO-1/2/3 x Muon/Shampoo/SOAP on one device), ns-time.",
                    add_arguments=add_arguments, run=run)


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m ds_canzona.bench gpu-check", description=GPU_CHECK.description)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
