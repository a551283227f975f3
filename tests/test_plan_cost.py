"""Specs from shapes files and shipped configs, and the cost models' flop counts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ds_canzona.plan import (
    ADAMW_FLOPS_PER_ELEMENT,
    ADAMW_LAUNCHES,
    DEFAULT_LAUNCH_BYTES,
    DEFAULT_MACHINE_BALANCE,
    ParamSpec,
    PlanError,
    RooflineCost,
    cost_model,
    default_matrix_rule,
    load_model_config,
    model_specs,
    default_launch_bytes,
    default_machine_balance,
    muon_flops,
    newton_schulz_flops,
    newton_schulz_launches,
    optimizer_work,
    shampoo_flops,
    shard_for_tp,
    shipped_models,
    soap_flops,
    specs_from_shapes_file,
    step_launches,
)

# ----------------------------------------------------------------------------- specs


def test_default_matrix_rule_follows_deepspeeds_muon() -> None:
    assert default_matrix_rule("model.layers.0.mlp.up_proj.weight", (8, 4))
    assert default_matrix_rule("conv.weight", (8, 4, 3, 3))
    assert not default_matrix_rule("model.layers.0.input_layernorm.weight", (8,))
    assert not default_matrix_rule("model.embed_tokens.weight", (100, 8))
    assert not default_matrix_rule("LM_HEAD.weight", (100, 8))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"name": ""}, "name"),
        ({"shape": (4, 0)}, "shape"),
        ({"shape": (4, -2)}, "shape"),
        ({"shape": (4.0, 2)}, "shape"),
        ({"matrix": 1}, "matrix"),
        ({"tp_size": 0}, "tp_size"),
        ({"tp_dim": 2}, "tp_dim"),
        ({"tp_size": 2}, "tp_dim"),
    ],
)
def test_param_spec_errors_name_the_field(kwargs: dict, field: str) -> None:
    arguments = {"name": "w", "shape": (4, 4), "matrix": True, **kwargs}
    with pytest.raises(PlanError, match=field):
        ParamSpec(**arguments)


def test_param_spec_is_a_frozen_keyword_only_value() -> None:
    spec = ParamSpec(name="w", shape=[3, 4], matrix=True)  # type: ignore[arg-type]
    assert spec.shape == (3, 4) and spec.numel == 12
    assert spec == ParamSpec(name="w", shape=(3, 4), matrix=True)
    with pytest.raises(AttributeError):
        spec.name = "v"  # type: ignore[misc]
    with pytest.raises(TypeError):
        ParamSpec("w", (3, 4), True)  # type: ignore[misc]
    scalar = ParamSpec(name="t", shape=(), matrix=False)
    assert scalar.numel == 1
    shard = ParamSpec(name="w", shape=(3, 4), matrix=True, tp_dim=0, tp_size=4)
    assert shard.full_shape == (12, 4)


def test_shapes_file(tmp_path: Path) -> None:
    path = tmp_path / "shapes.json"
    entries = [
        {"name": "embed.weight", "shape": [100, 8]},
        {"name": "layer.weight", "shape": [8, 8], "matrix": True},
        {"name": "layer.bias", "shape": [8], "matrix": False},
        {"name": "gate", "shape": [8, 8], "matrix": False},
    ]
    path.write_text(json.dumps(entries))
    specs = specs_from_shapes_file(path)
    assert [s.name for s in specs] == ["embed.weight", "layer.weight", "layer.bias", "gate"]
    assert [s.matrix for s in specs] == [False, True, False, False]  # the file's flag wins over the default rule
    forced = specs_from_shapes_file(path, matrix_rule=lambda name, shape: len(shape) == 2)
    assert [s.matrix for s in forced] == [True, True, False, True]


@pytest.mark.parametrize(
    "content, message",
    [
        ("[]", "empty"),
        ("{}", "list"),
        ("not json", "not valid JSON"),
        ('[{"shape": [2]}]', "missing field 'name'"),
        ('[{"name": "a", "shape": [2, 0]}]', "positive"),
        ('[{"name": "a", "shape": 3}]', "shape"),
        ('[{"name": "a", "shape": [2], "dtype": "bf16"}]', "unknown field"),
        ('[{"name": "a", "shape": [2]}, {"name": "a", "shape": [2]}]', "Duplicate"),
    ],
)
def test_bad_shapes_files(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "shapes.json"
    path.write_text(content)
    with pytest.raises(PlanError, match=message):
        specs_from_shapes_file(path)


def test_unreadable_shapes_file(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="Cannot read"):
        specs_from_shapes_file(tmp_path / "missing.json")


def test_shipped_qwen3_configs() -> None:
    assert shipped_models() == ["qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b",
                                "qwen3-h128"]
    expected = {  # hidden, intermediate, layers, heads, kv heads, tied
        "qwen3-h128": (128, 384, 8, 4, 2, True),
        "qwen3-0.6b": (1024, 3072, 28, 16, 8, True),
        "qwen3-1.7b": (2048, 6144, 28, 16, 8, True),
        "qwen3-4b": (2560, 9728, 36, 32, 8, True),
        "qwen3-8b": (4096, 12288, 36, 32, 8, False),
        "qwen3-14b": (5120, 17408, 40, 40, 8, False),
        "qwen3-32b": (5120, 25600, 64, 64, 8, False),
    }
    for name, (hidden, inter, layers, heads, kv, tied) in expected.items():
        config = load_model_config(name.upper())
        assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (
            hidden,
            inter,
            layers,
        )
        assert (config["num_attention_heads"], config["num_key_value_heads"], config["tie_word_embeddings"]) == (
            heads,
            kv,
            tied,
        )
        small = name == "qwen3-h128"  # the small config of collective counts: head_dim 32, vocabulary 1024
        assert (config["head_dim"], config["vocab_size"]) == ((32, 1024) if small else (128, 151936))
    total = sum(spec.numel for spec in model_specs("qwen3-32b"))
    assert 32.7e9 < total < 32.8e9
    with pytest.raises(PlanError, match="Unknown model"):
        load_model_config("llama-7b")


def test_shard_for_tp_splits_megatron_style() -> None:
    specs = shard_for_tp(model_specs("qwen3-0.6b"), 4)
    by_name = {spec.name: spec for spec in specs}
    q = by_name["model.layers.0.self_attn.q_proj.weight"]
    assert (q.shape, q.tp_dim, q.tp_size, q.full_shape) == ((512, 1024), 0, 4, (2048, 1024))
    o = by_name["model.layers.0.self_attn.o_proj.weight"]
    assert (o.shape, o.tp_dim) == ((1024, 512), 1)
    assert by_name["model.norm.weight"].tp_size == 1
    assert by_name["model.embed_tokens.weight"].tp_dim == 0


# ----------------------------------------------------------------------------- costs


class Symbolic:
    """A matrix that only knows its shape, counting flops as an algorithm runs on it."""

    flops = 0

    def __init__(self, rows: int, cols: int) -> None:
        self.rows, self.cols = rows, cols

    @property
    def T(self) -> Symbolic:
        return Symbolic(self.cols, self.rows)

    def __matmul__(self, other: Symbolic) -> Symbolic:
        assert self.cols == other.rows
        Symbolic.flops += 2 * self.rows * self.cols * other.cols
        return Symbolic(self.rows, other.cols)

    def scale(self) -> Symbolic:
        Symbolic.flops += self.rows * self.cols
        return self

    def __add__(self, other: Symbolic) -> Symbolic:
        Symbolic.flops += self.rows * self.cols
        return Symbolic(self.rows, self.cols)


def gram_newton_schulz(x: Symbolic, steps: int, restart: int = 2) -> Symbolic:
    """The Gram iteration, written independently of the planner, for counting."""
    r = x @ x.T
    q = None
    for step in range(steps):
        if step == restart:
            x = q @ x  # type: ignore[operator]
            r = x @ x.T
            q = None
        z = r.scale() + (r @ r).scale()
        if q is None:
            q = z
            Symbolic.flops += z.rows  # a·I on the diagonal
        else:
            q = q.scale() + z @ q
        if step < steps - 1 and step + 1 != restart:
            rz = r.scale() + z @ r
            r = rz.scale() + z @ rz
    return q @ x  # type: ignore[operator]


def standard_newton_schulz(x: Symbolic, steps: int) -> Symbolic:
    for _ in range(steps):
        a = x @ x.T
        b = a.scale() + (a @ a).scale()
        x = x.scale() + b @ x
    return x


@pytest.mark.parametrize("rows, cols", [(64, 320), (320, 64), (17, 100)])
def test_newton_schulz_counts_match_the_algorithms(rows: int, cols: int) -> None:
    n, m = min(rows, cols), max(rows, cols)
    Symbolic.flops = 0
    gram_newton_schulz(Symbolic(n, m), 5)
    assert newton_schulz_flops(rows, cols, steps=5, method="gram") == Symbolic.flops
    Symbolic.flops = 0
    standard_newton_schulz(Symbolic(n, m), 5)
    assert newton_schulz_flops(rows, cols, steps=5, method="standard") == Symbolic.flops


def test_gram_leading_terms_and_square_fallback() -> None:
    n, m = 1000, 5000
    gram = newton_schulz_flops(n, m, steps=5, method="gram")
    assert gram == pytest.approx(8 * n * n * m + 28 * n**3, rel=1e-2)
    assert newton_schulz_flops(n, m, method="standard") / gram > 1.5
    assert newton_schulz_flops(512, 512, method="gram") == newton_schulz_flops(512, 512, method="standard")


def test_flops_cost_model() -> None:
    muon = cost_model("flops", "muon")
    matrix = ParamSpec(name="w", shape=(64, 320), matrix=True)
    vector = ParamSpec(name="b", shape=(320,), matrix=False)
    assert muon.cost(vector) == ADAMW_FLOPS_PER_ELEMENT * 320
    assert muon.cost(matrix) == muon_flops((64, 320)) == newton_schulz_flops(64, 320) + 12 * 64 * 320
    conv = ParamSpec(name="c", shape=(8, 4, 3, 3), matrix=True)
    assert muon.cost(conv) == muon_flops((8, 36))
    shard = ParamSpec(name="w", shape=(16, 320), matrix=True, tp_dim=0, tp_size=4)
    assert muon.cost(shard) == muon.cost(matrix) / 4
    standard = cost_model("flops", "muon", ns_method="standard", ns_steps=6)
    assert standard.cost(matrix) == newton_schulz_flops(64, 320, steps=6, method="standard") + 12 * 64 * 320
    assert "ns_method=standard" in standard.label and "ns_steps=6" in standard.label
    assert cost_model("numel").cost(matrix) == 64 * 320


def test_shampoo_blocks_above_the_max_dimension() -> None:
    block = shampoo_flops((1024, 1024), max_preconditioner_dim=1024)
    assert shampoo_flops((2048, 2048), max_preconditioner_dim=1024) == pytest.approx(4 * block)
    assert shampoo_flops((2048, 1000), max_preconditioner_dim=1024) == pytest.approx(2 * shampoo_flops((1024, 1000)))
    a, b, f = 300, 500, 10
    expected = (
        4 * a * a * b + 3 * a * a + 4 * a * b * b + 3 * b * b + (11 * (a**3 + b**3) + a * a + b * b) / f + 20 * a * b
    )
    assert shampoo_flops((a, b), precondition_frequency=f) == pytest.approx(expected)
    assert shampoo_flops((a, b), precondition_frequency=1) > shampoo_flops((a, b), precondition_frequency=100)


def test_soap_leaves_long_sides_unrotated() -> None:
    rows, cols = 20000, 100
    rotated_right_only = 2 * rows * cols * cols * 4 + 3 * cols * cols + 15 * rows * cols
    refresh = ((16 / 3) * cols**3 + rows * cols) / 10
    assert soap_flops((rows, cols)) == pytest.approx(rotated_right_only + refresh)
    assert soap_flops((200, 100)) > soap_flops((200, 100), max_preconditioner_dim=150)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: cost_model("time"), "name"),
        (lambda: cost_model("flops", "adagrad"), "optimizer"),
        (lambda: cost_model("flops", "muon", beta=0.9), "option"),
        (lambda: cost_model("flops", "muon", ns_method="svd"), "ns_method"),
        (lambda: cost_model("flops", "shampoo", precondition_frequency=0), "precondition_frequency"),
        (lambda: cost_model("numel", ns_steps=5), "numel"),
    ],
)
def test_cost_model_errors(call, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        call()


def test_every_shipped_model_costs_are_finite() -> None:
    for optimizer in ("muon", "shampoo", "soap"):
        model = cost_model("flops", optimizer)
        costs = [model.cost(spec) for spec in model_specs("qwen3-8b")]
        assert all(math.isfinite(c) and c > 0 for c in costs)


# ----------------------------------------------------------------------------- roofline


def test_roofline_charges_elementwise_passes_for_their_bytes():
    balance = 30.0
    # The launch floor off: these tensors are small enough for the GPU default to set their cost.
    roofline = cost_model("roofline", "muon", machine_balance=balance, launch_bytes=0)
    embedding = ParamSpec(name="embed", shape=(4096, 256), matrix=False)
    matrix = ParamSpec(name="w", shape=(256, 1024), matrix=True)
    # AdamW: 24 fp32 element accesses per element, each byte worth `balance` matmul FLOPs.
    assert roofline.cost(embedding) == balance * 4 * 24 * 4096 * 256
    # Muon: Newton-Schulz at the matmul rate plus its 14 elementwise accesses per element.
    assert roofline.cost(matrix) == newton_schulz_flops(256, 1024) + balance * 4 * 14 * 256 * 1024
    # FLOPs alone make the embedding look nearly free next to the matrix; the roofline does not.
    flops = cost_model("flops", "muon")
    assert flops.cost(embedding) / flops.cost(matrix) < 0.05
    assert roofline.cost(embedding) / roofline.cost(matrix) > 1.0


@pytest.mark.parametrize("optimizer,options", [("muon", {"ns_method": "standard", "ns_steps": 6}),
                                               ("shampoo", {"precondition_frequency": 7}),
                                               ("soap", {"max_preconditioner_dim": 100})])
def test_step_work_adds_up_to_the_flops_model(optimizer, options):
    for shape in [(64, 320), (320, 64), (2048, 1000), (8, 3, 3, 3)]:
        spec = ParamSpec(name="w", shape=shape, matrix=True)
        work = optimizer_work(spec, optimizer, **options)
        assert work.flops == pytest.approx(cost_model("flops", optimizer, **options).cost(spec), rel=1e-12)
        assert work.matmul_flops >= 0 and work.elementwise_accesses > 0
        # A balance too small to matter leaves FLOPs; the elementwise part can only add.
        assert work.roofline(1e-9) == pytest.approx(work.flops, rel=1e-12)
        assert work.roofline(1e3) > work.flops


def test_roofline_tp_shard_and_label():
    roofline = cost_model("roofline", "muon", machine_balance=12.5, ns_method="standard")
    full = ParamSpec(name="w", shape=(256, 512), matrix=True)
    shard = ParamSpec(name="w", shape=(64, 512), matrix=True, tp_size=4, tp_dim=0)
    assert roofline.cost(shard) == pytest.approx(roofline.cost(full) / 4, rel=1e-12)
    assert roofline.label == \
        "roofline:muon(ns_method=standard,ns_steps=5,device=cuda,launch_bytes=1.5e+07,machine_balance=12.5)"
    assert cost_model("roofline").machine_balance == DEFAULT_MACHINE_BALANCE["cuda"]
    assert default_machine_balance("cpu") == DEFAULT_MACHINE_BALANCE["cpu"]
    assert default_machine_balance("xpu") == DEFAULT_MACHINE_BALANCE["cuda"]
    assert cost_model("roofline").launch_bytes == DEFAULT_LAUNCH_BYTES["cuda"]
    assert default_launch_bytes("cpu") == DEFAULT_LAUNCH_BYTES["cpu"]
    assert default_launch_bytes("xpu") == DEFAULT_LAUNCH_BYTES["cuda"]
    assert cost_model("roofline", launch_bytes=0).label.endswith(",launch_bytes=0,machine_balance=150)")
    # The device kind picks both defaults and how AdamW launches; given rates win over the defaults.
    on_cpu = cost_model("roofline", device="cpu")
    assert (on_cpu.device, on_cpu.machine_balance, on_cpu.launch_bytes) == \
        ("cpu", DEFAULT_MACHINE_BALANCE["cpu"], DEFAULT_LAUNCH_BYTES["cpu"])
    assert cost_model("roofline", device="cpu", machine_balance=12.5).machine_balance == 12.5
    assert ",device=cpu,launch_bytes=15000,machine_balance=30)" in on_cpu.label
    for device in ("", 0, None):
        with pytest.raises(PlanError, match="device"):
            RooflineCost(device=device)
    with pytest.raises(PlanError, match="device applies to the roofline cost model only"):
        cost_model("flops", device="cpu")


@pytest.mark.parametrize("balance", [0, -1.0, float("nan"), float("inf"), True, "30"])
def test_roofline_rejects_a_bad_machine_balance(balance):
    with pytest.raises(PlanError, match="machine_balance"):
        cost_model("roofline", machine_balance=balance)


@pytest.mark.parametrize("launch_bytes", [-1.0, float("nan"), float("inf"), True, "1e4"])
def test_roofline_rejects_a_bad_launch_bytes(launch_bytes):
    with pytest.raises(PlanError, match="launch_bytes"):
        cost_model("roofline", launch_bytes=launch_bytes)


def test_machine_balance_belongs_to_the_roofline_model_only():
    for name in ("flops", "numel"):
        with pytest.raises(PlanError, match="roofline cost model only"):
            cost_model(name, machine_balance=30.0)
        with pytest.raises(PlanError, match="launch_bytes applies to the roofline cost model only"):
            cost_model(name, launch_bytes=1e4)
    with pytest.raises(PlanError, match="'roofline', 'flops', 'numel'"):
        cost_model("time")


# ----------------------------------------------------------------------------- launch floor


def test_every_item_costs_at_least_its_launches():
    """cost = max(work, balance · launch_bytes · launches): the floor binds on tiny items only."""
    balance, launch = 150.0, 1.5e7
    roofline = cost_model("roofline", "muon", machine_balance=balance, launch_bytes=launch)
    bare = cost_model("roofline", "muon", machine_balance=balance, launch_bytes=0)
    norm = ParamSpec(name="norm", shape=(4096,), matrix=False)
    small = ParamSpec(name="k", shape=(1024, 4096), matrix=True)
    big = ParamSpec(name="gate", shape=(12288, 4096), matrix=True)
    # A norm's AdamW bytes are far under one launch on a GPU: its share of the foreach group's
    # launches (0.14 of a launch; a fifth of that is still more than its bytes) sets its cost; on
    # the CPU, at the same rates, its 10 per-tensor launches.
    assert bare.cost(norm) == balance * 4 * 24 * 4096 < 0.2 * balance * launch * step_launches(norm)
    assert roofline.cost(norm) == balance * launch * step_launches(norm)
    per_tensor = cost_model("roofline", "muon", machine_balance=balance, launch_bytes=launch, device="cpu")
    assert per_tensor.cost(norm) == balance * launch * ADAMW_LAUNCHES
    # A k_proj-sized Muon step is launch-bound at the GPU default too; an MLP matrix is not.
    launches = step_launches(small, "muon")
    assert launches == 4 + 4 + newton_schulz_launches(1024, 4096) == 71
    assert roofline.cost(small) == balance * launch * launches > bare.cost(small)
    assert roofline.cost(big) == bare.cost(big) > balance * launch * step_launches(big, "muon")
    # A TP shard carries 1/tp_size of the launches, as of the work.
    shard = ParamSpec(name="k", shape=(256, 4096), matrix=True, tp_size=4, tp_dim=0)
    assert roofline.cost(shard) == pytest.approx(roofline.cost(small) / 4, rel=1e-12)
    # The FLOPs and numel models know nothing of launches.
    assert cost_model("flops").cost(norm) == ADAMW_FLOPS_PER_ELEMENT * 4096


def test_thousands_of_tiny_tensors_are_not_free():
    """Priced by their bytes alone, 300 norms look free and pile onto one rank with its share of matrices.

    Where each tensor launches its own kernels (the CPU's foreach ops; here at the GPU's rates, so
    that the launches weigh as they do on a GPU without multi-tensor kernels).
    """
    from ds_canzona.plan import plan_dp_partitions

    specs = [ParamSpec(name=f"w{i}", shape=(1024, 1024), matrix=True) for i in range(8)]
    specs += [ParamSpec(name=f"norm{i}", shape=(64,), matrix=False) for i in range(300)]
    aware = cost_model("roofline", "muon", machine_balance=150.0, launch_bytes=1.5e7, device="cpu")
    bare = cost_model("roofline", "muon", machine_balance=150.0, launch_bytes=0)
    assert bare.cost(specs[-1]) < 1e-4 * bare.cost(specs[0])  # 64 elements of AdamW
    assert aware.cost(specs[-1]) == 150.0 * 1.5e7 * ADAMW_LAUNCHES > 0.2 * aware.cost(specs[0])
    # With CUDA's multi-tensor launches the 300 norms take 42.6 launches, under one matrix's 48.
    assert 300 * step_launches(specs[-1]) < step_launches(specs[0]) == 48
    blind = plan_dp_partitions(specs, world_size=4, bucket_numel=10**9, cost=bare)
    seeing = plan_dp_partitions(specs, world_size=4, bucket_numel=10**9, cost=aware)
    # Timed with the launches, the blind plan's busiest rank holds two matrices and every norm:
    # 3.66x the average; the plan that sees them is within 0.5% of it.
    blind_times = blind.rank_costs(aware)
    assert max(blind.rank_tensors()) == 302 and max(blind_times) > 3.6 * sum(blind_times) / 4
    assert seeing.flops_ratio < 1.005 and max(seeing.rank_tensors()) < 100


class _LaunchCounter:
    """Counts the ops one update dispatches that write a tensor of >= 1 dim (views and the 0-dim step counter out)."""

    def __enter__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if not func.is_view and any(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in tree_flatten(out)[0]):
                    counter.launches += 1
                return out

        self.launches = 0
        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def _counted_launches(group: dict, shape: tuple[int, ...], warm: int, steps: int) -> float:
    """Average launches over ``steps`` updates after ``warm`` ones, on the torch path of the rules."""
    import torch

    from ds_canzona import kernels
    from ds_canzona.optim import rule_for_group

    previous = kernels.get_backend()
    kernels.set_backend("torch")
    try:
        rule = rule_for_group(group)
        generator = torch.Generator().manual_seed(0)
        param = torch.randn(shape, generator=generator)
        state = rule.init_state(param)
        total = 0
        for step in range(warm + steps):
            grad = torch.randn(shape, generator=generator)
            if step < warm:
                rule.update_([param], [grad], [state], lr=1e-3, known_finite=True)
                continue
            with _LaunchCounter() as counter:
                rule.update_([param], [grad], [state], lr=1e-3, known_finite=True)
            total += counter.launches
        return total / steps
    finally:
        kernels.set_backend(previous)


@pytest.mark.parametrize("group, shape, options, warm, steps", [
    ({"kind": "muon", "weight_decay": 0.1}, (32, 64), {}, 1, 1),
    ({"kind": "muon", "weight_decay": 0.1}, (64, 32), {}, 1, 1),  # tall: one more, a contiguous transpose
    ({"kind": "muon", "weight_decay": 0.1}, (32, 32), {}, 1, 1),  # square: the standard iteration
    ({"kind": "muon", "weight_decay": 0.1}, (3, 32, 64), {}, 1, 1),  # a stack: per matrix, plus a copy each
    ({"kind": "muon", "weight_decay": 0.1}, (8, 4, 3, 3), {}, 1, 1),  # a convolution: one (8, 36) matrix
    ({"kind": "muon", "weight_decay": 0.1, "ns_method": "standard"}, (64, 32), {"ns_method": "standard"}, 1, 1),
    ({"kind": "muon", "weight_decay": 0.1, "ns_method": "standard"}, (3, 32, 64), {"ns_method": "standard"}, 1, 1),
    ({"kind": "muon", "weight_decay": 0.1, "ns_steps": 2}, (32, 64), {"ns_steps": 2}, 1, 1),
    ({"kind": "muon", "weight_decay": 0.1, "ns_steps": 7}, (32, 64), {"ns_steps": 7}, 1, 1),
    # NorMuon and AdaMuon: Muon's plus the normalisation and the rescale, once per tensor.
    ({"kind": "normuon", "weight_decay": 0.1}, (32, 64), {}, 1, 1),
    ({"kind": "normuon", "weight_decay": 0.1, "lr_scaling": "match_rms_adamw"}, (3, 32, 64),
     {"lr_scaling": "match_rms_adamw"}, 1, 1),
    ({"kind": "adamuon", "weight_decay": 0.1}, (64, 32), {}, 1, 1),
    ({"kind": "adamuon", "weight_decay": 0.1, "sign_momentum": False, "lr_scaling": "original"}, (8, 4, 3, 3),
     {"sign_momentum": False, "lr_scaling": "original"}, 1, 1),
    # Shampoo's roots and SOAP's bases refresh every precondition_frequency steps: over that many
    # steps past the start, one refresh each.
    ({"kind": "shampoo", "weight_decay": 0.1, "precondition_frequency": 3}, (32, 64),
     {"precondition_frequency": 3}, 3, 3),
    ({"kind": "shampoo", "weight_decay": 0.1, "precondition_frequency": 3, "max_preconditioner_dim": 32},
     (32, 64), {"precondition_frequency": 3, "max_preconditioner_dim": 32}, 3, 3),  # two blocks
    ({"kind": "soap", "weight_decay": 0.1, "precondition_frequency": 3}, (32, 64), {"precondition_frequency": 3}, 1, 3),
    ({"kind": "soap", "weight_decay": 0.1, "precondition_frequency": 3, "max_precond_dim": 40}, (32, 64),
     {"precondition_frequency": 3, "max_preconditioner_dim": 40}, 1, 3),  # the long side unrotated
    ({"kind": "soap", "weight_decay": 0.1, "precondition_frequency": 3, "max_precond_dim": 40}, (64, 32),
     {"precondition_frequency": 3, "max_preconditioner_dim": 40}, 1, 3),  # only the right side rotated
    ({"kind": "soap", "weight_decay": 0.1, "precondition_frequency": 3, "max_precond_dim": 40}, (64, 64),
     {"precondition_frequency": 3, "max_preconditioner_dim": 40}, 1, 3),  # no side rotated: Adam, no guard
    ({"kind": "shampoo", "weight_decay": 0.1, "precondition_frequency": 3, "max_preconditioner_dim": 32},
     (64, 32), {"precondition_frequency": 3, "max_preconditioner_dim": 32}, 3, 3),  # row blocks: contiguous
    # Expert stacks: each expert blocked or rotated on its own, the guard's read once per tensor.
    ({"kind": "shampoo", "weight_decay": 0.1, "precondition_frequency": 3}, (3, 32, 64),
     {"precondition_frequency": 3}, 3, 3),
    ({"kind": "shampoo", "weight_decay": 0.1, "precondition_frequency": 3, "max_preconditioner_dim": 24},
     (2, 64, 32), {"precondition_frequency": 3, "max_preconditioner_dim": 24}, 3, 3),  # 3 x 2 blocks per expert
    ({"kind": "soap", "weight_decay": 0.1, "precondition_frequency": 3}, (3, 32, 64), {"precondition_frequency": 3}, 1, 3),
    ({"kind": "soap", "weight_decay": 0.1, "precondition_frequency": 3, "max_precond_dim": 40}, (2, 64, 32),
     {"precondition_frequency": 3, "max_preconditioner_dim": 40}, 1, 3),
])
def test_launch_counts_are_what_the_rules_launch(group, shape, options, warm, steps):
    """The model's launches per step against the ops the matrix rules dispatch (torch path, weight decay on).

    AdamW runs foreach operations, which this counter sees once per list: its launches are counted
    per device below.
    """
    spec = ParamSpec(name="w", shape=shape, matrix=True)
    expected = step_launches(spec, group["kind"], **options)
    assert _counted_launches(group, shape, warm, steps) == pytest.approx(expected, rel=1e-12)


def _adamw_group_update(shapes: list[tuple[int, ...]], *, adam_w_mode: bool = True):
    """A warmed-up AdamW group (weight decay on) and a function running one more update of all of it."""
    import torch

    from ds_canzona.optim import rule_for_group

    rule = rule_for_group({"kind": "adamw", "weight_decay": 0.1, "adam_w_mode": adam_w_mode})
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(shape, generator=generator) for shape in shapes]
    grads = [torch.randn(shape, generator=generator) for shape in shapes]
    states = [rule.init_state(param) for param in params]

    def update() -> None:
        rule.update_(params, grads, states, lr=1e-3, known_finite=True)

    update()
    return update


class _ForeachOps:
    """The foreach operations one update dispatches on tensors of >= 1 dim, with each one's multi-tensor depth.

    The depth is how many tensor lists the operation hands torch's multi_tensor_apply: its list
    arguments, and its output list when it is not in place. Anything else dispatched on a tensor
    of >= 1 dim is recorded in ``others``.
    """

    def __enter__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        recorder = self

        def is_list(value) -> bool:
            return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(t, torch.Tensor) for t in value)

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
                if not any(t.dim() >= 1 for t in tensors):
                    return out  # the 0-dim step counters
                if func.__name__.startswith("_foreach_"):
                    lists = [a for a in list(args) + list((kwargs or {}).values()) if is_list(a)]
                    recorder.depths.append(len(lists) + (1 if is_list(out) else 0))
                else:
                    recorder.others.append(func.__name__)
                return out

        self.depths: list[int] = []
        self.others: list[str] = []
        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def _cpu_per_tensor_kernels(update) -> int:
    """Per-tensor ops the CPU's foreach operations run in one ``update``: profiler events directly under a foreach op.

    The CPU has no multi-tensor kernels: each foreach op calls its per-tensor op once per tensor,
    which the profiler records as that op's child. Children on 0-dim tensors (the step counters,
    scalars wrapped as tensors) do not count, as everywhere in the launch counts.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as profiler:
        update()
    return sum(1 for event in profiler.events()
               if event.cpu_parent is not None and event.cpu_parent.name.startswith("aten::_foreach_")
               and any(len(shape) >= 1 for shape in event.input_shapes if isinstance(shape, list)))


@pytest.mark.parametrize("shapes", [[(64,)], [(64,)] * 5, [(64,), (3, 7), (1000,), (2, 3, 4)]])
def test_adamw_rule_launches_on_the_cpu_as_the_model_counts(shapes):
    """A foreach group of n tensors on the CPU: ADAMW_LAUNCHES per-tensor kernels per tensor, and nothing else."""
    update = _adamw_group_update(shapes)
    with _ForeachOps() as ops:
        update()
    assert ops.others == []  # every launch of the rule on a tensor of >= 1 dim is inside a foreach op
    assert len(ops.depths) == ADAMW_LAUNCHES
    kernels = _cpu_per_tensor_kernels(update)
    specs = [ParamSpec(name=f"v{i}", shape=shape, matrix=False) for i, shape in enumerate(shapes)]
    assert kernels == sum(step_launches(spec, device="cpu") for spec in specs) == ADAMW_LAUNCHES * len(shapes)


def test_adamw_rule_hands_multi_tensor_apply_the_depths_the_model_assumes():
    """The model's CUDA launches are per foreach op at its depth (cost._ADAMW_FOREACH_DEPTHS): the rule's ops, in order."""
    from ds_canzona.plan.cost import _ADAMW_FOREACH_DEPTHS

    update = _adamw_group_update([(64,), (128,)])
    with _ForeachOps() as ops:
        update()
    assert tuple(ops.depths) == _ADAMW_FOREACH_DEPTHS
    # Adam's L2 mode adds the decay to a copy of the gradients and drops the decoupled one: as many ops.
    l2_update = _adamw_group_update([(64,)], adam_w_mode=False)
    with _ForeachOps() as l2:
        l2_update()
    assert len(l2.depths) == len(_ADAMW_FOREACH_DEPTHS)


def _multi_tensor_apply_launches(numels: list[int], depth: int) -> int:
    """Kernels torch's multi_tensor_apply launches for one foreach op on tensors of ``numels`` (CUDA).

    Its rule (aten/src/ATen/native/cuda/MultiTensorApply.cuh): walk the tensors' chunks in order;
    launch when the launch holds its most tensors (a tensor counts once its last chunk is in) or
    its most chunks, then carry an unfinished tensor into the next launch; launch what is left.
    """
    from ds_canzona.plan.cost import _MTA_CHUNK_NUMEL, _MTA_MAX_CHUNKS, _MTA_MAX_TENSORS

    launches = held_tensors = held_chunks = 0
    for numel in numels:
        held_tensors += 1
        chunks = -(-numel // _MTA_CHUNK_NUMEL)
        for chunk in range(chunks):
            held_chunks += 1
            last = chunk == chunks - 1
            if (held_tensors == _MTA_MAX_TENSORS[depth] and last) or held_chunks == _MTA_MAX_CHUNKS:
                launches += 1
                held_chunks = 0
                held_tensors = 0 if last else 1
    return launches + (held_chunks > 0)


@pytest.mark.parametrize("numel, count", [
    (64, 10560),  # norms: as many tensors as a launch holds (110, 64 or 48 by depth), a multiple of each
    (4096, 10560),
    (5 * 65536, 10560),  # 5 chunks: at depths 1 and 2 a launch fills its 320 chunks first
    (2**22, 40),  # an embedding piece of the runtime's split_numel: 64 chunks, five pieces a launch
])
def test_adamw_cuda_launches_are_a_full_groups_share(numel, count):
    """Summed over a group that fills its launches, the per-tensor share is exactly what multi_tensor_apply launches."""
    from ds_canzona.plan.cost import _ADAMW_FOREACH_DEPTHS

    launched = sum(_multi_tensor_apply_launches([numel] * count, depth) for depth in _ADAMW_FOREACH_DEPTHS)
    spec = ParamSpec(name="v", shape=(numel,), matrix=False)
    assert count * step_launches(spec) == pytest.approx(launched, rel=1e-12)
    assert step_launches(spec, device="cuda") == step_launches(spec)  # the model's default device


def test_adamw_cuda_launches_of_a_small_tensor():
    """One slot of a launch per op: 6 ops at depth 2 (64 tensors), one at 3 (48), 3 at 1 (110)."""
    small = ParamSpec(name="norm", shape=(4096,), matrix=False)
    assert step_launches(small) == 6 / 64 + 1 / 48 + 3 / 110
    # A group of a few small tensors still takes a whole launch per op, the model charges a share:
    # it prices each tensor alone, and a rank owns hundreds of them (tests above: exact when full).
    assert _multi_tensor_apply_launches([4096] * 3, 2) == 1
    # Past a launch's chunks, a tensor pays for its chunks: an embedding of 151936 x 2560 over 10 ops.
    embedding = ParamSpec(name="embed", shape=(151936, 2560), matrix=False)
    chunks = -(-151936 * 2560 // 65536)
    assert step_launches(embedding) == pytest.approx(10 * chunks / 320, rel=1e-12)
    assert sum(_multi_tensor_apply_launches([151936 * 2560], depth) for depth in (2, 3, 2, 2, 2, 1, 1, 2, 1, 2)) \
        == 10 * -(-chunks // 320)
    assert step_launches(embedding, device="cpu") == ADAMW_LAUNCHES


def test_calibrate_reports_the_launch_term_in_the_models_units(tmp_path, capsys):
    from ds_canzona.bench.benchmarks.calibrate import main as calibrate_main

    out = tmp_path / "calibrate.json"
    assert calibrate_main(["--matrix", "256", "--vector", str(2**18), "--repeats", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert 0 < data["launch_seconds"] < 1e-3
    assert data["launch_bytes"] == pytest.approx(data["launch_seconds"] * data["elementwise_bytes_per_s"])
    # One launch in matmul FLOPs is the balance times its bytes: the roofline model's floor per launch.
    assert data["launch_flops"] == pytest.approx(data["machine_balance"] * data["launch_bytes"], rel=1e-9)
    assert data["default_launch_bytes"] == DEFAULT_LAUNCH_BYTES["cpu"]
    assert "launch_bytes=" in capsys.readouterr().out


@pytest.mark.parametrize("optimizer, options", [
    ("shampoo", {"precondition_frequency": 3}),
    ("shampoo", {"precondition_frequency": 3, "max_preconditioner_dim": 8}),  # each expert cut into blocks
    ("soap", {"precondition_frequency": 3}),
    ("soap", {"precondition_frequency": 3, "max_preconditioner_dim": 16}),  # each expert's long side unrotated
])
def test_shampoo_and_soap_price_an_expert_stack_as_its_experts(optimizer, options) -> None:
    """A [E, rows, cols] stack is E matrices of rows x cols, as the rules update it (one set of
    statistics per expert): its work is E times one expert's, in FLOPs and on the roofline, and its
    launches are E times one expert's per-matrix launches on top of the tensor's own."""
    stack = ParamSpec(name="experts", shape=(4, 12, 20), matrix=True)
    expert = ParamSpec(name="expert", shape=(12, 20), matrix=True)
    for name in ("flops", "roofline"):
        # Launches off for the work: a stack launches its per-tensor kernels once (checked below).
        model = cost_model(name, optimizer, **({"launch_bytes": 0.0} if name == "roofline" else {}), **options)
        assert model.cost(stack) == pytest.approx(4 * model.cost(expert), rel=1e-12)
    one, two = (step_launches(ParamSpec(name="s", shape=(n, 12, 20), matrix=True), optimizer, **options)
                for n in (1, 2))
    assert one == pytest.approx(step_launches(expert, optimizer, **options), rel=1e-12)
    per_expert = step_launches(ParamSpec(name="s", shape=(3, 12, 20), matrix=True), optimizer, **options) - two
    assert per_expert > 0
    assert step_launches(stack, optimizer, **options) == pytest.approx(two + 2 * per_expert, rel=1e-12)
