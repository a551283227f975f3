"""Newton-Schulz iterations against a float64 reference written out plainly."""

from __future__ import annotations

import pytest
import torch

from ds_canzona.optim.newton_schulz import (
    COEFFICIENT_SETS,
    POLAR_EXPRESS,
    QUINTIC,
    coefficient_set,
    newton_schulz_gram,
    newton_schulz_standard,
    normalize,
    orthogonalize,
)

SHAPES = [(16, 48), (48, 16), (32, 32), (7, 13), (1, 9), (64, 24)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def reference_polar(g: torch.Tensor, coefficients: list[tuple[float, float, float]], norm_scale: float) -> torch.Tensor:
    """The quintic iteration in float64, X <- a X + b (X X^T) X + c (X X^T)^2 X, plainly."""
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (torch.linalg.matrix_norm(x) * norm_scale + 1e-7)
    for a, b, c in coefficients:
        gram = x @ x.T
        x = a * x + b * (gram @ x) + c * (gram @ (gram @ x))
    return x.T if tall else x


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("method", ["standard", "gram"])
@pytest.mark.parametrize("name", ["quintic", "polar_express"])
def test_fp32_matches_float64_reference(shape, method, name):
    # The Gram iteration is the standard one rearranged, so both are held to the same reference.
    torch.manual_seed(0)
    g = torch.randn(shape)
    coefficients = COEFFICIENT_SETS[name]
    out = orthogonalize(g, method=method, coefficients=coefficients, steps=5)
    assert out.dtype == torch.float32 and out.shape == g.shape
    ref = reference_polar(g, coefficients.for_steps(5), coefficients.norm_scale)
    # fp32 unit roundoff 6e-8, amplified ~20x by five steps of slope up to 3.4 at zero: measured ~2e-6.
    assert rel(out, ref) < 1e-5


@pytest.mark.parametrize("method", ["standard", "gram"])
def test_float64_run_is_the_reference(method):
    torch.manual_seed(1)
    g = torch.randn(12, 40, dtype=torch.float64)
    out = orthogonalize(g, method=method, steps=5)
    assert out.dtype == torch.float64
    assert rel(out, reference_polar(g, QUINTIC.for_steps(5), 1.0)) < 1e-12


def test_gram_restarts_do_not_change_the_math():
    torch.manual_seed(2)
    x = normalize(torch.randn(10, 50, dtype=torch.float64))
    schedule = POLAR_EXPRESS.for_steps(7)
    standard = newton_schulz_standard(x, schedule)
    for restarts in [(), (2,), (1, 3, 5), (6,)]:
        assert rel(newton_schulz_gram(x, schedule, restarts), standard) < 1e-12


def test_batched_matches_each_matrix():
    torch.manual_seed(3)
    g = torch.randn(4, 8, 24)
    batched = orthogonalize(g, method="gram", steps=5)
    for i in range(4):
        assert rel(batched[i], orthogonalize(g[i], method="gram", steps=5)) < 1e-6


def test_polar_express_converges_where_quintic_plateaus():
    # Singular values spread over [1e-2, 1]: eight Polar Express steps bring them all near 1; the
    # classic quintic keeps oscillating in roughly [0.7, 1.2], by design.
    torch.manual_seed(4)
    u, _ = torch.linalg.qr(torch.randn(32, 32, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(32, 32, dtype=torch.float64))
    g = u @ torch.diag(torch.logspace(-2, 0, 32, dtype=torch.float64)) @ v.T
    pe = torch.linalg.svdvals(orthogonalize(g, coefficients=POLAR_EXPRESS, steps=8))
    assert (pe - 1).abs().max() < 2e-2
    quintic = torch.linalg.svdvals(orthogonalize(g, coefficients=QUINTIC, steps=8))
    assert 0.6 < quintic.min() and quintic.max() < 1.25 and (quintic - 1).abs().max() > 0.05


def test_coefficient_schedules():
    assert QUINTIC.for_steps(3) == [(3.4445, -4.7750, 2.0315)] * 3
    assert len(POLAR_EXPRESS.steps) == 8
    assert POLAR_EXPRESS.for_steps(10)[-1] == (1.875, -1.25, 0.375)
    assert coefficient_set((1.5, -0.5, 0.0)).for_steps(2) == [(1.5, -0.5, 0.0)] * 2
    with pytest.raises(ValueError, match="unknown coefficient set 'cubic'"):
        coefficient_set("cubic")


def test_zero_input_stays_zero_and_errors():
    assert torch.equal(orthogonalize(torch.zeros(4, 6), method="gram"), torch.zeros(4, 6))
    with pytest.raises(ValueError, match="unknown Newton-Schulz method 'fast'"):
        orthogonalize(torch.randn(4, 6), method="fast")
    with pytest.raises(ValueError, match="matrix"):
        orthogonalize(torch.randn(6))
