"""Smoke test of ``python -m ds_canzona.bench step`` on a tiny Qwen3 model (never on time).

Every system takes two steps on DP=2 gloo ranks; the JSON must hold every field, the
Newton-Schulz and byte counts must say what each scheme does, and the two schemes that run the
same math on the same all-reduced gradients (synchronous and layer-wise) must agree exactly.
"""

from __future__ import annotations

import json

from ds_canzona.bench.step import SYSTEMS, main

TINY = ["--hidden", "32", "--layers", "2", "--intermediate", "64", "--vocab", "128", "--heads", "2", "--kv-heads", "1",
        "--head-dim", "16", "--seq", "16", "--micro-batch", "1"]
MATRICES = 2 * 7


def test_step_command_runs_every_system(tmp_path):
    out = tmp_path / "step.json"
    argv = ["--dp", "2", "--warmup", "1", "--steps", "1", "--shampoo-steps", "1", "--json", str(out), *TINY]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert {"machine", "model", "settings", "results", "checks", "collectives"} <= set(data)
    results = {(r["system"], r["optimizer"]): r for r in data["results"]}
    expected = {(key, opt) for key, system in SYSTEMS.items() for opt in system.optimizers}
    assert set(results) == expected
    for r in data["results"]:
        for name in ("iteration_s", "fwd_bwd_s", "step_s", "iteration_mean_s"):
            assert r[name] > 0.0
        assert r["dp"] == 2 and r["steps"] == 1
        assert sum(r["comm_payload_bytes"].values()) > 0
        assert r["matrix_state_bytes_max"] > 0

    muon = {key: results[(key, "muon")] for key in SYSTEMS}
    # ds_canzona orthogonalises each matrix once, on its owner; synchronous on every rank.
    assert muon["canzona-z1"]["ns_runs_total"] == MATRICES
    assert muon["canzona-z2"]["ns_runs_total"] == MATRICES
    assert muon["layerwise"]["ns_runs_total"] == MATRICES
    assert muon["synchronous"]["ns_runs_total"] == 2 * MATRICES
    assert muon["deepspeed-z2"]["ns_runs_total"] >= MATRICES
    # ds_canzona reduce-scatters; the ZeRO-0 schemes all-reduce; layer-wise broadcasts in the step.
    assert muon["canzona-z2"]["comm_calls"].get("reduce_scatter", 0) >= 1
    assert muon["synchronous"]["comm_calls"].get("all_reduce", 0) >= 1
    assert muon["layerwise"]["comm_calls"].get("broadcast", 0) >= 1
    # Half the Muon state of DeepSpeed's (no staging copy), none duplicated.
    assert muon["canzona-z1"]["matrix_state_bytes_total"] < muon["deepspeed-z1"]["matrix_state_bytes_total"]
    assert muon["synchronous"]["matrix_state_bytes_max"] == muon["layerwise"]["matrix_state_bytes_total"]
    # Same all-reduced gradients, same per-tensor rule: the same parameters after the first step.
    for opt in ("muon", "shampoo"):
        assert results[("synchronous", opt)]["final_loss"] == results[("layerwise", opt)]["final_loss"]
        assert results[("canzona-z1", opt)]["final_loss"] == results[("canzona-z2", opt)]["final_loss"]
