"""Specs from live modules and HuggingFace configs (meta device), against the torch-free generator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds_canzona.plan import (
    ParamSpec,
    PlanError,
    load_model_config,
    plan_dp_partitions,
    qwen3_specs,
    specs_from_hf_config,
    specs_from_module,
)
from ds_canzona.plan.models import model_config_path

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def small(name: str, **overrides: object) -> dict:
    """A shipped config shrunk in depth and vocabulary, so the meta model builds quickly."""
    config = load_model_config(name)
    config.update({"num_hidden_layers": 3, "vocab_size": 1000, **overrides})
    return config


@pytest.mark.parametrize(
    "config",
    [
        small("qwen3-0.6b"),  # tied head
        small("qwen3-8b"),  # separate head
        small("qwen3-1.7b", attention_bias=True),  # biased attention projections
    ],
    ids=["tied", "untied", "attention-bias"],
)
def test_qwen3_generator_matches_the_meta_model(config: dict, tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    from_model = specs_from_hf_config(path)
    assert from_model == qwen3_specs(config), "same names, shapes, order and matrix flags"


def test_hf_config_folder_and_shipped_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(small("qwen3-4b")))
    specs = specs_from_hf_config(tmp_path)
    assert specs[0].name == "model.embed_tokens.weight" and not specs[0].matrix
    shipped = specs_from_hf_config(model_config_path("qwen3-0.6b"))
    assert shipped == qwen3_specs(load_model_config("qwen3-0.6b"))


def test_hf_config_errors(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="Cannot read"):
        specs_from_hf_config(tmp_path / "missing.json")
    broken = tmp_path / "config.json"
    broken.write_text("{")
    with pytest.raises(PlanError, match="Cannot load"):
        specs_from_hf_config(broken)


def test_specs_from_module_skips_frozen_and_tied_params() -> None:
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(50, 8)
            self.body = torch.nn.Linear(8, 16)
            self.frozen = torch.nn.Linear(16, 16)
            self.frozen.requires_grad_(False)
            self.conv = torch.nn.Conv1d(4, 6, 3)
            self.lm_head = torch.nn.Linear(8, 50, bias=False)
            self.lm_head.weight = self.embed.weight

    specs = specs_from_module(Net())
    assert specs == [
        ParamSpec(name="embed.weight", shape=(50, 8), matrix=False),
        ParamSpec(name="body.weight", shape=(16, 8), matrix=True),
        ParamSpec(name="body.bias", shape=(16,), matrix=False),
        ParamSpec(name="conv.weight", shape=(6, 4, 3), matrix=True),
        ParamSpec(name="conv.bias", shape=(6,), matrix=False),
    ]
    custom = specs_from_module(Net(), matrix_rule=lambda name, shape: name.startswith("conv") and len(shape) > 1)
    assert [s.matrix for s in custom] == [False, False, False, True, False]
    plan = plan_dp_partitions(specs, world_size=3, bucket_numel=1000)
    assert len(plan.owner) == 5


def test_incomplete_hf_config_says_which_sizes_are_transformers_defaults(tmp_path: Path, capsys) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    specs = specs_from_hf_config(tmp_path)
    note = capsys.readouterr().err
    assert "num_hidden_layers=32" in note and "vocab_size=32000" in note and "LlamaConfig's defaults" in note
    assert "hidden_size" not in note, "hidden_size is in the file"
    assert sum(spec.name.endswith("q_proj.weight") for spec in specs) == 32, "the note describes what was planned"

    complete = tmp_path / "complete.json"
    complete.write_text(json.dumps(small("qwen3-0.6b")))
    specs_from_hf_config(complete)
    note = capsys.readouterr().err
    assert "num_hidden_layers" not in note and "vocab_size" not in note, note


# ----------------------------------------------------------------- other families, planned with the defaults

def test_other_families_meet_the_balance_targets_through_hf_config(tmp_path: Path, capsys) -> None:
    """Busiest cost within 2% of LPT, busiest memory within max(1.25 x avg, 1.05 x largest item), DP 16-128."""
    from ds_canzona.cli import main
    from ds_canzona.plan import cost_model, lpt_loads

    roofline = cost_model("roofline", "muon", machine_balance=150.0)  # what `ds-canzona plan` uses by default
    kwargs = {"bucket_numel": 500_000_000, "split_numel": 2**22, "cost": roofline}
    from ds_canzona.bench.benchmarks.balance import FAMILY_CONFIGS

    for name, config in FAMILY_CONFIGS.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(config))
        specs = specs_from_hf_config(path)
        if name == "qwen2.5-7b":
            assert any(spec.name.endswith("q_proj.bias") for spec in specs)
        if name == "olmoe-64-experts":
            assert any(spec.shape[0] == 64 and len(spec.shape) == 3 for spec in specs)
        for world in (16, 32, 64, 128):
            plan = plan_dp_partitions(specs, world_size=world, **kwargs)
            assert max(plan.rank_costs()) <= 1.02 * max(lpt_loads(plan.costs, world)), (name, world)
            average = sum(plan.memory) / world
            target = max(1.25 * average, 1.05 * max(plan.memory))
            assert max(plan.rank_memory()) <= target, (name, world, plan.state_bytes_ratio)
        # The user's own path: the command line plans the same thing.
        assert main(["plan", "--hf-config", str(path), "--dp", "64", "--json"]) == 0
        document = json.loads(capsys.readouterr().out)
        assert document["digest"] == plan_dp_partitions(specs, world_size=64, **kwargs).digest(), name
