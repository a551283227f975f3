"""Optimizer offload (ds_canzona.zero.offload): offloaded training equals training without it, bit for bit.

``zero_optimization.offload_optimizer: {"device": "cpu"}`` moves each owner's fp32 masters and
optimizer state to the host; the same per-tensor rules run on the same values, so parameters and
state after every step must equal the run without offload exactly, at every stage, optimizer,
dtype and accumulation. On the CPU accelerator the "device" is host memory too, so the placement
is real but the copies are host to host: these tests check the logic and count the bytes (each
step's bytes are derived here from the owned tensors' sizes, independently of the counter).

DeepSpeed's own offloaded Muon (where its cpu_adam op is built): within the dense comparison's
bound after 8 steps, and the host<->device bytes of one more of its steps, metered at run time,
equal to the count read from its code (what ``bench step-offload`` reports for it).

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
NORMUON = {"type": "NorMuon", "params": {"lr": 0.02, "adam_lr": 0.003, "weight_decay": 0.01}}
ADAMUON = {"type": "AdaMuon", "params": {"lr": 0.003, "weight_decay": 0.01}}
SHAMPOO = {"type": "Shampoo", "params": {"lr": 0.003, "adam_lr": 0.003, "precondition_frequency": 2}}
SOAP = {"type": "SOAP", "params": {"lr": 0.003, "adam_lr": 0.003, "precondition_frequency": 2}}
OFFLOAD = {"device": "cpu", "pin_memory": True}
# Small enough that the tiny model's matrices go in many waves (each 24x24 Muon matrix stages
# 3 x 2304 bytes), so the double-buffered loop runs more than one wave per group.
SMALL_STAGING = 16_000
CAP = 30_000


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
    dict(stage=1, optimizer=NORMUON, bf16=False, ga=1),  # its row moments staged, and in the host-bytes model
]
DP3_CASES = [
    dict(stage=1, optimizer=MUON, bf16=True, ga=3),
    dict(stage=2, optimizer=SHAMPOO, bf16=True, ga=1),
    dict(stage=2, optimizer=MUON, bf16=False, ga=1, staging=SMALL_STAGING),
    dict(stage=3, optimizer=SOAP, bf16=True, ga=1),
    dict(stage=3, optimizer=MUON, bf16=False, ga=3),
    dict(stage=3, optimizer=ADAMUON, bf16=True, ga=1),
]


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    from offload_workers import offload_runs

    save_dir = str(tmp_path_factory.mktemp("offload_ckpt"))
    cases = [dict(case) for case in DP2_CASES]
    cases[1]["save"] = save_dir  # stage 2, Muon, bf16: checkpoints after step 3, with and without offload
    runs = _pairs(2, cases)
    # canzona.max_state_bytes_per_rank caps device bytes: offloaded, only the gradient segments
    # (busiest rank 27,168 bytes here, fp32); without offload the masters' state counts too.
    for offload in (True, False):
        capped = _config(2, stage=2, optimizer=MUON, bf16=False, ga=1, offload=offload)
        capped["canzona"]["max_state_bytes_per_rank"] = CAP
        runs.append({"config": capped, "steps": 1})
    return run_ranks(offload_runs, 2, runs, timeout=1200), save_dir


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
    _check_pairs([results[:2 * len(DP2_CASES)] for results in per_rank], DP2_CASES)
    assert "offload_optimizer cpu" in per_rank[0][1]["summary"]


def test_plan_splits_host_and_device_bytes_and_caps_the_device(dp2):
    per_rank, _ = dp2
    for results in per_rank:
        for result in results[:2 * len(DP2_CASES)]:
            if result["plan_host_bytes"] is not None:  # offloaded, stage 1 or 2
                # The memory model's host bytes are what the runtime allocated on the host.
                assert result["plan_host_bytes"] == result["host_bytes"]
                assert "in host memory" in result["plan_summary"]
        capped_offloaded, capped_plain = results[2 * len(DP2_CASES):]
        assert "init_error" not in capped_offloaded, capped_offloaded.get("init_error")
        assert f"max_state_bytes_per_rank={CAP:,} cannot be met" in capped_plain["init_error"]


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


# --------------------------------------------------------------------------- DeepSpeed's CPU Adam on the host

def _cpu_adam_available() -> bool:
    """Whether DeepSpeed's cpu_adam op loads without a build: prebuilt, or already in the JIT cache.

    Its JIT build takes minutes on a 2-core machine (CI), so the tests below run where it is
    ready, or where DS_CANZONA_TEST_CPU_ADAM=1 asks for the build.
    """
    import importlib.util
    import os

    if os.environ.get("DS_CANZONA_TEST_CPU_ADAM") == "1":
        return True
    from deepspeed.ops.op_builder import CPUAdamBuilder

    builder = CPUAdamBuilder()
    if importlib.util.find_spec(builder.absolute_name()) is not None:
        return True
    from torch.utils.cpp_extension import _get_build_directory

    built = os.path.join(_get_build_directory(builder.name, verbose=False), f"{builder.name}.so")
    return os.path.exists(built)


# DeepSpeed's kernel computes the same AdamW with the bias corrections folded into the step size
# and the square root (lr / (1 - beta1^t) and sqrt(v) / sqrt(1 - beta2^t) + eps), in AVX fp32, so
# each step differs from ds_canzona's rule by fp32 roundings, which grow slowly with the steps.
# Measured on this CPU over 10 steps: the largest relative difference of a parameter grows from
# 2.8e-7 to 9.3e-7 (the unit test below; the engine run stays inside the same bound); the bound
# leaves 4x room.
CPU_ADAM_RTOL = 4e-6


@pytest.mark.skipif(not _cpu_adam_available(), reason="DeepSpeed's cpu_adam op is not built here (its JIT build "
                    "takes minutes; set DS_CANZONA_TEST_CPU_ADAM=1 to build it)")
def test_deepspeed_cpu_adam_agrees_with_the_adamw_rule():
    from ds_canzona.optim import rule_for_group
    from ds_canzona.zero.offload import _CPUAdamKernel

    torch.manual_seed(0)
    group = {"kind": "adamw", "lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01}
    rule, kernel = rule_for_group(group), _CPUAdamKernel()
    params = [torch.randn(257), torch.randn(31, 17)]
    ours = [p.clone() for p in params]
    states_ours = [rule.init_state(p) for p in ours]
    states_ds = [rule.init_state(p) for p in params]
    worst = 0.0
    for _ in range(10):
        grads = [torch.randn_like(p) for p in params]
        rule.update_(ours, [g.clone() for g in grads], states_ours, lr=group["lr"], known_finite=True)
        kernel.update_(group, params, [g.clone() for g in grads], states_ds)
        for a, b in zip(params, ours):
            worst = max(worst, float(((a - b).abs() / b.abs().clamp_min(1e-3)).max()))
    assert worst <= CPU_ADAM_RTOL, worst
    assert worst > 0.0  # a different kernel: if this ever holds bit for bit, the notes should say so
    for a, b in zip(states_ds, states_ours):
        assert a["step"] == b["step"] == 10
        # Its moments are m = beta1 m + (1 - beta1) g (the rule: lerp): the same to fp32 rounding of
        # entries of order 0.1-1, so near-zero entries need an absolute bound (measured: at most 1.5e-7
        # for exp_avg and 3e-7 for exp_avg_sq after 10 steps).
        torch.testing.assert_close(a["exp_avg"], b["exp_avg"], rtol=CPU_ADAM_RTOL, atol=1e-6)
        torch.testing.assert_close(a["exp_avg_sq"], b["exp_avg_sq"], rtol=CPU_ADAM_RTOL, atol=1e-6)


@pytest.mark.skipif(not _cpu_adam_available(), reason="DeepSpeed's cpu_adam op is not built here (its JIT build "
                    "takes minutes; set DS_CANZONA_TEST_CPU_ADAM=1 to build it)")
def test_engine_with_deepspeed_cpu_adam_on_the_host():
    from offload_workers import host_adam_runs

    configs = [_config(1, stage=2, optimizer=MUON, bf16=False, ga=1, offload=True) for _ in range(2)]
    configs[1]["canzona"]["offload_host_adam"] = "deepspeed_cpu_adam"
    ours, theirs = run_ranks(host_adam_runs, 1, configs, 10)[0]
    assert "DeepSpeed's CPU Adam" in theirs["summary"]
    for name, p in ours["params"].items():
        if ours["kinds"][name] == "adamw":
            torch.testing.assert_close(theirs["params"][name], p, rtol=CPU_ADAM_RTOL, atol=1e-6)
    # Matrices see the AdamW items only through the loss; after 10 steps they still agree closely.
    assert any(not torch.equal(theirs["params"][n], p) for n, p in ours["params"].items())


# --------------------------------------------------------------------------- DeepSpeed's own offloaded Muon

@pytest.mark.skipif(not _cpu_adam_available(), reason="DeepSpeed's offload_optimizer builds DeepSpeedCPUAdam, whose "
                    "cpu_adam op is not built here (its JIT build takes minutes; DS_CANZONA_TEST_CPU_ADAM=1 builds it)")
def test_matches_deepspeeds_offloaded_muon():
    """DP 2, stage 2, both offloaded: within tests/test_param_groups.py's bound of DeepSpeed's Muon after 8 steps.

    The model has an embedding and a head on AdamW, biases, norms, a 3-D expert stack and a layer
    that never gets a gradient; the bound and the reasons the rounding differs are those of the
    dense comparison (``DEEPSPEED_PARITY``): offloading moves where the state lives, not the math,
    on either side.
    """
    from offload_workers import deepspeed_offload_parity
    from test_param_groups import DEEPSPEED_PARITY
    from tiny_model import make_moe_model

    results = run_ranks(deepspeed_offload_parity, 2, 2, timeout=900)
    result = results[0]
    assert result["offloaded"]
    start = {n: p.detach() for n, p in make_moe_model().named_parameters()}
    worst = {}
    for name, theirs in result["deepspeed"].items():
        moved = (theirs - start[name]).norm()
        if moved == 0:  # no gradient and no weight decay (unused.bias): nothing may move it
            assert torch.equal(result["ours"][name], start[name]), name
            continue
        worst[name] = float((result["ours"][name] - theirs).norm() / moved)
    print("worst relative difference to DeepSpeed's offloaded Muon:", max(worst.items(), key=lambda kv: kv[1]))
    assert max(worst.values()) < DEEPSPEED_PARITY, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    assert len(worst) == len(result["deepspeed"]) - 1

    # DeepSpeed's host<->device bytes of one more step (bench step-offload's count): every copy_ its
    # run made between its host tensors and the rest equals the count read from its code, on
    # both ranks, on a model whose unused layer skips the gradient copy but not the Muon update.
    for rank, ranked in enumerate(results):
        moved = ranked["bytes"]
        assert moved["muon_slice_numel"] > 0 and moved["metered"].to_host > 0, (rank, moved)
        assert moved["metered"] == moved["from_code"], (rank, moved)
        # At least the whole fp32 partition back to the device, and two fp32 tensors per Muon element each way.
        assert moved["metered"].to_device >= 4 * (moved["partition_numel"] + 2 * moved["muon_slice_numel"]), moved


# --------------------------------------------------------------------------- the host<->device copy meter

def test_copy_meter_counts_copies_across_the_host_boundary_at_the_crossing_dtype():
    """bench step-offload's meter of DeepSpeed's copies, on tensors whose placement the test declares.

    Copies count once, in their direction, only when exactly one side is a declared host tensor
    (views count as their storage); a conversion counts at the dtype PyTorch moves (module
    docstring of ds_canzona.bench.standins.offload_bytes); one-element copies are not counted.
    """
    from ds_canzona.bench.standins.offload_bytes import CopyCount, HostDeviceCopyMeter

    host = torch.zeros(64)
    device = torch.zeros(64, dtype=torch.bfloat16)
    other_device = torch.zeros(16)
    meter = HostDeviceCopyMeter(lambda: {host.untyped_storage().data_ptr()})
    with meter:
        device.copy_(host)                            # to device, converted on the host: 64 bf16
        host.narrow(0, 8, 16).copy_(other_device)     # to host, blocking: 16 fp32
        host.narrow(0, 0, 32).copy_(device[:32], non_blocking=True)  # to host, converted on the device: 32 fp32
        host.narrow(0, 0, 32).copy_(device[:32])      # to host, blocking: 32 bf16
        other_device.copy_(device[:16])               # device to device: not counted
        host[:16].copy_(host[16:32])                  # host to host: not counted
        host[:1].copy_(other_device[:1])              # one element: not counted
        host.add_(1.0)                                # not a copy
    assert meter.count == CopyCount(to_device=64 * 2, to_host=16 * 4 + 32 * 4 + 32 * 2)
