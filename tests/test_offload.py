"""Optimizer offload (ds_canzona.zero.offload): offloaded training equals training without it, bit for bit.

``zero_optimization.offload_optimizer: {"device": "cpu"}`` moves each owner's fp32 masters and
optimizer state to the host; the same per-tensor rules run on the same values, so parameters and
state after every step must equal the run without offload exactly, at every stage, optimizer,
dtype and accumulation. On the CPU accelerator the "device" is host memory too, so the placement
is real but the copies are host to host: these tests check the logic and count the bytes (each
step's bytes are derived here from the owned tensors' sizes, independently of the counter).

Two spawns in all (the suite is near its CI limit): DP=2 runs its pairs and saves checkpoints,
DP=3 runs its pairs and loads those checkpoints crosswise (saved offloaded, loaded without, and the
reverse, at another world size).
"""

from __future__ import annotations

import copy

import pytest
import torch

from distributed import run_ranks

STEPS = 10
MUON = {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 0.003, "weight_decay": 0.01}}
SHAMPOO = {"type": "Shampoo", "params": {"lr": 0.003, "adam_lr": 0.003, "precondition_frequency": 2}}
SOAP = {"type": "SOAP", "params": {"lr": 0.003, "adam_lr": 0.003, "precondition_frequency": 2}}
OFFLOAD = {"device": "cpu", "pin_memory": True}
# Small enough that the tiny model's matrices go in many waves (each 24x24 Muon matrix stages
# 3 x 2304 bytes), so the double-buffered loop runs more than one wave per group.
SMALL_STAGING = 16_000


def _config(world_size: int, *, stage: int, optimizer: dict, bf16: bool, ga: int, offload: bool,
            staging: int | None = None) -> dict:
    from zero_workers import make_config

    config = make_config(world_size, stage=stage, optimizer=copy.deepcopy(optimizer),
                         gradient_accumulation_steps=ga)
    if bf16:
        config["bf16"] = {"enabled": True}
    if offload:
        config["zero_optimization"]["offload_optimizer"] = dict(OFFLOAD)
    if staging is not None:
        config["canzona"]["offload_staging_bytes"] = staging
    return config


def _pairs(world_size: int, cases: list[dict]) -> list[dict]:
    runs = []
    for case in cases:
        for offload in (False, True):
            settings = {k: v for k, v in case.items() if k not in ("save",)}
            run = {"config": _config(world_size, offload=offload, **settings), "steps": STEPS}
            if "save" in case:
                run["save"] = (case["save"], "offloaded" if offload else "plain", 3)
            runs.append(run)
    return runs


DP2_CASES = [
    dict(stage=1, optimizer=SOAP, bf16=False, ga=1),
    dict(stage=2, optimizer=MUON, bf16=True, ga=3),
    dict(stage=3, optimizer=SHAMPOO, bf16=False, ga=3),
]
DP3_CASES = [
    dict(stage=1, optimizer=MUON, bf16=True, ga=3),
    dict(stage=2, optimizer=SHAMPOO, bf16=True, ga=1),
    dict(stage=2, optimizer=MUON, bf16=False, ga=1, staging=SMALL_STAGING),
    dict(stage=3, optimizer=SOAP, bf16=True, ga=1),
    dict(stage=3, optimizer=MUON, bf16=False, ga=3),
]


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    from offload_workers import offload_runs

    save_dir = str(tmp_path_factory.mktemp("offload_ckpt"))
    cases = [dict(case) for case in DP2_CASES]
    cases[1]["save"] = save_dir  # stage 2, Muon, bf16: checkpoints after step 3, with and without offload
    return run_ranks(offload_runs, 2, _pairs(2, cases), timeout=1200), save_dir


@pytest.fixture(scope="module")
def dp3(dp2):
    from offload_workers import offload_runs

    _, save_dir = dp2
    runs = _pairs(3, DP3_CASES)
    # Continue the DP=2 checkpoints at DP=3: the plain one with offload, the offloaded one without,
    # and the plain one without (the reference both must equal bit for bit).
    resume = dict(stage=2, optimizer=MUON, bf16=True, ga=3)
    for tag, offload in (("plain", True), ("offloaded", False), ("plain", False)):
        runs.append({"config": _config(3, offload=offload, **resume), "steps": 2, "load": (save_dir, tag),
                     "first": 3})
    return run_ranks(offload_runs, 3, runs, timeout=1200)


def _assert_equal(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{what}: {len(different)} of {len(a)} tensors differ, e.g. {different[:3]}"


def _expected_step_bytes(result: dict) -> tuple[int, int]:
    """(to device, to host) per step, from the owned tensors: what the data path should move.

    A matrix item's fp32 master and state go to the device and back; a non-matrix item's fp32
    gradient comes to the host and its new low-precision values go to the device.
    """
    to_device = to_host = 0
    for name, kind in result["owned_kinds"].items():
        numel, state = result["owned_numel"][name], result["owned_state_numel"][name]
        if kind == "adamw":
            to_host += 4 * numel
            to_device += result["param_bytes"] * numel
        else:
            to_device += 4 * (numel + state)
            to_host += 4 * (numel + state)
    return to_device, to_host


def _check_pairs(per_rank: list[list[dict]], cases: list[dict]) -> None:
    for rank, results in enumerate(per_rank):
        for k, case in enumerate(cases):
            plain, offloaded = results[2 * k], results[2 * k + 1]
            label = f"rank {rank}, {case}"
            _assert_equal(plain["params"], offloaded["params"], f"params, {label}")
            assert plain["owned"].keys() == offloaded["owned"].keys(), label
            for name in plain["owned"]:
                _assert_equal({k: v for k, v in plain["owned"][name].items() if torch.is_tensor(v)},
                              {k: v for k, v in offloaded["owned"][name].items() if torch.is_tensor(v)},
                              f"state of {name}, {label}")
            assert offloaded["masters_on_host"] and not offloaded["masters_share_params"], label
            assert plain["step_bytes"] == [] and len(offloaded["step_bytes"]) == STEPS, label
            assert set(offloaded["step_bytes"]) == {_expected_step_bytes(offloaded)}, label
            assert offloaded["host_bytes"] == sum(4 * (offloaded["owned_numel"][n] + offloaded["owned_state_numel"][n])
                                                  for n in offloaded["owned_numel"]), label


def test_offload_equals_no_offload_dp2(dp2):
    per_rank, _ = dp2
    _check_pairs(per_rank, DP2_CASES)
    assert "offload_optimizer cpu" in per_rank[0][1]["summary"]


def test_offload_equals_no_offload_dp3(dp3):
    _check_pairs([results[:2 * len(DP3_CASES)] for results in dp3], DP3_CASES)


def test_checkpoints_cross_offload_and_world_size(dp2, dp3):
    """Saved offloaded at DP=2 and loaded without offload at DP=3, and the reverse: the same continuation."""
    for rank, results in enumerate(dp3):
        plain_into_offloaded, offloaded_into_plain, reference = results[2 * len(DP3_CASES):]
        _assert_equal(plain_into_offloaded["params"], reference["params"], f"plain -> offloaded, rank {rank}")
        _assert_equal(offloaded_into_plain["params"], reference["params"], f"offloaded -> plain, rank {rank}")
        assert plain_into_offloaded["masters_on_host"], rank
        for name, saved in reference["loaded"].items():
            for key in saved:
                if torch.is_tensor(saved[key]):
                    assert torch.equal(plain_into_offloaded["loaded"][name][key], saved[key]), (rank, name, key)
                    assert torch.equal(offloaded_into_plain["loaded"][name][key], saved[key]), (rank, name, key)
