"""Every Triton kernel variant a real launch can request compiles for a Hopper GPU (sm_90), without one.

Triton's compiler and ptxas ship in the wheel, so the kernels are compiled here ahead of time. The
variants are not written out by hand: the real wrappers (``syrk.syrk``, ``newton_schulz.ns_step``,
``shampoo.sym_stat_update_``, ``shampoo.coupled_newton_step``) are called on CPU tensors with the
``@triton.jit`` kernels replaced by recorders, and each recorded launch is turned into the
signature Triton's JIT would build from it (``triton.runtime.jit.native_specialize_impl``: an int
equal to 1 becomes a constant, ints and pointers are marked divisible by 16 where they are), with
the launch's constexprs, warps and stages. Distinct signatures are compiled once each, in a few
processes at a time.

The calls cover: the default tiles (``default_config``) of every dtype and size regime; every
epilogue (``HAS_C`` off, on with a 16-bit output as in each Newton-Schulz polynomial step, on with
an fp32 output from 16-bit operands as in the statistic update); the ``INPUT_PRECISION`` variants
(ieee, tf32, tf32x3); tails (sizes and strides that are not multiples of 16), stacks, transposed
(column-major) operands and a pointer that is not 16-byte aligned; and every tile config of
``python -m ds_canzona.bench kernels --sweep`` at the bench's default dtype (bf16).

Each compiled kernel is checked for what the interpreter cannot show: the compiler accepts it,
shared memory within the 227 KiB a Hopper block may use, tensor cores (wgmma) for 16-bit and tf32
operands and none for IEEE fp32, a pipelined K loop (cp.async) when stages > 1, 16-byte vector
stores for a contiguous, aligned 16-bit output. Speed and the numbers of a compiled kernel are for
``python -m ds_canzona.bench kernels`` on a GPU.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import time
from collections.abc import Callable

import pytest

triton = pytest.importorskip("triton")

try:
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource
    from triton.runtime.jit import native_specialize_impl
except ImportError:  # pragma: no cover - another Triton layout
    pytest.skip("this Triton has no ASTSource/GPUTarget/native_specialize_impl to compile ahead of time",
                allow_module_level=True)

import torch  # noqa: E402

from ds_canzona.bench.benchmarks import kernels as bench  # noqa: E402
from ds_canzona.kernels import newton_schulz, shampoo, syrk  # noqa: E402
from ds_canzona.kernels._common import TileConfig, is_interpreted  # noqa: E402

if is_interpreted(syrk.syrk_kernel):  # pragma: no cover
    pytest.skip("TRITON_INTERPRET=1 in this process: kernels are interpreted, nothing to compile", allow_module_level=True)

HOPPER = GPUTarget("cuda", 90, 32)
SMEM_LIMIT = 232448  # bytes of shared memory one block may use on sm_90
KERNELS = {"syrk_kernel": syrk.syrk_kernel, "ns_step_kernel": newton_schulz.ns_step_kernel}
COEFFS = (3.4445, -4.7750, 2.0315)


# --- the calls: what the library and the bench launch ------------------------------------------------


def _x(shape, dtype, *, transposed=False, unaligned=False) -> torch.Tensor:
    """A CPU tensor of ``shape`` (contents irrelevant: nothing runs), column-major or off by one element."""
    *lead, m, n = shape
    if transposed:
        return torch.zeros(*lead, n, m, dtype=dtype).mT
    if unaligned:
        return torch.zeros(1 + torch.Size(shape).numel(), dtype=dtype)[1:].view(shape)
    return torch.zeros(shape, dtype=dtype)


def _stat(g: torch.Tensor) -> torch.Tensor:
    return torch.zeros(*g.shape[:-2], g.shape[-2], g.shape[-2])


SMALL, LARGE, TAILS, LARGE_TAILS = (64, 96), (1024, 1536), (40, 72), (1030, 1100)
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32

CALLS: list[tuple[str, Callable[[], object]]] = []
for _dt in (F16, BF16):
    for _size, _name in ((SMALL, "small"), (LARGE, "large")):
        # a Newton-Schulz step: X Xᵀ (no C), b A + c A A (C, 16-bit out), B X + a X
        CALLS.append((f"ns_step-{_dt}-{_name}", lambda s=_size, d=_dt: newton_schulz.ns_step(_x(s, d), *COEFFS)))
        # the statistic update: fp32 C and out from 16-bit operands
        CALLS.append((f"stat-{_dt}-{_name}", lambda s=_size, d=_dt: shampoo.sym_stat_update_(_stat(_x(s, d)), _x(s, d), 0.9)))
CALLS += [
    ("ns_step-fp32", lambda: newton_schulz.ns_step(_x(SMALL, F32), *COEFFS)),
    ("stat-fp32", lambda: shampoo.sym_stat_update_(_stat(_x(SMALL, F32)), _x(SMALL, F32), 0.9)),
    ("newton-step-fp32", lambda: shampoo.coupled_newton_step(torch.eye(96), torch.eye(96), 4)),
    ("newton-step-bf16-tails", lambda: shampoo.coupled_newton_step(*(torch.eye(40, dtype=BF16),) * 2, 4)),
    # tails: sizes, hence strides, not multiples of 16
    ("ns_step-bf16-tails", lambda: newton_schulz.ns_step(_x(TAILS, BF16), *COEFFS)),
    ("ns_step-fp32-tails", lambda: newton_schulz.ns_step(_x(TAILS, F32), *COEFFS)),
    ("ns_step-bf16-large-tails", lambda: newton_schulz.ns_step(_x(LARGE_TAILS, BF16), *COEFFS)),
    ("stat-bf16-tails", lambda: shampoo.sym_stat_update_(_stat(_x(TAILS, BF16)), _x(TAILS, BF16), 0.9)),
    ("stat-fp32-tails", lambda: shampoo.sym_stat_update_(_stat(_x(TAILS, F32)), _x(TAILS, F32), 0.9)),
    # tall X (stepped through Xᵀ: column-major operand and output) and the right statistic (g.mT)
    ("ns_step-bf16-tall", lambda: newton_schulz.ns_step(_x(SMALL[::-1], BF16), *COEFFS)),
    ("ns_step-fp16-tall-tails", lambda: newton_schulz.ns_step(_x(TAILS[::-1], F16), *COEFFS)),
    ("stat-bf16-right", lambda: shampoo.sym_stat_update_(_stat(_x(SMALL, BF16)), _x(SMALL, BF16, transposed=True), 0.9)),
    ("stat-fp32-right-tails", lambda: shampoo.sym_stat_update_(_stat(_x(TAILS, F32)), _x(TAILS, F32, transposed=True), 0.9)),
    # stacks (a batch stride; 3 x 40 x 72 is not a multiple of 16 either)
    ("ns_step-bf16-stack-tails", lambda: newton_schulz.ns_step(_x((3, *TAILS), BF16), *COEFFS)),
    ("ns_step-fp16-stack", lambda: newton_schulz.ns_step(_x((3, *SMALL), F16), *COEFFS)),
    # a pointer off 16-byte alignment (a view one element in)
    ("ns_step-bf16-unaligned", lambda: newton_schulz.ns_step(_x(SMALL, BF16, unaligned=True), *COEFFS)),
    ("xxt-fp32-unaligned", lambda: syrk.syrk(_x(SMALL, F32, unaligned=True))),
    # fp32 with tensor cores: tf32 and tf32x3
    ("ns_step-fp32-tf32", lambda: newton_schulz.ns_step(_x(SMALL, F32), *COEFFS, fp32_precision="tf32")),
    ("ns_step-fp32-tf32x3", lambda: newton_schulz.ns_step(_x(SMALL, F32), *COEFFS, fp32_precision="tf32x3")),
]
# The bench's sweep (its default dtype, bf16), as it calls the wrappers: xxt and stat with the
# square configs only, ns_step with every config.
for _i, _cfg in enumerate(bench._sweep_configs()):
    _square = _cfg.block_m == _cfg.block_n
    _shape = (1024, 1024)
    if _square:
        CALLS.append((f"sweep{_i}-xxt", lambda c=_cfg: syrk.syrk(_x(_shape, BF16), config=c)))
        CALLS.append((f"sweep{_i}-stat", lambda c=_cfg: shampoo.sym_stat_update_(
            _stat(_x(_shape, BF16)), _x(_shape, BF16), 0.95, config=c)))
    CALLS.append((f"sweep{_i}-ns_step", lambda c=_cfg: newton_schulz.ns_step(_x(_shape, BF16), *COEFFS, config=c)))


# --- recording the launches ------------------------------------------------------------------------


class _Recorder:
    """Takes a kernel's place: ``kernel[grid](*args, **meta)`` records (name, args, meta) instead of launching."""

    def __init__(self, name: str, launches: list):
        self.name, self.launches = name, launches

    def __getitem__(self, grid):
        return lambda *args, **meta: self.launches.append((self.name, args, meta))


def _signature(name: str, args: tuple, meta: dict) -> tuple:
    """(kernel, signature, constexprs, attrs, num_warps, num_stages) as Triton's JIT builds them, hashable."""
    kernel = KERNELS[name]
    names = kernel.arg_names
    signature, constexprs, attrs = {}, {}, {}
    for i, (arg_name, value) in enumerate(zip(names, args)):
        kind, spec = native_specialize_impl(CUDABackend, value, False, True, True)
        if kind == "constexpr":
            signature[arg_name], constexprs[arg_name] = "constexpr", spec
            continue
        signature[arg_name] = kind
        if spec:
            attrs[(i,)] = CUDABackend.parse_attr(spec)
    for arg_name in names[len(args):]:
        signature[arg_name], constexprs[arg_name] = "constexpr", meta[arg_name]
    return (name, tuple(signature.items()), tuple(sorted(constexprs.items(), key=lambda kv: kv[0])),
            tuple(sorted((k, tuple(map(tuple, v))) for k, v in attrs.items())), meta["num_warps"], meta["num_stages"])


def _record(monkeypatch: pytest.MonkeyPatch) -> dict[tuple, list[str]]:
    """Every distinct launch signature of CALLS -> the calls that request it."""
    launches: list = []
    monkeypatch.setattr(syrk, "syrk_kernel", _Recorder("syrk_kernel", launches))
    monkeypatch.setattr(newton_schulz, "ns_step_kernel", _Recorder("ns_step_kernel", launches))
    for module in (syrk, newton_schulz):  # the one check a CPU tensor cannot pass: "needs CUDA"
        monkeypatch.setattr(module, "check_operand", lambda name, x, *, kernel: None)
    variants: dict[tuple, list[str]] = {}
    for call_id, call in CALLS:
        start = len(launches)
        call()
        assert len(launches) > start, f"{call_id} launched nothing"
        for name, args, meta in launches[start:]:
            variants.setdefault(_signature(name, args, meta), []).append(call_id)
    return variants


# --- compiling (in worker processes) ----------------------------------------------------------------


def _compile_one(variant: tuple) -> dict:
    """Compile one variant for sm_90; what the checks need (no PTX crosses the process boundary)."""
    name, signature, constexprs, attrs, num_warps, num_stages = variant
    t0 = time.perf_counter()
    try:
        kernel = triton.compile(
            ASTSource(KERNELS[name], dict(signature), constexprs=dict(constexprs),
                      attrs={k: [list(a) for a in v] for k, v in attrs}),
            target=HOPPER,
            options={"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": True},
        )
    except Exception as err:  # reported with the variant by the test
        return {"error": f"{type(err).__name__}: {err}"[:2000]}
    ptx = kernel.asm["ptx"]
    return {
        "error": None, "shared": kernel.metadata.shared, "seconds": time.perf_counter() - t0,
        "wgmma": "wgmma.mma_async" in ptx, "tf32": ".tf32" in ptx, "cp_async": "cp.async" in ptx,
        "v4_store": "st.global.v4" in ptx,
    }


@pytest.fixture(scope="module")
def compiled(request) -> dict[tuple, tuple[list[str], dict]]:
    monkeypatch = pytest.MonkeyPatch()
    try:
        variants = _record(monkeypatch)
    finally:
        monkeypatch.undo()
    workers = max(1, min(4, os.cpu_count() or 1))
    fusion = os.environ.get("TRITON_DEFAULT_FP_FUSION")
    os.environ["TRITON_DEFAULT_FP_FUSION"] = fusion or "1"  # the workers' Triton 3.9 warns when unset; 1 is its default
    t0 = time.perf_counter()
    try:
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            results = dict(zip(variants, pool.map(_compile_one, variants)))
    finally:
        if fusion is None:
            del os.environ["TRITON_DEFAULT_FP_FUSION"]
    seconds = time.perf_counter() - t0
    request.config.stash[_SUMMARY] = f"{len(variants)} variants compiled in {seconds:.0f} s ({workers} processes)"
    if any("ptxas" in (r["error"] or "") and "not found" in (r["error"] or "").lower() for r in results.values()):
        pytest.skip("no ptxas in this Triton install")
    return {v: (variants[v], results[v]) for v in variants}


_SUMMARY = pytest.StashKey[str]()


def _describe(variant: tuple) -> str:
    name, signature, constexprs, attrs, warps, stages = variant
    types = dict(signature)
    consts = dict(constexprs)
    aligned = {i for (i,), _ in attrs}
    divisible = [n for i, (n, _) in enumerate(signature) if i in aligned]
    return (f"{name} {types[next(iter(types))]} -> {types['out_ptr']} {consts} w{warps} s{stages} "
            f"divisible: {','.join(divisible)}")


def _loads_provably_aligned(variant: tuple) -> bool:
    """Every pointer 16-byte aligned and every stride 1 or a multiple of 16: what cp.async needs proven."""
    _, signature, _, attrs, _, _ = variant
    aligned = {i for (i,), _ in attrs}
    return all(i in aligned for i, (n, kind) in enumerate(signature)
               if kind != "constexpr" and (kind.startswith("*") or n.startswith("stride")))


# --- the tests --------------------------------------------------------------------------------------


def test_the_calls_request_every_variant_class(compiled) -> None:
    """The variants include what the brief of each axis asks for (so a change to the calls cannot drop one)."""
    seen = {(v[0], dict(v[2]).get("HAS_C"), dict(v[1])["a_ptr" if v[0] == "syrk_kernel" else "x_ptr"],
             dict(v[1])["out_ptr"]) for v in compiled}
    for dt in ("fp16", "bf16"):
        assert ("syrk_kernel", True, f"*{dt}", f"*{dt}") in seen, "HAS_C with a 16-bit output (Newton-Schulz poly step)"
        assert ("syrk_kernel", True, f"*{dt}", "*fp32") in seen, "fp32 output from 16-bit operands (statistics)"
        assert ("syrk_kernel", False, f"*{dt}", f"*{dt}") in seen
        assert ("ns_step_kernel", None, f"*{dt}", f"*{dt}") in seen
    precisions = {dict(v[2])["INPUT_PRECISION"] for v in compiled}
    assert {"ieee", "tf32", "tf32x3", None} <= precisions
    tiles = {(dict(v[2]).get("BLOCK", dict(v[2]).get("BLOCK_M")), dict(v[2])["BLOCK_K"], v[4], v[5]) for v in compiled}
    for cfg in bench._sweep_configs():
        assert (cfg.block_m, cfg.block_k, cfg.num_warps, cfg.num_stages) in tiles, cfg
    # the divisible and the non-divisible signature of M, and an unaligned pointer
    m_specs = {(v[0], [n for n, _ in v[1]].index("M") in {i for (i,), _ in v[3]}) for v in compiled}
    assert {("syrk_kernel", True), ("syrk_kernel", False), ("ns_step_kernel", True), ("ns_step_kernel", False)} <= m_specs
    assert any(not {(0,), (1,)} <= {i for i, _ in v[3]} for v in compiled), "a launch with an unaligned pointer"
    assert any(dict(v[1]).get("stride_am") == "constexpr" for v in compiled if v[0] == "syrk_kernel"), "column-major"


def test_every_variant_compiles_for_hopper(compiled, request) -> None:
    failures = [f"{_describe(v)} (from {calls[0]}): {res['error']}" for v, (calls, res) in compiled.items() if res["error"]]
    print(request.config.stash.get(_SUMMARY, ""))
    assert not failures, "\n".join(failures)


def test_compiled_code_uses_the_hardware(compiled) -> None:
    """Tensor cores, pipelining, shared memory and vector stores, where the specialisation allows them.

    Where a stride is not a multiple of 16 or a pointer not 16-byte aligned (tails, odd shapes),
    Triton cannot prove the alignment cp.async needs and loads without it: those shapes compile and
    are right (the interpreter tests), but their K loop is not pipelined (docs/KERNELS.md).
    """
    problems = []
    for variant, (calls, res) in compiled.items():
        if res["error"]:
            continue
        name, signature, constexprs, attrs, warps, stages = variant
        types, consts = dict(signature), dict(constexprs)
        operand = types["a_ptr" if name == "syrk_kernel" else "x_ptr"]
        where = f"{_describe(variant)} (from {calls[0]})"
        if res["shared"] > SMEM_LIMIT:
            problems.append(f"{where}: {res['shared']} bytes of shared memory > {SMEM_LIMIT}")
        if operand != "*fp32" or consts["INPUT_PRECISION"] in ("tf32", "tf32x3"):
            if not res["wgmma"]:
                problems.append(f"{where}: no wgmma (tensor cores)")
        elif res["wgmma"]:
            problems.append(f"{where}: IEEE fp32 should not use tensor cores")
        if consts["INPUT_PRECISION"] in ("tf32", "tf32x3") and not res["tf32"]:
            problems.append(f"{where}: no tf32 instructions")
        if stages > 1 and _loads_provably_aligned(variant) and not res["cp_async"]:
            problems.append(f"{where}: K loop not pipelined (no cp.async)")
        aligned = {i for (i,), _ in attrs}
        names = [n for n, _ in signature]
        contiguous_out = (types["stride_on"] == "constexpr" and names.index("out_ptr") in aligned
                          and names.index("stride_om") in aligned)
        if operand != "*fp32" and types["out_ptr"] != "*fp32" and contiguous_out and not res["v4_store"]:
            problems.append(f"{where}: a contiguous aligned 16-bit output should store 16-byte vectors")
    assert not problems, "\n".join(problems)
