"""ds_canzona.kernels on the CPU: the torch references, the dispatch, the bench CLI.

The Triton kernels themselves are run in the interpreter by test_kernels_triton.py and compiled
for Hopper by test_kernels_compile.py.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

import ds_canzona.kernels as K
from ds_canzona.kernels import dispatch
from ds_canzona.kernels.newton_schulz import ns_step_reference
from ds_canzona.kernels.shampoo import coupled_newton_step_reference, sym_stat_update_reference
from ds_canzona.kernels.syrk import syrk_kernel, syrk_reference

COEFFS = (3.4445, -4.7750, 2.0315)


@pytest.fixture(autouse=True)
def _auto_backend():
    before = K.get_backend()
    K.set_backend("default")
    yield
    K.set_backend(before)


def _spd(n: int, cond: float = 100.0, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    s = (q * torch.logspace(0, -torch.log10(torch.tensor(cond)).item(), n, dtype=torch.float64)) @ q.T
    return (s + s.T) / 2


# --- the public API keeps the names and semantics the optimizers call ----------------------------


def test_public_names() -> None:
    for name in ("xxt", "ns_step", "sym_stat_update_", "set_backend", "get_backend", "TRITON_AVAILABLE"):
        assert hasattr(K, name)
    from ds_canzona.kernels import reference

    assert reference.ns_step_reference is ns_step_reference


def test_xxt_matches_float64_and_is_symmetric() -> None:
    x = torch.randn(3, 37, 53, dtype=torch.float64)
    out = K.xxt(x)
    torch.testing.assert_close(out, x @ x.mT, rtol=1e-13, atol=1e-13)
    assert torch.equal(out, out.mT)
    poisoned = torch.full((3, 37, 37), float("nan"), dtype=torch.float64)
    assert K.xxt(x, out=poisoned) is poisoned and not poisoned.isnan().any()


def test_ns_step_reference_is_the_quintic_step_and_tall_goes_through_the_transpose() -> None:
    x = torch.randn(2, 30, 70, dtype=torch.float64) / 30
    a, b, c = COEFFS
    gram = x @ x.mT
    expected = a * x + (b * gram + c * gram @ gram) @ x
    torch.testing.assert_close(K.ns_step(x, *COEFFS), expected, rtol=1e-12, atol=1e-12)
    tall = K.ns_step(x.mT, *COEFFS)
    assert tall.shape == (2, 70, 30) and tall.is_contiguous()
    gram_t = x.mT @ x  # the literal step on the tall matrix: the same polynomial
    torch.testing.assert_close(tall, a * x.mT + (b * gram_t + c * gram_t @ gram_t) @ x.mT, rtol=1e-10, atol=1e-12)


def test_sym_stat_update_in_place_and_in_the_wider_dtype() -> None:
    g = torch.randn(20, 12).to(torch.bfloat16)
    stat = torch.eye(20)
    res = K.sym_stat_update_(stat, g, 0.9)
    assert res is stat and stat.dtype == torch.float32
    expected = 0.9 * torch.eye(20, dtype=torch.float64) + 0.1 * g.double() @ g.double().T
    torch.testing.assert_close(stat.double(), expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="stat must be"):
        sym_stat_update_reference(torch.zeros(5, 5), g, 0.9)


def test_sym_matmul_reads_only_the_upper_triangle_of_c() -> None:
    s = _spd(16)
    a, b = s @ s, s @ s @ s
    c = _spd(16, seed=1)
    poisoned = c.clone()
    poisoned[torch.ones(16, 16, dtype=torch.bool).tril(-1)] = float("nan")
    res = K.sym_matmul(a, b, alpha=0.5, beta=2.0, c=poisoned, out=poisoned)
    assert res is poisoned
    torch.testing.assert_close(res, 0.5 * a @ b + 2.0 * c, rtol=1e-12, atol=1e-12)


def test_inverse_root_newton_reference_against_eigh() -> None:
    a = torch.stack([_spd(24, 50.0, seed=s) for s in range(2)])
    x = K.inverse_root_newton(a, 4, tol=1e-12)
    ev, v = torch.linalg.eigh(a)
    expected = (v * ev.pow(-0.25)[..., None, :]) @ v.mT
    torch.testing.assert_close(x, expected, rtol=1e-9, atol=1e-9)
    # in fp32 it stops at its rounding floor instead of running max_iters
    x32 = K.inverse_root_newton(a.float(), 4, tol=0.0, max_iters=60)
    assert ((x32.double() - expected).norm() / expected.norm()) < 1e-5


def test_coupled_newton_step_keeps_the_invariant() -> None:
    a, root = _spd(12, 10.0), 3
    z = (root + 1) / (2 * torch.linalg.matrix_norm(a))
    x, m = z ** (1 / root) * torch.eye(12, dtype=torch.float64), z * a
    for _ in range(3):
        x, m = K.coupled_newton_step(x, m, root)
        torch.testing.assert_close(m, torch.linalg.matrix_power(x, root) @ a, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="root"):
        coupled_newton_step_reference(x, m, 0)


def test_triangular_tile_map_formula() -> None:
    """The closed form syrk_kernel uses (fp32 sqrt, one correction each way), T up to 1023 tiles."""
    import numpy as np

    for t in [*range(1, 130), 255, 256, 511, 777, 1000, 1023]:
        pid = np.arange(t * (t + 1) // 2, dtype=np.int64)
        two_t1 = 2 * t + 1
        ti = ((two_t1 - np.sqrt((two_t1 * two_t1 - 8 * pid).astype(np.float32))) * np.float32(0.5)).astype(np.int64)

        def start(i):
            return i * t - (i * (i - 1)) // 2

        ti = np.where(start(ti) > pid, ti - 1, ti)
        ti = np.where(start(ti + 1) <= pid, ti + 1, ti)
        tj = pid - start(ti) + ti
        assert (start(ti) <= pid).all() and (pid < start(ti + 1)).all() and (ti <= tj).all() and (tj < t).all(), t


# --- dispatch --------------------------------------------------------------------------------------


def test_default_uses_the_reference_on_the_cpu_and_logs_once(caplog: pytest.LogCaptureFixture) -> None:
    dispatch._logged.clear()
    x = torch.randn(8, 5)
    with caplog.at_level(logging.INFO, logger="ds_canzona.kernels"):
        for _ in range(3):
            K.xxt(x)
    lines = [r.getMessage() for r in caplog.records if "xxt runs on" in r.getMessage()]
    assert len(lines) == 1 and "torch" in lines[0]
    assert dispatch.choose("xxt", syrk_kernel, x) is False


def test_backend_names_are_validated() -> None:
    for name in ("torch", "triton", "default", " Torch "):
        K.set_backend(name)
    assert K.get_backend() == "torch"
    K.set_backend("auto")  # the former name of 'default', still accepted outside the config
    assert K.get_backend() == "default"
    with pytest.raises(ValueError, match="kernels backend"):
        K.set_backend("cuda")


def test_forced_triton_refuses_what_it_cannot_run() -> None:
    K.set_backend("triton")
    with pytest.raises(ValueError, match="'triton' cannot run xxt"):
        K.xxt(torch.randn(4, 4, dtype=torch.float64))
    if K.TRITON_AVAILABLE and not os.environ.get("TRITON_INTERPRET"):
        with pytest.raises(ValueError, match="CUDA"):
            K.ns_step(torch.randn(4, 6), *COEFFS)


def test_refusals_for_offsets_beyond_int32_and_overlapping_outputs() -> None:
    from ds_canzona.kernels._common import matrix_extent, overlaps

    if K.TRITON_AVAILABLE:
        huge = torch.empty(50000, 50000, device="meta")
        assert matrix_extent(huge) > 2**31
        assert "int32" in dispatch._triton_refusal(syrk_kernel, (huge,), None)
        assert "int32" in dispatch._triton_refusal(syrk_kernel, (torch.empty(50000, 8),), 50000)
    buf = torch.zeros(10, 10)
    assert overlaps(buf[:5], buf[4:]) and not overlaps(buf[:5], buf[5:])
    assert overlaps(buf.mT, buf) and not overlaps(buf, torch.zeros(10, 10))


def test_torch_backend_never_touches_triton() -> None:
    K.set_backend("torch")
    x = torch.randn(6, 9, dtype=torch.float16)
    assert torch.equal(K.xxt(x), syrk_reference(x))


def test_tile_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"TileConfig.block_k=48"):
        K.TileConfig(block_k=48)
    with pytest.raises(ValueError, match=r"TileConfig.num_warps=3"):
        K.TileConfig(num_warps=3)


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("DS_CANZONA_KERNELS", "TRITON_INTERPRET")}
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120)


def test_environment_variable_selects_the_backend() -> None:
    ok = _run("import ds_canzona.kernels as K; print(K.get_backend())", DS_CANZONA_KERNELS="torch")
    assert ok.returncode == 0 and ok.stdout.strip() == "torch", ok.stderr
    bad = _run("import ds_canzona.kernels", DS_CANZONA_KERNELS="fast")
    assert bad.returncode != 0 and "DS_CANZONA_KERNELS='fast'" in bad.stderr


def test_imports_and_runs_without_triton() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
        "import torch, ds_canzona.kernels as K\n"
        "assert not K.TRITON_AVAILABLE\n"
        "x = torch.randn(6, 9)\n"
        "assert torch.allclose(K.xxt(x), x @ x.T, atol=1e-5)\n"
        "K.ns_step(x, 3.4445, -4.775, 2.0315); K.sym_stat_update_(torch.eye(6), x, 0.9)\n"
        "K.set_backend('triton')\n"
        "try:\n    K.xxt(x)\nexcept ValueError as e:\n    print(e)\n"
    )
    res = _run(code)
    assert res.returncode == 0, res.stderr
    assert "Triton is not importable" in res.stdout


# --- the bench CLI without a GPU -----------------------------------------------------------------


def test_bench_without_a_gpu_says_so_and_exits_zero(capsys: pytest.CaptureFixture, tmp_path) -> None:
    from ds_canzona.bench.benchmarks.kernels import main

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the bench would run")
    assert main([]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "no CUDA GPU" in out[0]
    path = tmp_path / "bench.json"
    assert main(["--cpu", "--ops", "xxt,ns_step", "--repeats", "1", "--warmup", "0", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["meta"]["device"] == "cpu"
    assert {r["op"] for r in data["rows"]} == {"xxt", "ns_step"} and all(r["torch_ms"] > 0 for r in data["rows"])
    with pytest.raises(SystemExit):
        main(["--ops", "gemm"])


def test_the_checkout_root_on_sys_path_leaves_huggingfaces_kernels_package_its_name():
    """Run from the checkout's root (``python -m pytest``, ``python -m ds_canzona.bench``) the
    folder ``kernels/`` is on sys.path as a top-level package; transformers imports HuggingFace's
    ``kernels`` when that is installed, and must get it, not ours."""
    import importlib.metadata
    import pathlib
    import subprocess
    import sys

    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("HuggingFace's kernels package is not installed")
    root = pathlib.Path(__file__).resolve().parents[1]
    probe = (
        "import kernels, ds_canzona.kernels as ours, pathlib;"
        "print(pathlib.Path(kernels.__file__).resolve().parent, pathlib.Path(ours.__file__).resolve().parent);"
        "from kernels import Device"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    theirs, ours = done.stdout.split()
    assert pathlib.Path(theirs) != root / "kernels"
    assert pathlib.Path(ours) == root / "kernels"
