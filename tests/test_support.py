"""What the engine hook refuses (ds_canzona.zero.support) and what it accepts, at deepspeed.initialize.

Every refusal must be one CanzonaConfigError that names the key or feature, raised before
ds_canzona allocates anything; the cases run one after another in one spawned rank (world size 1
is enough: each is refused before any collective of ours). Keys with no numeric effect here must
still build an engine.
"""

from __future__ import annotations

import pytest

from distributed import run_ranks


class FakeMpu:
    """An mpu as Megatron-style code passes one: data parallel of size 1 plus one other dimension."""

    def __init__(self, **sizes: int):
        self.sizes = sizes

    def get_data_parallel_world_size(self):
        return 1

    def get_data_parallel_rank(self):
        return 0

    def get_model_parallel_world_size(self):
        return self.sizes.get("tensor", 1)

    def get_model_parallel_rank(self):
        return 0

    def get_sequence_parallel_world_size(self):
        return self.sizes.get("sequence", 1)

    def get_pipe_parallel_world_size(self):
        return self.sizes.get("pipe", 1)


def _moe_model():
    import torch
    from deepspeed.moe.layer import MoE
    from tiny_model import make_model

    model = make_model()
    model.moe = MoE(hidden_size=24, expert=torch.nn.Linear(24, 24), num_experts=2, ep_size=1)
    return model


def _pipeline_model():
    import torch
    from deepspeed.pipe import PipelineModule

    return PipelineModule(layers=[torch.nn.Linear(8, 8)], num_stages=1, loss_fn=torch.nn.MSELoss())


# (label, top-level config changes, zero_optimization changes, what initialize gets besides the config,
#  what the message must contain)
REFUSED = [
    ("stage 0", {}, {"stage": 0}, {}, "zero_optimization.stage is 0"),
    ("stage 3 parameter offload", {}, {"stage": 3, "offload_param": {"device": "cpu"}}, {},
     "zero_optimization.offload_param"),
    ("stage 3 memory cap", {"canzona": {"max_state_bytes_per_rank": 10**9}}, {"stage": 3}, {},
     "canzona.max_state_bytes_per_rank"),
    ("no optimizer", {"optimizer": None}, {}, {}, "needs an optimizer"),
    ("pipeline module", {}, {}, {"model": "pipeline"}, "pipeline parallelism"),
    # MoE trains at stages 1 and 2, with offload too (tests/test_expert_parallel.py); not at stage 3.
    ("moe layers at stage 3", {}, {"stage": 3}, {"model": "moe"}, "expert parallelism at ZeRO stage 3"),
    ("autoep", {"expert_parallel": {"enabled": True}}, {}, {}, "expert_parallel.enabled"),
    # AutoTP itself is supported (tests/test_tp.py); with an mpu of the user's it is not.
    ("autotp with an mpu", {"tensor_parallel": {"autotp_size": 2}}, {}, {"mpu": {}}, "together with an mpu"),
    ("mpu tensor parallel", {}, {}, {"mpu": {"tensor": 2}}, "tensor/model parallel world size 2"),
    ("mpu sequence parallel", {}, {}, {"mpu": {"sequence": 2}}, "sequence parallel world size 2"),
    # DeepSpeed divides the world size by it: 0.5 here, so the batch size is left for it to derive.
    ("mpu pipeline parallel", {}, {}, {"mpu": {"pipe": 2}}, "pipeline parallel world size 2"),
    ("sequence_parallel_size", {"sequence_parallel_size": 2, "train_batch_size": None}, {}, {},
     "sequence_parallel_size"),
    ("unmanaged accumulation", {"managed_gradient_accumulation": False}, {}, {}, "managed_gradient_accumulation"),
    ("zero++ weights", {}, {"zero_quantized_weights": True}, {}, "zero_quantized_weights"),
    ("zero++ gradients", {}, {"zero_quantized_gradients": True}, {}, "zero_quantized_gradients"),
    ("zero++ hpz", {}, {"zero_hpz_partition_size": 2}, {}, "zero_hpz_partition_size"),
    ("zenflow", {}, {"zenflow": {"topk_ratio": 0.1}}, {}, "zero_optimization.zenflow"),
    # offload_optimizer device cpu is supported (tests/test_offload.py); these variants of it are not.
    ("nvme offload", {}, {"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}, {},
     "offload_optimizer.device 'nvme'"),
    # DeepSpeed itself refuses ratio < 1 below stage 3.
    ("partial offload", {}, {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}, {},
     "offload_optimizer.ratio 0.5"),
    ("super offload", {}, {"offload_optimizer": {"device": "cpu", "super_offload": True}}, {},
     "offload_optimizer.super_offload"),
    ("universal load", {"checkpoint": {"load_universal": True}}, {}, {}, "checkpoint.load_universal"),
    ("node-local storage", {"checkpoint": {"use_node_local_storage": True}}, {}, {}, "use_node_local_storage"),
    ("checkpoint writer", {"checkpoint": {"writer": {"type": "fast"}}}, {}, {}, "checkpoint.writer"),
    ("pipeline-stage writes", {"checkpoint": {"parallel_write": {"pipeline_stage": True}}}, {}, {},
     "checkpoint.parallel_write.pipeline_stage"),
    ("bf16 master weights", {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}, {}, {},
     "bf16_master_weights_and_grads"),
    ("deepcompile", {"compile": {"deepcompile": True}}, {}, {}, "compile.deepcompile"),
    ("bf16 without the overflow check", {"bf16": {"enabled": True, "check_grad_overflow": False}}, {}, {},
     "bf16.check_grad_overflow"),
    ("bf16 without the overflow check, stage 3", {"bf16": {"enabled": True, "check_grad_overflow": False}},
     {"stage": 3}, {}, "bf16.check_grad_overflow"),
    # Refused in the optimizer's construction, still inside deepspeed.initialize (tests/test_adam_keys.py).
    ("adam amsgrad", {"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "amsgrad": True}}}, {}, {}, "amsgrad"),
    ("zero++ nontrainable weights", {}, {"zero_quantized_nontrainable_weights": True}, {},
     "zero_quantized_nontrainable_weights"),
    ("optimizer type", {"optimizer": {"type": "Lamb", "params": {"lr": 0.01}}}, {}, {}, "optimizer types Muon, NorMuon, AdaMuon, Shampoo, SOAP and AdamW"),
    # DeepSpeed's ZeRO-1/2 asserts the same (test_allgather_bucket_size_is_refused_as_deepspeed_refuses_it).
    ("odd allgather_bucket_size", {}, {"allgather_bucket_size": 1001}, {}, "zero_optimization.allgather_bucket_size 1001"),
]

# Read by DeepSpeed's own ZeRO-1/2 for its communication schedule; no numeric effect here.
ACCEPTED_ZERO_KEYS = {"overlap_comm": True, "contiguous_gradients": False, "reduce_scatter": False,
                      "allgather_bucket_size": 1000, "allgather_partitions": False, "round_robin_gradients": True,
                      "reduce_bucket_size": 3000, "use_multi_rank_bucket_allreduce": False,
                      "elastic_checkpoint": True, "ignore_unused_parameters": False}


def _initialize(config: dict, extra: dict):
    import deepspeed
    import ds_canzona  # noqa: F401  (registers the engine hook)
    from tiny_model import make_model

    deepspeed.init_distributed(dist_backend="gloo")
    model = {"pipeline": _pipeline_model, "moe": _moe_model}.get(extra.get("model"), make_model)()
    mpu = FakeMpu(**extra["mpu"]) if "mpu" in extra else None
    engine, *_ = deepspeed.initialize(model=model, config=config, mpu=mpu)
    return engine


def _outcomes(rank, world_size, cases):
    from zero_workers import make_config
    from ds_canzona.config import CanzonaConfigError

    outcomes = []
    for _, top, zero, extra, _ in cases:
        config = make_config(world_size)
        config["zero_optimization"].update(zero)
        config.update(top)
        config = {key: value for key, value in config.items() if value is not None}
        try:
            engine = _initialize(config, extra)
            outcomes.append(("ok", type(engine.optimizer).__name__))
        except CanzonaConfigError as error:
            outcomes.append(("CanzonaConfigError", str(error)))
        except Exception as error:  # anything else is a bug in how we report bad input
            outcomes.append((type(error).__name__, str(error)[:300]))
    return outcomes


def _compression_training_case() -> list:
    """DeepSpeed 0.19.0-0.19.6 have compression training (0.19.7+ refuse the section themselves)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    if not hasattr(DeepSpeedEngine, "_configure_compression_scheduler"):
        return []
    section = {"weight_quantization": {"shared_parameters": {"enabled": False}, "different_groups": {}}}
    return [("compression", {"compression_training": section}, {}, {}, "compression_training")]


def _fp16_cases() -> list:
    """fp16 keys, where the accelerator has fp16 (elsewhere DeepSpeed refuses fp16 itself, first)."""
    from deepspeed.accelerator import get_accelerator

    if not get_accelerator().is_fp16_supported():
        return []
    return [("fp16 master weights", {"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, {}, {},
             "fp16_master_weights_and_grads")]


def test_refusals_are_one_clear_error_naming_the_key():
    cases = REFUSED + _compression_training_case() + _fp16_cases()
    outcomes = run_ranks(_outcomes, 1, cases, timeout=300)[0]
    problems = []
    for (label, *_, key), (kind, message) in zip(cases, outcomes):
        if kind != "CanzonaConfigError" or key not in message or "\n" in message:
            problems.append(f"{label}: {kind}: {message}")
    assert not problems, "\n".join(problems)
    stage0 = outcomes[0][1]
    assert "set zero_optimization.stage to 1, 2 or 3" in stage0


def _assertions(rank, world_size, configs):
    """Per config: the AssertionError ``deepspeed.initialize`` raised, as (type name, message), or "built"."""
    outcomes = []
    for config in configs:
        try:
            _initialize(config, {})
            outcomes.append("built")
        except AssertionError as error:
            outcomes.append((type(error).__name__, str(error)))
    return outcomes


def test_allgather_bucket_size_is_refused_as_deepspeed_refuses_it():
    """An allgather_bucket_size that is not a multiple of 2 stops stock DeepSpeed's ZeRO-1/2 with an
    AssertionError; ds_canzona stops it at the same point with one too (a CanzonaConfigError as well)."""
    from zero_workers import make_config

    configs = []
    for stage in (1, 2):
        for canzona in (True, False):
            config = make_config(1, stage=stage)
            config["zero_optimization"]["allgather_bucket_size"] = 1001
            if not canzona:
                config.pop("canzona")
                config["optimizer"] = {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}
            configs.append(config)
    even = make_config(1, stage=2)
    even["zero_optimization"]["allgather_bucket_size"] = 1000
    outcomes = run_ranks(_assertions, 1, configs + [even], timeout=300)[0]
    phrase = "allgather_bucket_size must be a multiple of nccl_start_alignment_factor"
    for (config, outcome) in zip(configs, outcomes):
        assert outcome != "built" and phrase in outcome[1], (config, outcome)
        assert outcome[0] == ("CanzonaConfigAssertion" if "canzona" in config else "AssertionError"), outcome
    assert outcomes[-1] == "built"


def test_unused_parameters_stop_every_rank_when_not_ignored():
    """zero_optimization.ignore_unused_parameters false at stages 1/2: a step in which any rank saw
    a trainable tensor without a gradient raises on every rank (no rank left waiting in a
    collective), with a message naming the key, before anything is updated; true (the default)
    trains on. DeepSpeed asserts only under CPU offload (its norm path there); its docs give the
    key this meaning at stage 2, and here it holds with or without offload."""
    from zero_workers import unused_parameter_steps

    # tiny_model.uses_branch: the branch runs on every rank at step 1, on rank 0 only at step 2,
    # on no rank at step 0. Stage 3 trains on, as DeepSpeed's does (it reads the key at stages 1/2
    # only); its case skips step 2, where the branch's gather would run on one rank alone, a
    # hang under any ZeRO-3.
    cases = [(1, False, [1, 2]), (2, False, [1, 2]), (2, False, [0]), (2, True, [0, 1, 2]), (3, False, [0, 1])]
    per_rank = run_ranks(unused_parameter_steps, 2, cases, timeout=300)
    for rank, results in enumerate(per_rank):
        for (stage, ignore, steps), outcomes in zip(cases, results):
            if ignore or stage == 3:
                assert outcomes == ["stepped"] * len(steps), (stage, rank, outcomes)
                continue
            *stepped, (kind, message, is_assertion, kept) = outcomes
            assert stepped == ["stepped"] * (len(steps) - 1) and kind == "raised", (stage, rank, outcomes)
            assert "zero_optimization.ignore_unused_parameters is false" in message and is_assertion and kept
            rank_misses = steps[-1] == 0 or rank == 1
            assert ("'branch.weight'" in message) == rank_misses, (stage, rank, message)
            assert "none on this rank" in message or rank_misses, message
            count = 2 * (2 if steps[-1] == 0 else 1)  # branch.weight and branch.bias, on the ranks without them
            assert message.startswith(f"ds_canzona: {count} trainable tensor(s)"), message


def _mesh_outcome(rank, world_size):
    import deepspeed
    import ds_canzona  # noqa: F401  (registers the engine hook)
    from ds_canzona.config import CanzonaConfigError
    from tiny_model import make_model
    from zero_workers import make_config

    import torch.distributed as torch_dist

    deepspeed.init_distributed(dist_backend="gloo")
    config = make_config(world_size)
    config.pop("train_batch_size")  # DeepSpeed derives it from the mesh's data-parallel size
    try:
        deepspeed.initialize(model=make_model(), config=config, mesh_param=(1, world_size))
        outcome = "accepted"
    except CanzonaConfigError as error:
        outcome = str(error)
    # Rank 0 hosts the store the mesh's process groups rendezvous on: a rank 0 that refused first
    # and exited reset the connection of a rank still building its groups (seen twice in CI under
    # load, as "Connection reset by peer" inside init_device_mesh).
    torch_dist.barrier()
    return outcome


def test_a_mesh_with_sequence_parallelism_is_refused():
    messages = run_ranks(_mesh_outcome, 2, timeout=300)
    assert all("sequence_parallel dimension" in m and "mesh_param" in m for m in messages), messages


def test_keys_without_numeric_effect_are_accepted():
    cases = [("accepted", {}, ACCEPTED_ZERO_KEYS, {}, ""),
             ("bf16 with the overflow check", {"bf16": {"enabled": True, "check_grad_overflow": True}}, {}, {}, "")]
    outcomes = run_ranks(_outcomes, 1, cases, timeout=300)[0]
    assert outcomes == [("ok", "CanzonaZeroOptimizer")] * 2, outcomes


@pytest.mark.parametrize("version, ok", [("0.19.8", True), ("0.19.0", True), ("0.19.4+6a4f3c1", True),
                                         ("0.18.4", False), ("0.20.0", False), ("0.19.9", False),
                                         ("0.19.10", False), ("garbage", False)])
def test_deepspeed_version_check(version, ok):
    from ds_canzona.zero.versions import check_deepspeed_version, deepspeed_version_supported
    from ds_canzona.config import CanzonaConfigError

    assert deepspeed_version_supported(version) is ok
    if not ok:
        with pytest.raises(CanzonaConfigError, match=rf"found {version}: install one of them") as info:
            check_deepspeed_version(version)
        assert "0.19.0" in str(info.value) and "0.19.8" in str(info.value)


def test_setup_declares_the_versions_the_hook_accepts():
    import re
    from pathlib import Path
    from ds_canzona.zero.versions import SUPPORTED_DEEPSPEED_VERSIONS

    setup = (Path(__file__).resolve().parent.parent / "setup.py").read_text()
    [requirement] = re.findall(r'"deepspeed([^"]*)"', setup)
    assert requirement == f">={SUPPORTED_DEEPSPEED_VERSIONS[0]},<={SUPPORTED_DEEPSPEED_VERSIONS[-1]}"
    patches = [int(v.rsplit(".", 1)[1]) for v in SUPPORTED_DEEPSPEED_VERSIONS]
    assert patches == list(range(patches[0], patches[-1] + 1)), "a range in setup.py needs a contiguous set"


def test_accumulation_boundary_as_attribute_or_method():
    from ds_canzona.zero.compat import at_accumulation_boundary

    class Old:  # DeepSpeed 0.19.0-0.19.4: a bool attribute, absent until the engine first sets it
        pass

    class New:  # 0.19.5+: a method
        def __init__(self, flag):
            self.flag = flag

        def is_gradient_accumulation_boundary(self):
            return self.flag

    old = Old()
    assert at_accumulation_boundary(old) is True
    old.is_gradient_accumulation_boundary = False
    assert at_accumulation_boundary(old) is False
    assert at_accumulation_boundary(New(False)) is False and at_accumulation_boundary(New(True)) is True


def _step_counts(rank, world_size, configs):
    """Per config: the engine's global_steps and, per state entry DeepSpeed's test reads, its step and keys."""
    from zero_workers import init_engine
    from tiny_model import batches

    out = []
    for config in configs:
        engine = init_engine(config)
        zero, basic = engine.optimizer, engine.optimizer.optimizer
        for step in range(2):
            for micro in range(config["gradient_accumulation_steps"]):
                engine.backward(engine(batches(step, micro, rank, world_size)))
                engine.step()
        if "canzona" in config or config["zero_optimization"]["stage"] < 3:
            # DeepSpeed's TestZeroAdamOptimizerStepCount at stages 1/2 (stock: the flat partitions).
            keyed = [p for group in basic.param_groups for p in group["params"]]
        else:
            keyed = list(zero.fp32_partitioned_groups_flat)  # its stage-3 reading, a stock internal
        states = [basic.state[p] for p in keyed]
        out.append({"global_steps": engine.global_steps, "steps": [float(s["step"]) for s in states],
                    "keys": sorted({tuple(sorted(s)) for s in states})})
    return out


def test_optimizer_state_gives_every_parameter_its_step_as_stock_deepspeed_does():
    """``engine.optimizer.optimizer.state[param]["step"]`` (what LR callbacks and trainers read)
    at stages 1-3: the applied step count for every trainable parameter, equal to stock
    DeepSpeed's on the same AdamW run; a parameter this rank owns whole has AdamW's keys as
    torch's AdamW (DeepSpeed's basic optimizer here) names them, any other has ``step`` only."""
    from zero_workers import make_config

    adamw = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}}
    ours = [make_config(2, stage=stage, optimizer={"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}})
            for stage in (1, 2, 3)]
    ours.append(make_config(2, stage=2))  # Muon: its matrices' state is step and momentum_buffer
    stock = []
    for stage in (2, 3):  # stock stage 1 reads as stage 2 does
        config = make_config(2, stage=stage, optimizer=adamw)
        config.pop("canzona")
        stock.append(config)
    per_rank = run_ranks(_step_counts, 2, ours + stock, timeout=600)
    for rank, results in enumerate(per_rank):
        mine, theirs = results[:len(ours)], results[len(ours):]
        for result in mine + theirs:
            assert result["global_steps"] == 2 and result["steps"] and set(result["steps"]) == {2.0}, (rank, result)
        adam_keys = ("exp_avg", "exp_avg_sq", "step")
        for result in theirs:
            assert result["keys"] == [adam_keys], result
        for result in mine[:3]:  # every entry: torch's AdamW keys where owned whole, else step alone
            assert set(result["keys"]) <= {adam_keys, ("step",)} and adam_keys in result["keys"], result
        assert ("momentum_buffer", "step") in mine[3]["keys"], mine[3]


# Every zero_optimization key ds_canzona reads, with a value that is wrong for it. Each must stop
# deepspeed.initialize with an error naming the key (DeepSpeed's config model or ours), or train
# as DeepSpeed does; a hang would fail on run_ranks' timeout.
BAD_ZERO_VALUES = [
    (2, "stage", 4), (2, "stage", "two"),
    (2, "reduce_bucket_size", -1), (2, "reduce_bucket_size", 0), (2, "reduce_bucket_size", "big"),
    (2, "allgather_bucket_size", -2), (2, "overlap_comm", "sometimes"),
    (2, "ignore_unused_parameters", "maybe"),
    (2, "offload_optimizer", {"device": "disk"}), (2, "offload_optimizer", {"device": "cpu", "pin_memory": "yes"}),
    (2, "offload_optimizer", {"device": "nvme"}),
    (3, "offload_param", {"device": "disk"}),
    (3, "stage3_prefetch_bucket_size", -1), (3, "stage3_param_persistence_threshold", -1),
    (3, "stage3_model_persistence_threshold", -1), (3, "stage3_max_live_parameters", -1),
    (3, "stage3_max_reuse_distance", -1), (3, "stage3_module_granularity_threshold", -1),
    (3, "reduce_bucket_size", 0),
]
# Legal, extreme values DeepSpeed trains with: these must train here too (no planner blow-up on
# one-element buckets, no stall with no live-parameter budget).
EXTREME_ZERO_VALUES = [
    (2, "reduce_bucket_size", 1), (3, "reduce_bucket_size", 1), (2, "allgather_bucket_size", 0),
    (3, "stage3_prefetch_bucket_size", 0), (3, "stage3_max_live_parameters", 0),
    (3, "stage3_max_reuse_distance", 0), (3, "stage3_param_persistence_threshold", 10**12),
]


def _bad_zero_value_outcomes(rank, world_size, cases):
    from zero_workers import init_engine, make_config
    from tiny_model import batches

    outcomes = []
    for stage, key, value in cases:
        config = make_config(world_size, stage=stage)
        config["zero_optimization"][key] = value
        try:
            engine = init_engine(config)
        except Exception as error:
            outcomes.append(("refused", type(error).__name__, str(error)))
            continue
        for micro in range(config["gradient_accumulation_steps"]):
            engine.backward(engine(batches(0, micro, rank, world_size)))
            engine.step()
        outcomes.append(("trained", "", ""))
    return outcomes


def test_every_zero_key_read_stops_with_its_name_on_a_bad_value_or_trains():
    cases = BAD_ZERO_VALUES + EXTREME_ZERO_VALUES
    per_rank = run_ranks(_bad_zero_value_outcomes, 2, cases, timeout=400)
    problems = []
    for (stage, key, value), *outcomes in zip(cases, *per_rank):
        kinds = {kind for kind, _, _ in outcomes}
        if (stage, key, value) in EXTREME_ZERO_VALUES and kinds != {"trained"}:
            problems.append(f"stage {stage} {key}={value!r}: DeepSpeed trains with it, here: {outcomes[0]}")
        elif len(kinds) != 1:  # one rank refusing alone would leave the other in a collective
            problems.append(f"stage {stage} {key}={value!r}: ranks disagree: {outcomes}")
        elif kinds == {"refused"} and not all(key in message for _, _, message in outcomes):
            problems.append(f"stage {stage} {key}={value!r}: the error does not name the key: {outcomes[0][2][:400]}")
    assert not problems, "\n".join(problems)
