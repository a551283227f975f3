"""The step's per-item overhead: each cheaper form gives the bits of the form it replaced.

One process, small shapes. The references below are the per-tensor sequences the step ran
before it was grouped (written out here, so the check does not depend on the code it checks):

- AdamW: the per-tensor ``adam_direction_`` sequence (lerp, square, two bias corrections, sqrt,
  eps, divide, decay, add) against the rule's foreach form, over fp32/bf16/fp16/fp64 tensors of
  odd sizes, both decay modes, several steps, tensors at different step counts in one call;
- the squared norm: ``dot(g64, g64)`` of a full float64 copy against the chunked form, equal to
  the bit up to one chunk and within the stated bound above it (float64 regrouping);
- the gradient into its bucket: ``zeros + g`` against the copy of the first gradient, equal
  bit for bit except the sign of zeros (``torch.equal`` treats -0.0 and 0.0 as equal, and the
  test checks the copy keeps the sign the gradient had).

And the launch count: operations dispatched per AdamW item in one update of many small
tensors, counted with a dispatch mode, against the per-tensor sequence counted the same way.
"""

from __future__ import annotations

import pytest
import torch

from ds_canzona.bench.benchmarks.step_ops import LaunchCounter
from ds_canzona.optim.adamw import AdamWRule
from ds_canzona.optim.base import new_step
from ds_canzona.optim.clipping import NORM_CHUNK_NUMEL, tensor_sq_norm

SIZES = [(1,), (7,), (3, 5), (33, 17), (2, 3, 11), (1031,)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _reference_adamw_(param, grad, state, *, lr, betas, eps, weight_decay, adam_w_mode):
    """The per-tensor AdamW update as the rule ran it before the foreach form (master arithmetic included)."""
    dtype = torch.float64 if param.dtype == torch.float64 else torch.float32
    master = param if param.dtype == dtype else param.to(dtype)
    grad = grad.to(dtype)
    state["step"] += 1
    step = int(state["step"].item())
    if not adam_w_mode and weight_decay != 0.0:
        grad = grad.add(master, alpha=weight_decay)
    beta1, beta2 = betas
    state["exp_avg"].lerp_(grad, 1.0 - beta1)
    state["exp_avg_sq"].lerp_(grad.square(), 1.0 - beta2)
    first = state["exp_avg"] / (1.0 - beta1**step)
    second = state["exp_avg_sq"] / (1.0 - beta2**step)
    direction = first / (second.sqrt() + eps)
    if adam_w_mode and weight_decay != 0.0:
        master.mul_(1.0 - lr * weight_decay)
    master.add_(direction, alpha=-lr)
    if master is not param:
        param.copy_(master)


def _tensors(seed: int, dtype: torch.dtype):
    generator = torch.Generator().manual_seed(seed)
    params = [torch.randn(shape, generator=generator).to(dtype) for shape in SIZES]
    return params, generator


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("adam_w_mode,weight_decay", [(True, 0.0), (True, 0.1), (False, 0.1)])
def test_foreach_adamw_equals_the_per_tensor_sequence(dtype, adam_w_mode, weight_decay):
    rule = AdamWRule(betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay, adam_w_mode=adam_w_mode)
    ours, generator = _tensors(0, dtype)
    theirs = [p.clone() for p in ours]
    our_states = [rule.init_state(p) for p in ours]
    their_states = [rule.init_state(p) for p in theirs]
    for step in range(4):
        grads = [torch.randn(p.shape, generator=generator).to(dtype) * (10.0 ** (step - 2)) for p in ours]
        # From the third step on, the first tensor sits out a step: counts differ inside one call.
        members = range(len(ours)) if step != 2 else range(1, len(ours))
        rule.update_([ours[i] for i in members], [grads[i] for i in members], [our_states[i] for i in members],
                     lr=1e-2, known_finite=True)
        for i in members:
            _reference_adamw_(theirs[i], grads[i], their_states[i], lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                              weight_decay=weight_decay, adam_w_mode=adam_w_mode)
        for mine, reference, state, expected in zip(ours, theirs, our_states, their_states):
            assert torch.equal(mine, reference)
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(state[key], expected[key]), key


def test_foreach_groups_cut_by_size_give_the_same_bits(monkeypatch):
    import ds_canzona.optim.adamw as adamw

    monkeypatch.setattr(adamw, "FOREACH_GROUP_NUMEL", 40)  # SIZES: runs of 1+7+15, 561 alone, 66 alone, ...
    test_foreach_adamw_equals_the_per_tensor_sequence(torch.float32, True, 0.1)
    test_foreach_adamw_equals_the_per_tensor_sequence(torch.bfloat16, False, 0.1)
    runs = list(adamw._bounded_groups([(torch.empty(n),) for n in (1, 7, 15, 561, 66, 30, 10)], 40))
    assert [[item[0].numel() for item in run] for run in runs] == [[1, 7, 15], [561], [66], [30, 10]]


def test_foreach_adamw_leaves_the_gradients_alone_in_l2_mode():
    rule = AdamWRule(weight_decay=0.5, adam_w_mode=False)
    params = [torch.randn(5), torch.randn(3, 2)]
    grads = [torch.randn(5), torch.randn(3, 2)]
    kept = [g.clone() for g in grads]
    rule.update_(params, grads, [rule.init_state(p) for p in params], lr=0.1)
    assert all(torch.equal(g, k) for g, k in zip(grads, kept))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel", [1, 1001, NORM_CHUNK_NUMEL])
def test_norm_up_to_one_chunk_is_the_full_copy_dot(dtype, numel):
    grad = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).to(dtype)
    wide = grad.to(torch.float64)
    assert torch.equal(tensor_sq_norm(grad), torch.dot(wide, wide))
    assert torch.equal(tensor_sq_norm(grad.view(-1, 1)), torch.dot(wide, wide))  # any shape, same bits


def test_norm_above_one_chunk_is_the_float64_sum_regrouped():
    numel = 3 * NORM_CHUNK_NUMEL + 12345
    grad = torch.randn(numel, generator=torch.Generator().manual_seed(1)) * 1e3
    wide = grad.to(torch.float64)
    full = torch.dot(wide, wide)
    chunked = tensor_sq_norm(grad)
    assert chunked.dtype == torch.float64 and chunked.shape == ()
    # The bound of clipping.tensor_sq_norm: the float64 products of fp32 values are exact, and a
    # sum of n non-negative terms in any order lies within n x 2**-53 of the exact sum (relative),
    # so the old and new groupings differ by at most twice that; math.fsum gives the exact sum.
    import math
    bound = numel * 2.0**-53
    exact = math.fsum(v * v for v in wide.tolist())
    assert abs(float(chunked) - exact) <= bound * exact
    assert abs(float(full) - exact) <= bound * exact
    assert abs(float(chunked - full)) <= 2 * bound * exact


@pytest.mark.parametrize("grad_dtype,accumulate_dtype", [(torch.float32, torch.float32),
                                                         (torch.bfloat16, torch.float32),
                                                         (torch.float16, torch.float32),
                                                         (torch.bfloat16, torch.bfloat16)])
def test_first_gradient_copied_is_zeros_plus_gradient(grad_dtype, accumulate_dtype):
    generator = torch.Generator().manual_seed(3)
    grad = torch.randn(257, generator=generator).to(grad_dtype)
    grad[::7] = 0.0
    grad[3::7] = -0.0
    second = torch.randn(257, generator=generator).to(grad_dtype)
    added = torch.zeros(257, dtype=accumulate_dtype).add_(grad)
    copied = torch.empty(257, dtype=accumulate_dtype).copy_(grad)
    assert torch.equal(copied, added)
    # The one difference: a negative zero stays negative in the copy, as it is in the gradient.
    assert torch.equal(torch.signbit(copied), torch.signbit(grad.to(accumulate_dtype)))
    # Later micro-batches are added to either alike.
    assert torch.equal(copied.add_(second), added.add_(second))


def _copy_state(state):
    """A copy of an AdamW state whose step is a registered step counter again (host work, not counted)."""
    copy = {k: v.clone() for k, v in state.items() if k != "step"}
    copy["step"] = new_step()
    copy["step"].copy_(state["step"])
    return copy


def _per_tensor_launches(params, grads, states) -> int:
    with LaunchCounter() as counter:
        for param, grad, state in zip(params, grads, states):
            _reference_adamw_(param, grad, state, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1,
                              adam_w_mode=True)
    return counter.count


def test_adamw_launches_per_item_are_a_quarter_of_the_per_tensor_sequence():
    items = 64
    params = [torch.randn(17) for _ in range(items)]
    rule = AdamWRule(weight_decay=0.1)
    states = [rule.init_state(p) for p in params]
    grads = [torch.randn(17) for _ in range(items)]
    rule.update_(params, grads, states, lr=1e-3, known_finite=True)  # past the first step, as in training
    reference = _per_tensor_launches([p.clone() for p in params], grads, [_copy_state(s) for s in states])
    with LaunchCounter() as counter:
        rule.update_(params, grads, states, lr=1e-3, known_finite=True)
    # The per-tensor sequence launches a fixed number per tensor (measured here, not assumed);
    # the foreach form a fixed number per group, whatever the number of tensors in it.
    assert reference % items == 0 and reference // items >= 8
    assert counter.count <= reference / 4, (counter.count, reference)
    assert counter.count <= reference // items  # one group: no more than one tensor's sequence


def test_launch_counter_leaves_out_step_counters_and_counts_each_operation():
    step = new_step()
    x = torch.ones(4)
    with LaunchCounter() as counter:
        step += 1
        int(step.item())
        y = x * 2 + 1
        torch._foreach_add_([x, y], 1.0)
    assert counter.count == 3  # mul, add, one foreach add; the counter's work is host work
    assert counter.allocated_bytes == 2 * 4 * 4  # x * 2 and (x * 2) + 1


def test_host_reciprocal_is_the_float32_division():
    # What the CUDA branch of adamw._divided multiplies by: 1/b as float32 divides it.
    from ds_canzona.optim.adamw import _to_float32

    divisors = torch.rand(2000, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 0.999 + 1e-6
    divisors = torch.cat([divisors, 1.0 - 0.9 ** torch.arange(1, 200, dtype=torch.float64)])  # bias corrections
    expected = torch.ones(len(divisors)) / divisors.float()
    ours = torch.tensor([_to_float32(1.0 / _to_float32(b)) for b in divisors.tolist()])
    assert torch.equal(ours, expected)
