"""The GPU session's first phase: every kernel, called through its public function, against float64.

Each case builds inputs from a seeded generator, runs one public function of
``ds_canzona.kernels`` (so the call goes through ``dispatch.choose``), and measures the relative
Frobenius error ``||out - oracle|| / ||oracle||`` where the oracle is the same math in float64 on
the same, already rounded, inputs. A case passes when, with ``u`` the unit roundoff of the output
dtype,

* ``err <= BOUND_U[op][dtype] * u``: the fixed bound docs/KERNELS.md states and justifies per
  operation (the ones not in its table are justified below);
* ``max_err <= MAX_OF_BOUND * BOUND_U[op][dtype] * u``, ``max_err`` the largest elementwise error
  over the largest oracle element: one wrong element (a tail off by one) that the norm would
  average away over a large output is still seen;
* every output element is finite (outputs are poisoned with NaN first, so an element never
  written shows), and symmetric outputs are symmetric bit for bit (the statistic update's only on
  the kernel: its torch reference makes no such promise);
* on a GPU only, the yardstick: the torch reference of the same function in the same precision
  (cuBLAS) on the same inputs, ``err <= K_TORCH * torch_err + FLOOR_U * u`` and ``max_err <=
  K_MAX * torch_max_err + u``. On the CPU (the dry run) the yardstick is measured and reported but
  not judged: there the interpreter's products and torch's both run on the processor's BLAS, whose
  kernels differ between machines, so the ratio of two rounding errors of one size moves with the
  processor, and a verdict must not.

The cases run twice: with the backend forced to ``triton`` (a kernel that cannot compile or take
the input raises, so a miss is seen rather than hidden by a fallback) and with ``default`` (what a
training run gets, including any first-use check and fallback in ``dispatch``). Each case is its
own try/except: an error is recorded as a miss and the next case runs.

The shapes have tails on purpose (not multiples of 16 nor of the tiles), tall and wide inputs,
transposed (strided) views and stacks; the GPU list also crosses the 1024 size at which
``default_config`` changes tiles. ``dry`` selects tiny shapes for the CPU dry run, where the
kernels run in Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import math
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["BOUND_U", "FLOOR_U", "K_MAX", "K_TORCH", "MAX_OF_BOUND", "Case", "cases", "run_case", "run_cases"]

DTYPES = ("float16", "bfloat16", "float32")
UNIT_ROUNDOFF = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}

# The yardstick, judged on a GPU only (the module's docstring says why not on the CPU). Both the
# kernel and cuBLAS accumulate in fp32 and round once per product; only the order of the summation
# may differ, so the kernel should not be more than half again as far from float64. The floor
# covers inputs torch gets exact by luck.
K_TORCH = 1.5
FLOOR_U = 1.0 / 16
# The largest single error is noisier than the norm (an extreme over many elements, and summation
# orders differ most there), hence a wider factor; the floor, u of the largest element, is what
# one rounding of that element to the output dtype may cost.
K_MAX = 4.0
# The absolute bound on the largest elementwise error, as a multiple of the norm bound: the extreme
# of many rounding errors sits above their root mean square (seen on the dry cases: at most 2.4x
# the norm error, the fp32 inverse root; at most 1.02x the norm bound, fp16 sym_matmul on torch);
# 4x keeps one element off by 8u of a 16-bit single product a miss.
MAX_OF_BOUND = 4.0

# Fixed bounds in units of the output dtype's unit roundoff u. syrk, ns_step, stat (fp32 L),
# newton (fp32) and inverse_root (fp32) are docs/KERNELS.md's table. The others:
# - sym_matmul is the syrk kernel with a different B and the beta C epilogue: the syrk bounds.
# - stat with a 16-bit L: one fp32 product plus the fp32 beta L term, rounded once to L's dtype: 1u.
# - newton in 16-bit: Mp is rounded once elementwise and reaches M' = Mp^4 M through the fourth
#   power (4 x u/2), plus three rounded products (about 0.4u each, random directions): 4u.
# - inverse_root in 16-bit: the iteration stops at its rounding floor, amplified by the conditioning
#   (cond 100) as in fp32 (64u there); the same 64u. At bf16 that is 0.25: there the yardstick
#   against torch's own 16-bit iteration is the check that matters.
BOUND_U: dict[str, dict[str, float]] = {
    "xxt": {"float32": 16, "float16": 1.0, "bfloat16": 1.0},
    "sym_matmul": {"float32": 16, "float16": 1.0, "bfloat16": 1.0},
    "ns_step": {"float32": 16, "float16": 2.0, "bfloat16": 2.0},
    "sym_stat_update_": {"float32": 16, "float16": 1.0, "bfloat16": 1.0},
    "coupled_newton_step": {"float32": 16, "float16": 4.0, "bfloat16": 4.0},
    "inverse_root_newton": {"float32": 64, "float16": 64, "bfloat16": 64},
}

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
STAT_BETA = 0.95
SYM_ALPHA, SYM_BETA = 0.7, -0.3
SPD_CONDITION = 100.0


@dataclass(frozen=True, kw_only=True)
class Case:
    """One call of a public kernel function: ``op`` on operands of ``dtype`` and ``shape``.

    ``variant``: ``transposed`` (the operand is a strided ``.mT`` view), ``right`` (the right
    statistic, ``g.mT`` of a gradient), ``stat16`` (the statistic in the operand's dtype, not fp32),
    ``root3`` (a third root instead of the fourth).
    """

    op: str
    dtype: str
    shape: tuple[int, ...]
    variant: str = ""

    @property
    def name(self) -> str:
        dims = "x".join(map(str, self.shape))
        return f"{self.op}-{self.dtype}-{dims}" + (f"-{self.variant}" if self.variant else "")


# (op, shape, variant) for every dtype. GPU: the 1024 tile switch is crossed (1030, 1100, 3072),
# sizes are odd or 2 mod 16, the Muon-sized 1024 x 3072 step is in. Dry: tiny, but still several
# tiles of the interpreter's 128 and tails.
_GPU_CASES: tuple[tuple[str, tuple[int, ...], str], ...] = (
    ("xxt", (77, 200), ""),
    ("xxt", (1030, 515), ""),
    ("xxt", (300, 1100), ""),
    ("xxt", (2, 250, 130), "transposed"),  # a strided stack
    ("xxt", (3, 130, 257), ""),
    ("ns_step", (200, 333), ""),
    ("ns_step", (1100, 260), ""),
    ("ns_step", (170, 300), "transposed"),
    ("ns_step", (4, 128, 200), ""),
    ("ns_step", (2, 520, 130), ""),
    ("ns_step", (1024, 3072), ""),
    ("sym_stat_update_", (130, 90), ""),
    ("sym_stat_update_", (1030, 700), ""),
    ("sym_stat_update_", (2, 70, 50), "right"),
    ("sym_stat_update_", (200, 150), "stat16"),
    ("sym_matmul", (2, 100, 100), ""),
    ("sym_matmul", (1030, 1030), ""),
    ("sym_matmul", (300, 300), "beta0"),
    ("xxt", (1, 1030), ""),  # a size-1 dim, which Triton specialises
    ("coupled_newton_step", (2, 100, 100), ""),
    ("coupled_newton_step", (210, 210), "root3"),
    ("inverse_root_newton", (96, 96), ""),
    ("inverse_root_newton", (2, 130, 130), ""),
)
_DRY_CASES: tuple[tuple[str, tuple[int, ...], str], ...] = (
    ("xxt", (20, 33), ""),
    ("xxt", (2, 150, 70), "transposed"),
    ("xxt", (2, 130, 40), ""),
    ("ns_step", (40, 70), ""),
    ("ns_step", (2, 140, 30), ""),
    ("ns_step", (30, 50), "transposed"),
    ("sym_stat_update_", (130, 30), ""),
    ("sym_stat_update_", (2, 40, 30), "right"),
    ("sym_stat_update_", (30, 20), "stat16"),
    ("sym_matmul", (2, 40, 40), ""),
    ("sym_matmul", (30, 30), "beta0"),
    ("xxt", (1, 70), ""),  # a size-1 dim, which Triton specialises
    ("coupled_newton_step", (40, 40), ""),
    ("coupled_newton_step", (30, 30), "root3"),
    ("inverse_root_newton", (40, 40), ""),
)


def cases(*, dry: bool, ops: Iterable[str] | None = None, dtypes: Iterable[str] | None = None) -> list[Case]:
    """Every (op, shape, variant) of the GPU or the dry-run list, at each dtype (``stat16``: 16-bit only)."""
    table = _DRY_CASES if dry else _GPU_CASES
    wanted_ops = set(ops) if ops is not None else {op for op, _, _ in table}
    wanted_dtypes = list(dtypes) if dtypes is not None else list(DTYPES)
    unknown = (wanted_ops - set(BOUND_U)) | (set(wanted_dtypes) - set(DTYPES))
    if unknown:
        raise ValueError(f"unknown op or dtype {', '.join(sorted(unknown))}: ops {', '.join(BOUND_U)}; "
                         f"dtypes {', '.join(DTYPES)}")
    out = []
    for dtype in wanted_dtypes:
        for op, shape, variant in table:
            if op in wanted_ops and not (variant == "stat16" and dtype == "float32"):
                out.append(Case(op=op, dtype=dtype, shape=shape, variant=variant))
    return out


# --------------------------------------------------------------------------- inputs and oracles


def _randn(*shape: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=generator, dtype=torch.float64)


def _spd(n: int, lead: Sequence[int], generator: torch.Generator) -> torch.Tensor:
    """A float64 symmetric positive definite matrix (stack) of condition SPD_CONDITION."""
    q, _ = torch.linalg.qr(_randn(*lead, n, n, generator=generator))
    values = torch.logspace(0, -math.log10(SPD_CONDITION), n, dtype=torch.float64)
    s = (q * values) @ q.mT
    return (s + s.mT) / 2


def _rel(out: torch.Tensor, oracle: torch.Tensor) -> float:
    return float((out.double() - oracle).norm() / oracle.norm())


def _rel_max(out: torch.Tensor, oracle: torch.Tensor) -> float:
    return float((out.double() - oracle).abs().amax() / oracle.abs().amax())


def _nan_lower(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its strictly lower triangle set to NaN (a symmetric kernel must not read it)."""
    t = t.clone()
    m = t.shape[-1]
    t[..., torch.ones(m, m, dtype=torch.bool, device=t.device).tril(-1)] = float("nan")
    return t


@dataclass
class _Outcome:
    out: torch.Tensor  # what the public function returned (all outputs concatenated)
    oracle: torch.Tensor  # float64, the same math on the same rounded inputs
    torch_out: torch.Tensor  # the torch reference in the operands' precision
    symmetric: bool | None = None  # whether a symmetric output is symmetric bit for bit


def _xxt(K: Any, case: Case, dt: torch.dtype, device: str, gen: torch.Generator) -> _Outcome:
    *lead, m, n = case.shape
    if case.variant == "transposed":
        x = _randn(*lead, n, m, generator=gen).to(device, dt).mT  # (m, n) with strides (1, m)
    else:
        x = _randn(*lead, m, n, generator=gen).to(device, dt)
    out = torch.full((*lead, m, m), float("nan"), dtype=dt, device=device)
    K.xxt(x, out=out)
    return _Outcome(out, x.double() @ x.double().mT, K.xxt_reference(x), bool(torch.equal(out, out.mT)))


def _ns_step(K: Any, case: Case, dt: torch.dtype, device: str, gen: torch.Generator) -> _Outcome:
    *lead, m, n = case.shape
    x = _randn(*lead, n, m, generator=gen).mT if case.variant == "transposed" else _randn(*lead, m, n, generator=gen)
    x = (x / torch.linalg.matrix_norm(x, keepdim=True)).to(device, dt)  # spectral norm <= 1, as Muon's input
    out = torch.full(x.shape, float("nan"), dtype=dt, device=device)
    K.ns_step(x, *NS_COEFFICIENTS, out=out)
    return _Outcome(out, K.ns_step_reference(x.double(), *NS_COEFFICIENTS), K.ns_step_reference(x, *NS_COEFFICIENTS))


def _stat_update(K: Any, case: Case, dt: torch.dtype, device: str, gen: torch.Generator) -> _Outcome:
    *lead, m, n = case.shape
    if case.variant == "right":
        g = _randn(*lead, n, m, generator=gen).to(device, dt).mT  # the right statistic takes G^T, no copy
    else:
        g = _randn(*lead, m, n, generator=gen).to(device, dt)
    stat_dtype = dt if case.variant == "stat16" else torch.float32
    h = _randn(*lead, m, 2 * m, generator=gen)
    stat0 = ((h @ h.mT) / (2 * m)).to(device, stat_dtype)
    stat0 = (stat0 + stat0.mT) / 2  # symmetric bit for bit, as the contract asks
    oracle = STAT_BETA * stat0.double() + (1 - STAT_BETA) * (g.double() @ g.double().mT)
    out = stat0.clone()
    K.sym_stat_update_(out, g, STAT_BETA)
    reference = K.sym_stat_update_reference(stat0.clone(), g, STAT_BETA)
    return _Outcome(out, oracle, reference, bool(torch.equal(out, out.mT)))


def _sym_matmul(K: Any, case: Case, dt: torch.dtype, device: str, gen: torch.Generator) -> _Outcome:
    from ds_canzona.kernels.syrk import syrk_reference  # the torch path of sym_matmul

    *lead, m, _ = case.shape
    s = _spd(m, lead, gen)
    a64, b64 = s @ s, s @ s @ s - 0.5 * s  # polynomials in s: symmetric and commuting
    a, b, c = (t.to(device, dt) for t in ((a64 + a64.mT) / 2, (b64 + b64.mT) / 2, _spd(m, lead, gen)))
    if case.variant == "beta0":  # no C term (HAS_C false: another specialisation), into a poisoned out
        oracle = SYM_ALPHA * a.double() @ b.double().mT
        out = torch.full_like(c, float("nan"))
        K.sym_matmul(a, b, alpha=SYM_ALPHA, out=out)
        reference = syrk_reference(a, b, alpha=SYM_ALPHA)
        return _Outcome(out, oracle, reference, bool(torch.equal(out, out.mT)))
    oracle = SYM_ALPHA * a.double() @ b.double().mT + SYM_BETA * c.double()
    out = _nan_lower(c)  # in place, out = c: the kernel reads c on and above the diagonal only
    K.sym_matmul(a, b, alpha=SYM_ALPHA, beta=SYM_BETA, c=out, out=out)
    reference = syrk_reference(a, b, alpha=SYM_ALPHA, beta=SYM_BETA, c=c)
    return _Outcome(out, oracle, reference, bool(torch.equal(out, out.mT)))


def _newton_step(K: Any, case: Case, dt: torch.dtype, device: str, gen: torch.Generator) -> _Outcome:
    *lead, m, _ = case.shape
    root = 3 if case.variant == "root3" else 4
    s = _spd(m, lead, gen)
    z = (root + 1) / (2 * torch.linalg.matrix_norm(s, keepdim=True))
    x64, m64 = z.pow(1 / root) * torch.eye(m, dtype=torch.float64), z * s
    for _ in range(2):  # two steps in, so that X is not a multiple of I
        x64, m64 = K.coupled_newton_step_reference(x64, m64, root)
    x, mm = x64.to(device, dt), m64.to(device, dt)
    xo, mo = K.coupled_newton_step(x, mm, root)
    xr, mr = K.coupled_newton_step_reference(x.double(), mm.double(), root)
    xt, mt = K.coupled_newton_step_reference(x, mm, root)
    symmetric = bool(torch.equal(xo, xo.mT) and torch.equal(mo, mo.mT))
    return _Outcome(torch.cat([xo, mo], -1), torch.cat([xr, mr], -1), torch.cat([xt, mt], -1), symmetric)


def _inverse_root(K: Any, case: Case, dt: torch.dtype, device: str, gen: torch.Generator) -> _Outcome:
    *lead, m, _ = case.shape
    a = _spd(m, lead, gen).to(device, dt)
    out = K.inverse_root_newton(a, 4)
    # The oracle by a float64 eigendecomposition on the CPU (no cuSOLVER in the validation phase).
    values, vectors = torch.linalg.eigh(a.double().cpu())
    oracle = ((vectors * values.pow(-0.25).unsqueeze(-2)) @ vectors.mT).to(device)
    return _Outcome(out, oracle, K.inverse_root_newton_reference(a, 4), bool(torch.equal(out, out.mT)))


_BUILDERS: dict[str, Callable[[Any, Case, torch.dtype, str, torch.Generator], _Outcome]] = {
    "xxt": _xxt,
    "ns_step": _ns_step,
    "sym_stat_update_": _stat_update,
    "sym_matmul": _sym_matmul,
    "coupled_newton_step": _newton_step,
    "inverse_root_newton": _inverse_root,
}


# --------------------------------------------------------------------------- running and judging


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_case(case: Case, *, device: str, seed: int = 1234, yardstick: bool | None = None) -> dict[str, Any]:
    """Run one case with the selected backend; a result row (``passed`` and, if not, ``reason``).

    ``yardstick``: judge the comparison with torch; by default on a GPU only (the module's docstring).
    """
    import ds_canzona.kernels as K

    dt = getattr(torch, case.dtype)
    out_dtype = "float32" if case.op == "sym_stat_update_" and case.variant != "stat16" else case.dtype
    u = UNIT_ROUNDOFF[out_dtype]
    generator = torch.Generator().manual_seed(seed)
    started = time.perf_counter()  # the whole case: inputs, the call (with any compilation), oracle, torch
    outcome = _BUILDERS[case.op](K, case, dt, device, generator)
    _synchronize(device)
    seconds = time.perf_counter() - started
    not_finite = int((~torch.isfinite(outcome.out)).sum())
    finite_out = outcome.out.nan_to_num(0.0, posinf=0.0, neginf=0.0)
    err, max_err = _rel(finite_out, outcome.oracle), _rel_max(finite_out, outcome.oracle)
    torch_err, torch_max_err = _rel(outcome.torch_out, outcome.oracle), _rel_max(outcome.torch_out, outcome.oracle)
    bound = BOUND_U[case.op][out_dtype] * u
    if yardstick is None:
        yardstick = device != "cpu"
    problems = []
    if not_finite:
        problems.append(f"{not_finite} output elements not finite (NaN: never written, or an overflow)")
    if not err <= bound:
        problems.append(f"err {err:.3g} > fixed bound {bound:.3g} ({BOUND_U[case.op][out_dtype]:g} u)")
    if not max_err <= MAX_OF_BOUND * bound:
        problems.append(f"largest error {max_err:.3g} > {MAX_OF_BOUND:g} x the fixed bound {bound:.3g}")
    if yardstick and not err <= K_TORCH * torch_err + FLOOR_U * u:
        problems.append(f"err {err:.3g} > {K_TORCH:g} x torch {torch_err:.3g} + {FLOOR_U:g} u")
    if yardstick and not max_err <= K_MAX * torch_max_err + u:
        problems.append(f"largest error {max_err:.3g} > {K_MAX:g} x torch's {torch_max_err:.3g} + u")
    # The torch reference of the statistic update does not promise a symmetric result (a 16-bit
    # product on the CPU is not); every other output is symmetric by contract on both paths.
    reference_may_skew = case.op == "sym_stat_update_" and K.get_backend() != "triton"
    if outcome.symmetric is False and not reference_may_skew:
        problems.append("output not symmetric bit for bit")
    return {"case": case.name, "op": case.op, "dtype": case.dtype, "shape": list(case.shape),
            "variant": case.variant, "err": err, "err_u": err / u, "torch_err": torch_err, "torch_err_u": torch_err / u,
            "max_err_u": max_err / u, "torch_max_err_u": torch_max_err / u,
            "bound_u": BOUND_U[case.op][out_dtype], "yardstick_judged": yardstick, "not_finite": not_finite, "symmetric": outcome.symmetric,
            "case_seconds": seconds,
            "passed": not problems, "reason": "; ".join(problems)}


def run_cases(selected: Sequence[Case], *, backend: str, device: str,
              report: Callable[[dict[str, Any]], None] | None = None,
              yardstick: bool | None = None) -> list[dict[str, Any]]:
    """Every case with ``backend`` selected, each in its own try/except; one row per case.

    An exception (a compile error, a refused input under ``triton``) is a failed row with its type,
    message and the last lines of its traceback; the next case runs.
    """
    import ds_canzona.kernels as K

    previous = K.get_backend()
    K.set_backend(backend)
    rows = []
    try:
        for case in selected:
            try:
                row = run_case(case, device=device, yardstick=yardstick)
            except Exception as error:  # recorded, never raised: the run goes on
                tail = traceback.format_exc().strip().splitlines()[-6:]
                row = {"case": case.name, "op": case.op, "dtype": case.dtype, "shape": list(case.shape),
                       "variant": case.variant, "passed": False,
                       "reason": f"{type(error).__name__}: {' '.join(str(error).split())[:500]}", "traceback": tail}
            row["backend"] = backend
            rows.append(row)
            if report is not None:
                report(row)
    finally:
        K.set_backend(previous)
    return rows


def format_row(row: dict[str, Any]) -> str:
    """One line: verdict, backend, case, error and torch's error in u, the fixed bound, the case's time."""
    verdict = "ok  " if row["passed"] else "MISS"
    text = f"{verdict} {row['backend']:<7} {row['case']:<48}"
    if "err_u" in row:
        text += (f" err {row['err_u']:7.3f} u  torch {row['torch_err_u']:7.3f} u  bound {row['bound_u']:>4g} u"
                 f"  max {row['max_err_u']:6.3f} u  torch {row['torch_max_err_u']:6.3f} u"
                 f"  case {row['case_seconds'] * 1e3:7.1f} ms")
    if not row["passed"]:
        text += f"  [{row['reason']}]"
    return text
