"""``ds-canzona plan`` / ``python -m ds_canzona.plan`` and ``python -m ds_canzona.bench``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ds_canzona.cli import main

SHAPES = [
    {"name": "embed.weight", "shape": [1000, 64], "matrix": False},
    {"name": "l0.q.weight", "shape": [64, 64], "matrix": True},
    {"name": "l0.up.weight", "shape": [256, 64], "matrix": True},
    {"name": "l0.norm.weight", "shape": [64], "matrix": False},
    {"name": "l1.q.weight", "shape": [64, 64], "matrix": True},
    {"name": "l1.up.weight", "shape": [256, 64], "matrix": True},
    {"name": "head.weight", "shape": [1000, 64], "matrix": True},
]


@pytest.fixture
def shapes(tmp_path: Path) -> Path:
    path = tmp_path / "shapes.json"
    path.write_text(json.dumps(SHAPES))
    return path


def test_json_output_is_one_object_with_the_schema(shapes: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--shapes", str(shapes), "--dp", "3", "--bucket-numel", "20000", "--json"]) == 0
    out = capsys.readouterr().out
    document = json.loads(out)
    assert out.count("\n") == 1
    for key in (
        "world_size",
        "strategy",
        "alpha",
        "cost_model",
        "bucket_numel",
        "buckets",
        "params",
        "ranks",
        "flops_ratio",
        "memory_ratio",
    ):
        assert key in document
    assert document["world_size"] == 3 and document["bucket_numel"] == 20000
    assert [p["name"] for p in document["params"]] == [e["name"] for e in SHAPES]
    for bucket in document["buckets"]:
        assert len(bucket["cuts"]) == 4 and bucket["cuts"][0] == 0 and bucket["cuts"][-1] == bucket["numel"]
    for param in document["params"]:
        cuts = document["buckets"][param["bucket"]]["cuts"]
        assert cuts[param["owner"]] <= param["offset"] < cuts[param["owner"] + 1]
    assert len(document["ranks"]) == 3


def test_table_output(shapes: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--shapes", str(shapes), "--dp", "2", "--strategy", "uniform", "--cost", "numel"]) == 0
    out = capsys.readouterr().out
    assert "rank" in out and "max/avg" in out and "uniform" in out


def test_table_names_the_tensor_that_bounds_the_busiest_rank(capsys: pytest.CaptureFixture[str]) -> None:
    # Whole, Qwen3-8B's AdamW embedding (151936 x 4096) outweighs a rank's share at DP=128, not at DP=16:
    # its cost over the average, 1.851 x at the GPU defaults (the launch floor raises every small
    # matrix's cost, while a norm is charged its share of CUDA's multi-tensor launches).
    from ds_canzona.plan import cost_model, model_specs

    specs = model_specs("qwen3-8b")
    costs = [cost_model("roofline", "muon").cost(spec) for spec in specs]
    share = f"{costs[0] / (sum(costs) / 128):.3f}"
    assert specs[0].name == "model.embed_tokens.weight"
    assert main(["plan", "--model", "qwen3-8b", "--dp", "128", "--split-numel", "0"]) == 0
    out = capsys.readouterr().out
    assert f"the costliest tensor alone, model.embed_tokens.weight, is {share} x" in out
    assert "(--split-numel plans non-matrix tensors in pieces)" in out
    assert f"roofline {share}" in out and f"unconstrained LPT reaches {share}" in out
    assert main(["plan", "--model", "qwen3-8b", "--dp", "16", "--split-numel", "0"]) == 0
    assert "costliest tensor alone" not in capsys.readouterr().out
    # In pieces (the default, as the runtime) the embedding spreads out.
    assert main(["plan", "--model", "qwen3-8b", "--dp", "128", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["split_numel"] == 4194304 and document["flops_ratio"] < 1.3
    assert any(p["name"].startswith("model.embed_tokens.weight[") for p in document["params"])


def test_roofline_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "qwen3-0.6b", "--dp", "8", "--machine-balance", "30", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["cost_model"] == "roofline" and "machine_balance=30)" in document["cost_label"]
    assert main(["plan", "--model", "qwen3-0.6b", "--dp", "8", "--cost", "flops", "--machine-balance", "30"]) == 2
    assert "--machine-balance applies to --cost roofline only" in capsys.readouterr().err


def test_model_shortcut_with_tp(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "Qwen3-0.6B", "--dp", "4", "--tp", "2", "--alpha", "0.5", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["tp"]["tp_size"] == 2 and document["tp"]["groups"]
    assert main(["plan", "--model", "qwen3-0.6b", "--dp", "4", "--tp", "2", "--optimizer", "soap"]) == 0
    assert "TP micro-groups" in capsys.readouterr().out


@pytest.mark.parametrize("optimizer", ["normuon", "adamuon"])
def test_the_muon_variants_are_priced_as_the_runtime_prices_them(optimizer, capsys: pytest.CaptureFixture[str]) -> None:
    from ds_canzona.plan import cost_model

    assert main(["plan", "--model", "qwen3-0.6b", "--dp", "8", "--optimizer", optimizer, "--ns-method", "standard",
                 "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["cost_label"] == cost_model("roofline", optimizer, ns_method="standard").label


def test_plot(shapes: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    target = tmp_path / "ranks.png"
    assert main(["plan", "--shapes", str(shapes), "--dp", "4", "--plot", str(target)]) == 0
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--shapes", "EMPTY"], "empty"),
        (["--shapes", "ZERO"], "positive"),
        (["--shapes", "MISSING"], "Cannot read"),
        (["--shapes", "SHAPES", "--alpha", "1.5"], "alpha"),
        (["--shapes", "SHAPES", "--alpha", "-0.5"], "alpha"),
        (["--shapes", "SHAPES", "--dp", "0"], "--dp"),
        (["--shapes", "SHAPES", "--tp", "-1"], "--tp"),
        (["--shapes", "SHAPES", "--bucket-numel", "0"], "bucket-numel"),
        (["--shapes", "SHAPES", "--strategy", "best"], "strategy"),
        (["--hf-config", "MISSING"], "Cannot read"),
        (["--model", "qwen3-99b"], "Unknown model"),
        ([], "required"),
    ],
)
def test_bad_input_is_one_error_line(
    arguments: list[str], message: str, shapes: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = {
        "EMPTY": tmp_path / "empty.json",
        "ZERO": tmp_path / "zero.json",
        "MISSING": tmp_path / "missing.json",
        "SHAPES": shapes,
    }
    files["EMPTY"].write_text("[]")
    files["ZERO"].write_text('[{"name": "w", "shape": [3, 0]}]')
    argv = ["plan", *(str(files.get(a, a)) for a in arguments)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_unknown_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["nope"]) == 2
    assert "unknown command" in capsys.readouterr().err
    assert main(["--help"]) == 0
    assert "plan" in capsys.readouterr().out


def test_shapes_path_does_not_import_torch(shapes: Path) -> None:
    script = (
        "import sys, io, contextlib\n"
        "from ds_canzona.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    assert main(['plan', '--shapes', {str(shapes)!r}, '--dp', '8', '--json']) == 0\n"
        "heavy = sorted(m for m in ('torch', 'deepspeed', 'transformers', 'numpy') if m in sys.modules)\n"
        "print(heavy)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_module_entry_points(shapes: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ds_canzona.plan", "--shapes", str(shapes), "--dp", "2", "--json"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0 and json.loads(result.stdout)["world_size"] == 2
    bench = subprocess.run([sys.executable, "-m", "ds_canzona.bench", "nope"], capture_output=True, text=True)
    assert bench.returncode == 2 and "balance" in bench.stderr


def test_bench_balance_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ds_canzona.bench.__main__ import COMMANDS
    from ds_canzona.cli import dispatch

    output = tmp_path / "balance.json"
    arguments = ["balance", "--models", "qwen3-1.7b", "--dp", "16", "--buckets", "4e7", "--sweep-model", "qwen3-0.6b"]
    assert dispatch("bench", COMMANDS, [*arguments, "--sweep-dp", "8", "--json", str(output)]) == 0
    out = capsys.readouterr().out
    assert "| qwen3-1.7b | 16 |" in out and "Alpha sweep" in out
    document = json.loads(output.read_text())
    assert len(document["balance"]) == 1 and len(document["alpha_sweep"]) == 11
    row = document["balance"][0]
    assert row["alpha_flops"] <= 1.05 * row["lpt"] and row["uniform"] > row["alpha_flops"]


def test_memory_columns_bounds_and_cap(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "qwen3-0.6b", "--dp", "4"]) == 0
    out = capsys.readouterr().out
    assert "state bytes" in out and "bytes/avg" in out
    assert "cost lower bounds: average" in out and "state bytes lower bounds: average" in out
    assert "(model.embed_tokens.weight[0:4194304])" in out  # the largest item in bytes, named
    assert "the average binds" in out
    assert main(["plan", "--model", "qwen3-0.6b", "--dp", "4", "--dtype", "fp32", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["memory_model"] == "state_bytes:muon(param_bytes=4)"
    assert all(rank["state_bytes"] > 0 for rank in document["ranks"])
    assert main(["plan", "--model", "qwen3-0.6b", "--dp", "4", "--max-state-bytes", "1e6"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("ds-canzona plan: error: max_state_bytes_per_rank=1,000,000 cannot be met")
    assert error.count("\n") == 1


def test_stage3_owner_plan(capsys: pytest.CaptureFixture[str]) -> None:
    """--stage 3 prints the ZeRO-3 owner plan the runtime builds (plan_zero3_owners, same split_numel)."""
    from ds_canzona.plan import DEFAULT_SPLIT_NUMEL, cost_model, model_specs, plan_zero3_owners

    assert main(["plan", "--model", "qwen3-0.6b", "--dp", "8", "--stage", "3"]) == 0
    out = capsys.readouterr().out
    assert "ZeRO-3 owner placement" in out and "347 items (38 of them pieces of at most 4,194,304 elements)" in out
    assert "largest item model.embed_tokens.weight[0:4194304]" in out
    assert main(["plan", "--model", "qwen3-0.6b", "--dp", "8", "--stage", "3", "--split-numel", "0"]) == 0
    out = capsys.readouterr().out
    assert "pieces" not in out and "largest item model.embed_tokens.weight (155,582,464 elements, 2.088" in out
    assert main(["plan", "--model", "qwen3-0.6b", "--dp", "8", "--stage", "3", "--cost", "flops", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    plan = plan_zero3_owners(model_specs("qwen3-0.6b"), world_size=8, cost=cost_model("flops"),
                             split_numel=DEFAULT_SPLIT_NUMEL)
    assert document["digest"] == plan.digest() and [p["owner"] for p in document["params"]] == list(plan.owner)
    for flag in (["--tp", "2"], ["--max-state-bytes", "1e9"]):
        assert main(["plan", "--model", "qwen3-0.6b", "--dp", "8", "--stage", "3", *flag]) == 2
        assert f"{flag[0]} does not apply with --stage 3" in capsys.readouterr().err
