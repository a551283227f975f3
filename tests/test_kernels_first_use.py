"""The first-use check of backend 'default' on CUDA, by fault injection on the CPU.

``dispatch.device_type`` is made to call every CPU tensor a CUDA one (a stand-in device), and the
Triton wrappers the public functions call (``kernels._syrk_triton``, ``_ns_step_triton``, ...) are
replaced: by one that raises (a compile error), one that returns garbage (and scribbles on its
in-place arguments), and correct ones. Everything runs in this process, on small shapes.
The real kernels pass the same check in Triton's interpreter (tests/test_kernels_triton.py).
"""

from __future__ import annotations

import logging

import pytest
import torch

import ds_canzona.kernels as K
from ds_canzona.kernels import dispatch, validation
from ds_canzona.kernels.newton_schulz import ns_step_reference
from ds_canzona.kernels.shampoo import coupled_newton_step_reference, sym_stat_update_reference
from ds_canzona.kernels.syrk import syrk_reference
from ds_canzona.optim import SOAP, Muon, Shampoo

WRAPPERS = ("_syrk_triton", "_ns_step_triton", "_sym_stat_update_triton", "_coupled_newton_step_triton")


@pytest.fixture
def stand_in_cuda(monkeypatch):
    """Backend 'default', every CPU tensor counted as CUDA, Triton 'available', a fresh check state."""
    monkeypatch.setattr(dispatch, "device_type", lambda t: "cuda")
    monkeypatch.setattr(dispatch, "TRITON_AVAILABLE", True)
    before = K.get_backend()
    K.set_backend("default")
    validation.reset()
    dispatch._logged.clear()
    yield
    K.set_backend(before)
    validation.reset()
    dispatch._logged.clear()


def _raising(*args, **kwargs):
    raise RuntimeError("injected compile error: PassManager::run failed")


def _garbage_like(t: torch.Tensor) -> torch.Tensor:
    return torch.randn(t.shape, generator=torch.Generator().manual_seed(99)).to(t.dtype)


def _garbage_syrk(a, b=None, *, out=None, c=None, **kwargs):
    m = a.shape[-2]
    res = _garbage_like(torch.empty(*a.shape[:-2], m, m, dtype=a.dtype if out is None else out.dtype))
    return res if out is None else out.copy_(res)


def _garbage_ns_step(x, a, b, c, *, out=None, **kwargs):
    return _garbage_like(x) if out is None else out.copy_(_garbage_like(x))


def _garbage_stat(stat, g, beta, **kwargs):
    return stat.copy_(_garbage_like(stat))


def _garbage_newton(x, m, root, **kwargs):
    return _garbage_like(x), _garbage_like(m)


GARBAGE = dict(zip(WRAPPERS, (_garbage_syrk, _garbage_ns_step, _garbage_stat, _garbage_newton)))


def _inject(monkeypatch, faulty: str) -> dict[str, int]:
    """Replace every wrapper by a raising or a garbage one; returns the calls each received."""
    calls = dict.fromkeys(WRAPPERS, 0)
    for name in WRAPPERS:
        fake = _raising if faulty == "raises" else GARBAGE[name]

        def counted(*args, _fake=fake, _name=name, **kwargs):
            calls[_name] += 1
            return _fake(*args, **kwargs)

        monkeypatch.setattr(K, name, counted)
    return calls


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "ds_canzona.kernels"]


# --- one operation at a time ------------------------------------------------------------------


@pytest.mark.parametrize("faulty", ["raises", "garbage"])
def test_a_faulty_kernel_falls_back_with_one_warning(stand_in_cuda, monkeypatch, caplog, faulty):
    calls = _inject(monkeypatch, faulty)
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(shape, generator=gen) for shape in ((40, 72), (3, 40, 72), (64, 16))]
    with caplog.at_level(logging.INFO, logger="ds_canzona.kernels"):
        for x in inputs:
            assert torch.equal(K.xxt(x), syrk_reference(x))
    warnings = _warnings(caplog)
    assert len(warnings) == 1, warnings
    for part in ("syrk_kernel", "xxt", "float32", "[40, 72]", "torch for the rest of this process"):
        assert part in warnings[0]
    assert ("PassManager::run failed" if faulty == "raises" else "relative error") in warnings[0]
    assert calls["_syrk_triton"] == 1, "after the fallback the kernel must not run again"
    status = K.backend_report()
    assert "fell back after a failed first-use check" in status and "xxt: torch" in status


def test_in_place_arguments_hold_the_reference_result_after_a_miss(stand_in_cuda, monkeypatch):
    """The garbage wrappers write into stat / out; the check restores them before the reference runs."""
    _inject(monkeypatch, "garbage")
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(24, 40, generator=gen).to(torch.bfloat16)
    h = torch.randn(24, 48, generator=gen)
    stat = h @ h.T / 48
    expected = sym_stat_update_reference(stat.clone(), g, 0.9)
    result = K.sym_stat_update_(stat, g, 0.9)
    assert result is stat and torch.equal(stat, expected)

    a = torch.randn(30, 30, generator=gen)
    a = a @ a.T
    b = a @ a
    c = torch.randn(30, 30, generator=gen)
    c = c + c.T
    expected = syrk_reference(a, b, alpha=0.5, beta=2.0, c=c)
    out = c.clone()  # in place, out is c: the kernel would read c after scribbling on it
    assert K.sym_matmul(a, b, alpha=0.5, beta=2.0, c=out, out=out) is out and torch.equal(out, expected)

    x = torch.randn(2, 20, 36, generator=gen) / 30
    out = torch.full((2, 20, 36), float("nan"))
    coeffs = (3.4445, -4.775, 2.0315)
    assert K.ns_step(x, *coeffs, out=out) is out and torch.equal(out, ns_step_reference(x, *coeffs))

    xm, mm = torch.eye(16) * 0.7, torch.eye(16) * 0.9
    got = K.coupled_newton_step(xm, mm, 4)
    want = coupled_newton_step_reference(xm, mm, 4)
    assert all(torch.equal(p, q) for p, q in zip(got, want))


def test_a_correct_kernel_is_checked_once_per_class_then_runs_alone(stand_in_cuda, monkeypatch, caplog):
    kernel_calls, reference_calls = [], []

    def accurate_syrk(a, b=None, *, out=None, config=None, **kwargs):  # a right kernel: float64, rounded once
        kernel_calls.append(tuple(a.shape))
        res = syrk_reference(a.double()).to(a.dtype if out is None else out.dtype)
        return res if out is None else out.copy_(res)

    def counted_reference(*args, **kwargs):
        reference_calls.append(args[0].dtype)
        return syrk_reference(*args, **kwargs)

    monkeypatch.setattr(K, "_syrk_triton", accurate_syrk)
    monkeypatch.setattr(K, "syrk_reference", counted_reference)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(40, 72, generator=gen).to(torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="ds_canzona.kernels"):
        first = K.xxt(x)
        assert len(kernel_calls) == 1 and reference_calls == [torch.float64, torch.bfloat16]  # oracle, reference
        assert torch.equal(first, syrk_reference(x.double()).to(torch.bfloat16)), "a pass returns the kernel's result"
        for seed in range(3):  # same class (same dtype, tails, layout): the kernel alone
            y = torch.randn(56, 88, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
            K.xxt(y)
        assert len(kernel_calls) == 4 and len(reference_calls) == 2
        K.xxt(torch.randn(3, 40, 72, generator=gen).to(torch.bfloat16))  # a stack: a class of its own
        assert len(kernel_calls) == 5 and len(reference_calls) == 4
    assert not _warnings(caplog)
    status = K.backend_status()["xxt"]
    assert status["backend"] == "triton" and status["fallback"] is None and len(status["validated"]) == 2
    assert "passed its first-use check" in K.backend_report()


def test_shape_classes_separate_what_triton_specialises_on():
    def key(t, config=None):
        return validation.shape_class("xxt", [t], config).key

    base = torch.zeros(40, 72)
    assert key(base) == key(torch.zeros(56, 88)), "the same divisibility, dtype and layout: one class"
    others = [
        torch.zeros(48, 64),  # multiples of 16
        torch.zeros(40, 72, dtype=torch.bfloat16),
        torch.zeros(3, 40, 72),  # a stack
        torch.zeros(72, 40).mT,  # column-major
        torch.zeros(40, 144)[:, ::2],  # strided
        torch.zeros(40 * 72 + 1)[1:].view(40, 72),  # not 16-byte aligned
        torch.zeros(1040, 72),  # default_config's large regime
        torch.zeros(72, 40),  # tall
    ]
    keys = {key(t) for t in others} | {key(base), key(base, K.TileConfig(block_m=64, block_n=64))}
    assert len(keys) == len(others) + 2
    text = validation.shape_class("sym_stat_update_", [torch.zeros(40, 40), torch.zeros(72, 40).mT], None).text
    assert text == ("float32 [40, 40] row-major (rows % 16 = 8, cols % 16 = 8), "
                    "float32 [40, 72] column-major (rows % 16 = 8, cols % 16 = 8)")
    assert key(torch.zeros(72, 40)) != key(torch.zeros(40, 72)), "tall and wide: ns_step steps a tall X transposed"


def test_an_input_that_cannot_decide_is_not_trusted(stand_in_cuda, monkeypatch):
    """All-zero inputs (a tensor whose gradient never arrives): the kernel cannot be told right from wrong."""
    calls = _inject(monkeypatch, "garbage")
    zero = torch.zeros(24, 40)
    for _ in range(validation.MAX_INCONCLUSIVE):
        assert torch.equal(K.xxt(zero), torch.zeros(24, 24))
    assert calls["_syrk_triton"] == validation.MAX_INCONCLUSIVE
    assert K.backend_status()["xxt"]["fallback"] is None, "inconclusive is not a miss"
    assert torch.equal(K.xxt(zero), torch.zeros(24, 24))
    assert calls["_syrk_triton"] == validation.MAX_INCONCLUSIVE, "the class has given up: torch alone"
    assert K.backend_status()["xxt"]["gave_up"]
    x = torch.randn(24, 40)
    assert torch.equal(K.xxt(x), syrk_reference(x))  # another input of that class: still torch
    K.xxt(torch.randn(3, 24, 40))  # another class: checked, and the garbage caught
    assert K.backend_status()["xxt"]["fallback"] is not None


def test_forced_triton_raises_and_is_never_checked(stand_in_cuda, monkeypatch):
    K.set_backend("triton")
    _inject(monkeypatch, "raises")
    with pytest.raises(RuntimeError, match="injected compile error"):
        K.xxt(torch.randn(8, 12))
    _inject(monkeypatch, "garbage")
    x = torch.randn(8, 12)
    assert torch.equal(K.xxt(x), _garbage_syrk(x)), "forced: the kernel's result, unchecked"
    assert K.backend_status()["xxt"]["fallback"] is None


def test_the_warning_is_rank_0s(stand_in_cuda, monkeypatch, caplog):
    _inject(monkeypatch, "raises")
    monkeypatch.setattr(validation, "_rank", lambda: 1)
    with caplog.at_level(logging.INFO, logger="ds_canzona.kernels"):
        K.xxt(torch.randn(8, 12))
    assert not _warnings(caplog)
    assert any(r.getMessage().startswith("(rank 1)") for r in caplog.records)
    assert K.backend_status()["xxt"]["fallback"] is not None


def test_plan_line_says_what_each_backend_does(stand_in_cuda, monkeypatch):
    assert "checked on first use" in K.backend_summary("cuda") and "one warning" in K.backend_summary("cuda")
    assert "Triton on CUDA only" in K.backend_summary("cpu")
    K.set_backend("torch")
    assert "torch reference everywhere" in K.backend_summary("cuda")
    K.set_backend("triton")
    assert "raises" in K.backend_summary("cuda")


# --- whole optimizers: a faulty kernel leaves the run equal to a 'torch' run ---------------------


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 16))


OPTIMIZERS = {
    # (builder, the operations it calls)
    "muon-standard-bf16": (lambda m: Muon(m.named_parameters(), lr=0.05, ns_method="standard", ns_dtype="bfloat16"),
                           {"ns_step"}),
    "muon-gram-fp16": (lambda m: Muon(m.named_parameters(), lr=0.05, ns_method="gram", ns_dtype="float16"), {"xxt"}),
    "shampoo-eigh": (lambda m: Shampoo(m.named_parameters(), lr=0.01, betas=(0.9, 0.99), precondition_frequency=2),
                     {"sym_stat_update_"}),
    "shampoo-newton-summed": (lambda m: Shampoo(m.named_parameters(), lr=0.01, precondition_frequency=2,
                                                inverse_root="newton", epsilon=1e-6),
                              {"xxt", "coupled_newton_step"}),
    "soap": (lambda m: SOAP(m.named_parameters(), lr=0.01, precondition_frequency=2), {"sym_stat_update_"}),
}


def _train(make_optimizer, steps: int = 3) -> list[torch.Tensor]:
    model = _model()
    opt = make_optimizer(model)
    gen = torch.Generator().manual_seed(5)
    for _ in range(steps):
        x, y = torch.randn(32, 24, generator=gen), torch.randn(32, 16, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("faulty", ["raises", "garbage"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_run_with_faulty_kernels_equals_a_torch_run(stand_in_cuda, monkeypatch, caplog, name, faulty):
    make_optimizer, ops = OPTIMIZERS[name]
    K.set_backend("torch")
    expected = _train(make_optimizer)
    K.set_backend("default")
    calls = _inject(monkeypatch, faulty)
    with caplog.at_level(logging.WARNING, logger="ds_canzona.kernels"):
        got = _train(make_optimizer)
    assert all(torch.equal(p, q) for p, q in zip(got, expected)), "parameters differ from the 'torch' run"
    warnings = _warnings(caplog)
    assert sorted(w.split(" for ")[1].split(" on ")[0] for w in warnings) == sorted(ops), warnings
    assert sum(calls.values()) == len(ops), "each faulty kernel runs once, then its operation is on torch"
    status = K.backend_status()
    assert all(status[op]["fallback"] is not None for op in ops)
