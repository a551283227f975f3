"""``python -m ds_canzona.bench kernels``: the Triton kernels against torch and cuBLAS, on a GPU.

For each shape and operation it times

* ``triton``: the kernel wrapper (``ds_canzona.kernels.syrk`` / ``newton_schulz`` / ``shampoo``);
* ``torch``: the same math in plain torch in the same precision (for ``ns_step`` the torch
  Newton-Schulz step ``ns_step_reference``; for ``xxt`` ``X @ X.mT``; for ``stat``
  ``L.mul_(beta).add_(G @ G.mT, alpha=1 - beta)`` with the product in G's dtype);
* ``cublas``: one plain ``torch.matmul`` of the same size, ``(m, n) @ (n, m)``, the dense roofline
  the symmetric kernels are meant to beat.

TFLOP/s count the FLOPs the math needs (the full products: ``2 m² n`` for X Xᵀ, ``4 m² n + 2 m³``
for a Newton-Schulz step on a wide m x n X), not the ones the symmetric kernels save, so a kernel
that skips half the tiles can show more TFLOP/s than cuBLAS. ``err`` is the kernel's relative
Frobenius error against the same math in fp32 (TF32 off), a check that the compiled kernel is right.

Without a CUDA GPU it prints one line and exits 0; ``--cpu`` times tiny shapes on the torch
reference only (no Triton, no cuBLAS column). ``--json FILE`` writes every number, rewritten after each row.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .._record import JsonRecord

SQUARE = [(1024, 1024), (2048, 2048), (4096, 4096), (8192, 8192)]

# (name, rows, cols) of the matrix parameters of Qwen3 (head_dim 128, GQA with 8 KV heads),
# from the models' config.json: 8B hidden 4096, intermediate 12288, 32 heads;
# 32B hidden 5120, intermediate 25600, 64 heads.
QWEN3 = [
    ("qwen3-8b.k_proj", 1024, 4096),
    ("qwen3-8b.gate_proj", 12288, 4096),
    ("qwen3-8b.down_proj", 4096, 12288),
    ("qwen3-32b.k_proj", 1024, 5120),
    ("qwen3-32b.q_proj", 8192, 5120),
    ("qwen3-32b.o_proj", 5120, 8192),
    ("qwen3-32b.gate_proj", 25600, 5120),
]

CPU_SHAPES = [("cpu", 64, 96), ("cpu", 128, 128), ("cpu", 96, 256), ("cpu", 256, 96)]

OPS = ("xxt", "ns_step", "stat")
NS_COEFFS = (3.4445, -4.7750, 2.0315)
STAT_BETA = 0.95


def _flops(op: str, m: int, n: int) -> float:
    if op == "ns_step":
        small, large = min(m, n), max(m, n)
        return 4.0 * small * small * large + 2.0 * small**3
    return 2.0 * m * m * n  # xxt and stat: the full m x m product over n


def _parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ds_canzona.bench kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="operand dtype (default bf16)")
    p.add_argument("--shapes", choices=("square", "qwen3", "all"), default="all", help="which shapes (default all)")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    p.add_argument("--repeats", type=int, default=10, help="timed runs per measurement; the median is kept")
    p.add_argument("--warmup", type=int, default=3, help="untimed runs first (compilation happens here)")
    p.add_argument("--sweep", action="store_true", help="also time a few tile configs per shape and report the best")
    p.add_argument("--cpu", action="store_true", help="no GPU: time tiny shapes on the torch reference only")
    p.add_argument("--json", metavar="FILE", help="write every number to FILE")
    args = p.parse_args(list(argv))
    args.ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    bad = [o for o in args.ops if o not in OPS]
    if bad:
        p.error(f"unknown op(s) {', '.join(bad)}: choose from {', '.join(OPS)}")
    if args.repeats < 1 or args.warmup < 0:
        p.error("--repeats must be >= 1 and --warmup >= 0")
    return args


def _timer(device: str) -> Callable[[Callable[[], Any], int, int], float]:
    import torch

    if device == "cuda":
        flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")  # > L2 (H200: 60 MB)

        def time_cuda(fn: Callable[[], Any], warmup: int, repeats: int) -> float:
            for _ in range(warmup):
                fn()
            torch.cuda.synchronize()
            times = []
            for _ in range(repeats):
                flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            return statistics.median(times)

        return time_cuda

    def time_cpu(fn: Callable[[], Any], warmup: int, repeats: int) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return time_cpu


def _sweep_configs() -> list[Any]:
    from ds_canzona.kernels import TileConfig

    return [
        TileConfig(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=4),
        TileConfig(block_m=128, block_n=128, block_k=32, num_warps=4, num_stages=4),
        TileConfig(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=3),
        TileConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3),
        TileConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4),
        TileConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3),
    ]


def _rel(x: Any, ref: Any) -> float:
    return float((x.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def _gpu_shapes(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    shapes: list[tuple[str, int, int]] = []
    if args.shapes in ("square", "all"):
        shapes += [(f"square{m}", m, n) for m, n in SQUARE]
    if args.shapes in ("qwen3", "all"):
        shapes += QWEN3
    return shapes


def _bench_kernels(args: argparse.Namespace, device: str, shapes: Sequence[tuple[str, int, int]],
                   on_row: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Kernel, torch and cuBLAS on ``device`` ('cuda'; 'cpu' only under TRITON_INTERPRET=1, in tests)."""
    import torch

    from ds_canzona.kernels import newton_schulz, shampoo, syrk

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means IEEE fp32, as the kernels' default
    timed = _timer(device)
    gen = torch.Generator(device=device).manual_seed(0)
    rows: list[dict[str, Any]] = []
    for name, m, n in shapes:
        x = torch.randn(m, n, device=device, dtype=torch.float32, generator=gen)
        x = (x / x.norm()).to(dtype)
        for op in args.ops:
            if op == "xxt":
                def run_triton(cfg=None):
                    return syrk.syrk(x, config=cfg)

                def run_torch():
                    return x @ x.mT

                ref32 = x.float() @ x.float().mT
            elif op == "ns_step":
                out = torch.empty_like(x)

                def run_triton(cfg=None):
                    return newton_schulz.ns_step(x, *NS_COEFFS, out=out, config=cfg)

                def run_torch():
                    return newton_schulz.ns_step_reference(x, *NS_COEFFS)

                ref32 = newton_schulz.ns_step_reference(x.float(), *NS_COEFFS)
            else:  # stat: fp32 statistic, g in the operand dtype
                stat = torch.zeros(m, m, device=device, dtype=torch.float32)
                stat_t = torch.zeros_like(stat)

                def run_triton(cfg=None):
                    return shampoo.sym_stat_update_(stat, x, STAT_BETA, config=cfg)

                def run_torch():
                    return stat_t.mul_(STAT_BETA).add_(x @ x.mT, alpha=1.0 - STAT_BETA)

                ref32 = (1.0 - STAT_BETA) * (x.float() @ x.float().mT)
            err = _rel(run_triton(), ref32)  # stat: one update from zero, (1 - beta) G Gᵀ
            flops = _flops(op, m, n)
            t_triton = timed(run_triton, args.warmup, args.repeats)
            t_torch = timed(run_torch, args.warmup, args.repeats)
            t_cublas = timed(lambda: torch.matmul(x, x.mT), args.warmup, args.repeats)
            row: dict[str, Any] = {
                "op": op, "shape": name, "m": m, "n": n, "dtype": args.dtype, "flops": flops,
                "triton_ms": t_triton, "torch_ms": t_torch, "cublas_ms": t_cublas,
                "triton_tflops": flops / t_triton / 1e9, "torch_tflops": flops / t_torch / 1e9,
                "cublas_tflops": 2.0 * m * m * n / t_cublas / 1e9,
                "speedup_vs_torch": t_torch / t_triton, "err_vs_fp32": err,
            }
            if args.sweep:
                best = None
                for cfg in _sweep_configs():
                    if op != "ns_step" and cfg.block_m != cfg.block_n:
                        continue
                    try:
                        t = timed(lambda cfg=cfg: run_triton(cfg), args.warmup, args.repeats)
                    except Exception as err_:  # a config the GPU cannot hold (shared memory)
                        print(f"  sweep {op} {name} {cfg}: {type(err_).__name__}: {err_}", file=sys.stderr)
                        continue
                    if best is None or t < best[0]:
                        best = (t, cfg)
                if best is not None:
                    row["sweep_best_ms"] = best[0]
                    row["sweep_best_config"] = {k: getattr(best[1], k) for k in best[1].__dataclass_fields__}
            rows.append(row)
            print(_format_row(row), flush=True)
            if on_row is not None:  # the --json record, rewritten after each row
                on_row(row)
            del ref32
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def _bench_cpu(args: argparse.Namespace, on_row: Callable[[dict[str, Any]], None] | None = None
               ) -> list[dict[str, Any]]:
    import torch

    from ds_canzona.kernels import newton_schulz, shampoo, syrk

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    timed = _timer("cpu")
    gen = torch.Generator().manual_seed(0)
    rows: list[dict[str, Any]] = []
    for name, m, n in CPU_SHAPES:
        x = torch.randn(m, n, generator=gen)
        x = (x / x.norm()).to(dtype)
        stat = torch.zeros(m, m)
        fns = {
            "xxt": lambda: syrk.syrk_reference(x),
            "ns_step": lambda: newton_schulz.ns_step_reference(x, *NS_COEFFS),
            "stat": lambda: shampoo.sym_stat_update_reference(stat, x, STAT_BETA),
        }
        for op in args.ops:
            flops = _flops(op, m, n)
            t = timed(fns[op], args.warmup, args.repeats)
            row = {"op": op, "shape": name, "m": m, "n": n, "dtype": args.dtype, "flops": flops,
                   "torch_ms": t, "torch_tflops": flops / t / 1e9}
            rows.append(row)
            print(_format_row(row), flush=True)
            if on_row is not None:  # the --json record, rewritten after each row
                on_row(row)
    return rows


# (row key, title, width, format); text columns are left-aligned.
_COLUMNS = [
    ("op", "op", 8, "s"), ("shape", "shape", 20, "s"), ("m", "m", 6, "d"), ("n", "n", 6, "d"),
    ("triton_ms", "triton ms", 10, ".3f"), ("triton_tflops", "TFLOP/s", 8, ".1f"),
    ("torch_ms", "torch ms", 10, ".3f"), ("torch_tflops", "TFLOP/s", 8, ".1f"),
    ("speedup_vs_torch", "x torch", 8, ".2f"), ("cublas_ms", "cuBLAS mm", 10, ".3f"),
    ("cublas_tflops", "TFLOP/s", 8, ".1f"), ("err_vs_fp32", "err", 9, ".2e"),
]


def _format_row(row: dict[str, Any]) -> str:
    cells = []
    for key, _, width, fmt in _COLUMNS:
        value = row.get(key)
        align = "<" if fmt == "s" else ">"
        cells.append(f"{value:{align}{width}{fmt}}" if value is not None else f"{'-':>{width}}")
    text = " ".join(cells)
    if "sweep_best_config" in row:
        c = row["sweep_best_config"]
        text += (f"  best {row['sweep_best_ms']:.3f} ms @ {c['block_m']}x{c['block_n']}x{c['block_k']}"
                 f" w{c['num_warps']} s{c['num_stages']}")
    return text


def _header() -> str:
    return " ".join(f"{title:<{w}}" if fmt == "s" else f"{title:>{w}}" for _, title, w, fmt in _COLUMNS)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the kernel benchmark; 0 on success, also when there is no GPU to run it on."""
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    import torch

    has_cuda = torch.cuda.is_available()
    if not has_cuda and not args.cpu:
        print("ds_canzona.bench kernels: no CUDA GPU here, nothing measured "
              "(the Triton kernels need one; --cpu times tiny shapes on the torch reference only).")
        return 0
    device = "cpu" if args.cpu else "cuda"
    meta: dict[str, Any] = {"device": device, "dtype": args.dtype, "torch": torch.__version__}
    if device == "cuda":
        from ds_canzona.kernels import TRITON_AVAILABLE

        if not TRITON_AVAILABLE:
            print("ds_canzona.bench kernels: Triton is not importable here, nothing measured.")
            return 0
        import triton

        meta.update(gpu=torch.cuda.get_device_name(), triton=triton.__version__)
        print(f"# {meta['gpu']}, {args.dtype} operands, fp32 accumulation; median of {args.repeats} runs; "
              "TFLOP/s count the full products")
    else:
        print(f"# CPU, torch reference only, {args.dtype}; median of {args.repeats} runs")
    print(_header())
    # Written after every row: a sweep stopped at a time limit keeps what it measured.
    record = JsonRecord(Path(args.json), {"meta": meta}) if args.json else None
    on_row = record.add if record is not None else None
    if device == "cuda":
        _bench_kernels(args, "cuda", _gpu_shapes(args), on_row)
    else:
        _bench_cpu(args, on_row)
    if record is not None:
        print(f"# wrote {record.finish()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
