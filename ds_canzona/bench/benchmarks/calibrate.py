"""``python -m ds_canzona.bench calibrate``: measure the roofline cost model's machine balance here.

The roofline model prices a tensor's optimizer step as its matrix-product FLOPs plus
``machine_balance`` FLOPs per byte of its elementwise passes (ds_canzona.plan.cost). The balance is
a property of the device: how many matmul FLOPs it does in the time it moves one byte through an
elementwise op. This command measures both rates with the per-tensor rules the runtime runs:

- AdamW on a long vector is elementwise only: its time gives the bytes/s of those passes;
- Muon on a square matrix is mostly Newton-Schulz products: its time, less its elementwise part
  at that bandwidth, gives the matmul FLOP/s;

- a tiny in-place add, many times over, is launch latency only: its time per op, times the
  elementwise bytes/s, is one launch in elementwise bytes (the model's ``launch_bytes``), and
  times the matmul FLOP/s, one launch in the model's unit (``machine_balance · launch_bytes``);

and prints the balance, ready for ``"canzona": {"machine_balance": ...}``, and the launch term,
ready for ``cost_model("roofline", launch_bytes=...)``. The runtime never measures by itself:
every rank must compute the same plan, so the values come from the config (or the device kind's
defaults, ``ds_canzona.plan.DEFAULT_MACHINE_BALANCE`` and ``DEFAULT_LAUNCH_BYTES``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from ...cli import Command, OneLineParser
from .._record import write_json_atomically

__all__ = ["CALIBRATE", "Calibration", "calibrate", "main"]


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """Measured rates of this device and the balance they imply."""

    device: str
    threads: int
    matrix: int
    vector: int
    muon_seconds: float
    adamw_seconds: float
    elementwise_bytes_per_s: float
    matmul_flops_per_s: float
    machine_balance: float
    default: float
    launch_seconds: float
    """One tiny elementwise op, launched back to back: the latency of a launch."""
    launch_bytes: float
    """That latency in elementwise bytes (launch seconds x elementwise bytes/s): the model's ``launch_bytes``."""
    launch_flops: float
    """The same in the model's unit, matmul FLOPs (``machine_balance · launch_bytes``)."""
    default_launch_bytes: float

# Back-to-back launches of the tiny op per timed sample, and its elements (a few cache lines).
LAUNCHES_PER_SAMPLE = 2000
TINY_ELEMENTS = 64


def _median_seconds(run, repeats: int, synchronize) -> float:
    run()  # warm-up: allocations, kernel selection
    synchronize()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        synchronize()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def calibrate(*, matrix: int, vector: int, repeats: int = 3, threads: int | None = None) -> Calibration:
    """Time one Muon step on ``matrix`` x ``matrix`` and one AdamW step on ``vector`` elements, fp32."""
    import torch

    from ...optim import rule_for_group
    from ...plan import ParamSpec, StepWork, default_launch_bytes, default_machine_balance, optimizer_work
    from ...plan.cost import STATE_ELEMENT_BYTES

    if matrix < 2 or vector < 1 or repeats < 1:
        raise ValueError(f"need matrix >= 2, vector >= 1, repeats >= 1; got {matrix}, {vector}, {repeats}")
    # torch alone (no DeepSpeed needed): the device kinds are the names DeepSpeed's accelerators use.
    device_kind = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device_kind)
    synchronize = torch.cuda.synchronize if device_kind == "cuda" else (lambda: None)
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(0)

        def timed(kind: str, shape: tuple[int, ...]) -> float:
            rule = rule_for_group({"kind": kind})
            param = (torch.randn(shape, generator=generator) * 0.02).to(device)
            grad = torch.randn(shape, generator=generator).to(device)
            state = rule.init_state(param)
            return _median_seconds(lambda: rule.update_([param], [grad], [state], lr=1e-3), repeats, synchronize)

        adamw_seconds = timed("adamw", (vector,))
        muon_seconds = timed("muon", (matrix, matrix))
        tiny = torch.zeros(TINY_ELEMENTS, device=device)

        def launches() -> None:
            for _ in range(LAUNCHES_PER_SAMPLE):
                tiny.add_(1.0)

        launch_seconds = _median_seconds(launches, repeats, synchronize) / LAUNCHES_PER_SAMPLE
        used_threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(previous)

    adamw: StepWork = optimizer_work(ParamSpec(name="vector", shape=(vector,), matrix=False))
    muon: StepWork = optimizer_work(ParamSpec(name="matrix", shape=(matrix, matrix), matrix=True), "muon")
    bandwidth = adamw.elementwise_accesses * STATE_ELEMENT_BYTES / adamw_seconds
    matmul_seconds = muon_seconds - muon.elementwise_accesses * STATE_ELEMENT_BYTES / bandwidth
    if matmul_seconds <= 0:
        raise RuntimeError(f"Muon on {matrix}x{matrix} ({muon_seconds:.4g} s) took no longer than its elementwise "
                           "passes alone; use a larger --matrix")
    flops_per_s = muon.matmul_flops / matmul_seconds
    return Calibration(device=device_kind, threads=used_threads, matrix=matrix, vector=vector,
                       muon_seconds=muon_seconds, adamw_seconds=adamw_seconds, elementwise_bytes_per_s=bandwidth,
                       matmul_flops_per_s=flops_per_s, machine_balance=flops_per_s / bandwidth,
                       default=default_machine_balance(device_kind), launch_seconds=launch_seconds,
                       launch_bytes=launch_seconds * bandwidth, launch_flops=launch_seconds * flops_per_s,
                       default_launch_bytes=default_launch_bytes(device_kind))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--matrix", type=int, default=None, help="Muon matrix side (default 1024 on CPU, 4096 on GPU)")
    parser.add_argument("--vector", type=int, default=None, help="AdamW elements (default 2^24 on CPU, 2^27 on GPU)")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps each (median)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads on the CPU (default 1: one per rank, as the runtime's ranks run)")
    parser.add_argument("--json", metavar="FILE", help="also write the numbers as JSON")


def run(args: argparse.Namespace) -> int:
    import torch

    on_cpu = not torch.cuda.is_available()
    result = calibrate(matrix=args.matrix or (1024 if on_cpu else 4096),
                       vector=args.vector or (2**24 if on_cpu else 2**27), repeats=args.repeats,
                       threads=args.threads if on_cpu else None)
    print(f"device {result.device} ({result.threads} thread(s) on the CPU side), fp32 state:")
    print(f"  AdamW on {result.vector} elements: {result.adamw_seconds * 1e3:.1f} ms -> elementwise "
          f"{result.elementwise_bytes_per_s / 1e9:.2f} GB/s")
    print(f"  Muon on {result.matrix} x {result.matrix}: {result.muon_seconds * 1e3:.1f} ms -> matmul "
          f"{result.matmul_flops_per_s / 1e9:.1f} GFLOP/s")
    print(f"  machine balance {result.machine_balance:.1f} FLOPs/byte (default for {result.device}: {result.default:g})")
    print(f"  a tiny add, {LAUNCHES_PER_SAMPLE} back to back: {result.launch_seconds * 1e6:.2f} us per launch -> "
          f"launch_bytes {result.launch_bytes:.3g} (default for {result.device}: {result.default_launch_bytes:g}), "
          f"{result.launch_flops:.3g} matmul FLOPs")
    print(f'\n"canzona": {{"cost_model": "roofline", "machine_balance": {result.machine_balance:.0f}}}')
    print(f'cost_model("roofline", machine_balance={result.machine_balance:.0f}, launch_bytes={result.launch_bytes:.2g})')
    if args.json:
        write_json_atomically(Path(args.json), asdict(result))
    return 0


CALIBRATE = Command(description="Measure this device's machine balance (matmul FLOP/s over elementwise bytes/s) "
                    "and kernel launch latency for the roofline cost model, with the runtime's own Muon and "
                    "AdamW rules.",
                    add_arguments=add_arguments, run=run)


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m ds_canzona.bench calibrate", description=CALIBRATE.description)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
