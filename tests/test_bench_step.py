"""Smoke test of ``python -m ds_canzona.bench step`` on a tiny Qwen3 model (never on time).

Every system takes two steps on DP=2 gloo ranks; the JSON must hold every field, the
Newton-Schulz and byte counts must say what each scheme does, and the two schemes that run the
same math on the same all-reduced gradients (synchronous and layer-wise) must agree exactly.
The ZeRO-3 rows run in a test of their own: DeepSpeed's ZeRO-3 Muon reports time, bytes and
memory, and ds_canzona's stage-3 rows (tensors whole, and the embedding and head in pieces) are
measured the same way.
"""

from __future__ import annotations

import json

from ds_canzona.bench.benchmarks.step import SYSTEMS, ModelShape, main, model_numel

TINY = ["--hidden", "32", "--layers", "2", "--intermediate", "64", "--vocab", "128", "--heads", "2", "--kv-heads", "1",
        "--head-dim", "16", "--seq", "16", "--micro-batch", "1"]
MATRICES = 2 * 7
TINY_NUMEL = model_numel(ModelShape(hidden=32, layers=2, intermediate=64, vocab=128, heads=2, kv_heads=1, head_dim=16,
                                    seq=16, micro_batch=1))
ZERO3 = ("deepspeed-z3", "canzona-z3", "canzona-z3-pieces")
VOCAB_PIECES = 8  # canzona-z3-pieces: the embedding and the head in 8 pieces each


def test_step_command_runs_every_system(tmp_path):
    out = tmp_path / "step.json"
    systems = ",".join(key for key in SYSTEMS if key not in ZERO3)
    argv = ["--dp", "2", "--warmup", "1", "--steps", "1", "--shampoo-steps", "1", "--systems", systems,
            "--optimizers", "muon,normuon,adamuon,shampoo", "--json", str(out), *TINY]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert {"machine", "model", "settings", "results", "checks", "collectives"} <= set(data)
    results = {(r["system"], r["optimizer"]): r for r in data["results"]}
    expected = {(key, opt) for key, system in SYSTEMS.items() for opt in system.optimizers if key not in ZERO3}
    assert set(results) == expected
    for r in data["results"]:
        for name in ("iteration_s", "fwd_bwd_s", "step_s", "iteration_mean_s"):
            assert r[name] > 0.0
        assert r["dp"] == 2 and r["steps"] == 1
        assert sum(r["comm_payload_bytes"].values()) > 0
        assert r["matrix_state_bytes_max"] > 0
        assert r["memory"]["step_peak"]["max"] > r["memory"]["total"]["max"] > 0

    muon = {key: results[(key, "muon")] for key in SYSTEMS if key not in ZERO3}
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
    # NorMuon and AdaMuon run where Muon runs on ds_canzona's rows and the ZeRO-0 schemes.
    for opt in ("normuon", "adamuon"):
        assert results[("canzona-z1", opt)]["ns_runs_total"] == MATRICES
        assert results[("canzona-z2", opt)]["ns_runs_total"] == MATRICES
        assert results[("synchronous", opt)]["ns_runs_total"] == 2 * MATRICES
        assert results[("layerwise", opt)]["ns_runs_total"] == MATRICES
    # Same all-reduced gradients, same per-tensor rule: the same parameters after the first step.
    for opt in ("muon", "normuon", "adamuon", "shampoo"):
        assert results[("synchronous", opt)]["final_loss"] == results[("layerwise", opt)]["final_loss"]
        assert results[("canzona-z1", opt)]["final_loss"] == results[("canzona-z2", opt)]["final_loss"]


def _check_memory(row: dict, *, state_counted: bool = True, gradients_held: bool = True) -> None:
    memory = row["memory"]
    for name in ("parameters", "gradients", "optimizer", "total", "step_peak", "step_extra"):
        assert len(memory[name]["per_rank"]) == 2
        if name == "gradients" and not gradients_held:
            assert memory[name]["max"] == 0, "gradients held between steps"
            continue
        assert memory[name]["max"] >= memory[name]["avg"] > 0, name
    # The peak of a step (activations, gathered parameters, gradients) lies above what is held
    # between steps, and the walk found at least the optimizer state the engine-specific count sees.
    assert memory["step_peak"]["max"] > memory["total"]["max"]
    if state_counted:
        state = row["matrix_state_bytes_max"] + row["adamw_state_bytes_max"] + row["fp32_master_bytes_max"]
        assert memory["optimizer"]["max"] >= state > 0


def test_step_zero3_rows(tmp_path, capsys):
    out = tmp_path / "step.json"
    argv = ["--dp", "2", "--warmup", "1", "--steps", "1", "--systems", "deepspeed-z3,canzona-z3,canzona-z3-pieces,canzona-z2",
            "--optimizers", "muon", "--json", str(out), *TINY]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    results = {r["system"]: r for r in data["results"]}
    refused = {u["system"]: u for u in data["unavailable"]}

    deepspeed = results["deepspeed-z3"]
    assert deepspeed["stage"] == 3 and deepspeed["iteration_s"] > 0.0
    # reduce_scatter off: gradients all-reduced in full; parameters and Muon's inputs all-gathered.
    assert deepspeed["comm_payload_bytes"]["all_reduce"] >= 4 * TINY_NUMEL
    assert deepspeed["comm_payload_bytes"]["all_gather"] > 0
    assert deepspeed["ns_runs_total"] == MATRICES  # round-robin: each matrix on one rank
    _check_memory(deepspeed)
    _check_memory(results["canzona-z2"])
    # ZeRO-2 keeps every parameter on every rank, in its flat buckets: exactly the model in fp32.
    assert results["canzona-z2"]["memory"]["parameters"]["max"] == 4 * TINY_NUMEL
    assert "ZeRO-3, Muon, DP=2" in printed and "Memory per rank, Muon, DP=2" in printed

    # ds_canzona's stage 3 is measured like DeepSpeed's: each matrix orthogonalised once, on its
    # owner, and no gradient held between steps (each is reduced to its owner and consumed there).
    assert "canzona-z3" not in refused, refused.get("canzona-z3")
    assert results["canzona-z3"]["stage"] == 3
    assert results["canzona-z3"]["ns_runs_total"] == MATRICES
    _check_memory(results["canzona-z3"], state_counted=False, gradients_held=False)

    # In pieces: the same bytes and the same training, one more reduce per step for each piece
    # beyond the first of the embedding and the head (one reduce per owned item, as above).
    whole, pieces = results["canzona-z3"], results["canzona-z3-pieces"]
    _check_memory(pieces, state_counted=False, gradients_held=False)
    assert pieces["ns_runs_total"] == MATRICES
    assert pieces["comm_calls"]["reduce"] == whole["comm_calls"]["reduce"] + 2 * (VOCAB_PIECES - 1)
    assert pieces["comm_calls"]["broadcast"] > whole["comm_calls"]["broadcast"]
    for kind in ("reduce", "broadcast"):
        assert pieces["comm_payload_bytes"][kind] == whole["comm_payload_bytes"][kind], kind
    assert pieces["final_loss"] == whole["final_loss"]  # the step is bit-exact in pieces or whole
    assert "ds_canzona ZeRO-3, pieces vs whole" in printed


class _Holder:
    """An optimizer-like object: tensors under gradient and non-gradient names, one only in a closure."""

    def __init__(self, model, grad_bucket, momentum, cache):
        self.ipg_buffer = grad_bucket
        self.state = {model.weight: {"momentum_buffer": momentum}}
        self.params = list(model.parameters())  # already counted as parameters
        self.fetch = lambda: cache  # reachable only through a closure


def test_held_bytes_counts_each_storage_once_by_category():
    import types

    import torch
    from ds_canzona.bench.standins._memory import held_bytes

    model = torch.nn.Linear(8, 4, bias=False)  # 128 bytes
    model.weight.grad = torch.zeros(4, 8)  # 128
    flat = torch.zeros(100)  # 400: two views of it count once
    grad_bucket, cache = [flat[:10], flat[50:]], torch.zeros(30)  # 120 in a closure
    optimizer = _Holder(model, grad_bucket, torch.zeros(16), cache)  # momentum 64
    model.register_buffer("table", torch.zeros(5))  # 20, the engine's via the module
    engine = types.SimpleNamespace(module=model, optimizer=optimizer)
    assert held_bytes(engine) == {"parameters": 128, "gradients": 128 + 400, "optimizer": 64 + 120, "other": 20,
                                  "total": 128 + 528 + 184 + 20}


def test_step_memory_peak_sees_a_step_temporary():
    import types

    import torch
    from ds_canzona.bench.standins._memory import measure_step_memory

    model = torch.nn.Linear(8, 4, bias=False)
    engine = types.SimpleNamespace(module=model, optimizer=types.SimpleNamespace())
    kept = []

    def run_step(k: int) -> None:
        temporary = torch.ones(1_000_000)  # 4 MB, freed at return
        kept.append(torch.ones(1000) * float(temporary[0]))  # 4 KB that outlive the step (not the engine's)

    memory = measure_step_memory(engine, run_step)
    assert memory["total"] == memory["held_after"] == 128
    assert memory["step_net"] == 4000
    assert 4_000_000 <= memory["step_extra"] < 4_000_000 + 10_000
    assert memory["step_peak"] == 128 + memory["step_extra"]


def test_step_ops_counts_launches_per_owned_item(tmp_path, capsys):
    # One rank (the cheapest spawn): the counts are per owned item, and every item is owned here.
    out = tmp_path / "ops.json"
    assert main(["--ops", "--dp", "1", "--systems", "canzona-z2", "--warmup", "1", "--json", str(out), *TINY]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["before"] is None  # recorded for the default model only
    (row,) = data["systems"]["canzona-z2"]
    assert row["items"]["adamw"] > 1 and row["items"]["matrix"] == MATRICES
    launches = row["launches"]
    assert launches["adamw"] > 0 and launches["matrix"] > 0 and launches["step"] > 0
    # The foreach AdamW launches per group (about 10), where the per-tensor form launched 9 per tensor.
    assert launches["adamw"] < row["items"]["adamw"] * 2
    assert row["allocated"]["adamw"] > 0
    assert "launches per AdamW item (in the rule)" in printed and "canzona-z2:" in printed
