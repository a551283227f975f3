"""NorMuon and AdaMuon against float64 references written here from the papers' equations.

NorMuon (Li et al. 2025, arXiv:2510.05491, Algorithm 1): M = b1 M + (1 - b1) G, O = NS5(M),
v = b2 v + (1 - b2) mean_cols(O * O), O' = O / (sqrt(v) + eps), and the step
W <- W - lr wd W - lr' O' with lr' = 0.2 lr sqrt(m n) / ||O'||_F (our "match_rms_adamw"); the
authors' code rescales O' to ||O||_F and multiplies by sqrt(max(1, m / n)) instead (our
"original"). AdaMuon (Si et al. 2025, arXiv:2507.11005): the same with O = NS5(sign(M)), an
element-wise V = b2 V + (1 - b2) O * O and O' = O / (sqrt(V) + eps), rescaled to RMS 0.2.

The references use none of ds_canzona's helpers: their own quintic Newton-Schulz (Keller
Jordan's coefficients, the papers' NS5), their own momentum and moments, one matrix at a time
(an expert of a stack, a head of a per-head projection, the 2-D view of a filter).
"""

from __future__ import annotations

import math

import pytest
import torch

from ds_canzona.optim import AdaMuon, NorMuon, rule_for_group

QUINTIC = (3.4445, -4.7750, 2.0315)


def ns5(x: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The papers' Newton-Schulz: normalise by the Frobenius norm, iterate the quintic on the wide side."""
    a, b, c = QUINTIC
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def matrices_of(shape: tuple[int, ...], num_heads: int | None) -> list[tuple[slice, ...]]:
    """Index of each matrix of a tensor, as the papers' per-matrix rules see it."""
    if len(shape) == 3:
        return [(i,) for i in range(shape[0])]
    if num_heads:
        rows = shape[0] // num_heads
        return [(slice(h * rows, (h + 1) * rows),) for h in range(num_heads)]
    return [()]


class Reference:
    """One tensor under NorMuon or AdaMuon in float64, each matrix on its own."""

    def __init__(self, kind: str, param: torch.Tensor, *, momentum=0.95, beta2, eps, weight_decay, lr_scaling,
                 nesterov=True, sign_momentum=False, num_heads=None):
        self.kind, self.momentum, self.beta2, self.eps = kind, momentum, beta2, eps
        self.weight_decay, self.lr_scaling, self.nesterov = weight_decay, lr_scaling, nesterov
        self.sign_momentum, self.num_heads = sign_momentum, num_heads
        self.shape = tuple(param.shape)
        self.w = param.double().reshape(self._view_shape()).clone()
        self.m = torch.zeros_like(self.w)
        self.v = torch.zeros_like(self.w) if kind == "adamuon" else torch.zeros(self.w.shape[:-1], dtype=torch.float64)

    def _view_shape(self) -> tuple[int, ...]:
        if len(self.shape) >= 4:
            return self.shape[0], math.prod(self.shape[1:])
        return self.shape

    def step(self, grad: torch.Tensor, lr: float) -> None:
        g = grad.double().reshape(self.w.shape)
        self.m = self.momentum * self.m + (1 - self.momentum) * g
        u = (1 - self.momentum) * g + self.momentum * self.m if self.nesterov else self.m
        update = torch.zeros_like(self.w)
        for index in matrices_of(self.w.shape, self.num_heads):
            x = u[index]
            rows, cols = x.shape
            o = ns5(torch.sign(x) if self.sign_momentum else x)
            if self.kind == "normuon":
                self.v[index] = self.beta2 * self.v[index] + (1 - self.beta2) * (o * o).mean(dim=1)
                normalised = o / (self.v[index].sqrt()[:, None] + self.eps)
            else:
                self.v[index] = self.beta2 * self.v[index] + (1 - self.beta2) * o * o
                normalised = o / (self.v[index].sqrt() + self.eps)
            if self.lr_scaling == "match_rms_adamw":  # both papers: RMS 0.2
                update[index] = 0.2 * math.sqrt(rows * cols) / normalised.norm() * normalised
            else:  # NorMuon's code: O's norm, times Muon's shape factor
                update[index] = math.sqrt(max(1.0, rows / cols)) * o.norm() / normalised.norm() * normalised
        self.w = self.w - lr * self.weight_decay * self.w - lr * update

    @property
    def param(self) -> torch.Tensor:
        return self.w.reshape(self.shape)


# (kind, shape, options): tall, wide, square, a 3-D stack, per-head, a 4-D filter; both rescalings,
# both Newton-Schulz methods, AdaMuon with and without its sign step, Nesterov off once.
CASES = [
    ("normuon", (24, 40), {}),
    ("normuon", (40, 24), {"lr_scaling": "match_rms_adamw"}),
    ("normuon", (32, 32), {"weight_decay": 0.0}),
    ("normuon", (3, 16, 24), {"ns_method": "standard"}),
    ("normuon", (32, 24), {"num_heads": 4}),
    ("normuon", (8, 3, 3, 3), {"nesterov": False}),
    ("adamuon", (24, 40), {}),
    ("adamuon", (40, 24), {"sign_momentum": False, "lr_scaling": "original"}),
    ("adamuon", (32, 32), {"ns_method": "standard"}),
    ("adamuon", (3, 24, 16), {}),
    ("adamuon", (32, 24), {"num_heads": 2, "sign_momentum": False}),
]
DEFAULTS = {
    "normuon": {"beta2": 0.95, "eps": 1e-10, "weight_decay": 0.1, "lr_scaling": "original", "sign_momentum": False},
    "adamuon": {"beta2": 0.999, "eps": 1e-8, "weight_decay": 0.1, "lr_scaling": "match_rms_adamw",
                "sign_momentum": True},
}
STEPS = 5


def _run(kind: str, shape: tuple[int, ...], options: dict, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    settings = {**DEFAULTS[kind], **options}
    if kind == "normuon":
        settings.pop("sign_momentum")
    group = {"kind": kind, **settings}
    start = torch.randn(shape, generator=generator, dtype=torch.float64) * 0.1
    param = start.to(dtype)
    rule = rule_for_group(group)
    state = rule.init_state(param)
    reference = Reference(kind, start, **{k: v for k, v in {**DEFAULTS[kind], **options}.items()
                                         if k not in ("ns_method",)})
    lr = 0.02 if settings["lr_scaling"] == "original" else 3e-3
    for _ in range(STEPS):
        grad = torch.randn(shape, generator=generator, dtype=torch.float64)
        rule.update_([param], [grad.to(dtype)], [state], lr=lr)
        reference.step(grad, lr)
    return param, state, reference


@pytest.mark.parametrize("kind, shape, options", CASES)
def test_float64_equals_the_papers_equations(kind, shape, options):
    """In float64 only the order of operations differs (the Gram iteration, lerp against the EMA's
    two products, the eps on the rescale's norm): measured at most 5e-13 on weights of order 0.3,
    moments to 2e-14 relative; 1e-10 allowed. The state is the paper's moment, in the tensor's
    own layout."""
    param, state, reference = _run(kind, shape, options, torch.float64)
    torch.testing.assert_close(param, reference.param, rtol=0, atol=1e-10)
    key = "row_second_moment" if kind == "normuon" else "second_moment"
    torch.testing.assert_close(state[key].reshape(-1), reference.v.reshape(-1), rtol=1e-10, atol=0)
    assert float(state["step"]) == STEPS


@pytest.mark.parametrize("kind, shape, options", CASES)
def test_float32_is_close_to_the_float64_equations(kind, shape, options):
    """fp32 state and iteration: Newton-Schulz in fp32 agrees with float64 to ~6e-6 relative
    (docs/OPTIMIZERS.md) and the normalisation keeps that relative size, so each step's change of
    the weights (order 1e-2 per element) is off by ~1e-7; five steps. Measured: at most 2.8e-6
    absolute (AdaMuon without the sign step, whose small moments amplify it), 1.3e-7 elsewhere;
    allowed: 2e-5."""
    param, _, reference = _run(kind, shape, options, torch.float32)
    assert param.dtype == torch.float32
    torch.testing.assert_close(param.double(), reference.param, rtol=0, atol=2e-5)


def test_state_layout_and_dtypes():
    """fp32 moments for a bf16 parameter; NorMuon's one per row of each matrix, AdaMuon's one per element."""
    rule = rule_for_group({"kind": "normuon"})
    assert rule.init_state(torch.zeros(8, 5, dtype=torch.bfloat16))["row_second_moment"].dtype == torch.float32
    assert rule.init_state(torch.zeros(3, 8, 5))["row_second_moment"].shape == (3, 8)
    assert rule.init_state(torch.zeros(8, 2, 3, 3))["row_second_moment"].shape == (8,)
    assert rule_for_group({"kind": "normuon", "num_heads": 2}).init_state(
        torch.zeros(8, 5))["row_second_moment"].shape == (8,)
    state = rule_for_group({"kind": "adamuon"}).init_state(torch.zeros(3, 8, 5, dtype=torch.float16))
    assert set(state) == {"step", "momentum_buffer", "second_moment"}
    assert state["second_moment"].shape == (3, 8, 5) and state["second_moment"].dtype == torch.float32


def test_a_zero_row_stays_zero():
    """A row whose gradient is always zero has a zero moment: its update is 0, not 0 / 0."""
    for kind in ("normuon", "adamuon"):
        rule = rule_for_group({"kind": kind})
        param = torch.randn(6, 10)
        before = param.clone()
        state = rule.init_state(param)
        for _ in range(3):
            grad = torch.randn(6, 10)
            grad[2] = 0.0
            rule.update_([param], [grad], [state], lr=0.01)
        assert torch.isfinite(param).all()
        assert torch.equal(param[2], before[2]), kind


@pytest.mark.parametrize("group, message", [
    ({"kind": "normuon", "beta2": 1.0}, "beta2"),
    ({"kind": "normuon", "eps": 0.0}, "eps"),
    ({"kind": "adamuon", "sign_momentum": 1}, "sign_momentum"),
    ({"kind": "adamuon", "batch_same_shape": True}, "batch_same_shape"),
    ({"kind": "normuon", "lr_scaling": "spectral"}, "lr_scaling"),
])
def test_bad_values_name_the_key(group, message):
    with pytest.raises(ValueError, match=f"Invalid {group['kind']} {message}="):
        rule_for_group(group)


def test_single_process_optimizers_route_and_default():
    """Matrices to the kind, the rest to AdamW; AdaMuon's lr is on AdamW's scale, so adam_lr follows it."""
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    named = [(f"embed.{n}" if n.startswith("0.") else n, p) for n, p in model.named_parameters()]
    normuon = NorMuon(named)
    kinds = {n: g["kind"] for g in normuon.param_groups for n in g["param_names"]}
    assert kinds == {"embed.0.weight": "adamw", "1.weight": "normuon", "1.bias": "adamw", "2.weight": "adamw",
                     "2.bias": "adamw"}
    lrs = {g["kind"]: g["lr"] for g in normuon.param_groups}
    assert lrs == {"normuon": 0.02, "adamw": 3e-4}
    adamuon = AdaMuon(named, lr=1e-3)
    assert {g["kind"]: g["lr"] for g in adamuon.param_groups} == {"adamuon": 1e-3, "adamw": 1e-3}
    matrix = next(g for g in adamuon.param_groups if g["kind"] == "adamuon")
    assert (matrix["beta2"], matrix["eps"], matrix["sign_momentum"], matrix["weight_decay"]) == (0.999, 1e-8, True, 0.1)


def test_planner_prices_the_extra_passes_and_state():
    """Priced as Muon plus their elementwise passes; state bytes as the rules allocate them."""
    from ds_canzona.plan import ParamSpec, cost_model
    from ds_canzona.plan.memory import state_elements

    for shape in [(24, 40), (3, 16, 24), (8, 3, 3, 3)]:
        spec = ParamSpec(name="w", shape=shape, matrix=True)
        muon = cost_model("roofline", "muon", machine_balance=30.0, launch_bytes=0).cost(spec)
        for kind in ("normuon", "adamuon"):
            rule = rule_for_group({"kind": kind})
            assert rule.cost(shape, model="roofline", machine_balance=30.0) > muon
            assert rule.cost(shape) > cost_model("flops", "muon").cost(spec)
            state = rule.init_state(torch.zeros(shape))
            assert state_elements(spec, kind) == sum(v.numel() for k, v in state.items() if k != "step")
    heads = ParamSpec(name="q", shape=(32, 24), matrix=True, heads=4)
    assert state_elements(heads, "normuon") == 32 * 24 + 32
    # The group's options reach the model: the sign step and the "original" rescale cost more.
    signed = rule_for_group({"kind": "adamuon"}).cost((24, 40))
    assert rule_for_group({"kind": "adamuon", "sign_momentum": False}).cost((24, 40)) < signed
    assert rule_for_group({"kind": "adamuon", "lr_scaling": "original"}).cost((24, 40)) > signed


class _Engine:
    """What ds_canzona.zero.build.optimizer_from_config reads of a DeepSpeed engine."""

    def __init__(self, name: str, params: dict, module: torch.nn.Module):
        self._name, self._params, self.module = name, params, module

    def optimizer_name(self):
        return self._name

    def optimizer_params(self):
        return self._params


def _module():
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.embed_tokens = torch.nn.Embedding(10, 8)
    model.proj = torch.nn.Linear(8, 8)
    return model


def test_config_types_build_the_optimizers_with_their_keys():
    from ds_canzona.zero.build import optimizer_from_config

    built = optimizer_from_config(_Engine("NorMuon", {"lr": 0.01, "adam_lr": 0.002, "beta2": 0.9, "eps": 1e-9,
                                                      "adam_betas": [0.8, 0.9], "adam_w_mode": False}, _module()))
    assert type(built).__name__ == "NorMuon"
    groups = {g["kind"]: g for g in built.param_groups}
    assert (groups["normuon"]["lr"], groups["normuon"]["beta2"], groups["normuon"]["eps"]) == (0.01, 0.9, 1e-9)
    adamw = groups["adamw"]
    assert (adamw["lr"], tuple(adamw["betas"]), adamw["adam_w_mode"]) == (0.002, (0.8, 0.9), False)
    built = optimizer_from_config(_Engine("AdaMuon", {"lr": 0.001, "sign_momentum": False}, _module()))
    groups = {g["kind"]: g for g in built.param_groups}
    assert groups["adamuon"]["sign_momentum"] is False and groups["adamw"]["lr"] == 0.001


@pytest.mark.parametrize("name, params, needle", [
    ("NorMuon", {"beta2": 1.5}, "beta2"),
    ("AdaMuon", {"momentum_typo": 0.9}, "momentum_typo"),
    ("NorMuon", {"per_head_muon": True}, "per_head_muon applies to Muon only"),
])
def test_config_types_refuse_bad_params_naming_them(name, params, needle):
    from ds_canzona.config import CanzonaConfigError
    from ds_canzona.zero.build import optimizer_from_config

    with pytest.raises(CanzonaConfigError, match=needle):
        optimizer_from_config(_Engine(name, params, _module()))
