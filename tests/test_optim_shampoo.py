"""Shampoo against a float64 reference written out plainly."""

from __future__ import annotations

import pytest
import torch

from ds_canzona.optim import Shampoo, rule_for_group
from ds_canzona import kernels
from ds_canzona.optim.shampoo import inverse_root_eigh

# fp32 against float64: relative Frobenius error of one step taken from the same weights. An fp32
# statistic (and its fp32 eigendecomposition) holds its small eigenvalues only to ~1e-7 * lambda_max,
# i.e. ~1e-7 * cond relative; statistics summed from a few gradients have cond up to ~1e3, and the
# inverse 4th root quarters the relative error: ~3e-5. Measured <= 1.3e-5 over five seeds, with the
# roots in float32 or float64 alike (the statistics' own fp32 rounding dominates).
FP32_VS_FP64 = 1e-4


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def plain_inverse_fourth_root(stat: torch.Tensor, epsilon: float) -> torch.Tensor:
    values, vectors = torch.linalg.eigh(stat)
    return vectors @ torch.diag((values.clamp(min=0) + epsilon) ** -0.25) @ vectors.T


def reference_directions(grads, *, betas, epsilon, frequency, start, block, graft_beta2, graft_eps):
    """Blocked Shampoo grafted onto AdamW, in float64: the step direction D of each step in turn.

    The weights do not enter D; a step from W is W * (1 - lr * weight_decay) - lr * D.
    """
    beta1, beta2 = betas
    shape = grads[0].shape
    rows = shape[0]
    cols = grads[0][0].numel()
    blocks = [(r, min(r + block, rows), c, min(c + block, cols))
              for r in range(0, rows, block) for c in range(0, cols, block)]
    left = {b: torch.zeros(b[1] - b[0], b[1] - b[0], dtype=torch.float64) for b in blocks}
    right = {b: torch.zeros(b[3] - b[2], b[3] - b[2], dtype=torch.float64) for b in blocks}
    left_root, right_root = {}, {}
    m = torch.zeros(shape, dtype=torch.float64)
    v = torch.zeros(shape, dtype=torch.float64)
    out = []
    for t, g in enumerate(grads, start=1):
        g = g.double()
        m = beta1 * m + (1 - beta1) * g
        v = graft_beta2 * v + (1 - graft_beta2) * g * g
        m_hat = m / (1 - beta1**t)
        adam = m_hat / ((v / (1 - graft_beta2**t)).sqrt() + graft_eps)
        g2, m2, a2 = g.reshape(rows, cols), m_hat.reshape(rows, cols), adam.reshape(rows, cols)
        direction = a2.clone()
        for b in blocks:
            r0, r1, c0, c1 = b
            gb = g2[r0:r1, c0:c1]
            if beta2 == 1.0:
                left[b] = left[b] + gb @ gb.T
                right[b] = right[b] + gb.T @ gb
            else:
                left[b] = beta2 * left[b] + (1 - beta2) * gb @ gb.T
                right[b] = beta2 * right[b] + (1 - beta2) * gb.T @ gb
            if t >= start and (t - start) % frequency == 0:
                left_root[b] = plain_inverse_fourth_root(left[b], epsilon)
                right_root[b] = plain_inverse_fourth_root(right[b], epsilon)
            if t >= start:
                s = left_root[b] @ m2[r0:r1, c0:c1] @ right_root[b]
                direction[r0:r1, c0:c1] = s * a2[r0:r1, c0:c1].norm() / s.norm()
        out.append(direction.reshape(shape))
    return out


def assert_steps_match(w, ours, directions, *, lr, weight_decay, tolerance):
    """Each of our steps against the exact step from the same weights (errors do not compound)."""
    starts = [w, *ours[:-1]]
    for start, after, direction in zip(starts, ours, directions):
        start = start.double()
        exact = start * (1 - lr * weight_decay) - lr * direction - start
        assert rel(after.double() - start, exact) < tolerance


def run_rule(group, w, grads, lr):
    rule = rule_for_group({"kind": "shampoo", **group})
    w = w.clone()
    state = rule.init_state(w)
    out = []
    for g in grads:
        rule.update_([w], [g.clone()], [state], lr=lr)
        out.append(w.clone())
    return out, state


CASES = [
    # shape, block, betas, epsilon. With epsilon 1e-12 the statistics must be full rank by the start
    # step (3): a singular one leaves null directions whose fp32 eigenvalues are rounding noise,
    # which the inverse root turns into O(1) differences, so fp32 vs fp64 would be ill posed.
    ((6, 10), 1024, (0.9, 1.0), 1e-12),
    ((12, 20), 8, (0.9, 0.95), 1e-12),
    ((10, 3, 1, 2), 1024, (0.0, 1.0), 1e-12),
    ((10, 9), 5, (0.5, 0.99), 1e-12),
    # 1-wide edge blocks: their 4x4 statistics have rank <= 3 at the start step; regularised.
    ((9, 9), 4, (0.9, 1.0), 1e-2),
]


@pytest.mark.parametrize(("shape", "block", "betas", "epsilon"), CASES)
@pytest.mark.parametrize(("dtype", "root_dtype", "tolerance"), [
    (torch.float32, "float32", FP32_VS_FP64),
    (torch.float32, "float64", FP32_VS_FP64),
    (torch.float64, "float64", 1e-10),
])
def test_matches_float64_reference(shape, block, betas, epsilon, dtype, root_dtype, tolerance):
    torch.manual_seed(0)
    w = torch.randn(shape, dtype=dtype)
    grads = [torch.randn(shape, dtype=dtype) for _ in range(8)]
    group = dict(betas=betas, epsilon=epsilon, weight_decay=0.1, precondition_frequency=2,
                 start_preconditioning_step=3, max_preconditioner_dim=block, root_dtype=root_dtype)
    ours, _ = run_rule(group, w, grads, lr=0.01)
    directions = reference_directions(grads, betas=betas, epsilon=epsilon, frequency=2, start=3, block=block,
                                      graft_beta2=0.999, graft_eps=1e-8)
    assert_steps_match(w, ours, directions, lr=0.01, weight_decay=0.1, tolerance=tolerance)


def test_blocks_and_state_keys():
    rule = rule_for_group({"kind": "shampoo", "max_preconditioner_dim": 8})
    state = rule.init_state(torch.zeros(12, 20))
    assert state["left_stat.1.2"].shape == (4, 4) and state["right_stat.1.2"].shape == (4, 4)
    assert state["left_stat.0.1"].shape == (8, 8) and state["right_root.0.0"].shape == (8, 8)
    assert len([k for k in state if k.startswith("left_stat.")]) == 6
    assert state["step"].dtype == torch.float32 and state["step"].device.type == "cpu"


def test_before_start_it_is_adamw_exactly():
    torch.manual_seed(1)
    w = torch.randn(8, 6)
    grads = [torch.randn(8, 6) for _ in range(4)]
    shampoo, _ = run_rule(dict(start_preconditioning_step=5, betas=(0.9, 1.0), graft_beta2=0.99,
                               graft_eps=1e-7, weight_decay=0.1), w, grads, lr=0.01)
    adam = rule_for_group({"kind": "adamw", "betas": (0.9, 0.99), "eps": 1e-7, "weight_decay": 0.1})
    x = w.clone()
    state = adam.init_state(x)
    for g, expected in zip(grads, shampoo):
        adam.update_([x], [g.clone()], [state], lr=0.01)
        assert torch.equal(x, expected)


def test_newton_inverse_root_matches_eigh():
    torch.manual_seed(2)
    q, _ = torch.linalg.qr(torch.randn(16, 16, dtype=torch.float64))
    stat = (q @ torch.diag(torch.logspace(-2, 1, 16, dtype=torch.float64)) @ q.T).float()
    exact = inverse_root_eigh(stat.double(), 4, 1e-6, torch.float64)
    assert rel(inverse_root_eigh(stat, 4, 1e-6, torch.float32), exact) < 1e-5
    # The coupled iteration (Shampoo's 'newton' path) stops at its tolerance (1e-6 on M - I) or
    # its fp32 rounding floor.
    assert rel(kernels.inverse_root_newton(stat, 4, epsilon=1e-6), exact) < 1e-4


def test_newton_path_trains_like_eigh():
    torch.manual_seed(3)
    w = torch.randn(10, 14)
    grads = [torch.randn(10, 14) for _ in range(6)]
    group = dict(precondition_frequency=2, start_preconditioning_step=2, epsilon=1e-6)
    eigh, _ = run_rule(group, w, grads, lr=0.01)
    newton, _ = run_rule({**group, "inverse_root": "newton"}, w, grads, lr=0.01)
    assert rel(newton[-1] - w, eigh[-1] - w) < 1e-3


def test_non_finite_gradient_is_skipped():
    rule = rule_for_group({"kind": "shampoo", "start_preconditioning_step": 1, "precondition_frequency": 1})
    w = torch.randn(6, 5)
    state = rule.init_state(w)
    rule.update_([w], [torch.randn(6, 5)], [state], lr=0.01)
    before_w, before_state = w.clone(), {k: v.clone() for k, v in state.items()}
    g = torch.randn(6, 5)
    g[0, 0] = float("nan")
    rule.update_([w], [g], [state], lr=0.01)
    assert torch.equal(w, before_w) and all(torch.equal(state[k], before_state[k]) for k in state)


@pytest.mark.parametrize(("key", "value", "message"), [
    ("lr", -1e-3, "lr=-0.001"),
    ("betas", (1.0, 1.0), "betas"),
    ("betas", (0.9, 0.0), "betas"),
    ("epsilon", 0.0, "epsilon=0.0"),
    ("precondition_frequency", 0, "precondition_frequency=0"),
    ("start_preconditioning_step", 0, "start_preconditioning_step=0"),
    ("max_preconditioner_dim", 0, "max_preconditioner_dim=0"),
    ("inverse_root", "cholesky", "inverse_root='cholesky'"),
    ("root_dtype", "bfloat16", "root_dtype='bfloat16'"),
    ("graft_beta2", 1.0, "graft_beta2=1.0"),
])
def test_bad_hyper_parameters_fail_at_construction(key, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Shampoo([torch.nn.Parameter(torch.randn(4, 4))], **{key: value})


# --------------------------------------------------------------------------- 3-D expert stacks

# (stack shape, block, betas, epsilon): experts of CASES' blocked shapes, so each expert is cut into
# blocks (12 x 20 in blocks of 8: 2 x 3 of them, the edge ones 4 wide) and conditioned like its 2-D case.
STACK_CASES = [
    ((3, 12, 20), 8, (0.9, 0.95), 1e-12),
    ((3, 9, 9), 4, (0.9, 1.0), 1e-2),
]
STACK_GROUP = dict(weight_decay=0.1, precondition_frequency=2, start_preconditioning_step=3)


def stack_grads(shape, dtype, steps):
    return [torch.randn(shape, dtype=dtype) for _ in range(steps)]


@pytest.mark.parametrize(("shape", "block", "betas", "epsilon"), STACK_CASES)
@pytest.mark.parametrize(("dtype", "inverse_root"), [(torch.float32, "eigh"), (torch.float64, "eigh"),
                                                     (torch.float32, "newton"), (torch.bfloat16, "eigh")])
def test_each_expert_is_updated_bitwise_as_a_parameter_of_its_own(shape, block, betas, epsilon, dtype, inverse_root):
    # Seven steps: AdamW alone, then the start step's roots, refreshes at steps 5 and 7.
    torch.manual_seed(4)
    w = torch.randn(shape, dtype=dtype)
    grads = stack_grads(shape, dtype, 7)
    group = dict(STACK_GROUP, betas=betas, epsilon=epsilon, max_preconditioner_dim=block, inverse_root=inverse_root)
    stacked, stack_state = run_rule(group, w, grads, lr=0.01)
    blocks_per_expert = len(rule_for_group({"kind": "shampoo", **group}).blocks(shape[1:]))
    for e in range(shape[0]):
        alone, state = run_rule(group, w[e], [g[e] for g in grads], lr=0.01)
        for stack_param, param in zip(stacked, alone):
            assert torch.equal(stack_param[e], param), e
        for key, value in state.items():
            if key == "step":
                assert torch.equal(stack_state["step"], value)
            elif key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(stack_state[key][e], value), (e, key)
            else:  # "left_stat.i.j" of the expert alone is "left_stat.e.i.j" of the stack
                name, suffix = key.split(".", 1)
                assert torch.equal(stack_state[f"{name}.{e}.{suffix}"], value), (e, key)
        assert len(state) == 3 + 4 * blocks_per_expert
    assert len(stack_state) == 3 + 4 * blocks_per_expert * shape[0]


@pytest.mark.parametrize(("shape", "block", "betas", "epsilon"), STACK_CASES)
@pytest.mark.parametrize(("dtype", "root_dtype", "tolerance"), [
    (torch.float32, "float32", FP32_VS_FP64),
    (torch.float32, "float64", FP32_VS_FP64),
    (torch.float64, "float64", 1e-10),
])
def test_expert_stack_matches_float64_reference_per_expert(shape, block, betas, epsilon, dtype, root_dtype, tolerance):
    # The 2-D reference run on each expert's gradients, at the 2-D cases' tolerances (FP32_VS_FP64:
    # the experts are matrices of those cases' shapes and conditioning, each preconditioned alone).
    torch.manual_seed(0)
    w = torch.randn(shape, dtype=dtype)
    grads = stack_grads(shape, dtype, 8)
    group = dict(STACK_GROUP, betas=betas, epsilon=epsilon, max_preconditioner_dim=block, root_dtype=root_dtype)
    ours, _ = run_rule(group, w, grads, lr=0.01)
    for e in range(shape[0]):
        directions = reference_directions([g[e] for g in grads], betas=betas, epsilon=epsilon, frequency=2, start=3,
                                          block=block, graft_beta2=0.999, graft_eps=1e-8)
        assert_steps_match(w[e], [o[e] for o in ours], directions, lr=0.01, weight_decay=0.1, tolerance=tolerance)


def test_expert_stack_state_keys_name_the_expert():
    rule = rule_for_group({"kind": "shampoo", "max_preconditioner_dim": 8})
    state = rule.init_state(torch.zeros(3, 12, 20))
    assert state["left_stat.2.1.2"].shape == (4, 4) and state["right_root.0.0.1"].shape == (8, 8)
    assert len([k for k in state if k.startswith("left_stat.")]) == 3 * 6
    # No key of a 2-D tensor's form ("left_stat.i.j"): a stack's keys never collide with them.
    assert all(k.count(".") == 3 for k in state if "_" in k and k not in ("exp_avg", "exp_avg_sq"))
    assert state["exp_avg"].shape == state["exp_avg_sq"].shape == (3, 12, 20)
