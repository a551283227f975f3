"""Every Triton kernel, run in Triton's CPU interpreter, against a float64 oracle.

Triton picks the interpreter when a kernel is *defined*, so the kernels run in one subprocess
started with ``TRITON_INTERPRET=1`` (this file run as a script with ``--worker``); it runs every
case below and prints one JSON object per case, which the tests here read. Three parts:

* every kernel (xxt/syrk, sym_matmul, ns_step, sym_stat_update_, coupled_newton_step,
  inverse_root_newton) at fp32, fp16 and bf16, with tails, stacks and strided operands (``CASES``);
* the Muon (standard and Gram, ``ns_dtype`` float16 and bfloat16), Shampoo and SOAP rules on the
  interpreted kernels, each step against the float64 reference of the same math from
  tests/test_optim_muon.py, test_optim_shampoo.py and test_optim_soap.py (``RULE_CASES``);
* backend ``default`` on a stand-in CUDA device (``dispatch.device_type`` says "cuda" for CPU
  tensors): the real kernels pass their first-use check (kernels/validation.py) on every dtype,
  tails and stacks, and then run alone.

Each case poisons the kernel's output with NaN first (in-place updates: the lower triangle the
kernel must not read), so a NaN left over is an element the kernel did not write. Accuracy is the
relative Frobenius error ``||out - oracle|| / ||oracle||`` where the oracle is the float64 torch
reference on the same (already rounded) inputs. The verdict is one absolute bound per case: a fixed
multiple of the unit roundoff ``u`` of the output dtype (fp32 2^-24, fp16 2^-11, bf16 2^-8), stated
per operation in ``BOUND_U`` and justified in docs/KERNELS.md, or for the rules the bound the CPU
tests state for that precision.

The torch path's error in the same precision is measured too and printed beside a failure, but it
is no part of the verdict: the interpreter's products and torch's both run on the processor's
BLAS, whose kernels (FMA or not, blocking, the split of k) differ between machines, so the ratio
of two rounding errors of the same size moves with the processor (SOAP one-sided: kernels / torch
2.7x on an AMD EPYC without AVX-512, under 1.5x on Intel machines, 16x inside the bound on both). A
bound in units of u holds for any correctly rounded BLAS.

Sizes are small and mostly not multiples of the tile; tiles are pinned (64 or 32, so that
several tiles, the triangular map, the L2 swizzle and every tail mask run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("triton")

# --- the cases (pure data, shared by the worker and the tests) ------------------------------------

U = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}

# Relative Frobenius error bound, in units of the output dtype's unit roundoff u (docs/KERNELS.md).
# Seen on these cases (kernel / torch in the same precision): syrk 16-bit 0.48u / 0.48u, fp32 2.2u /
# 4.7u; ns_step 16-bit 0.43u / 0.61u, fp32 0.63u / 0.64u; stat 1.9u / 2.5u; newton step 3.6u / 4.7u;
# inverse root 12u / 15u.
BOUND_U = {
    # One product rounded once to the output dtype: round-to-nearest leaves at most u/2 per element
    # (rms about 0.4u over many), so 1u for 16-bit. fp32 outputs add the fp32 accumulation error,
    # a random walk of about sqrt(k) roundings (k <= 300 here): 16u.
    "syrk": {"float32": 16, "float16": 1.0, "bfloat16": 1.0},
    # Three chained products with A and B rounded to the dtype, then a X + B X: each rounding of
    # A or B reaches the output scaled by |c| ||A|| + |b| <= 7 but in random directions; 2u for
    # 16-bit (torch's unfused step: 0.6u), 16u for fp32.
    "ns_step": {"float32": 16, "float16": 2.0, "bfloat16": 2.0},
    # fp32 statistic, whatever g's dtype (bf16/fp16 products are exact in fp32): as a fp32 product;
    # a 16-bit statistic: beta stat + (1 - beta) g gᵀ formed in fp32 and rounded once, 1u.
    "stat": {"float32": 16, "float16": 1.0, "bfloat16": 1.0},
    # Four chained fp32 products of matrices with ||M - I|| < 1: 4 x the one-product bound / 4 = 16u;
    # in 16-bit each of the four products is rounded once to the dtype: 4u (seen 1.3-1.5u, = torch).
    "newton": {"float32": 16, "float16": 4.0, "bfloat16": 4.0},
    # The whole iteration to its floor on a matrix of condition 100 (4th root): the error
    # accumulates over ~15 steps and is amplified by the conditioning; torch in fp32 reaches 15u,
    # 4x that; in 16-bit the floor is reached sooner (seen 3.2-3.6u, = torch), 4x that, 16u.
    "inverse_root": {"float32": 64, "float16": 16, "bfloat16": 16},
}

_T64 = {"block_m": 64, "block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 1}
_T32 = {"block_m": 32, "block_n": 32, "block_k": 64, "num_warps": 4, "num_stages": 1, "group_m": 4}

CASES: list[dict] = []
for _dt in ("float32", "float16", "bfloat16"):
    CASES += [
        {"op": "syrk", "dtype": _dt, "shape": [200, 300], "tile": _T64},  # 4x4 tiles, k tail
        {"op": "syrk", "dtype": _dt, "shape": [3, 130, 70], "tile": _T64},  # a stack, 3x3 tiles
        {"op": "syrk", "dtype": _dt, "shape": [150, 90], "tile": _T64, "transposed": True},  # strided view
        {"op": "syrk", "dtype": _dt, "shape": [20, 33], "tile": _T64},  # smaller than one tile
        {"op": "ns_step", "dtype": _dt, "shape": [100, 150], "tile": _T64},  # wide
        {"op": "ns_step", "dtype": _dt, "shape": [2, 150, 100], "tile": _T64},  # tall stack: via X^T
        {"op": "ns_step", "dtype": _dt, "shape": [150, 170], "tile": _T32},  # 5 tile rows: swizzle tail
        {"op": "ns_step", "dtype": _dt, "shape": [128, 128], "tile": _T64},  # exact multiple
        {"op": "stat", "dtype": "float32", "g_dtype": _dt, "shape": [130, 90], "tile": _T64},
        {"op": "stat", "dtype": "float32", "g_dtype": _dt, "shape": [2, 70, 50], "tile": _T64, "right": True},
    ]
CASES += [
    {"op": "sym_matmul", "dtype": "float32", "shape": [2, 100, 100], "tile": _T64},  # alpha A B + beta C in place
    {"op": "newton", "dtype": "float32", "shape": [2, 100, 100], "tile": _T64, "root": 4},
    {"op": "newton", "dtype": "float32", "shape": [70, 70], "tile": _T32, "root": 3},
    {"op": "inverse_root", "dtype": "float32", "shape": [96, 96], "tile": _T64, "root": 4},
    {"op": "inverse_root", "dtype": "float32", "shape": [2, 40, 40], "tile": None, "root": 4},  # a stack, a tail
]
for _dt in ("float16", "bfloat16"):  # the 16-bit variants of the Shampoo kernels: 2 x 2 tiles of 32 over 40
    CASES += [
        {"op": "sym_matmul", "dtype": _dt, "shape": [3, 40, 40], "tile": _T32},
        {"op": "newton", "dtype": _dt, "shape": [3, 40, 40], "tile": _T32, "root": 4},
        {"op": "inverse_root", "dtype": _dt, "shape": [40, 40], "tile": None, "root": 4},  # one tile: the iteration is long
        {"op": "stat", "dtype": _dt, "g_dtype": _dt, "shape": [3, 40, 72], "tile": _T32},
    ]
for _i, _c in enumerate(CASES):
    _c["id"] = f"{_i:02d}-{_c['op']}-{_c.get('g_dtype', _c['dtype'])}-{'x'.join(map(str, _c['shape']))}"


# The rules on the interpreted kernels: the largest relative error of one step (from the same
# weights) against the float64 reference of the same math, over a few steps, must be within the
# bound the CPU tests state for that precision (``bound``), as must the torch path's (the module's
# docstring says why the two are not compared with each other).
# Muon bf16: test_optim_muon's BF16_VS_EXACT (8e-2; seen: kernels 1.6e-2 standard, 4.5e-2 Gram,
# torch 3.6e-2 / 4.5e-2); Muon fp16: fp16's roundoff 4.9e-4 amplified ~10x by the iteration, 4x
# margin, 2e-2 (seen 1.9e-3 / 6.0e-3, torch 4.8e-3 / 6.0e-3); Shampoo and SOAP in fp32: their
# files' FP32_VS_FP64 (1e-4, 5e-4; seen 5.1e-6 and 6.8e-5, equal to torch's). Only the Gram
# matrix runs on a kernel in the Gram iteration (its polynomial steps are plain torch). Shampoo's
# 'newton' roots (coupled_newton_step) are left to the kernel cases above and the first-use part:
# through the rule they cost ~20 interpreted iterations per statistic (seen 3.8e-6, = torch).
RULE_CASES: list[dict] = []
for _method in ("standard", "gram"):
    for _nd, _bound in (("bfloat16", 8e-2), ("float16", 2e-2)):
        RULE_CASES.append({"id": f"muon-{_method}-{_nd}", "kind": "muon", "shape": [40, 72], "steps": 3,
                           "group": {"ns_method": _method, "ns_dtype": _nd}, "bound": _bound})
RULE_CASES += [
    {"id": "muon-gram-bfloat16-tall", "kind": "muon", "shape": [72, 40], "steps": 3,
     "group": {"ns_method": "gram", "ns_dtype": "bfloat16"}, "bound": 8e-2},
    # beta2 < 1: the statistics on sym_stat_update_; beta2 = 1: on xxt; 'newton': coupled_newton_step
    {"id": "shampoo-eigh", "kind": "shampoo", "shape": [40, 72], "steps": 4, "group": {"betas": [0.9, 0.95]},
     "bound": 1e-4},
    {"id": "shampoo-eigh-summed", "kind": "shampoo", "shape": [40, 72], "steps": 4, "group": {"betas": [0.9, 1.0]},
     "bound": 1e-4},
    {"id": "soap", "kind": "soap", "shape": [40, 40], "steps": 5, "group": {}, "bound": 5e-4},
    {"id": "soap-one-side", "kind": "soap", "shape": [24, 40], "steps": 5, "group": {"max_precond_dim": 30},
     "bound": 5e-4},
]


# --- the worker (runs with TRITON_INTERPRET=1, prints JSON lines) ---------------------------------


def _worker() -> None:  # pragma: no cover - runs in the subprocess
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined
    import torch

    from ds_canzona.kernels import newton_schulz, shampoo, syrk
    from ds_canzona.kernels._common import TileConfig, is_interpreted

    assert is_interpreted(syrk.syrk_kernel) and is_interpreted(newton_schulz.ns_step_kernel)
    torch.set_num_threads(1)
    coeffs = (3.4445, -4.7750, 2.0315)

    def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
        return float((x.double() - ref).norm() / ref.norm())

    def spd(n: int, batch: tuple[int, ...], gen: torch.Generator, cond: float = 100.0) -> torch.Tensor:
        q, _ = torch.linalg.qr(torch.randn(*batch, n, n, generator=gen, dtype=torch.float64))
        ev = torch.logspace(0, -torch.log10(torch.tensor(cond)).item(), n, dtype=torch.float64)
        s = (q * ev[..., None, :]) @ q.mT
        return (s + s.mT) / 2

    for case in CASES:
        gen = torch.Generator().manual_seed(1234)
        dt = getattr(torch, case["dtype"])
        cfg = TileConfig(**case["tile"]) if case["tile"] else None
        *lead, m, n = case["shape"]
        res: dict = {"id": case["id"]}
        t0 = time.perf_counter()
        if case["op"] == "syrk":
            x = torch.randn(*lead, m, n, generator=gen).to(dt)
            if case.get("transposed"):
                x = torch.randn(*lead, n, m, generator=gen).to(dt).mT  # a (m, n) view with strides (1, m)
            out = torch.full((*lead, m, m), float("nan"), dtype=dt)
            syrk.syrk(x, out=out, config=cfg)
            res["seconds"] = time.perf_counter() - t0
            oracle = x.double() @ x.double().mT
            res["torch"] = rel(x @ x.mT, oracle)
            res["exact_symmetric"] = bool(torch.equal(out, out.mT))
        elif case["op"] == "ns_step":
            x = torch.randn(*lead, m, n, generator=gen)
            x = (x / torch.linalg.matrix_norm(x, keepdim=True)).to(dt)  # spectral norm <= 1, as Muon
            out = torch.full(x.shape, float("nan"), dtype=dt)
            newton_schulz.ns_step(x, *coeffs, out=out, config=cfg)
            res["seconds"] = time.perf_counter() - t0
            oracle = newton_schulz.ns_step_reference(x.double(), *coeffs)
            res["torch"] = rel(newton_schulz.ns_step_reference(x, *coeffs), oracle)
        elif case["op"] == "stat":
            g = torch.randn(*lead, m, n, generator=gen).to(getattr(torch, case["g_dtype"]))
            if case.get("right"):
                g = torch.randn(*lead, n, m, generator=gen).to(g.dtype).mT  # Gᵀ of a (n, m) gradient
            h = torch.randn(*lead, m, 2 * m, generator=gen, dtype=torch.float64)
            stat0 = ((h @ h.mT) / (2 * m)).to(dt)
            stat0 = (stat0 + stat0.mT) / 2  # exactly symmetric in fp32
            beta = 0.95
            oracle = beta * stat0.double() + (1 - beta) * (g.double() @ g.double().mT)
            out = stat0.clone()
            lower = torch.ones(m, m, dtype=torch.bool).tril(-1)
            out[..., lower] = float("nan")  # the kernel reads the upper triangle only
            shampoo.sym_stat_update_(out, g, beta, config=cfg)
            res["seconds"] = time.perf_counter() - t0
            res["torch"] = rel(shampoo.sym_stat_update_reference(stat0.clone(), g, beta), oracle)
            res["exact_symmetric"] = bool(torch.equal(out, out.mT))
        elif case["op"] == "sym_matmul":
            s = spd(m, tuple(lead), gen)
            a64, b64 = s @ s, s @ s @ s - 0.5 * s  # polynomials in s: symmetric, commuting
            c64 = spd(m, tuple(lead), gen)
            a, b, c = (t.to(dt) for t in (a64, (b64 + b64.mT) / 2, c64))
            oracle = 0.7 * a.double() @ b.double().mT - 0.3 * c.double()
            out = c.clone()
            out[..., torch.ones(m, m, dtype=torch.bool).tril(-1)] = float("nan")
            syrk.syrk(a, b, alpha=0.7, beta=-0.3, c=out, out=out, config=cfg)  # in place
            res["seconds"] = time.perf_counter() - t0
            res["torch"] = rel(syrk.syrk_reference(a, b, alpha=0.7, beta=-0.3, c=c), oracle)
            res["exact_symmetric"] = bool(torch.equal(out, out.mT))
        elif case["op"] == "newton":
            s = spd(m, tuple(lead), gen)
            z = (case["root"] + 1) / (2 * torch.linalg.matrix_norm(s, keepdim=True))
            eye = torch.eye(m, dtype=torch.float64)
            # two steps in, so that X is not a multiple of I
            x64, m64 = z.pow(1 / case["root"]) * eye, z * s
            for _ in range(2):
                x64, m64 = shampoo.coupled_newton_step_reference(x64, m64, case["root"])
            x, mm = x64.to(dt), m64.to(dt)
            xo, mo = shampoo.coupled_newton_step(x, mm, case["root"], config=cfg)
            res["seconds"] = time.perf_counter() - t0
            xr, mr = shampoo.coupled_newton_step_reference(x.double(), mm.double(), case["root"])
            xt, mt = shampoo.coupled_newton_step_reference(x, mm, case["root"])
            out = torch.cat([xo, mo], -1)
            oracle = torch.cat([xr, mr], -1)
            res["torch"] = rel(torch.cat([xt, mt], -1), oracle)
            res["exact_symmetric"] = bool(torch.equal(xo, xo.mT) and torch.equal(mo, mo.mT))
        elif case["op"] == "inverse_root":
            s = spd(m, tuple(lead), gen)
            a = s.to(dt)
            out = shampoo.inverse_root_newton(a, case["root"], config=cfg)
            res["seconds"] = time.perf_counter() - t0
            ev, v = torch.linalg.eigh(a.double())
            oracle = (v * ev.pow(-1.0 / case["root"])[..., None, :]) @ v.mT
            res["torch"] = rel(shampoo.inverse_root_newton_reference(a, case["root"]), oracle)
            res["exact_symmetric"] = bool(torch.equal(out, out.mT))
        else:
            raise AssertionError(case["op"])
        res["nan"] = int(torch.isnan(out).sum())
        res["err"] = rel(out.nan_to_num(0.0), oracle)
        print(json.dumps(res), flush=True)

    # The public functions: 'default' keeps CPU tensors on the reference even under the interpreter;
    # 'triton' routes them to the interpreted kernels (default tile config), with the same results.
    import ds_canzona.kernels as K

    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(3, 90, 140, generator=gen) / 40).to(torch.bfloat16)
    g = torch.randn(90, 60, generator=gen).to(torch.bfloat16)
    checks: dict = {"id": "dispatch", "backend": K.get_backend()}
    auto_x = K.xxt(x)
    checks["auto_is_reference"] = bool(torch.equal(auto_x, syrk.syrk_reference(x)))
    K.set_backend("triton")
    checks["xxt"] = bool(torch.equal(K.xxt(x), syrk.syrk(x)))
    checks["ns_step"] = bool(torch.equal(K.ns_step(x, *coeffs), newton_schulz.ns_step(x, *coeffs)))
    s1, s2 = torch.eye(90), torch.eye(90)
    checks["sym_stat_update_"] = bool(torch.equal(K.sym_stat_update_(s1, g, 0.9), shampoo.sym_stat_update_(s2, g, 0.9)))
    ns_ref = newton_schulz.ns_step_reference(x.double(), *coeffs)
    checks["ns_step_err"] = rel(K.ns_step(x, *coeffs), ns_ref)
    checks["ns_step_torch_err"] = rel(newton_schulz.ns_step_reference(x, *coeffs), ns_ref)
    print(json.dumps(checks), flush=True)

    # The rules on the kernels ('triton') and on torch, each step against the float64 reference.
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import test_optim_muon
    import test_optim_shampoo
    import test_optim_soap

    def step_errors(kind: str, group: dict, w: torch.Tensor, grads: list[torch.Tensor], lr: float) -> dict:
        if kind == "muon":
            directions = test_optim_muon.reference_directions(grads, momentum=0.95)
            full = group
        elif kind == "shampoo":
            full = {"epsilon": 1e-12, "precondition_frequency": 2, "start_preconditioning_step": 2, **group}
            full["betas"] = tuple(full["betas"])
            directions = test_optim_shampoo.reference_directions(
                grads, betas=full["betas"], epsilon=full["epsilon"], frequency=2, start=2,
                block=full.get("max_preconditioner_dim", 1024), graft_beta2=0.999, graft_eps=1e-8)
        else:
            full = {"betas": (0.9, 0.95), "shampoo_beta": 0.9, "eps": 1e-8, "weight_decay": 0.0,
                    "precondition_frequency": 2, **group}
            directions = test_optim_soap.reference_directions(
                grads, betas=(0.9, 0.95), shampoo_beta=0.9, eps=1e-8, frequency=2,
                max_dim=full.get("max_precond_dim", 10000))
        runner = {"muon": test_optim_muon, "shampoo": test_optim_shampoo, "soap": test_optim_soap}[kind].run_rule
        out = {}
        for backend in ("triton", "torch"):
            K.set_backend(backend)
            t0 = time.perf_counter()
            trajectory, _ = runner(full, w, grads, lr)
            out[f"{backend}_seconds"] = time.perf_counter() - t0
            starts = [w, *trajectory[:-1]]
            errs = [rel(after - start, -lr * d) for start, after, d in zip(starts, trajectory, directions)
                    if d is not None]  # no weight decay: the exact step is -lr D
            out[backend] = max(errs)
        K.set_backend("default")
        return out

    for case in RULE_CASES:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(*case["shape"], generator=gen)
        grads = [torch.randn(*case["shape"], generator=gen) for _ in range(case["steps"])]
        lr = 0.02 if case["kind"] == "muon" else 0.01
        print(json.dumps({"id": f"rule-{case['id']}", **step_errors(case["kind"], case["group"], w, grads, lr)}),
              flush=True)

    # Backend 'default' on a stand-in CUDA device: the real kernels face their first-use check.
    import logging

    from ds_canzona.kernels import dispatch, validation

    warnings: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    logging.getLogger("ds_canzona.kernels").addHandler(Collect())
    t0 = time.perf_counter()
    dispatch.device_type = lambda t: "cuda"
    K.set_backend("default")
    validation.reset()
    gen = torch.Generator().manual_seed(11)
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        for _ in range(2):  # a stack with tails; the second call of the class runs the kernel alone
            x = (torch.randn(3, 40, 72, generator=gen) / 8).to(dt)
            K.xxt(x)
            K.ns_step(x, *coeffs)
            K.sym_stat_update_(torch.eye(40).repeat(3, 1, 1), x, 0.95)
            s = spd(40, (3,), gen)
            K.sym_matmul(s.to(dt), (s @ s).to(dt), alpha=0.5, beta=0.25, c=s.to(dt))
        s = spd(40, (), gen)
        z = 5 / (2 * torch.linalg.matrix_norm(s))
        K.coupled_newton_step((z**0.25 * torch.eye(40, dtype=torch.float64)).to(dt), (z * s).to(dt), 4)
    K.ns_step((torch.randn(72, 40, generator=gen) / 8).to(torch.bfloat16), *coeffs)  # tall: a class of its own
    K.inverse_root_newton(spd(40, (2,), gen).float(), 4, epsilon=1e-6)  # Shampoo's: every step is checked
    status = K.backend_status()
    print(json.dumps({"id": "first-use", "seconds": time.perf_counter() - t0, "warnings": warnings,
                      "report": K.backend_report(),
                      "status": {op: {"fallback": st["fallback"], "validated": len(st["validated"]),
                                      "gave_up": st["gave_up"], "backend": st["backend"],
                                      "routes": {f"{i}: {r}": n for (i, r), n in st["routes"].items()}}
                                 for op, st in status.items()}}), flush=True)
    dispatch.device_type = lambda t: t.device.type

    # The GPU bench's code path, on the interpreted kernels and the CPU timer (tiny shapes, sweep on).
    import contextlib
    import io

    from ds_canzona.bench.benchmarks import kernels as bench

    args = bench._parse_args(["--repeats", "1", "--warmup", "0", "--sweep"])
    bench._sweep_configs = lambda: [TileConfig(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=1)]
    with contextlib.redirect_stdout(io.StringIO()):
        rows = bench._bench_kernels(args, "cpu", [("tiny", 70, 100), ("tiny-tall", 100, 40)])
    print(json.dumps({"id": "bench", "rows": rows}), flush=True)


# --- the tests -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONHASHSEED="0")
    env.pop("DS_CANZONA_KERNELS", None)
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--worker"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0:
        pytest.fail(f"interpreter worker failed (rc {proc.returncode}) after {len(rows)} cases:\n{proc.stderr[-4000:]}")
    return {r["id"]: r for r in rows}


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_kernel_in_interpreter(case: dict, results: dict[str, dict]) -> None:
    res = results[case["id"]]
    u = U[case["dtype"]]
    bound = BOUND_U[case["op"] if case["op"] != "sym_matmul" else "syrk"][case["dtype"]] * u
    assert res["nan"] == 0, f"{res['nan']} output elements were never written"
    assert res["err"] <= bound, (f"relative error {res['err']:.3g} > bound {bound:.3g} ({bound / u:g} u); "
                                 f"the torch reference in {case['dtype']}: {res['torch']:.3g}")
    if "exact_symmetric" in res:
        assert res["exact_symmetric"], "the symmetric kernel's output is not exactly symmetric"


def test_public_functions_route_to_the_kernels(results: dict[str, dict]) -> None:
    res = results["dispatch"]
    assert res["backend"] == "default"
    assert res["auto_is_reference"], "backend 'default' must keep CPU tensors on the torch reference"
    for op in ("xxt", "ns_step", "sym_stat_update_"):
        assert res[op], f"kernels.{op} with backend 'triton' differs from the kernel wrapper"
    assert res["ns_step_err"] <= BOUND_U["ns_step"]["bfloat16"] * U["bfloat16"], res


def test_bench_code_path_on_the_interpreted_kernels(results: dict[str, dict]) -> None:
    rows = results["bench"]["rows"]
    assert [(r["op"], r["shape"]) for r in rows] == [
        (op, shape) for shape in ("tiny", "tiny-tall") for op in ("xxt", "ns_step", "stat")
    ]
    for r in rows:
        assert r["triton_ms"] > 0 and r["torch_ms"] > 0 and r["cublas_ms"] > 0 and "sweep_best_config" in r
        assert r["err_vs_fp32"] < 2e-2, r  # bf16 against fp32


@pytest.mark.parametrize("case", RULE_CASES, ids=[c["id"] for c in RULE_CASES])
def test_rule_on_the_kernels_against_float64(case: dict, results: dict[str, dict]) -> None:
    res = results[f"rule-{case['id']}"]
    assert res["triton"] <= case["bound"], (f"largest step error {res['triton']:.3g} > bound {case['bound']:.3g}; "
                                            f"the torch path's: {res['torch']:.3g}")
    # The same bound holds for the torch path: a bound the reference itself broke would say
    # nothing about the kernels.
    assert res["torch"] <= case["bound"], f"the torch path's largest step error {res['torch']:.3g} > {case['bound']:.3g}"


def test_real_kernels_pass_their_first_use_check(results: dict[str, dict]) -> None:
    res = results["first-use"]
    assert not res["warnings"], res["warnings"]
    for op in ("xxt", "ns_step", "sym_stat_update_", "sym_matmul", "coupled_newton_step"):
        status = res["status"][op]
        assert status["fallback"] is None and not status["gave_up"], (op, status)
        assert status["validated"] >= (4 if op in ("ns_step", "coupled_newton_step") else 3), (op, status)
        assert status["backend"] == "triton", (op, status)
        passed = status["routes"].get("triton: passed its first-use check", 0)
        assert passed > status["validated"], ("no call ran the kernel alone after its check", op, status)
    assert "passed its first-use check" in res["report"]


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker()
