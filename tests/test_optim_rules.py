"""The rule contract the distributed runtime relies on, and the single-process optimizer plumbing."""

from __future__ import annotations

import copy
import math
import sys
import types

import pytest
import torch

from ds_canzona.optim import (
    MATRIX_KINDS,
    SOAP,
    AdaMuon,
    AdamW,
    Muon,
    NorMuon,
    Shampoo,
    TensorRule,
    is_matrix,
    known_kinds,
    rule_for_group,
)

# Groups that exercise every branch within a few steps (roots and bases refreshed, blocks cut).
GROUPS = {
    "muon": {"kind": "muon", "weight_decay": 0.1},
    "muon_standard": {"kind": "muon", "ns_method": "standard", "ns_coefficients": "polar_express"},
    "shampoo": {"kind": "shampoo", "precondition_frequency": 1, "start_preconditioning_step": 2,
                "max_preconditioner_dim": 8, "epsilon": 1e-6, "weight_decay": 0.1},
    "shampoo_newton": {"kind": "shampoo", "precondition_frequency": 2, "start_preconditioning_step": 1,
                       "inverse_root": "newton", "epsilon": 1e-4},
    "soap": {"kind": "soap", "precondition_frequency": 2, "max_precond_dim": 12},
    "adamw": {"kind": "adamw", "weight_decay": 0.1},
    "normuon": {"kind": "normuon", "weight_decay": 0.1},
    "normuon_rms": {"kind": "normuon", "lr_scaling": "match_rms_adamw", "ns_coefficients": "polar_express"},
    "adamuon": {"kind": "adamuon", "weight_decay": 0.1},
    "adamuon_unsigned": {"kind": "adamuon", "sign_momentum": False, "lr_scaling": "original", "ns_method": "standard"},
}
MATRIX_SHAPES = [(12, 20), (12, 20), (20, 12), (7, 3, 2, 2), (12, 20)]
STACK_SHAPES = [(3, 7, 5), (2, 10, 6)]  # 3-D stacks of matrices (MoE experts); Shampoo's blocks of 8 cut the second
VECTOR_SHAPES = [(12,), (5,), (12,)]


def shapes_for(group):
    if group["kind"] in MATRIX_KINDS:
        return MATRIX_SHAPES + STACK_SHAPES
    return MATRIX_SHAPES + STACK_SHAPES + VECTOR_SHAPES


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_registry_and_protocol():
    assert set(known_kinds()) == {"muon", "normuon", "adamuon", "shampoo", "soap", "adamw"}
    assert MATRIX_KINDS == {"muon", "normuon", "adamuon", "shampoo", "soap"}
    for group in GROUPS.values():
        assert isinstance(rule_for_group(group), TensorRule)


@pytest.mark.parametrize("name", sorted(GROUPS))
def test_result_is_independent_of_the_other_tensors(name):
    # The runtime's owners call update_ with their subset; the single-process optimizer with all.
    group = GROUPS[name]
    rule = rule_for_group(group)
    torch.manual_seed(0)
    shapes = shapes_for(group)
    params = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(4)]
    together = [p.clone() for p in params]
    together_states = [rule.init_state(p) for p in together]
    alone = [p.clone() for p in params]
    alone_states = [rule.init_state(p) for p in alone]
    for step_grads in grads:
        rule.update_(together, step_grads, together_states, lr=0.01)
        for p, g, s in zip(alone, step_grads, alone_states):
            rule.update_([p], [g], [s], lr=0.01)
    for p, q, s, t in zip(together, alone, together_states, alone_states):
        assert torch.equal(p, q)
        assert s.keys() == t.keys() and all(torch.equal(s[k], t[k]) for k in s)


@pytest.mark.parametrize("name", sorted(GROUPS))
def test_order_of_the_list_does_not_matter(name):
    group = GROUPS[name]
    rule = rule_for_group(group)
    torch.manual_seed(1)
    shapes = shapes_for(group)
    params = [torch.randn(s) for s in shapes]
    grads = [torch.randn(s) for s in shapes]
    forward = [p.clone() for p in params]
    backward = [p.clone() for p in params]
    forward_states = [rule.init_state(p) for p in forward]
    backward_states = [rule.init_state(p) for p in backward]
    for _ in range(3):
        rule.update_(forward, grads, forward_states, lr=0.01)
        rule.update_(backward[::-1], grads[::-1], backward_states[::-1], lr=0.01)
    assert all(torch.equal(p, q) for p, q in zip(forward, backward))


@pytest.mark.parametrize("name", sorted(GROUPS))
def test_non_finite_gradient_skips_only_that_tensor(name):
    group = GROUPS[name]
    rule = rule_for_group(group)
    torch.manual_seed(2)
    shapes = shapes_for(group)
    params = [torch.randn(s) for s in shapes]
    states = [rule.init_state(p) for p in params]
    rule.update_(params, [torch.randn(s) for s in shapes], states, lr=0.01)  # non-trivial state first
    reference = [p.clone() for p in params]
    reference_states = [{k: v.clone() for k, v in s.items()} for s in states]
    grads = [torch.randn(s) for s in shapes]
    poisoned = [g.clone() for g in grads]
    poisoned[1].view(-1)[3] = float("nan")
    rule.update_(params, poisoned, states, lr=0.01)
    rule.update_(reference, grads, reference_states, lr=0.01)
    for index, (p, r, s, rs) in enumerate(zip(params, reference, states, reference_states)):
        if index == 1:
            assert not torch.equal(p, r)  # the reference did move it; ours stayed put
        else:
            assert torch.equal(p, r) and all(torch.equal(s[k], rs[k]) for k in s)


def test_update_checks_its_arguments():
    rule = rule_for_group({"kind": "adamw"})
    p = torch.zeros(3)
    with pytest.raises(ValueError, match="one grad and one state per param"):
        rule.update_([p], [], [rule.init_state(p)], lr=0.1)
    with pytest.raises(ValueError, match="does not match param shape"):
        rule.update_([p], [torch.zeros(4)], [rule.init_state(p)], lr=0.1)
    with pytest.raises(ValueError, match="lr=-0.1"):
        rule.update_([p], [torch.zeros(3)], [rule.init_state(p)], lr=-0.1)


def test_rule_for_group_errors_name_the_key():
    with pytest.raises(ValueError, match="no 'kind'"):
        rule_for_group({"lr": 0.1})
    with pytest.raises(ValueError, match="kind='lion'"):
        rule_for_group({"kind": "lion"})
    with pytest.raises(ValueError, match="Invalid muon momentum=1.5"):
        rule_for_group({"kind": "muon", "momentum": 1.5})
    with pytest.raises(ValueError, match="Invalid muon lr=-1"):
        rule_for_group({"kind": "muon", "lr": -1})
    with pytest.raises(ValueError, match="Invalid muon nesterov=1"):
        rule_for_group({"kind": "muon", "nesterov": 1})
    # bookkeeping keys of torch and LR schedulers are not hyper-parameters
    rule_for_group({"kind": "adamw", "params": [], "initial_lr": 0.1, "param_names": [], "lr": 0.1})


def test_step_is_a_cpu_float32_scalar():
    for group in GROUPS.values():
        state = rule_for_group(group).init_state(torch.zeros(4, 4))
        assert state["step"].shape == () and state["step"].dtype == torch.float32
        assert all(v.dtype == torch.float32 for v in state.values())
        assert all(v.dtype == torch.float64 for k, v in rule_for_group(group).init_state(
            torch.zeros(4, 4, dtype=torch.float64)).items() if k != "step")


def test_cost_delegates_to_the_planner(monkeypatch):
    calls = []

    class FakeModel:
        def __init__(self, **kwargs):
            calls.append(kwargs)

        def cost(self, spec):
            calls.append({"matrix": spec.matrix, **({"heads": spec.heads} if spec.heads > 1 else {})})
            return float(math.prod(spec.shape))

    class FakeSpec:
        def __init__(self, name, shape, matrix, heads=1):
            self.name, self.shape, self.matrix, self.heads = name, shape, matrix, heads

    fake = types.ModuleType("ds_canzona.plan")
    fake.cost_model = lambda **kwargs: FakeModel(**kwargs)
    fake.ParamSpec = FakeSpec
    monkeypatch.setitem(sys.modules, "ds_canzona.plan", fake)
    assert rule_for_group({"kind": "muon", "ns_steps": 3}).cost((4, 6)) == 24.0
    assert calls[-2:] == [{"name": "flops", "optimizer": "muon", "ns_steps": 3, "ns_method": "gram"},
                          {"matrix": True}]
    rule_for_group({"kind": "soap", "max_precond_dim": 64}).cost((4, 6))
    assert calls[-2] == {"name": "flops", "optimizer": "soap", "max_preconditioner_dim": 64,
                         "precondition_frequency": 10}
    rule_for_group({"kind": "shampoo"}).cost((4, 6))
    assert calls[-2]["max_preconditioner_dim"] == 1024
    assert rule_for_group({"kind": "adamw"}).cost((4,)) == 4.0
    assert calls[-2:] == [{"name": "flops"}, {"matrix": False}]
    rule_for_group({"kind": "muon", "num_heads": 2}).cost((4, 6))  # per-head: the spec says so
    assert calls[-1] == {"matrix": True, "heads": 2}


def test_cost_with_the_real_planner():
    from ds_canzona.plan import ParamSpec, cost_model

    for group in GROUPS.values():
        rule = rule_for_group(group)
        shape = (64, 32) if group["kind"] in MATRIX_KINDS else (64,)
        assert rule.cost(shape) > 0
    muon = rule_for_group({"kind": "muon", "ns_steps": 5, "ns_method": "standard"})
    expected = cost_model(name="flops", optimizer="muon", ns_steps=5, ns_method="standard").cost(
        ParamSpec(name="w", shape=(64, 32), matrix=True))
    assert muon.cost((64, 32)) == expected
    roofline = cost_model(name="roofline", optimizer="muon", machine_balance=9.0, ns_steps=5, ns_method="standard")
    assert muon.cost((64, 32), model="roofline", machine_balance=9.0) == roofline.cost(
        ParamSpec(name="w", shape=(64, 32), matrix=True))
    adamw = rule_for_group({"kind": "adamw"})
    assert adamw.cost((64,), model="roofline", machine_balance=9.0) == roofline.cost(
        ParamSpec(name="b", shape=(64,), matrix=False))


# --------------------------------------------------------------------------- AdamW


def test_adamw_is_deepspeeds_adam_update_bit_for_bit():
    original_muon = pytest.importorskip("deepspeed.runtime.zero.muon.original_muon")
    torch.manual_seed(3)
    p = torch.randn(7, 5)
    ours = p.clone()
    rule = rule_for_group({"kind": "adamw", "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.1})
    state = rule.init_state(ours)
    exp_avg, exp_avg_sq = torch.zeros_like(p), torch.zeros_like(p)
    for step in range(1, 6):
        g = torch.randn(7, 5)
        update = original_muon.adam_update(g.clone(), exp_avg, exp_avg_sq, step, (0.9, 0.95), 1e-10)
        p.mul_(1 - 3e-3 * 0.1)
        p.add_(update, alpha=-3e-3)
        rule.update_([ours], [g], [state], lr=3e-3)
        assert torch.equal(ours, p)
    assert torch.equal(state["exp_avg"], exp_avg) and torch.equal(state["exp_avg_sq"], exp_avg_sq)


def test_adamw_matches_torch_adamw():
    # torch folds the bias corrections into the step size and eps: equal up to fp32 rounding.
    torch.manual_seed(4)
    model = torch.nn.Linear(6, 4)
    twin = torch.nn.Linear(6, 4)
    twin.load_state_dict(model.state_dict())
    ours = AdamW(model.named_parameters(), lr=1e-2, weight_decay=0.05)
    theirs = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.05)
    x = torch.randn(8, 6)
    for _ in range(5):
        for net, opt in ((model, ours), (twin, theirs)):
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
    for mine, other in zip(model.parameters(), twin.parameters()):
        assert rel(mine.detach(), other.detach()) < 1e-6


# --------------------------------------------------------------------------- single-process plumbing


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(11, 8)
        self.proj = torch.nn.Linear(8, 8)
        # A 4-D filter (one (out, rest) matrix for every matrix kind); a Conv1d's 3-D weight would
        # be a stack of matrices, which Shampoo and SOAP refuse.
        self.conv = torch.nn.Conv2d(8, 4, (1, 3))
        self.norm = torch.nn.LayerNorm(4)
        self.lm_head = torch.nn.Linear(4, 11, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.proj(self.embed_tokens(tokens)))  # (batch, length, 8)
        x = self.conv(x.transpose(1, 2).unsqueeze(2)).squeeze(2).transpose(1, 2)  # (batch, length - 2, 4)
        return self.lm_head(self.norm(x))


def loss_of(model: Tiny, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 11, (3, 6), generator=generator)
    logits = model(tokens)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, 11), tokens[:, 2:].reshape(-1))


def train(model, opt, seeds):
    for seed in seeds:
        opt.zero_grad()
        loss_of(model, seed).backward()
        opt.step()


OPTIMIZERS = [
    (Muon, {}),
    (Shampoo, {"precondition_frequency": 2}),
    (SOAP, {"precondition_frequency": 2}),
    (AdamW, {}),
    (NorMuon, {}),
    (AdaMuon, {}),
]


def test_matrix_rule_splits_named_parameters():
    model = Tiny()
    opt = Muon(model.named_parameters())
    kinds = {name: group["kind"] for group in opt.param_groups for name in group["param_names"]}
    assert kinds == {"proj.weight": "muon", "conv.weight": "muon", "embed_tokens.weight": "adamw",
                     "proj.bias": "adamw", "conv.bias": "adamw", "norm.weight": "adamw", "norm.bias": "adamw",
                     "lm_head.weight": "adamw"}
    assert is_matrix("model.layers.0.mlp.up_proj.weight", (8, 4))
    assert not is_matrix("model.embed_tokens.weight", (8, 4)) and not is_matrix("LM_HEAD.weight", (8, 4))
    unnamed = Muon(model.parameters())
    assert sorted(len(g["params"]) for g in unnamed.param_groups) == [4, 4]  # ndim >= 2 -> muon


def test_group_overrides_and_explicit_kinds():
    model = Tiny()
    no_decay = [(n, p) for n, p in model.named_parameters() if p.ndim < 2]
    decay = [(n, p) for n, p in model.named_parameters() if p.ndim >= 2]
    opt = Muon([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], weight_decay=0.1, adam_lr=1e-3)
    by_kind = {(g["kind"], g["weight_decay"]) for g in opt.param_groups}
    assert by_kind == {("muon", 0.1), ("adamw", 0.1), ("adamw", 0.0)}
    # adam_weight_decay=None follows weight_decay, group by group
    explicit = Muon([{"params": [model.proj.weight], "kind": "muon", "momentum": 0.9},
                     {"params": [model.proj.bias], "kind": "adamw", "betas": (0.8, 0.9)}])
    muon_group, adam_group = explicit.param_groups
    assert muon_group["momentum"] == 0.9 and muon_group["lr"] == 0.02
    assert adam_group["betas"] == (0.8, 0.9) and adam_group["lr"] == 3e-4 and adam_group["eps"] == 1e-10
    assert Muon([model.proj.weight, model.proj.bias], lr=0.1, lr_scaling="match_rms_adamw").param_groups[1]["lr"] == 0.1
    assert Shampoo([model.proj.bias], lr=0.01).param_groups[0]["lr"] == 0.01


def test_group_errors():
    model = Tiny()
    with pytest.raises(ValueError, match=r"key\(s\) \['momentun'\]"):
        Muon([{"params": [model.proj.weight], "momentun": 0.9}])
    with pytest.raises(ValueError, match=r"key\(s\) \['eps'\] for kind 'muon'"):
        Muon([{"params": [model.proj.weight], "kind": "muon", "eps": 1e-8}])
    with pytest.raises(ValueError, match="kind='soap'"):
        Muon([{"params": [model.proj.weight], "kind": "soap"}])
    with pytest.raises(ValueError, match="matrix kinds need >= 2 dims"):
        Muon([{"params": [model.proj.bias], "kind": "muon"}])
    with pytest.raises(ValueError, match="Invalid muon momentum=2"):
        Muon([{"params": [model.proj.weight], "momentum": 2}])
    with pytest.raises(ValueError, match="needs parameter names"):
        Muon(model.parameters()).state_dict_by_name()


@pytest.mark.parametrize(("cls", "kwargs"), OPTIMIZERS)
def test_step_is_the_rule_path(cls, kwargs):
    # The optimizer's step equals calling each group's rule on the same tensors: the runtime's path.
    torch.manual_seed(5)
    model, twin = Tiny(), Tiny()
    twin.load_state_dict(model.state_dict())
    opt = cls(model.named_parameters(), **kwargs)
    groups = [dict(g) for g in cls(twin.named_parameters(), **kwargs).param_groups]
    twin_params = dict(twin.named_parameters())
    states: dict[str, dict] = {}
    for seed in range(4):
        train(model, opt, [seed])
        twin.zero_grad()
        loss_of(twin, seed).backward()
        for group in groups:
            rule = rule_for_group(group)
            names = group["param_names"]
            params = [twin_params[n] for n in names]
            for n, p in zip(names, params):
                states.setdefault(n, rule.init_state(p))
            with torch.no_grad():
                rule.update_(params, [p.grad for p in params], [states[n] for n in names], lr=group["lr"])
    for (name, mine), other in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(mine, other), name


@pytest.mark.parametrize(("cls", "kwargs"), OPTIMIZERS)
def test_state_by_name_round_trip(cls, kwargs):
    torch.manual_seed(6)
    model = Tiny()
    opt = cls(model.named_parameters(), **kwargs)
    train(model, opt, range(3))
    saved = {name: {k: v.clone() for k, v in state.items()} for name, state in opt.state_dict_by_name().items()}
    assert set(saved) == {name for name, _ in model.named_parameters()}

    # A twin whose optimizer lists the parameters in another order finds each state by name.
    twin = Tiny()
    twin.load_state_dict(model.state_dict())
    twin_opt = cls(list(twin.named_parameters())[::-1], **kwargs)
    twin_opt.load_state_dict_by_name(saved)
    train(model, opt, range(3, 6))
    train(twin, twin_opt, range(3, 6))
    for (name, mine), other in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(mine, other), name


@pytest.mark.parametrize(("cls", "kwargs"), OPTIMIZERS)
def test_torch_state_dict_round_trip(cls, kwargs):
    torch.manual_seed(7)
    model = Tiny()
    opt = cls(model.named_parameters(), **kwargs)
    train(model, opt, range(3))
    twin = Tiny()
    twin.load_state_dict(model.state_dict())
    twin_opt = cls(twin.named_parameters(), **kwargs)
    twin_opt.load_state_dict(opt.state_dict())
    train(model, opt, range(3, 5))
    train(twin, twin_opt, range(3, 5))
    for mine, other in zip(model.parameters(), twin.parameters()):
        assert torch.equal(mine, other)


def test_bf16_parameters_keep_fp32_state_through_torch_state_dict():
    model = Tiny().to(torch.bfloat16)
    opt = Muon(model.named_parameters())
    train(model, opt, range(2))
    twin = Tiny().to(torch.bfloat16)
    twin.load_state_dict(model.state_dict())
    twin_opt = Muon(twin.named_parameters())
    twin_opt.load_state_dict(opt.state_dict())
    state = twin_opt.state[twin.proj.weight]
    assert state["momentum_buffer"].dtype == torch.float32
    assert torch.equal(state["momentum_buffer"], opt.state[model.proj.weight]["momentum_buffer"])


def test_load_state_by_name_errors():
    model = Tiny()
    opt = AdamW(model.named_parameters())
    train(model, opt, range(1))
    saved = opt.state_dict_by_name()
    with pytest.raises(ValueError, match="unknown \\['ghost'\\]"):
        opt.load_state_dict_by_name({**saved, "ghost": {}})
    partial = {k: v for k, v in saved.items() if k != "proj.bias"}
    with pytest.raises(ValueError, match="missing \\['proj.bias'\\]"):
        opt.load_state_dict_by_name(partial)
    opt.load_state_dict_by_name(partial, strict=False)
    broken = {**saved, "proj.bias": {"step": torch.tensor(1.0)}}
    with pytest.raises(ValueError, match="state of 'proj.bias' has keys"):
        opt.load_state_dict_by_name(broken)
    with pytest.raises(ValueError, match="has shape"):
        opt.load_state_dict_by_name({**saved, "proj.bias": {**saved["proj.bias"], "exp_avg": torch.zeros(3)}})


def test_lr_scheduler_drives_every_group():
    model = Tiny()
    opt = Muon(model.named_parameters(), adam_lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    assert sorted(g["lr"] for g in opt.param_groups) == [5e-4, 0.01]
    train(model, opt, range(1))
    scheduler.step()
    train(model, opt, range(1))  # initial_lr in the groups does not upset rule_for_group


def test_groups_added_later_copied_or_pickled():
    model = Tiny()
    opt = Muon([(n, p) for n, p in model.named_parameters() if n.startswith("proj.")])
    opt.add_param_group({"params": [(n, p) for n, p in model.named_parameters() if n.startswith("conv.")],
                         "weight_decay": 0.5})
    assert [(g["kind"], g["weight_decay"]) for g in opt.param_groups] == [
        ("muon", 0.0), ("adamw", 0.0), ("muon", 0.5), ("adamw", 0.5)]
    # A group carrying torch's 'param_names' (as copied from another optimizer) keeps its names.
    copied = Muon([{"params": [model.norm.weight], "param_names": ["norm.weight"]}])
    assert copied.param_groups[0]["param_names"] == ["norm.weight"]
    train(model, opt, range(1))
    clone = copy.deepcopy(opt)
    clone.add_param_group({"params": [("norm.bias", torch.nn.Parameter(torch.zeros(4)))]})
    assert clone.param_groups[-1]["kind"] == "adamw"
