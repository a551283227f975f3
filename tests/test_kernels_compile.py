"""The Triton kernels compile for a Hopper GPU (sm_90), on a machine without one.

Triton's compiler and ptxas ship in the wheel, so each kernel is compiled here ahead of time with
the specialisation a real launch gets (contiguous operands: unit strides become constants, pointers
and other strides are 16-aligned) and its default tile config. This catches what the interpreter
cannot: code the compiler rejects, tensor-core use (wgmma for 16-bit operands), a pipelined K loop
(cp.async), shared memory within the 227 KiB an H100/H200 block may use, vectorised stores.
Speed and the numbers of a compiled kernel are for ``python -m ds_canzona.bench kernels`` on a GPU.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # pragma: no cover - another Triton layout
    pytest.skip("this Triton has no ASTSource/GPUTarget to compile ahead of time", allow_module_level=True)

import torch  # noqa: E402

from ds_canzona.kernels._common import default_config, is_interpreted  # noqa: E402
from ds_canzona.kernels.newton_schulz import ns_step_kernel  # noqa: E402
from ds_canzona.kernels.syrk import syrk_kernel  # noqa: E402

if is_interpreted(syrk_kernel):  # pragma: no cover
    pytest.skip("TRITON_INTERPRET=1 in this process: kernels are interpreted, nothing to compile", allow_module_level=True)

HOPPER = GPUTarget("cuda", 90, 32)
SMEM_LIMIT = 232448  # bytes of shared memory one block may use on sm_90
TL = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _compile(fn, args: dict, constexprs: dict, num_warps: int, num_stages: int):
    """args: name -> 'type' | ('type', 'aligned') | 1 (a unit stride, which the JIT makes a constant)."""
    sig, attrs, consts = {}, {}, dict(constexprs)
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
            continue
        spec = args[name]
        if spec == 1:
            sig[name], consts[name] = "constexpr", 1
            continue
        kind, aligned = spec if isinstance(spec, tuple) else (spec, None)
        sig[name] = kind
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    try:
        return triton.compile(
            ASTSource(fn, sig, constexprs=consts, attrs=attrs),
            target=HOPPER,
            options={"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": True},
        )
    except RuntimeError as err:  # pragma: no cover - depends on the install
        if "ptxas" in str(err) and "not found" in str(err).lower():
            pytest.skip(f"no ptxas in this Triton install: {err}")
        raise


def _a(kind: str) -> tuple[str, str]:
    return (kind, "aligned")


CASES = [
    # (id, dtype of operands, dtype of out, problem size for default_config, transposed operand)
    ("bf16-large", torch.bfloat16, torch.bfloat16, 4096, False),
    ("fp16-small", torch.float16, torch.float16, 512, False),
    ("bf16-into-fp32", torch.bfloat16, torch.float32, 4096, False),
    ("bf16-transposed", torch.bfloat16, torch.bfloat16, 4096, True),
    ("fp32-ieee", torch.float32, torch.float32, 4096, False),
]


def _check(kernel, dtype: torch.dtype, cfg) -> None:
    ptx = kernel.asm["ptx"]
    assert kernel.metadata.shared <= SMEM_LIMIT, f"{kernel.metadata.shared} bytes of shared memory > {SMEM_LIMIT}"
    if dtype != torch.float32:
        assert "wgmma.mma_async" in ptx, "16-bit operands should run on Hopper's tensor cores (wgmma)"
    if cfg.num_stages > 1:
        assert "cp.async" in ptx, "the K loop should be pipelined with asynchronous copies"


@pytest.mark.parametrize("name,dtype,out_dtype,size,transposed", CASES, ids=[c[0] for c in CASES])
def test_syrk_kernel_compiles_for_hopper(name, dtype, out_dtype, size, transposed) -> None:
    cfg = default_config(size, size, dtype, interpreted=False)
    ab = {"stride_ab": _a("i32"), "stride_am": 1, "stride_ak": _a("i32")} if transposed else {
        "stride_ab": _a("i32"), "stride_am": _a("i32"), "stride_ak": 1}
    args = {
        "a_ptr": _a(f"*{TL[dtype]}"), "b_ptr": _a(f"*{TL[dtype]}"),
        "c_ptr": _a(f"*{TL[out_dtype]}"), "out_ptr": _a(f"*{TL[out_dtype]}"),
        "M": _a("i32"), "K": _a("i32"),
        **ab, **{k.replace("_a", "_b", 1): v for k, v in ab.items()},
        "stride_cb": _a("i32"), "stride_cm": _a("i32"), "stride_cn": 1,
        "stride_ob": _a("i32"), "stride_om": _a("i32"), "stride_on": 1,
        "alpha": "fp32", "beta": "fp32",
    }
    consts = {
        "HAS_C": out_dtype == torch.float32, "INTERP_BF16": False,
        "INPUT_PRECISION": "ieee" if dtype == torch.float32 else None,
        "BLOCK": cfg.block_m, "BLOCK_K": cfg.block_k,
    }
    kernel = _compile(syrk_kernel, args, consts, cfg.num_warps, cfg.num_stages)
    _check(kernel, dtype, cfg)
    if not transposed and dtype != torch.float32:
        assert "st.global.v4" in kernel.asm["ptx"], "off-diagonal tiles should store with 16-byte vectors"


@pytest.mark.parametrize("name,dtype,out_dtype,size,transposed", CASES, ids=[c[0] for c in CASES])
def test_ns_step_kernel_compiles_for_hopper(name, dtype, out_dtype, size, transposed) -> None:
    if out_dtype != dtype:
        pytest.skip("the step's output has x's dtype")
    cfg = default_config(size, size, dtype, interpreted=False)
    x = {"stride_xb": _a("i32"), "stride_xm": 1, "stride_xn": _a("i32")} if transposed else {
        "stride_xb": _a("i32"), "stride_xm": _a("i32"), "stride_xn": 1}
    out = {"stride_ob": _a("i32"), "stride_om": 1, "stride_on": _a("i32")} if transposed else {
        "stride_ob": _a("i32"), "stride_om": _a("i32"), "stride_on": 1}
    args = {
        "p_ptr": _a(f"*{TL[dtype]}"), "x_ptr": _a(f"*{TL[dtype]}"), "out_ptr": _a(f"*{TL[dtype]}"),
        "M": _a("i32"), "N": _a("i32"),
        "stride_pb": _a("i32"), "stride_pm": _a("i32"), "stride_pk": 1, **x, **out,
        "a_coef": "fp32",
    }
    consts = {
        "INTERP_BF16": False, "INPUT_PRECISION": "ieee" if dtype == torch.float32 else None,
        "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "GROUP_M": cfg.group_m,
    }
    kernel = _compile(ns_step_kernel, args, consts, cfg.num_warps, cfg.num_stages)
    _check(kernel, dtype, cfg)
