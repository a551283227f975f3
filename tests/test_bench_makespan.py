"""Smoke tests of ``python -m ds_canzona.bench makespan`` and the emulated strategies (never on time)."""

from __future__ import annotations

import json

import pytest

from ds_canzona.bench.benchmarks.baselines import (
    deepspeed_muon_loads,
    deepspeed_partition_touches,
    layerwise_loads,
    lpt_owners,
    synchronous_loads,
)
from ds_canzona.bench.benchmarks.makespan import STRATEGIES, main, scaled_config
from ds_canzona.plan import ParamSpec


def test_deepspeed_partitions_are_equal_cuts_of_the_padded_group():
    # 3 tensors of 5, 5, 2 elements at DP 2: 12 elements, padded to a multiple of 4 -> 12, cut at 6.
    touches = deepspeed_partition_touches([5, 5, 2], 2)
    assert [(first, last) for first, last, _ in touches] == [(0, 0), (0, 1), (1, 1)]
    assert touches[1][2] == [1, 4]
    # 10 elements at DP 3: padded to 12, partitions of 4.
    assert [(f, l) for f, l, _ in deepspeed_partition_touches([3, 3, 4], 3)] == [(0, 0), (0, 1), (1, 2)]


def test_deepspeed_muon_sorts_the_matrix_group_and_repeats_straddlers():
    specs = [ParamSpec(name="small", shape=(2, 2), matrix=True), ParamSpec(name="big", shape=(4, 3), matrix=True),
             ParamSpec(name="norm", shape=(8,), matrix=False)]
    times = [1.0, 10.0, 4.0]
    loads, runs = deepspeed_muon_loads(specs, times, 2)
    # Sorted: big (12) then small (4); 16 elements cut at 8: big straddles, small sits on rank 1.
    assert runs == 3
    assert loads == [10.0 + 2.0, 10.0 + 1.0 + 2.0]


def test_whole_tensor_strategies():
    assert lpt_owners([5.0, 4.0, 3.0, 3.0], 2) == [0, 1, 1, 0]
    assert layerwise_loads([5.0, 4.0, 3.0, 3.0], [1.0, 1.0, 1.0, 1.0], 2) == [2.0, 2.0]
    assert synchronous_loads([1.0, 2.0], 3) == [3.0, 3.0, 3.0]


def test_scaled_config_keeps_layers_and_head_dim():
    config = scaled_config("qwen3-8b", 4)
    assert config["hidden_size"] == 1024 and config["intermediate_size"] == 3072
    assert config["num_hidden_layers"] == 36 and config["head_dim"] == 128
    with pytest.raises(ValueError):
        scaled_config("qwen3-8b", 0)


def test_makespan_command_writes_json(tmp_path):
    out = tmp_path / "makespan.json"
    plot = tmp_path / "makespan.png"
    argv = ["--models", "qwen3-0.6b", "--scale", "64", "--dp", "2,4", "--repeats", "1", "--json", str(out)]
    try:
        import matplotlib  # noqa: F401
        argv += ["--plot", str(plot)]
    except ImportError:
        plot = None
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert {"machine", "settings", "timings", "rows"} <= set(data)
    assert [row["dp"] for row in data["rows"]] == [2, 4]
    assert data["settings"]["machine_balance"] == 30.0  # the runtime's CPU default
    for row in data["rows"]:
        assert row["machine_balance"] == 30.0
        assert row["split_numel"] == 2**22 // 64**2  # the runtime's piece size, scaled like the model
        for strategy in STRATEGIES:
            assert row[strategy] > 0.0
        assert row["synchronous"] >= row["ds_canzona"]
        assert row["deepspeed_ns_runs"] >= row["matrices"]
        assert row["state_mib"] > 0 and row["state_ratio"] >= 1.0 and row["state_ratio_layerwise"] >= 1.0
    if plot is not None:
        assert plot.stat().st_size > 0
    # Re-scored from the stored times: nothing is timed again, and the same plans give the same numbers.
    again = tmp_path / "again.json"
    assert main(argv[:8] + ["--json", str(again), "--timings", str(out)]) == 0
    reused = json.loads(again.read_text())
    assert reused["timings"] == data["timings"] and reused["rows"] == data["rows"]
    # --split-numel 0 means whole tensors, as in the config and `ds-canzona plan`.
    whole = tmp_path / "whole.json"
    assert main(argv[:8] + ["--json", str(whole), "--timings", str(out), "--split-numel", "0"]) == 0
    for row in json.loads(whole.read_text())["rows"]:
        assert row["split_numel"] is None and row["ds_canzona"] == row["ds_canzona_whole"]


def test_dispatcher_lists_the_benchmarks(capsys):
    from ds_canzona.bench.__main__ import COMMANDS
    from ds_canzona.cli import dispatch

    assert "makespan" in COMMANDS and "step" in COMMANDS
    assert dispatch("python -m ds_canzona.bench", COMMANDS, ["makespan", "--help"]) == 0
    assert dispatch("python -m ds_canzona.bench", COMMANDS, ["makespan", "--dp", "0", "--models", "qwen3-0.6b"]) == 2


def test_calibrate_measures_a_positive_balance_consistent_with_its_rates(tmp_path, capsys):
    from ds_canzona.bench.benchmarks.calibrate import main as calibrate_main

    out = tmp_path / "calibrate.json"
    assert calibrate_main(["--matrix", "384", "--vector", str(2**20), "--repeats", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["device"] == "cpu" and data["threads"] == 1 and data["default"] == 30.0
    assert data["elementwise_bytes_per_s"] > 0 and data["matmul_flops_per_s"] > 0
    assert data["machine_balance"] == pytest.approx(data["matmul_flops_per_s"] / data["elementwise_bytes_per_s"])
    assert '"machine_balance": ' in capsys.readouterr().out
