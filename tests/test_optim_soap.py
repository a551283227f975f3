"""SOAP against a float64 reference written out plainly."""

from __future__ import annotations

import pytest
import torch

from ds_canzona.optim import SOAP, rule_for_group

# fp32 against float64: relative Frobenius error of one step taken from the same weights. The bases
# come from fp32 eigenvectors and QR; an eigenvector is perturbed by ~1e-7 * lambda_max / gap, and
# the smallest gap between eigenvalues of these random statistics reaches ~1e-3 of lambda_max, so
# up to ~1e-4 for the two vectors of that pair; Adam's elementwise division in the rotated basis
# passes it on. Measured <= 5e-5 over five seeds (float64 parameters: the reference to 1e-10).
FP32_VS_FP64 = 5e-4


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def reference_directions(grads, *, betas, shampoo_beta, eps, frequency, max_dim):
    """SOAP in float64: the step direction D of each call (None for the first, which does not step).

    The weights do not enter D; a step from W is W * (1 - lr * weight_decay) - lr * D.
    """
    beta1, beta2 = betas
    shape = grads[0].shape
    rows, cols = shape[0], grads[0][0].numel()
    rotate_left, rotate_right = rows <= max_dim, cols <= max_dim
    m = torch.zeros(shape, dtype=torch.float64)
    v = torch.zeros(rows, cols, dtype=torch.float64)
    left = torch.zeros(rows, rows, dtype=torch.float64)
    right = torch.zeros(cols, cols, dtype=torch.float64)
    q_left = torch.eye(rows, dtype=torch.float64)
    q_right = torch.eye(cols, dtype=torch.float64)

    def descending_eigenvectors(s):
        return torch.linalg.eigh(s).eigenvectors.flip(-1)

    def power_step(s, q):
        order = torch.argsort(torch.diag(q.T @ s @ q), descending=True)
        return torch.linalg.qr(s @ q[:, order]).Q, order

    out = []
    for t, g in enumerate(grads, start=1):
        g = g.double()
        g2 = g.reshape(rows, cols)
        if t == 1:
            left = (1 - shampoo_beta) * g2 @ g2.T
            right = (1 - shampoo_beta) * g2.T @ g2
            if rotate_left:
                q_left = descending_eigenvectors(left)
            if rotate_right:
                q_right = descending_eigenvectors(right)
            out.append(None)
            continue
        k = t - 1
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * (q_left.T @ g2 @ q_right) ** 2
        m_rotated = q_left.T @ m.reshape(rows, cols) @ q_right
        step = (m_rotated / (1 - beta1**k)) / ((v / (1 - beta2**k)).sqrt() + eps)
        out.append((q_left @ step @ q_right.T).reshape(shape))
        left = shampoo_beta * left + (1 - shampoo_beta) * g2 @ g2.T
        right = shampoo_beta * right + (1 - shampoo_beta) * g2.T @ g2
        if k % frequency == 0:
            if rotate_left:
                q_left, order = power_step(left, q_left)
                v = v[order, :]
            if rotate_right:
                q_right, order = power_step(right, q_right)
                v = v[:, order]
    return out


def run_rule(group, w, grads, lr):
    rule = rule_for_group({"kind": "soap", **group})
    w = w.clone()
    state = rule.init_state(w)
    out = []
    for g in grads:
        rule.update_([w], [g.clone()], [state], lr=lr)
        out.append(w.clone())
    return out, state


CASES = [
    # shape, max_precond_dim. Square shapes give full-rank statistics from the first gradient, so
    # their eigenvalues are distinct and the bases well defined; a side longer than max_dim is
    # not rotated, which makes rectangular shapes well posed too.
    ((8, 8), 10000),
    ((6, 20), 10),
    ((20, 6), 10),
    ((4, 3, 1, 3), 8),
    ((12, 30), 8),
]


@pytest.mark.parametrize(("shape", "max_dim"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_float64_reference(shape, max_dim, dtype):
    torch.manual_seed(0)
    w = torch.randn(shape, dtype=dtype)
    grads = [torch.randn(shape, dtype=dtype) for _ in range(9)]
    ours, _ = run_rule(dict(betas=(0.9, 0.95), shampoo_beta=0.9, eps=1e-8, weight_decay=0.01,
                            precondition_frequency=3, max_precond_dim=max_dim), w, grads, lr=0.01)
    directions = reference_directions(grads, betas=(0.9, 0.95), shampoo_beta=0.9, eps=1e-8, frequency=3,
                                      max_dim=max_dim)
    assert torch.equal(ours[0], w)  # the first call only builds the bases
    tolerance = FP32_VS_FP64 if dtype == torch.float32 else 1e-10
    # Each step against the exact step from the same weights (errors do not compound).
    for start, after, direction in zip(ours[:-1], ours[1:], directions[1:]):
        start = start.double()
        exact = start * (1 - 0.01 * 0.01) - 0.01 * direction - start
        assert rel(after.double() - start, exact) < tolerance


def test_bases_stay_orthonormal_and_state_keys():
    torch.manual_seed(1)
    w = torch.randn(10, 7)
    _, state = run_rule(dict(precondition_frequency=2), w, [torch.randn(10, 7) for _ in range(6)], lr=0.01)
    for side, n in (("left", 10), ("right", 7)):
        q = state[f"{side}_basis"]
        assert torch.allclose(q.T @ q, torch.eye(n), atol=1e-5)
    assert set(state) == {"step", "exp_avg", "exp_avg_sq", "left_stat", "left_basis", "right_stat", "right_basis"}
    assert float(state["step"]) == 6.0
    unrotated = rule_for_group({"kind": "soap", "max_precond_dim": 8}).init_state(torch.zeros(10, 7))
    assert "left_basis" not in unrotated and "right_basis" in unrotated


def test_unrotated_is_adam():
    # With both sides longer than max_precond_dim, SOAP is Adam one step behind (the first call
    # only initialises) with shampoo-free bias corrections.
    torch.manual_seed(2)
    w = torch.randn(6, 5)
    grads = [torch.randn(6, 5) for _ in range(4)]
    soap, _ = run_rule(dict(max_precond_dim=4, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0), w, grads, lr=0.01)
    adam = rule_for_group({"kind": "adamw", "betas": (0.9, 0.99), "eps": 1e-8})
    x = w.clone()
    state = adam.init_state(x)
    for g, expected in zip(grads[1:], soap[1:]):
        adam.update_([x], [g.clone()], [state], lr=0.01)
        assert rel(x - w, expected - w) < 1e-6


def test_non_finite_gradient_is_skipped():
    rule = rule_for_group({"kind": "soap", "precondition_frequency": 1})
    w = torch.randn(5, 5)
    state = rule.init_state(w)
    for _ in range(2):
        rule.update_([w], [torch.randn(5, 5)], [state], lr=0.01)
    before_w, before_state = w.clone(), {k: v.clone() for k, v in state.items()}
    g = torch.randn(5, 5)
    g[1, 1] = float("-inf")
    rule.update_([w], [g], [state], lr=0.01)
    assert torch.equal(w, before_w) and all(torch.equal(state[k], before_state[k]) for k in state)


@pytest.mark.parametrize(("key", "value", "message"), [
    ("lr", -1.0, "lr=-1.0"),
    ("betas", (0.9, 1.0), "betas"),
    ("betas", (-0.1, 0.9), "betas"),
    ("shampoo_beta", 1.5, "shampoo_beta=1.5"),
    ("eps", -1e-8, "eps=-1e-08"),
    ("precondition_frequency", 0, "precondition_frequency=0"),
    ("max_precond_dim", 0, "max_precond_dim=0"),
])
def test_bad_hyper_parameters_fail_at_construction(key, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SOAP([torch.nn.Parameter(torch.randn(4, 4))], **{key: value})


# --------------------------------------------------------------------------- 3-D expert stacks

# (stack shape, max_precond_dim): experts of CASES' shapes, one with both sides rotated and two
# with the long side (20 > 10) left unrotated, so each expert's rotated sides follow its own shape.
STACK_CASES = [
    ((3, 8, 8), 10000),
    ((3, 6, 20), 10),
    ((3, 20, 6), 10),
]
STACK_GROUP = dict(betas=(0.9, 0.95), shampoo_beta=0.9, eps=1e-8, weight_decay=0.01, precondition_frequency=3)


@pytest.mark.parametrize(("shape", "max_dim"), STACK_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_each_expert_is_updated_bitwise_as_a_parameter_of_its_own(shape, max_dim, dtype):
    # Seven calls: the first builds the bases, refreshes after Adam steps 3 and 6.
    torch.manual_seed(4)
    w = torch.randn(shape, dtype=dtype)
    grads = [torch.randn(shape, dtype=dtype) for _ in range(7)]
    group = dict(STACK_GROUP, max_precond_dim=max_dim)
    stacked, stack_state = run_rule(group, w, grads, lr=0.01)
    for e in range(shape[0]):
        alone, state = run_rule(group, w[e], [g[e] for g in grads], lr=0.01)
        for stack_param, param in zip(stacked, alone):
            assert torch.equal(stack_param[e], param), e
        for key, value in state.items():
            if key == "step":
                assert torch.equal(stack_state["step"], value)
            elif key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(stack_state[key][e], value), (e, key)
            else:  # "left_basis" of the expert alone is "left_basis.e" of the stack
                assert torch.equal(stack_state[f"{key}.{e}"], value), (e, key)
        assert len(stack_state) == 3 + (len(state) - 3) * shape[0]


@pytest.mark.parametrize(("shape", "max_dim"), STACK_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_expert_stack_matches_float64_reference_per_expert(shape, max_dim, dtype):
    # The 2-D reference run on each expert's gradients, at the 2-D cases' tolerance (FP32_VS_FP64:
    # the experts are matrices of those cases' shapes, each with its own bases).
    torch.manual_seed(0)
    w = torch.randn(shape, dtype=dtype)
    grads = [torch.randn(shape, dtype=dtype) for _ in range(9)]
    ours, _ = run_rule(dict(STACK_GROUP, max_precond_dim=max_dim), w, grads, lr=0.01)
    assert torch.equal(ours[0], w)  # the first call only builds the bases
    tolerance = FP32_VS_FP64 if dtype == torch.float32 else 1e-10
    for e in range(shape[0]):
        directions = reference_directions([g[e] for g in grads], betas=(0.9, 0.95), shampoo_beta=0.9, eps=1e-8,
                                          frequency=3, max_dim=max_dim)
        for start, after, direction in zip(ours[:-1], ours[1:], directions[1:]):
            start = start[e].double()
            exact = start * (1 - 0.01 * 0.01) - 0.01 * direction - start
            assert rel(after[e].double() - start, exact) < tolerance, e


def test_expert_stack_state_keys_name_the_expert():
    state = rule_for_group({"kind": "soap", "max_precond_dim": 8}).init_state(torch.zeros(3, 10, 7))
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"} | {f"{name}.{e}" for e in range(3)
                                                             for name in ("right_stat", "right_basis")}
    assert state["exp_avg_sq"].shape == (3, 10, 7) and state["right_basis.2"].shape == (7, 7)
