"""Param groups as DeepSpeed users pass them, and the update against DeepSpeed 0.19.8's own Muon.

Unit tests (no processes): the groups ds_canzona builds from ``model_parameters`` give every
parameter the hyper-parameters DeepSpeed's ``_muon_param_groups`` gives it; per-head Muon takes
DeepSpeed's own head tags; the planner prices each matrix group with its own settings.

Distributed (DP 2, one spawn per ZeRO stage, tests/param_group_workers.py): the same model, data,
seed, groups, LR schedule and per-head Muon through DeepSpeed's Muon and through ds_canzona; ds_canzona bit for bit
against the single-process optimizer fed its averaged gradients; a checkpoint round trip of the
groups; a callable client optimizer; a 4-D convolution filter.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from distributed import run_ranks
from param_group_workers import (EXPERT_GROUP, MUON_PARAMS, NO_DECAY_GROUP, STEPS, deepspeed_groups, schedule,
                                 stage_run)
from tiny_model import TinyLM, make_moe_model

from ds_canzona.config import CanzonaConfigError
from ds_canzona.optim import is_matrix
from ds_canzona.zero.build import optimizer_from_config
from ds_canzona.zero.pricing import PerGroupCost, plan_cost_model

# ds_canzona against DeepSpeed's Muon after 8 steps, per tensor: |ours - theirs| / |theirs - start|.
# The math is the same (same groups, fp32 Newton-Schulz "standard", no clipping, gradient
# accumulation 1, Nesterov momentum placed alike); the rounding is not: DeepSpeed forms (c*A)@A
# where we form c*(A@A) and scales the update before adding it (~5e-6 relative per update, see
# test_optim_muon.py), orthogonalises an expert stack as one batched matmul (not bit-identical to
# per-expert products on this CPU) and averages gradients in another order. Those differences
# feed back through the loss for 8 steps; measured worst 1.3e-5 (the embedding: Adam divides by
# sqrt(v), which magnifies small gradient differences where v is small). A wrong group setting
# (an lr or momentum off, weight decay on a norm) moves a tensor by O(1) of its update.
DEEPSPEED_PARITY = 1e-4

# The distributed runs' config keys without per-head Muon (the unit tests' models carry no head tags).
PLAIN_PARAMS = {k: v for k, v in MUON_PARAMS.items() if k != "per_head_muon"}


class FakeEngine:
    """What optimizer_from_config reads from a DeepSpeed engine."""

    def __init__(self, module, params: dict, name: str = "muon"):
        self.module, self._params, self._name = module, params, name

    def optimizer_name(self):
        return self._name

    def optimizer_params(self):
        return self._params


def our_settings(optimizer) -> dict[str, dict]:
    """Per parameter name: the settings DeepSpeed's Muon groups carry, read from our groups."""
    out = {}
    for group in optimizer.param_groups:
        keys = ("lr", "momentum", "weight_decay", "ns_method") if group["kind"] == "muon" else \
            ("lr", "betas", "eps", "weight_decay")
        for name in group["param_names"]:
            out[name] = {"muon": group["kind"] == "muon",
                         **{k: tuple(group[k]) if k == "betas" else group[k] for k in keys}}
    return out


def deepspeed_settings(model, model_parameters, config_params) -> dict[str, dict]:
    engine_module = pytest.importorskip("deepspeed.runtime.engine")
    for name, p in model.named_parameters():
        p.use_muon = is_matrix(name, tuple(p.shape))  # deepspeed.initialize's tagging rule
    names = {p: n for n, p in model.named_parameters()}
    out = {}
    for group in engine_module.DeepSpeedEngine._muon_param_groups(model_parameters, config_params):
        keys = ("lr", "momentum", "weight_decay", "ns_method") if group["use_muon"] else \
            ("lr", "betas", "eps", "weight_decay")
        for p in group["params"]:
            out[names[p]] = {"muon": group["use_muon"],
                             **{k: tuple(group[k]) if k == "betas" else group[k] for k in keys if k in group}}
    return out


@pytest.mark.parametrize("config_params", [
    PLAIN_PARAMS,
    {"lr": 0.01, "muon_lr": 0.03, "weight_decay": 0.1, "momentum": 0.9, "betas": [0.8, 0.9], "eps": 1e-8,
     "ns_method": "standard"},
])
def test_groups_get_deepspeeds_settings(config_params):
    model = make_moe_model()
    experts = [p for n, p in model.named_parameters() if n.startswith("experts_")]
    norms = [p for p in model.parameters() if p.ndim == 1]
    heads = [model.embed_tokens.weight, model.lm_head.weight]
    rest = [p for p in model.parameters() if all(p is not q for q in experts + norms + heads)]
    groups = [
        {"params": experts, **EXPERT_GROUP},
        {"params": norms, **NO_DECAY_GROUP},
        {"params": heads, "betas": (0.85, 0.9), "eps": 1e-6, "ns_method": "gram"},
        {"params": rest, "momentum": 0.8, "weight_decay": 0.05},
    ]
    theirs = deepspeed_settings(model, groups, config_params)
    ours = our_settings(optimizer_from_config(FakeEngine(model, config_params), groups))
    assert theirs.keys() == ours.keys()
    for name in theirs:
        # Keys DeepSpeed leaves to its optimizers' defaults when neither config nor group sets them.
        assert {k: v for k, v in ours[name].items() if k in theirs[name]} == theirs[name], name


def test_loose_tensors_and_no_model_parameters():
    model = make_moe_model()
    ours = optimizer_from_config(FakeEngine(model, PLAIN_PARAMS), [model.embed_tokens.weight, model.router.weight])
    assert {n: g["kind"] for g in ours.param_groups for n in g["param_names"]} == \
        {"embed_tokens.weight": "adamw", "router.weight": "muon"}
    everything = optimizer_from_config(FakeEngine(model, PLAIN_PARAMS), None)
    kinds = {n: g["kind"] for g in everything.param_groups for n in g["param_names"]}
    assert kinds["lm_head.weight"] == "adamw" and kinds["experts_up"] == "muon" and len(kinds) == 19


def test_group_errors_name_the_problem():
    model = make_moe_model()
    with pytest.raises(CanzonaConfigError, match="not a parameter of the model"):
        optimizer_from_config(FakeEngine(model, PLAIN_PARAMS), [{"params": [torch.nn.Parameter(torch.ones(3))]}])
    with pytest.raises(CanzonaConfigError, match=r"param group.*momentun"):
        optimizer_from_config(FakeEngine(model, PLAIN_PARAMS), [{"params": list(model.parameters()), "momentun": 1}])
    with pytest.raises(CanzonaConfigError, match="per_head_muon applies to Muon only"):
        optimizer_from_config(FakeEngine(model, {"per_head_muon": True}, name="shampoo"), None)
    with pytest.raises(CanzonaConfigError, match="tagged no parameter"):
        optimizer_from_config(FakeEngine(make_moe_model(), {"per_head_muon": True}), None)


def test_shampoo_and_soap_take_expert_stacks_as_matrices():
    # A 3-D expert stack is a matrix for every matrix kind (each expert its own preconditioner).
    for name in ("shampoo", "soap"):
        optimizer = optimizer_from_config(FakeEngine(make_moe_model(), {}, name=name), None)
        kinds = {n: g["kind"] for g in optimizer.param_groups for n in g["param_names"]}
        assert kinds["experts_up"] == kinds["experts_down"] == name


def test_per_head_muon_takes_deepspeeds_head_tags():
    # DeepSpeed's own tagging (deepspeed.initialize runs it for a Muon config) on a model whose
    # config says 4 query heads and 2 key/value heads of width 6.
    deepspeed = pytest.importorskip("deepspeed")
    model = TinyLM(dim=24, heads=4, hidden=44, layers=1)
    model.config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, hidden_size=24, head_dim=6)
    config_params = {**PLAIN_PARAMS, "per_head_muon": True}
    deepspeed.set_optimizer_flags(SimpleNamespace(optimizer_name="muon", optimizer_params=config_params), model)
    optimizer = optimizer_from_config(FakeEngine(model, config_params), None)
    heads = {n: g["num_heads"] for g in optimizer.param_groups if g["kind"] == "muon" for n in g["param_names"]}
    assert heads["layers.0.q_proj.weight"] == 4
    assert heads["layers.0.k_proj.weight"] == heads["layers.0.v_proj.weight"] == 2
    assert heads["layers.0.o_proj.weight"] is None and heads["layers.0.gate_proj.weight"] is None


def test_plan_prices_each_matrix_group_with_its_own_settings():
    config = SimpleNamespace(cost_model="flops", machine_balance=None)
    standard = {"kind": "muon", "ns_method": "standard"}
    gram = {"kind": "muon", "ns_method": "gram"}
    adam = {"kind": "adamw"}
    same = plan_cost_model(config, ["a", "b", "c"], [gram, {**gram, "lr": 0.1, "weight_decay": 0.0}, adam], "cpu")
    assert not isinstance(same, PerGroupCost)  # groups differing in lr / weight decay share one model
    mixed = plan_cost_model(config, ["a", "b", "c"], [standard, gram, adam], "cpu")
    from ds_canzona.plan import ParamSpec, cost_model
    spec = ParamSpec(name="a", shape=(16, 64), matrix=True)
    assert mixed.cost(spec) == cost_model("flops", "muon", ns_method="standard").cost(spec)
    spec_b = ParamSpec(name="b", shape=(16, 64), matrix=True)
    assert mixed.cost(spec_b) == cost_model("flops", "muon", ns_method="gram").cost(spec_b)
    assert mixed.cost(spec) != mixed.cost(spec_b)


# --------------------------------------------------------------------------- distributed


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache = {}

    def get(stage: int):
        if stage not in cache:
            checkpoint = str(tmp_path_factory.mktemp("groups")) if stage == 2 else None
            cache[stage] = run_ranks(stage_run, 2, stage, checkpoint, timeout=900)
        return cache[stage]

    return get


def single_process_replay(grads_per_step: list[dict]) -> dict:
    """ds_canzona.optim.Muon with the same groups, in its own keywords, fed the averaged gradients."""
    from ds_canzona.optim import Muon

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: BLAS may block products differently with more threads
    try:
        model = make_moe_model()
        named = list(model.named_parameters())
        experts = [(n, p) for n, p in named if n.startswith("experts_")]
        no_decay = [(n, p) for n, p in named if p.ndim < 2]
        queries = [(n, p) for n, p in named if n == "block.q_proj.weight"]
        keys_values = [(n, p) for n, p in named if n in ("block.k_proj.weight", "block.v_proj.weight")]
        taken = {n for n, _ in experts + no_decay + queries + keys_values}
        rest = [(n, p) for n, p in named if n not in taken]
        optimizer = Muon([{"params": experts, "lr": 0.01, "adam_lr": 0.01, "momentum": 0.9},
                          {"params": no_decay, "weight_decay": 0.0, "adam_weight_decay": 0.0, "lr": 0.002,
                           "adam_lr": 0.002},
                          {"params": queries, "num_heads": 4},
                          {"params": keys_values, "num_heads": 2},
                          {"params": rest}],
                         lr=0.02, adam_lr=0.003, weight_decay=0.01, momentum=0.95, ns_method="standard",
                         adam_betas=(0.9, 0.95), adam_eps=1e-10)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        for grads in grads_per_step:
            for name, p in named:
                p.grad = grads[name].clone()
            optimizer.step()
            scheduler.step()
        return {n: p.detach().clone() for n, p in named}
    finally:
        torch.set_num_threads(threads)


def merged(results) -> list[dict]:
    return [{k: v for r in results for k, v in r["grads"][s].items()} for s in range(STEPS)]


@pytest.mark.parametrize("stage", [1, 2])
def test_matches_deepspeeds_muon(runs, stage):
    results = runs(stage)
    start = {n: p.detach() for n, p in make_moe_model().named_parameters()}
    ours, theirs = results[0]["ours"], results[0]["deepspeed"]
    worst = {}
    for name, theirs_p in theirs.items():
        moved = (theirs_p - start[name]).norm()
        if moved == 0:  # no gradient and no weight decay (unused.bias): nothing may move it
            assert torch.equal(ours[name], start[name]), name
            continue
        worst[name] = float((ours[name] - theirs_p).norm() / moved)
    assert max(worst.values()) < DEEPSPEED_PARITY, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    # Every tensor that should move did (the experts by their own groups' lr, norms without decay).
    assert len(worst) == len(theirs) - 1


@pytest.mark.parametrize("stage", [1, 2])
def test_groups_equal_the_single_process_optimizer(runs, stage):
    results = runs(stage)
    replay = single_process_replay(merged(results))
    for result in results:
        different = [n for n in replay if not torch.equal(result["ours"][n], replay[n])]
        assert not different, different
    groups = {g["kind"]: g for g in results[0]["groups"] if "experts_up" in g["names"] or
              "block.norm1.weight" in g["names"]}
    assert groups["muon"]["initial_lr"] == 0.01 and groups["muon"]["momentum"] == 0.9
    assert groups["adamw"]["weight_decay"] == 0.0 and groups["adamw"]["initial_lr"] == 0.002
    assert groups["muon"]["lr"] == pytest.approx(0.01 * schedule(STEPS))  # the scheduler's edits reached it
    heads = {name: g["num_heads"] for g in results[0]["groups"] if g["kind"] == "muon" for name in g["names"]}
    assert heads["block.q_proj.weight"] == 4 and heads["block.k_proj.weight"] == 2
    assert heads["block.o_proj.weight"] is None and heads["experts_up"] is None


def test_checkpoint_keeps_group_settings_and_schedule(runs):
    result = runs(2)[0]
    assert result["loaded_groups"] == result["saved_groups"]
    assert result["loaded_groups"] != result["fresh_groups"]  # the schedule had moved every lr
    assert result["loaded_scheduler"]["last_epoch"] == result["saved_scheduler"]["last_epoch"] == STEPS
    assert all(torch.equal(result["loaded_params"][n], result["ours"][n]) for n in result["ours"])


def test_callable_client_optimizer_gets_names(runs):
    kinds = runs(2)[0]["callable_kinds"]
    assert kinds["embed_tokens.weight"] == kinds["lm_head.weight"] == "adamw"
    assert kinds["experts_up"] == kinds["block.q_proj.weight"] == "muon"


def test_conv_filter_trains(runs):
    conv = runs(2)[0]["conv"]
    assert conv["kind"] == "muon" and conv["moved"] > 0
    assert all(torch.isfinite(torch.tensor(conv["losses"])))


def test_deepspeed_groups_hold_every_parameter_once():
    model = make_moe_model()
    held = [id(p) for group in deepspeed_groups(model) for p in group["params"]]
    assert sorted(held) == sorted(id(p) for p in model.parameters())


def test_group_keys_translate_like_the_config():
    from ds_canzona.zero.build import translate_group_keys
    # lr and weight_decay reach both halves; ds_canzona's own half keys win over them, in any order.
    assert translate_group_keys("muon", {"params": [], "adam_lr": 1e-3, "lr": 0.1, "weight_decay": 0.0}) == \
        {"lr": 0.1, "adam_lr": 1e-3, "weight_decay": 0.0, "adam_weight_decay": 0.0}
    assert translate_group_keys("muon", {"betas": [0.8, 0.9], "eps": 1e-6, "momentum": 0.9}) == \
        {"adam_betas": (0.8, 0.9), "adam_eps": 1e-6, "momentum": 0.9}
    assert translate_group_keys("shampoo", {"betas": [0.8, 0.9]}) == {"betas": (0.8, 0.9)}
    assert translate_group_keys("adamw", {"lr": 0.1, "weight_decay": 0.0}) == {"lr": 0.1, "weight_decay": 0.0}
