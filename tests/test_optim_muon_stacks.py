"""Muon on tensors that hold several matrices: 3-D expert stacks, per-head projections, 4-D filters.

DeepSpeed 0.19.8's ``muon_update`` treats a 3-D tensor as a batch of matrices over its first dim
(each orthogonalised and scaled on its own), flattens a 4-D convolution filter to (out, rest), and
with ``per_head_muon`` orthogonalises each head of an attention projection on its own. These tests
check ds_canzona against a float64 SVD, against each matrix updated alone (bit for bit), and
against DeepSpeed's own function; and that the planner prices the matrices separately.
"""

from __future__ import annotations

import math

import pytest
import torch

from ds_canzona.optim import SOAP, Muon, Shampoo, rule_for_group
from ds_canzona.optim.newton_schulz import QUINTIC
from ds_canzona.plan import ParamSpec, PlanError, cost_model, plan_dp_partitions
from ds_canzona.plan.cost import muon_flops, shampoo_flops, soap_flops

# The classic quintic does not converge to 1: it pushes every singular value into a plateau it
# oscillates in (Keller Jordan's note: roughly Uniform(0.5, 1.5) in bf16; measured here in fp32
# on random 32 x 16 inputs: 0.68-1.13). The old flattened view gives each expert 0.05-0.38.
PLATEAU = (0.6, 1.25)
# Relative error of one fp32 update against the same iteration in float64, or against
# DeepSpeed's fp32 run (which forms (c*A)@A where we form c*(A@A)): see test_optim_muon.py.
FP32_VS_FP64 = 3e-5
FP32_VS_DEEPSPEED = 2e-5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def one_step(rule_settings: dict, param: torch.Tensor, grads: list[torch.Tensor], lr: float = 0.02):
    """Run the Muon rule on ``param`` for each gradient; the parameter and state after each step."""
    rule = rule_for_group({"kind": "muon", **rule_settings})
    param = param.clone()
    state = rule.init_state(param)
    history = []
    for g in grads:
        rule.update_([param], [g.clone()], [state], lr=lr)
        history.append((param.clone(), {k: v.clone() for k, v in state.items()}))
    return history


def float64_quintic(u: torch.Tensor) -> torch.Tensor:
    """The quintic Newton-Schulz polar factor of one matrix, in float64, written out plainly."""
    x = u.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (torch.linalg.matrix_norm(x) + 1e-7)
    for a, b, c in QUINTIC.for_steps(5):
        gram = x @ x.T
        x = a * x + b * (gram @ x) + c * (gram @ (gram @ x))
    return x.T if tall else x


# --------------------------------------------------------------------------- 3-D expert stacks


def test_expert_stack_has_unit_singular_values_per_expert():
    # The case of issue 11: a 4 x 32 x 16 stack. One step from a zero momentum buffer, where the
    # Nesterov blend U = (1 - m) G + m (1 - m) G is a multiple of G, so each expert's step is
    # -lr * sqrt(32 / 16) * polar(G_e) up to the quintic's plateau: its singular values (float64
    # SVD) must lie there, and it must point along G_e's polar factor U V^T (float64 SVD).
    torch.manual_seed(0)
    w, g = torch.randn(4, 32, 16), torch.randn(4, 32, 16)
    (after, _), = one_step({"ns_method": "standard"}, w, [g], lr=0.02)
    update = (w - after).double() / (0.02 * math.sqrt(32 / 16))
    for e in range(4):
        values = torch.linalg.svdvals(update[e])
        assert PLATEAU[0] <= float(values.min()) and float(values.max()) <= PLATEAU[1], (e, values)
        u, _, vh = torch.linalg.svd(g[e].double(), full_matrices=False)
        polar = u @ vh
        cosine = float((update[e] * polar).sum() / (update[e].norm() * polar.norm()))
        assert cosine > 0.98, (e, cosine)
    # The flattened (4, 512) view this replaced gives each expert far smaller singular values.
    flat = float64_quintic(g.reshape(4, -1)).reshape(4, 32, 16)
    assert max(float(torch.linalg.svdvals(flat[e]).max()) for e in range(4)) < 0.5


@pytest.mark.parametrize("method", ["standard", "gram"])
@pytest.mark.parametrize("shape", [(4, 32, 16), (3, 8, 40), (5, 12, 12)])
def test_each_expert_is_updated_as_if_alone(method, shape):
    # Bit for bit: a 3-D stack against its experts as separate 2-D tensors, over three steps.
    torch.manual_seed(1)
    w = torch.randn(shape)
    grads = [torch.randn(shape) for _ in range(3)]
    stacked = one_step({"ns_method": method, "weight_decay": 0.1}, w, grads)
    for e in range(shape[0]):
        alone = one_step({"ns_method": method, "weight_decay": 0.1}, w[e], [g[e] for g in grads])
        for (stack_param, stack_state), (param, state) in zip(stacked, alone):
            assert torch.equal(stack_param[e], param)
            assert torch.equal(stack_state["momentum_buffer"][e], state["momentum_buffer"])


def test_expert_stack_matches_float64_reference():
    torch.manual_seed(2)
    w, g = torch.randn(4, 32, 16), torch.randn(4, 32, 16)
    (after, _), = one_step({"ns_method": "gram"}, w, [g], lr=0.02)
    u = 0.05 * g.double() + 0.95 * (0.05 * g.double())  # Nesterov from a zero buffer
    expected = w.double() - 0.02 * math.sqrt(2.0) * torch.stack([float64_quintic(u[e]) for e in range(4)])
    assert rel(after - w, expected - w.double()) < FP32_VS_FP64


def test_batched_stack_is_opt_in_and_close():
    torch.manual_seed(3)
    w, g = torch.randn(8, 6, 40), torch.randn(8, 6, 40)
    (exact, _), = one_step({}, w, [g])
    (batched, _), = one_step({"batch_same_shape": True}, w, [g])
    assert rel(batched - w, exact - w) < 1e-5


def test_conv_filter_is_one_flattened_matrix():
    # A 4-D filter is the (out, in * kh * kw) matrix, scale included: bit for bit the 2-D update.
    torch.manual_seed(4)
    w, grads = torch.randn(6, 3, 3, 3), [torch.randn(6, 3, 3, 3) for _ in range(2)]
    conv = one_step({}, w, grads)
    flat = one_step({}, w.reshape(6, 27), [g.reshape(6, 27) for g in grads])
    for (a, _), (b, _) in zip(conv, flat):
        assert torch.equal(a.reshape(6, 27), b)


def test_shampoo_and_soap_take_expert_stacks_per_expert():
    # Their optimizers build on a stack and step it with one set of statistics per expert (the
    # per-expert math, bit for bit and against float64: tests/test_optim_shampoo.py, test_optim_soap.py).
    stack = torch.nn.Parameter(torch.randn(4, 8, 6))
    for cls, key in ((Shampoo, "left_stat.3.0.0"), (SOAP, "left_stat.3")):
        optimizer = cls([("experts", stack)])
        stack.grad = torch.randn(4, 8, 6)
        optimizer.step()
        assert key in optimizer.state[stack] and optimizer.state[stack][key].shape == (8, 8)
    Shampoo([("conv", torch.nn.Parameter(torch.randn(4, 2, 3, 3)))])  # 4-D: one matrix, accepted
    Muon([("experts", stack)])


# --------------------------------------------------------------------------- per-head Muon


def test_per_head_is_each_head_alone_and_float64():
    torch.manual_seed(5)
    heads, head_dim, cols = 4, 6, 20
    w = torch.randn(heads * head_dim, cols)
    grads = [torch.randn(heads * head_dim, cols) for _ in range(3)]
    per_head = one_step({"num_heads": heads, "ns_method": "gram"}, w, grads)
    for h in range(heads):
        rows = slice(h * head_dim, (h + 1) * head_dim)
        alone = one_step({"ns_method": "gram"}, w[rows], [g[rows] for g in grads])
        for (a, _), (b, _) in zip(per_head, alone):
            assert torch.equal(a[rows], b)
    (after, _) = per_head[0]
    u = 0.05 * grads[0].double() + 0.95 * (0.05 * grads[0].double())
    # Wide heads (6 x 20): the lr scale sqrt(max(1, 6 / 20)) is 1.
    expected = w.double() - 0.02 * torch.cat([float64_quintic(u[h * head_dim:(h + 1) * head_dim])
                                              for h in range(heads)])
    assert rel(after - w, expected - w.double()) < FP32_VS_FP64


def test_per_head_needs_divisible_2d_rows():
    with pytest.raises(ValueError, match="rows split evenly"):
        Muon([{"params": [("q", torch.nn.Parameter(torch.randn(10, 4)))], "num_heads": 4}])
    with pytest.raises(ValueError, match="rows split evenly"):
        Muon([{"params": [("e", torch.nn.Parameter(torch.randn(2, 8, 4)))], "num_heads": 2}])
    with pytest.raises(ValueError, match="num_heads"):
        rule_for_group({"kind": "muon", "num_heads": 0})


# --------------------------------------------------------------------------- DeepSpeed's muon_update


@pytest.fixture
def deepspeed_muon(monkeypatch):
    """DeepSpeed's original_muon run eagerly (its functions are torch.compile'd), NS forced to fp32."""
    original_muon = pytest.importorskip("deepspeed.runtime.zero.muon.original_muon")
    import torch._dynamo

    monkeypatch.setattr(original_muon, "ns_compute_dtype", lambda ns_method="gram": torch.float32)
    with torch._dynamo.config.patch(disable=True):
        yield original_muon


def deepspeed_update(om, w, grads, *, lr, num_heads=None, ns_method="gram"):
    buf = torch.zeros_like(w)
    w = w.clone()
    for g in grads:
        update = om.muon_update(g.clone(), buf, beta=0.95, ns_steps=5, nesterov=True, ns_method=ns_method,
                                num_heads=num_heads)
        w.add_(update.reshape(w.shape), alpha=-lr)
    return w, buf


@pytest.mark.parametrize("method", ["standard", "gram"])
def test_expert_stack_matches_deepspeed(deepspeed_muon, method):
    torch.manual_seed(6)
    w, grads = torch.randn(4, 32, 16), [torch.randn(4, 32, 16) for _ in range(3)]
    ours = one_step({"ns_method": method}, w, grads)
    theirs, their_buf = deepspeed_update(deepspeed_muon, w, grads, lr=0.02, ns_method=method)
    assert rel(ours[-1][0] - w, theirs - w) < FP32_VS_DEEPSPEED
    assert torch.equal(ours[-1][1]["momentum_buffer"], their_buf)


@pytest.mark.parametrize("method", ["standard", "gram"])
def test_per_head_matches_deepspeed(deepspeed_muon, method):
    torch.manual_seed(7)
    w, grads = torch.randn(32, 24), [torch.randn(32, 24) for _ in range(3)]
    ours = one_step({"ns_method": method, "num_heads": 4}, w, grads)
    theirs, _ = deepspeed_update(deepspeed_muon, w, grads, lr=0.02, num_heads=4, ns_method=method)
    assert rel(ours[-1][0] - w, theirs - w) < FP32_VS_DEEPSPEED
    # Per head is not the whole-matrix update: the check above can tell them apart.
    whole, _ = deepspeed_update(deepspeed_muon, w, grads, lr=0.02, ns_method=method)
    assert rel(whole - w, theirs - w) > 0.1


# --------------------------------------------------------------------------- the planner


def test_cost_model_prices_each_matrix_of_a_stack():
    assert muon_flops((4, 32, 16)) == pytest.approx(4 * muon_flops((32, 16)), rel=1e-12)
    assert shampoo_flops((3, 20, 30)) == pytest.approx(3 * shampoo_flops((20, 30)), rel=1e-12)
    assert soap_flops((3, 20, 30)) == pytest.approx(3 * soap_flops((20, 30)), rel=1e-12)
    assert muon_flops((6, 3, 3, 3)) == muon_flops((6, 27))  # a 4-D filter is one matrix
    for name in ("flops", "roofline"):
        # The work of a stack is its matrices' work; the roofline's launch floor counts a stack's
        # launches (one tensor, E matrices: tests/test_plan_cost.py), so it is off here.
        model = cost_model(name, "muon", **({"launch_bytes": 0.0} if name == "roofline" else {}))
        stack = model.cost(ParamSpec(name="experts", shape=(4, 32, 16), matrix=True))
        one = model.cost(ParamSpec(name="expert", shape=(32, 16), matrix=True))
        assert stack == pytest.approx(4 * one, rel=1e-12)
        heads = model.cost(ParamSpec(name="q", shape=(32, 24), matrix=True, heads=4))
        head = model.cost(ParamSpec(name="q0", shape=(8, 24), matrix=True))
        assert heads == pytest.approx(4 * head, rel=1e-12)
        assert heads < model.cost(ParamSpec(name="q", shape=(32, 24), matrix=True))
    with pytest.raises(PlanError, match="heads"):
        ParamSpec(name="q", shape=(10, 4), matrix=True, heads=4)


def test_planner_cuts_a_stack_only_at_expert_boundaries():
    # Up to split_numel (or without it) a stack is one tensor with one owner, even where its cost is
    # most of the model's; above it, pieces of whole experts, so no cut falls inside an expert.
    specs = [ParamSpec(name="experts", shape=(16, 64, 32), matrix=True),
             *[ParamSpec(name=f"w{i}", shape=(32, 32), matrix=True) for i in range(4)],
             ParamSpec(name="bias", shape=(32,), matrix=False)]
    whole = plan_dp_partitions(specs, world_size=4, bucket_numel=10**6)
    assert [spec.name for spec in whole.specs].count("experts") == 1
    assert all(not 0 < cut < specs[0].numel for cut in whole.buckets[0].cuts)  # the stack leads its bucket
    plan = plan_dp_partitions(specs, world_size=4, bucket_numel=10**6, split_numel=1000)
    pieces = [i for i, spec in enumerate(plan.specs) if spec.name.startswith("experts[")]
    assert len(pieces) == 16 and all(plan.specs[i].shape == (1, 64, 32) for i in pieces)
    assert len({plan.owner[i] for i in pieces}) > 1  # most of the model's cost: it spreads
    assert all(cut % (64 * 32) == 0 for cut in plan.buckets[0].cuts if cut < specs[0].numel)
