"""Muon against torch.optim.Muon, DeepSpeed's muon_update and a float64 reference."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from ds_canzona.optim import Muon, rule_for_group
from ds_canzona.optim.newton_schulz import COEFFICIENT_SETS

SHAPES = [(16, 48), (48, 16), (32, 32), (20, 70), (64, 24)]

# Tolerances: relative Frobenius error of one step taken from the same weights; "measured" is the
# worst over 4 seeds x the shapes below (see docs/OPTIMIZERS.md).
# fp32 roundoff (6e-8) amplified by five NS steps, most by Polar Express's first (slope 8 at zero):
FP32_VS_FP64 = 3e-5  # measured <= 5.5e-6
# Both fp32 runs sit ~3e-6 from exact and round differently ((c*A)@A vs c*(A@A)):
FP32_VS_DEEPSPEED = 2e-5  # measured <= 5.2e-6
# bf16 has 8 mantissa bits (roundoff 3.9e-3) and the iteration amplifies rounding ~10x. torch's fused
# addmm rounds twice per step (measured <= 1.9e-2 from the exact step); the plain-torch
# kernels.ns_step, like DeepSpeed's own sequence, rounds seven times (measured <= 3.5e-2). Two runs
# that round differently differ by up to the sum of their distances to the exact result.
BF16_VS_EXACT = 8e-2
BF16_VS_BF16 = 1.2e-1  # measured <= 4.3e-2 against torch, <= 5.3e-2 against DeepSpeed's bf16
FP16_VS_FP16 = 2e-2  # fp16 roundoff 4.9e-4, ~10x amplification; measured <= 5.5e-3 (DeepSpeed's Gram)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def reference_directions(grads, *, momentum, nesterov=True, steps=5, coefficients="quintic", scaling="original"):
    """Muon's scaled step direction (scale * NS(U)) for each gradient in turn, in float64, plainly."""
    coefficient_set = COEFFICIENT_SETS[coefficients]
    buf = torch.zeros_like(grads[0], dtype=torch.float64)
    out = []
    for g in grads:
        g = g.double()
        buf = momentum * buf + (1 - momentum) * g
        u = (1 - momentum) * g + momentum * buf if nesterov else buf
        rows, cols = u.shape[0], u[0].numel()
        x = u.reshape(rows, cols)
        if rows > cols:
            x = x.T
        x = x / (torch.linalg.matrix_norm(x) * coefficient_set.norm_scale + 1e-7)
        for a, b, c in coefficient_set.for_steps(steps):
            gram = x @ x.T
            x = a * x + b * (gram @ x) + c * (gram @ (gram @ x))
        if rows > cols:
            x = x.T
        scale = math.sqrt(max(1.0, rows / cols)) if scaling == "original" else 0.2 * math.sqrt(max(rows, cols))
        out.append(scale * x.reshape(g.shape))
    return out


def exact_step(previous, direction, *, lr, weight_decay):
    """The float64 step from ``previous``: decoupled decay, then the scaled direction."""
    previous = previous.double()
    return previous * (1 - lr * weight_decay) - lr * direction - previous


def run_rule(group, w, grads, lr):
    """Our weights after each step, and the final state."""
    rule = rule_for_group({"kind": "muon", **group})
    w = w.clone()
    state = rule.init_state(w)
    out = []
    for g in grads:
        rule.update_([w], [g.clone()], [state], lr=lr)
        out.append(w.clone())
    return out, state


def our_steps(w, trajectory):
    """(start, step) of each step along our own trajectory: other runs are compared from the same start."""
    starts = [w, *trajectory[:-1]]
    return [(start, after - start) for start, after in zip(starts, trajectory)]


@pytest.mark.parametrize("shape", SHAPES + [(6, 3, 4, 2)])
@pytest.mark.parametrize("method", ["standard", "gram"])
@pytest.mark.parametrize("coefficients", ["quintic", "polar_express"])
def test_fp32_matches_float64_reference(shape, method, coefficients):
    torch.manual_seed(0)
    w = torch.randn(shape)
    grads = [torch.randn(shape) for _ in range(3)]
    group = dict(ns_method=method, ns_coefficients=coefficients, weight_decay=0.1, momentum=0.9)
    ours, _ = run_rule(group, w, grads, lr=0.05)
    directions = reference_directions(grads, momentum=0.9, coefficients=coefficients)
    for (start, step), direction in zip(our_steps(w, ours), directions):
        assert rel(step, exact_step(start, direction, lr=0.05, weight_decay=0.1)) < FP32_VS_FP64


@pytest.mark.parametrize("scaling", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_options_match_reference_in_float64(scaling, nesterov):
    torch.manual_seed(1)
    w = torch.randn(24, 10, dtype=torch.float64)
    grads = [torch.randn(24, 10, dtype=torch.float64) for _ in range(3)]
    group = dict(ns_method="gram", lr_scaling=scaling, nesterov=nesterov, weight_decay=0.01)
    ours, _ = run_rule(group, w, grads, lr=0.02)
    directions = reference_directions(grads, momentum=0.95, nesterov=nesterov, scaling=scaling)
    for (start, step), direction in zip(our_steps(w, ours), directions):
        assert rel(step, exact_step(start, direction, lr=0.02, weight_decay=0.01)) < 1e-12


@pytest.mark.parametrize("shape", SHAPES)
def test_matches_torch_muon_in_bf16(shape):
    # torch.optim.Muon runs Newton-Schulz in bf16 with fused addmm; ours with ns_dtype="bfloat16".
    torch.manual_seed(2)
    w = torch.randn(shape)
    grads = [torch.randn(shape) for _ in range(4)]
    torch_param = w.clone().requires_grad_()
    torch_opt = torch.optim.Muon([torch_param], lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True,
                                 ns_steps=5, adjust_lr_fn="original")
    ours, state = run_rule(dict(ns_method="standard", ns_dtype="bfloat16", weight_decay=0.1), w, grads, lr=0.02)
    directions = reference_directions(grads, momentum=0.95)
    # Steps are compared from one starting point (the weights themselves agree trivially), ours.
    for g, (start, step), direction in zip(grads, our_steps(w, ours), directions):
        torch_param.data.copy_(start)
        torch_param.grad = g.clone()
        torch_opt.step()
        torch_step = torch_param.detach() - start
        exact = exact_step(start, direction, lr=0.02, weight_decay=0.1)
        assert rel(torch_step, exact) < BF16_VS_EXACT
        assert rel(step, exact) < BF16_VS_EXACT
        assert rel(step, torch_step) < BF16_VS_BF16
    # The momentum is plain fp32 arithmetic in both: identical.
    assert torch.equal(state["momentum_buffer"], torch_opt.state[torch_param]["momentum_buffer"])


# --------------------------------------------------------------------------- DeepSpeed


@pytest.fixture
def deepspeed_muon(monkeypatch):
    """DeepSpeed's original_muon, run eagerly (its functions are torch.compile'd)."""
    original_muon = pytest.importorskip("deepspeed.runtime.zero.muon.original_muon")
    import torch._dynamo

    with torch._dynamo.config.patch(disable=True):
        yield original_muon


def deepspeed_steps(om, starts, grads, *, lr, momentum, weight_decay, ns_method):
    """DeepSpeed's step (SingleDeviceMuon's arithmetic) from each given start; and its momentum."""
    buf = torch.zeros_like(starts[0])
    out = []
    for start, g in zip(starts, grads):
        update = om.muon_update(g.clone(), buf, beta=momentum, ns_steps=5, nesterov=True, ns_method=ns_method)
        w = start.clone()
        w.mul_(1 - lr * weight_decay)
        w.add_(update.reshape(w.shape), alpha=-lr)
        out.append(w - start)
    return out, buf


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("method", ["standard", "gram"])
def test_matches_deepspeed_muon_update_in_fp32(deepspeed_muon, monkeypatch, shape, method):
    monkeypatch.setattr(deepspeed_muon, "ns_compute_dtype", lambda ns_method="gram": torch.float32)
    torch.manual_seed(3)
    w = torch.randn(shape)
    grads = [torch.randn(shape) for _ in range(4)]
    ours, state = run_rule(dict(ns_method=method, weight_decay=0.1), w, grads, lr=0.02)
    steps = our_steps(w, ours)
    theirs, their_buf = deepspeed_steps(deepspeed_muon, [start for start, _ in steps], grads, lr=0.02,
                                        momentum=0.95, weight_decay=0.1, ns_method=method)
    for (_, step), their_step in zip(steps, theirs):
        assert rel(step, their_step) < FP32_VS_DEEPSPEED
    assert torch.equal(state["momentum_buffer"], their_buf)


@pytest.mark.parametrize("method", ["standard", "gram"])
def test_matches_deepspeed_in_its_own_precision(deepspeed_muon, method):
    # DeepSpeed's choice where the accelerator has it: bf16 for standard, fp16 for Gram.
    dtype = deepspeed_muon.ns_compute_dtype(method)
    if dtype == torch.float32:
        pytest.skip("this accelerator runs DeepSpeed's iteration in fp32 (covered above)")
    torch.manual_seed(4)
    shape = (32, 96)
    w = torch.randn(shape)
    grads = [torch.randn(shape)]
    theirs, _ = deepspeed_steps(deepspeed_muon, [w], grads, lr=0.02, momentum=0.95, weight_decay=0.0,
                                ns_method=method)
    ns_dtype = str(dtype).removeprefix("torch.")
    ours, _ = run_rule(dict(ns_method=method, ns_dtype=ns_dtype), w, grads, lr=0.02)
    tolerance = FP16_VS_FP16 if dtype == torch.float16 else BF16_VS_BF16
    assert rel(ours[0] - w, theirs[0]) < tolerance


def test_defaults_are_deepspeeds(deepspeed_muon):
    signature = inspect.signature(getattr(deepspeed_muon.muon_update, "_torchdynamo_orig_callable",
                                          deepspeed_muon.muon_update))
    rule = rule_for_group({"kind": "muon"})
    assert rule.momentum == signature.parameters["beta"].default
    assert rule.ns_steps == signature.parameters["ns_steps"].default
    assert rule.nesterov == signature.parameters["nesterov"].default
    assert rule.ns_method == signature.parameters["ns_method"].default
    assert rule.ns_coefficients == "quintic" and rule.lr_scaling == "original" and rule.weight_decay == 0.0

    matrix, vector = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))
    theirs = deepspeed_muon.SingleDeviceMuonWithAuxAdam([dict(params=[matrix], use_muon=True),
                                                         dict(params=[vector], use_muon=False)])
    ours = Muon([("w", matrix), ("b", vector)])
    their_muon, their_adam = theirs.param_groups
    our_muon, our_adam = ours.param_groups
    for key in ("lr", "momentum", "weight_decay", "ns_method"):
        assert our_muon[key] == their_muon[key], key
    for key in ("lr", "eps", "weight_decay"):
        assert our_adam[key] == their_adam[key], key
    assert tuple(our_adam["betas"]) == tuple(their_adam["betas"])


def test_whole_optimizer_matches_deepspeed_single_device(deepspeed_muon, monkeypatch):
    # Within fp32 rounding everywhere: the Adam half's arithmetic is DeepSpeed's to the bit (see
    # test_optim_rules.py), but its gradients come through Muon-updated weights after step one.
    monkeypatch.setattr(deepspeed_muon, "ns_compute_dtype", lambda ns_method="gram": torch.float32)
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 6))
    twin = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 6))
    twin.load_state_dict(model.state_dict())
    muon_params = [p for p in twin.parameters() if p.ndim >= 2]
    adam_params = [p for p in twin.parameters() if p.ndim < 2]
    theirs = deepspeed_muon.SingleDeviceMuonWithAuxAdam([
        dict(params=muon_params, use_muon=True, lr=0.02, weight_decay=0.01),
        dict(params=adam_params, use_muon=False, lr=1e-3, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.01),
    ])
    ours = Muon(model.named_parameters(), lr=0.02, weight_decay=0.01, adam_lr=1e-3)
    x, y = torch.randn(16, 12), torch.randn(16, 6)
    for _ in range(3):
        for net, opt in ((model, ours), (twin, theirs)):
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
    for (name, mine), other in zip(model.named_parameters(), twin.parameters()):
        assert rel(mine.detach(), other.detach()) < 1e-5, name


# --------------------------------------------------------------------------- behaviour


def test_non_finite_gradient_leaves_tensor_and_state_untouched():
    rule = rule_for_group({"kind": "muon"})
    w = torch.randn(8, 12)
    state = rule.init_state(w)
    rule.update_([w], [torch.randn(8, 12)], [state], lr=0.02)
    before_w, before_state = w.clone(), {k: v.clone() for k, v in state.items()}
    for bad in (float("nan"), float("inf")):
        g = torch.randn(8, 12)
        g[3, 4] = bad
        rule.update_([w], [g], [state], lr=0.02)
        assert torch.equal(w, before_w)
        assert all(torch.equal(state[k], before_state[k]) for k in state)


def test_gradient_is_not_modified():
    rule = rule_for_group({"kind": "muon", "nesterov": True})
    w, g = torch.randn(8, 12), torch.randn(8, 12)
    copy = g.clone()
    rule.update_([w], [g], [rule.init_state(w)], lr=0.02)
    assert torch.equal(g, copy)


def test_batched_option_is_close_to_per_matrix():
    torch.manual_seed(6)
    params = [torch.randn(16, 40) for _ in range(3)] + [torch.randn(8, 8)]
    grads = [torch.randn_like(p) for p in params]
    results = []
    for batch in (False, True):
        rule = rule_for_group({"kind": "muon", "batch_same_shape": batch})
        ps = [p.clone() for p in params]
        rule.update_(ps, grads, [rule.init_state(p) for p in ps], lr=0.1)
        results.append(ps)
    for single, batched, start in zip(*results, params):
        assert rel(batched - start, single - start) < 1e-6


def test_bf16_parameters_keep_fp32_state():
    rule = rule_for_group({"kind": "muon"})
    w = torch.randn(8, 12, dtype=torch.bfloat16)
    state = rule.init_state(w)
    assert state["momentum_buffer"].dtype == torch.float32
    before = w.clone()
    rule.update_([w], [torch.randn(8, 12, dtype=torch.bfloat16)], [state], lr=0.02)
    assert w.dtype == torch.bfloat16 and not torch.equal(w, before)


def test_refuses_vectors():
    with pytest.raises(ValueError, match=">= 2 dims"):
        rule_for_group({"kind": "muon"}).init_state(torch.zeros(5))


@pytest.mark.parametrize(("key", "value", "message"), [
    ("lr", -0.1, "lr=-0.1"),
    ("momentum", 1.0, "momentum=1.0"),
    ("momentum", -0.1, "momentum=-0.1"),
    ("ns_steps", 0, "ns_steps=0"),
    ("ns_coefficients", "cubic", "ns_coefficients='cubic'"),
    ("ns_coefficients", (1.0, 2.0), "ns_coefficients"),
    ("ns_method", "fast", "ns_method='fast'"),
    ("lr_scaling", "none", "lr_scaling='none'"),
    ("ns_dtype", "int8", "ns_dtype='int8'"),
    ("weight_decay", -1.0, "weight_decay=-1.0"),
    ("gram_restart_steps", (0,), "gram_restart_steps"),
    ("adam_lr", -1.0, "lr=-1.0"),
    ("adam_betas", (0.9, 1.5), "betas"),
    ("adam_eps", -1.0, "eps=-1.0"),
])
def test_bad_hyper_parameters_fail_at_construction(key, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Muon([torch.nn.Parameter(torch.randn(4, 4))], **{key: value})


def _groups_deepspeed_style(model: torch.nn.Module) -> list[dict]:
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    others = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": matrices, "use_muon": True, "lr": 0.04, "momentum": 0.9},
            {"params": others, "use_muon": False, "lr": 1e-3, "betas": (0.8, 0.99)},
            ]


def test_deepspeed_style_groups_with_use_muon_mean_what_deepspeeds_muon_makes_of_them():
    """Groups written for DeepSpeed 0.19.8's MuonWithAuxAdam (``use_muon`` instead of ``kind``)
    give each parameter the settings DeepSpeed's optimizer gives it, and carry ``use_muon`` back
    (DeepSpeed's tests read ``param_groups[i]["use_muon"]``), also after a state dict without it."""
    from deepspeed.runtime.zero.muon.original_muon import MuonWithAuxAdam

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.LayerNorm(6), torch.nn.Linear(6, 4))
    theirs = MuonWithAuxAdam(_groups_deepspeed_style(model))
    ours = Muon(_groups_deepspeed_style(model))

    def settings(optimizer, keys):
        return {id(p): tuple(group.get(k) for k in keys) for group in optimizer.param_groups for p in group["params"]}

    assert settings(ours, ("use_muon", "lr")) == settings(theirs, ("use_muon", "lr"))
    assert all(group["kind"] == ("muon" if group["use_muon"] else "adamw") for group in ours.param_groups)
    muon_keys, adam_keys = ("momentum", "weight_decay", "ns_method"), ("betas", "eps", "weight_decay")
    for mine, deepspeeds in zip(ours.param_groups, theirs.param_groups):
        for key in muon_keys if deepspeeds["use_muon"] else adam_keys:
            assert tuple(mine[key]) == tuple(deepspeeds[key]) if key == "betas" else mine[key] == deepspeeds[key], key

    state = ours.state_dict()
    for group in state["param_groups"]:
        del group["use_muon"]
    ours.load_state_dict(state)
    assert [g["use_muon"] for g in ours.param_groups] == [True, False]
    with pytest.raises(ValueError, match="use_muon=True, which names 'muon'"):
        Muon([{"params": [model[0].weight], "use_muon": True, "kind": "adamw"}])
