"""The guarded eigendecomposition of Shampoo's roots and SOAP's bases (optim/shampoo.py, optim/soap.py).

All-zero statistics (a tensor whose gradient never arrives) take the closed form without calling
eigh; non-finite ones keep their root or basis with a warning; a failed decomposition is retried
(float64, then the CPU) and, when every attempt fails, the statistic keeps its root or basis;
low-rank statistics decompose correctly; the guard reads the host once per tensor per refresh.
"""

from __future__ import annotations

import logging

import pytest
import torch

from ds_canzona.optim import rule_for_group, shampoo as shampoo_module, soap as soap_module
from ds_canzona.optim.shampoo import eigh_attempts, inverse_root_eigh, symmetric_eigh, zero_inverse_root
from ds_canzona.optim.soap import eigenbasis, zero_eigenbasis

REAL_EIGH = torch.linalg.eigh


def _rule(kind: str, **group):
    return rule_for_group({"kind": kind, **group})


def _shampoo(**group):
    return _rule("shampoo", precondition_frequency=1, start_preconditioning_step=1, **group)


def _eigh_refusing(dtypes):
    """torch.linalg.eigh that fails (as LAPACK or cuSOLVER report it) for matrices of ``dtypes``."""
    seen = []

    def eigh(matrix, *args, **kwargs):
        seen.append(matrix.dtype)
        if matrix.dtype in dtypes:
            raise torch.linalg.LinAlgError("injected: the algorithm failed to converge")
        return REAL_EIGH(matrix, *args, **kwargs)

    return eigh, seen


@pytest.fixture(autouse=True)
def _fresh_warnings():
    shampoo_module._warned.clear()
    yield
    shampoo_module._warned.clear()


# --- all-zero statistics: the closed form, no decomposition -----------------------------------


@pytest.mark.parametrize("root_dtype", ["float32", "float64"])
def test_zero_statistic_takes_the_closed_form_of_the_decomposition(root_dtype):
    for n in (1, 7, 40):
        zero = torch.zeros(n, n)
        dtype = getattr(torch, root_dtype)
        closed = zero_inverse_root(zero, 4, 1e-12, dtype)
        assert torch.equal(closed, inverse_root_eigh(zero, 4, 1e-12, dtype)), "the closed form is what eigh gives"
        assert torch.equal(closed, torch.eye(n) * (1e-12) ** -0.25)
        assert torch.equal(zero_eigenbasis(zero), eigenbasis(zero))


@pytest.mark.parametrize("kind,group", [
    ("shampoo", {"precondition_frequency": 1, "start_preconditioning_step": 1}),
    ("shampoo", {"precondition_frequency": 1, "start_preconditioning_step": 1, "inverse_root": "newton",
                 "epsilon": 1e-6}),
    ("soap", {"precondition_frequency": 1}),
])
def test_a_tensor_without_gradient_never_reaches_eigh(monkeypatch, kind, group):
    eigh, seen = _eigh_refusing((torch.float32, torch.float64))
    monkeypatch.setattr(torch.linalg, "eigh", eigh)
    rule = _rule(kind, **group)
    w = torch.randn(6, 9)
    state = rule.init_state(w)
    for _ in range(3):
        rule.update_([w], [torch.zeros(6, 9)], [state], lr=0.01)
    assert not seen and torch.isfinite(w).all()
    if kind == "shampoo":
        epsilon = group.get("epsilon", 1e-12)
        assert torch.equal(state["left_root.0.0"], torch.eye(6) * epsilon ** -0.25)
        assert torch.equal(state["right_root.0.0"], torch.eye(9) * epsilon ** -0.25)
    else:
        assert torch.equal(state["left_basis"], torch.eye(6).flip(-1))
        assert torch.equal(state["right_basis"], torch.eye(9).flip(-1))


# --- non-finite statistics: the root or basis is kept, and a warning says so ----------------------


def test_a_non_finite_statistic_keeps_its_root(caplog):
    rule = _shampoo(betas=(0.9, 0.99))
    w = torch.randn(5, 8)
    state = rule.init_state(w)
    rule.update_([w], [torch.randn(5, 8)], [state], lr=0.01)
    left_before, right_before = state["left_root.0.0"].clone(), state["right_root.0.0"].clone()
    state["left_stat.0.0"][0, 0] = float("inf")  # an overflowed statistic (the gradient itself is finite)
    with caplog.at_level(logging.WARNING, logger="ds_canzona"):
        for _ in range(2):
            rule.update_([w], [torch.randn(5, 8)], [state], lr=0.01)
    assert torch.equal(state["left_root.0.0"], left_before), "the non-finite side keeps its root"
    assert not torch.equal(state["right_root.0.0"], right_before), "the healthy side is refreshed"
    assert torch.isfinite(w).all()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "5x5 statistic is not finite" in warnings[0] and "inverse root is kept" in warnings[0]


def test_a_non_finite_statistic_keeps_its_soap_basis(caplog):
    rule = _rule("soap", precondition_frequency=1)
    w = torch.randn(5, 8)
    state = rule.init_state(w)
    g = torch.randn(5, 8)
    g[0, 0] = 1e30  # g gᵀ overflows fp32: the statistic is inf, the gradient finite
    with caplog.at_level(logging.WARNING, logger="ds_canzona"):
        rule.update_([w], [g], [state], lr=0.01)
        assert torch.equal(state["left_basis"], torch.eye(5)) and torch.equal(state["right_basis"], torch.eye(8))
        state["right_stat"].zero_()  # a right statistic that is healthy again
        state["right_stat"] += torch.eye(8)
        before = state["left_basis"].clone()
        rule.update_([w], [torch.randn(5, 8)], [state], lr=0.01)
    assert torch.equal(state["left_basis"], before), "the refresh keeps the basis of a non-finite statistic"
    assert any("basis is kept" in r.getMessage() for r in caplog.records)


# --- a failed decomposition: the retries, then the root is kept ------------------------------------


def _spd(n: int, seed: int = 0) -> torch.Tensor:
    h = torch.randn(n, 2 * n, generator=torch.Generator().manual_seed(seed))
    s = h @ h.T / (2 * n)
    return (s + s.T) / 2  # exactly symmetric, as the decomposition's own symmetrisation leaves it


def test_a_float32_failure_is_retried_in_float64(monkeypatch):
    stat = _spd(12)
    expected = inverse_root_eigh(stat, 4, 1e-12, torch.float64)
    eigh, seen = _eigh_refusing((torch.float32,))
    monkeypatch.setattr(torch.linalg, "eigh", eigh)
    assert torch.equal(inverse_root_eigh(stat, 4, 1e-12, torch.float32), expected)
    assert seen == [torch.float32, torch.float64]
    assert torch.equal(eigenbasis(stat), REAL_EIGH(stat.double()).eigenvectors.flip(-1).float())


def test_cuda_decomposes_in_float64_first_then_on_the_cpu():
    assert eigh_attempts("cuda", torch.float32) == [(torch.float64, "here"), (torch.float64, "cpu")]
    assert eigh_attempts("cuda", torch.float64) == [(torch.float64, "here"), (torch.float64, "cpu")]
    assert eigh_attempts("cpu", torch.float32) == [(torch.float32, "here"), (torch.float64, "here")]
    assert eigh_attempts("cpu", torch.float64) == [(torch.float64, "here")]


def test_the_attempts_run_in_order_until_one_succeeds(monkeypatch):
    """The CUDA list on a CPU tensor: the first (float64 in place) fails, the second (on the CPU) runs."""
    monkeypatch.setattr(shampoo_module, "eigh_attempts", lambda device, dtype: [(torch.float64, "here"),
                                                                               (torch.float64, "cpu")])
    calls = []

    def eigh(matrix, *args, **kwargs):
        calls.append(matrix.dtype)
        if len(calls) == 1:
            raise torch.linalg.LinAlgError("injected: CUSOLVER_STATUS_EXECUTION_FAILED")
        return REAL_EIGH(matrix, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "eigh", eigh)
    stat = _spd(9)
    values, vectors = symmetric_eigh(stat, torch.float32)
    assert calls == [torch.float64, torch.float64] and vectors.dtype == torch.float64
    assert torch.equal(vectors, REAL_EIGH(stat.double()).eigenvectors)


@pytest.mark.parametrize("kind", ["shampoo", "soap"])
def test_when_every_attempt_fails_the_statistic_keeps_its_root(monkeypatch, caplog, kind):
    rule = _shampoo() if kind == "shampoo" else _rule("soap", precondition_frequency=1)
    w = torch.randn(6, 10)
    state = rule.init_state(w)
    before = {k: v.clone() for k, v in state.items()}
    eigh, seen = _eigh_refusing((torch.float32, torch.float64))
    monkeypatch.setattr(torch.linalg, "eigh", eigh)
    with caplog.at_level(logging.WARNING, logger="ds_canzona"):
        # Shampoo: two refreshes; SOAP: the first call (its later refreshes are QR steps, no eigh)
        for _ in range(2 if kind == "shampoo" else 1):
            rule.update_([w], [torch.randn(6, 10)], [state], lr=0.01)
    assert seen and torch.isfinite(w).all()
    kept = ("left_root.0.0", "right_root.0.0") if kind == "shampoo" else ("left_basis", "right_basis")
    assert all(torch.equal(state[k], before[k]) for k in kept)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "could not be decomposed" in warnings[0] and "injected" in warnings[0]


# --- low rank ---------------------------------------------------------------------------------------


def test_a_low_rank_statistic_decomposes_right():
    """A 30x30 statistic of rank 2 (two gradient columns) in fp32, the case cuSOLVER's fp32 eigh has
    crashed on: the decomposition finds the range and its eigenvalues, the null eigenvalues are
    rounding noise, and the inverse root is right on the range."""
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(30, 2, generator=gen, dtype=torch.float64)
    stat64 = g @ g.T
    values64, vectors64 = REAL_EIGH(stat64)
    top = vectors64[:, -2:]  # the range
    values, vectors = symmetric_eigh(stat64.float(), torch.float32)
    assert values.dtype == torch.float32 and torch.isfinite(values).all() and torch.isfinite(vectors).all()
    lam_max = float(values64[-1])
    # fp32: eigenvalues to ~u * lambda_max, eigenvectors of the range to ~u * lambda_max / gap (gap ~ lambda_max)
    assert float((values[-2:].double() - values64[-2:]).abs().max()) < 1e-5 * lam_max
    assert float(values[:-2].abs().max()) < 1e-5 * lam_max
    assert float((vectors[:, -2:].double() @ vectors[:, -2:].double().T - top @ top.T).norm()) < 1e-5
    # The root with an epsilon well above fp32's noise (1e-3 of lambda_max): the null space's boost,
    # eps^(-1/4) ~ 5, multiplies the range vectors' ~1e-6 leak; 1e-4 relative on the range.
    epsilon = 1e-3 * lam_max
    root = inverse_root_eigh(stat64.float(), 4, epsilon, torch.float32)
    exact = top * (values64[-2:] + epsilon) ** -0.25
    assert float((root.double() @ top - exact).norm() / exact.norm()) < 1e-4
    # SOAP's basis of the same statistic: orthonormal, the range first
    basis = eigenbasis(stat64.float()).double()
    assert float((basis.T @ basis - torch.eye(30, dtype=torch.float64)).abs().max()) < 1e-5
    assert float((basis[:, :2] @ basis[:, :2].T - top @ top.T).norm()) < 1e-5


# --- one host read per tensor per refresh, none on other steps ---------------------------------------


@pytest.mark.parametrize("kind,group,refresh_steps", [
    ("shampoo", {"precondition_frequency": 3, "start_preconditioning_step": 2, "max_preconditioner_dim": 4}, [2, 5]),
    ("soap", {"precondition_frequency": 2}, [1, 3, 5]),  # the first call, then k = 2, 4
])
def test_the_guard_reads_once_per_tensor_per_refresh(monkeypatch, kind, group, refresh_steps):
    reads = []
    health = shampoo_module.statistic_health

    def counted(stats):
        reads.append(len(stats))
        return health(stats)

    monkeypatch.setattr(shampoo_module if kind == "shampoo" else soap_module, "statistic_health", counted)
    rule = _rule(kind, **group)
    w = torch.randn(6, 9)
    state = rule.init_state(w)
    for step in range(1, 7):
        before = len(reads)
        rule.update_([w], [torch.randn(6, 9)], [state], lr=0.01)
        assert len(reads) - before == (1 if step in refresh_steps else 0), step
    if kind == "shampoo":
        assert reads[0] == 2 * len(rule.blocks((6, 9))), "every block's two statistics in the one read"
