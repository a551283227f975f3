"""DeepSpeed's Adam keys ("Adam", "AdamW" and Muon's auxiliary Adam) mean what DeepSpeed 0.19.8 means.

One process, no engine: DeepSpeed's own ``_configure_basic_optimizer`` (its real code, on an
object that answers the few engine questions it asks) picks and builds the optimizer a config
gives, FusedAdam or torch's Adam / AdamW, with DeepSpeed's defaults; ``optimizer_from_config``
builds ours from the same config. Both step the same model with the same gradients. The
distributed runtime runs this very optimizer's rule on each owner, bit for bit against it
(test_zero_stage12.py, test_zero3.py), so equality here carries to the engine.
"""

from __future__ import annotations

import pytest
import torch

from tiny_model import make_model

from ds_canzona.config import CanzonaConfigError
from ds_canzona.optim import is_matrix
from ds_canzona.zero.build import optimizer_from_config

engine_module = pytest.importorskip("deepspeed.runtime.engine")
DeepSpeedEngine = engine_module.DeepSpeedEngine

STEPS = 6
# Per tensor after STEPS steps on the same gradients: |ours - theirs| / |theirs - start|. The math
# is the same; the rounding is not: FusedAdam and torch fold the bias corrections into the step
# size and add eps to sqrt(v)/sqrt(1 - beta2^t), where ours divides m and v first (one fp32
# rounding of each, ~1e-7 relative per element, more relative to a tensor whose random-walk
# movement partly cancels). Measured worst 6.2e-6 (FusedAdam), 1.3e-6 (torch). Gradients are
# fixed, so nothing feeds back through a loss. A wrong meaning (a weight decay of 0.01 where it
# is 0, L2 for decoupled) is off by more than 50 times the tolerance: the negative controls below.
DEEPSPEED_PARITY = 2e-5


class DeepSpeedsChoice:
    """The engine methods and answers DeepSpeed's ``_configure_basic_optimizer`` reads (offload is refused by us)."""

    _configure_basic_optimizer = DeepSpeedEngine._configure_basic_optimizer
    get_optimizer_configuration = DeepSpeedEngine.get_optimizer_configuration
    _muon_param_groups = staticmethod(DeepSpeedEngine._muon_param_groups)
    _muon_half_defaults = staticmethod(DeepSpeedEngine._muon_half_defaults)
    has_moe_layers = False
    zenflow = False

    def __init__(self, name: str, params: dict, module=None):
        self._name, self._params, self.module = name, params, module

    def optimizer_name(self):
        return self._name

    def optimizer_params(self):
        return self._params

    def zero_use_cpu_optimizer(self):
        return False

    def bf16_optimizer_states(self):
        return False


def gradients(model) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [{n: torch.randn(p.shape, generator=generator) for n, p in model.named_parameters()}
            for _ in range(STEPS)]


def train(optimizer, model, grads) -> dict[str, torch.Tensor]:
    for step_grads in grads:
        for name, p in model.named_parameters():
            p.grad = step_grads[name].clone()
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def deepspeeds_run(type_name: str, params: dict) -> tuple[type, dict[str, torch.Tensor], dict]:
    model = make_model()
    for name, p in model.named_parameters():
        p.use_muon = is_matrix(name, tuple(p.shape))  # deepspeed.initialize's tagging rule
    optimizer = DeepSpeedsChoice(type_name.lower(), dict(params))._configure_basic_optimizer(list(model.parameters()))
    inner = getattr(optimizer, "aux_optimizer", None) or optimizer
    return type(inner), train(optimizer, model, gradients(model)), {n: p for n, p in model.named_parameters()}


def our_run(type_name: str, params: dict, **overrides) -> dict[str, torch.Tensor]:
    model = make_model()
    optimizer = optimizer_from_config(DeepSpeedsChoice(type_name.lower(), dict(params), model), None)
    for group in optimizer.param_groups:
        group.update(overrides)
    return train(optimizer, model, gradients(model))


def worst_difference(ours, theirs, names) -> float:
    start = dict(make_model().named_parameters())
    return max(float((ours[n] - theirs[n]).norm() / (theirs[n] - start[n].detach()).norm()) for n in names)


ADAM_CASES = [
    # (type, params, the class DeepSpeed builds, what the config means)
    ("Adam", {"lr": 1e-2}, "FusedAdam", "decoupled, weight decay 0"),
    ("AdamW", {"lr": 1e-2}, "FusedAdam", "decoupled, weight decay 0"),
    ("Adam", {"lr": 1e-2, "weight_decay": 0.1}, "FusedAdam", "decoupled 0.1"),
    ("Adam", {"lr": 1e-2, "weight_decay": 0.1, "adam_w_mode": False}, "FusedAdam", "L2 0.1"),
    ("AdamW", {"lr": 1e-2, "weight_decay": 0.1, "adam_w_mode": False}, "FusedAdam", "decoupled 0.1 (AdamW forces it)"),
    ("Adam", {"lr": 1e-2, "torch_adam": True}, "AdamW", "torch AdamW: weight decay 0.01"),
    ("Adam", {"lr": 1e-2, "torch_adam": True, "adam_w_mode": False, "weight_decay": 0.1}, "Adam", "torch Adam: L2"),
    ("Adam", {"lr": 1e-2, "torch_adam": True, "adam_w_mode": False, "decoupled_weight_decay": True,
              "weight_decay": 0.1}, "Adam", "torch Adam, decoupled"),
    ("AdamW", {"lr": 1e-2, "betas": [0.8, 0.99], "eps": 1e-6, "bias_correction": True, "amsgrad": False,
               "set_grad_none": True, "weight_decay": 0.05}, "FusedAdam", "every FusedAdam key at a value we run"),
    ("AdamW", {"lr": 1e-2, "torch_adam": True, "foreach": False, "amsgrad": False, "maximize": False},
     "AdamW", "torch's implementation keys"),
]


@pytest.mark.parametrize("type_name,params,built,meaning", ADAM_CASES, ids=[c[3] for c in ADAM_CASES])
def test_adam_types_match_deepspeeds_optimizer(type_name, params, built, meaning):
    built_class, theirs, _ = deepspeeds_run(type_name, params)
    assert built_class.__name__ == built  # the case tests the class it says it does
    ours = our_run(type_name, params)
    assert worst_difference(ours, theirs, theirs) < DEEPSPEED_PARITY


@pytest.mark.parametrize("torch_adam", [False, True])
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_muons_auxiliary_adam_matches_deepspeeds(torch_adam, adam_w_mode):
    params = {"lr": 0.02, "adam_lr": 1e-2, "weight_decay": 0.1, "adam_w_mode": adam_w_mode, "torch_adam": torch_adam}
    built_class, theirs, _ = deepspeeds_run("Muon", params)
    expected = ("AdamW" if adam_w_mode else "Adam") if torch_adam else "FusedAdam"
    assert built_class.__name__ == expected
    ours = our_run("Muon", params)
    # The auxiliary Adam's tensors (the matrices' Muon is compared in test_param_groups.py).
    model = make_model()
    adam_names = [n for n, p in model.named_parameters() if not is_matrix(n, tuple(p.shape))]
    assert worst_difference(ours, theirs, adam_names) < DEEPSPEED_PARITY
    # The other weight-decay mode is far off: the test can tell the two apart.
    wrong = our_run("Muon", params | {"adam_w_mode": not adam_w_mode})
    assert worst_difference(wrong, theirs, adam_names) > 50 * DEEPSPEED_PARITY


@pytest.mark.parametrize("type_name,params,wrong", [
    ("Adam", {"lr": 1e-2}, {"weight_decay": 0.01}),  # torch's AdamW default, where FusedAdam's is 0
    ("Adam", {"lr": 1e-2, "weight_decay": 0.1, "adam_w_mode": False}, {"adam_w_mode": True}),
    ("Adam", {"lr": 1e-2, "weight_decay": 0.1}, {"adam_w_mode": False}),
    ("Adam", {"lr": 1e-2, "torch_adam": True}, {"weight_decay": 0.0}),
])
def test_a_wrong_meaning_is_far_outside_the_tolerance(type_name, params, wrong):
    _, theirs, _ = deepspeeds_run(type_name, params)
    ours = our_run(type_name, params, **wrong)
    assert worst_difference(ours, theirs, theirs) > 50 * DEEPSPEED_PARITY


@pytest.mark.parametrize("type_name,params,names", [
    ("Adam", {"amsgrad": True}, "amsgrad"),
    ("AdamW", {"bias_correction": False}, "bias_correction"),
    ("Adam", {"torch_adam": True, "maximize": True}, "maximize"),
    ("AdamW", {"set_grad_none": True, "torch_adam": True}, "set_grad_none"),  # a TypeError in DeepSpeed
    ("Adam", {"momentum": 0.9}, "momentum"),
    ("Adam", {"adam_w_mode": "no"}, "adam_w_mode"),
    ("Shampoo", {"adam_w_mode": False}, "adam_w_mode"),
    ("SOAP", {"torch_adam": True}, "torch_adam"),
])
def test_keys_with_another_meaning_are_refused(type_name, params, names):
    model = make_model()
    with pytest.raises(CanzonaConfigError, match=names):
        optimizer_from_config(DeepSpeedsChoice(type_name.lower(), params, model), None)


def test_neutral_keys_of_matrix_types_are_accepted():
    model = make_model()
    for type_name in ("shampoo", "soap"):
        optimizer = optimizer_from_config(DeepSpeedsChoice(type_name, {"adam_w_mode": True, "torch_adam": False,
                                                                       "fp32_optimizer_states": True}, model), None)
        assert all(g.get("adam_w_mode", True) for g in optimizer.param_groups)
