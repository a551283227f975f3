"""What the engine hook accepts from the rest of a DeepSpeed setup, and what it refuses.

ds_canzona replaces DeepSpeed's ZeRO-1/2/3 optimizer for data parallelism, and at stages 1 and 2
for DeepSpeed AutoTP tensor parallelism (``ds_canzona.zero.tp``) and DeepSpeed MoE expert
parallelism (``ds_canzona.zero.expert_parallel``) along with it. Anything else that
would change which gradients a rank holds (pipeline or sequence parallelism, a
tensor-parallel ``mpu``, AutoTP or expert parallelism at stage 3, AutoEP), that
DeepSpeed would implement by calling methods this optimizer does not have, or that DeepSpeed's own
optimizer or checkpoint code would honour and this runtime would silently ignore, is refused here:
one ``CanzonaConfigError`` naming the key or feature and saying what to do, raised inside
``deepspeed.initialize`` before ds_canzona allocates anything.

Two entry points, because the engine learns about the model late:

- ``check_config_supported`` runs from the wrapped ``_do_sanity_check``: the config and the
  ``mpu`` are known (and, from DeepSpeed 0.19.4 on, whether the model is a pipeline module); the
  model is not yet stored on the engine;
- ``check_model_supported`` runs first thing in the wrapped ``_configure_optimizer``: DeepSpeed
  has scanned the model for MoE layers by then, and nothing of ds_canzona exists yet.

Keys that DeepSpeed reads but that have no numeric effect on this runtime (``overlap_comm``,
``contiguous_gradients``, ``reduce_scatter``, ``allgather_bucket_size``, ``round_robin_gradients``,
...) are accepted; docs/ARCHITECTURE.md lists what each means here.
"""

from __future__ import annotations

from typing import Any

from ds_canzona.config import MATRIX_OPTIMIZERS, CanzonaConfigAssertion, CanzonaConfigError
from ds_canzona.zero.versions import check_stage3_version

_REMOVE = "or remove the 'canzona' section to use DeepSpeed's own optimizer"


def _refuse(what: str, fix: str) -> CanzonaConfigError:
    return CanzonaConfigError(f"{what} is not supported with the 'canzona' section: {fix}, {_REMOVE}")


def check_config_supported(engine) -> None:
    """Refuse what the config, the mpu or a pipeline module ask for that the runtime lacks."""
    params = engine._config._param_dict
    _check_stage_and_optimizer(engine)
    _check_parallelism(engine, params)
    _check_zero_keys(engine, params)
    _check_precision_keys(engine)
    _check_checkpoint_keys(params)
    _check_engine_features(params)


def check_model_supported(engine) -> None:
    """Refuse pipeline modules, and expert parallelism where the runtime lacks it (ZeRO-3, AutoTP).

    Models with ``deepspeed.moe`` layers train at stages 1 and 2 (``ds_canzona.zero.expert_parallel``).
    """
    from deepspeed.moe.utils import is_moe_param

    _check_pipeline(engine)  # again: 0.19.0-0.19.3 set the flag only after _do_sanity_check

    experts = [name for name, p in engine.module.named_parameters() if is_moe_param(p)]
    if not (getattr(engine, "has_moe_layers", False) or experts):
        return
    where = f" (deepspeed.moe layers in the model, e.g. {experts[0]})" if experts else " (deepspeed.moe layers)"
    stage = engine.zero_optimization_stage()
    if stage == 3:
        raise _refuse(f"expert parallelism at ZeRO stage 3{where}",
                      "use zero_optimization.stage 1 or 2, where ds_canzona trains MoE models with each expert "
                      "owned inside its expert-data-parallel group")
    if autotp_size(engine) > 1:
        raise _refuse(f"expert parallelism with tensor_parallel.autotp_size {autotp_size(engine)}{where}",
                      "use one of the two")
    missing = [name for name, p in engine.module.named_parameters() if is_moe_param(p) and p.requires_grad
               and not hasattr(p, "group_name")]
    if missing:
        raise _refuse(f"expert parameters without DeepSpeed's expert group ({missing[0]})",
                      "build the experts with deepspeed.moe.layer.MoE")


# ----------------------------------------------------------------------------- the checks


def _check_stage_and_optimizer(engine) -> None:
    stage = engine.zero_optimization_stage()
    if stage == 0:
        raise CanzonaConfigError(
            "the 'canzona' section replaces DeepSpeed's ZeRO stage 1/2/3 optimizer, and zero_optimization.stage is 0 "
            f"(no ZeRO): set zero_optimization.stage to 1, 2 or 3, {_REMOVE}")
    if stage not in (1, 2, 3):
        raise _refuse(f"zero_optimization.stage {stage}", "use stage 1, 2 or 3")
    if stage == 3:
        _check_stage3(engine)
    _check_offload(engine)
    name = engine.optimizer_name()
    if engine.client_optimizer is None and name is None:
        raise CanzonaConfigError(
            "the 'canzona' section needs an optimizer: add an 'optimizer' section with type Muon, NorMuon, AdaMuon, "
            "Shampoo, SOAP or AdamW, or pass a ds_canzona.optim optimizer as deepspeed.initialize(optimizer=...)")
    supported = {*MATRIX_OPTIMIZERS, "adamw", "adam"}
    if engine.client_optimizer is None and name.lower() not in supported:
        raise CanzonaConfigError(f"the 'canzona' section supports optimizer types Muon, NorMuon, AdaMuon, Shampoo, SOAP and AdamW, "
                                 f"got optimizer.type {name!r}")


_OFFLOAD_SUPPORTED = ("offload_optimizer {\"device\": \"cpu\"} (ratio 1, pin_memory true or false) at stages 1, 2 "
                      "and 3 is supported")


def _check_offload(engine) -> None:
    """Optimizer offload to the host (ds_canzona.zero.offload) is built; NVMe, partial and super offload are not."""
    offload = engine.zero_offload_optimizer()
    device = str(getattr(getattr(offload, "device", "none"), "value", getattr(offload, "device", "none")))
    if offload is None or device == "none":
        return
    if device != "cpu":
        raise _refuse(f"zero_optimization.offload_optimizer.device {device!r}", f"{_OFFLOAD_SUPPORTED}; use device cpu")
    ratio = float(getattr(offload, "ratio", 1.0))
    if ratio != 1.0:
        raise _refuse(f"zero_optimization.offload_optimizer.ratio {ratio} (partial offload)",
                      f"{_OFFLOAD_SUPPORTED}: every owned item's state goes to the host; set ratio to 1 or remove it")
    if getattr(offload, "super_offload", False):
        raise _refuse("zero_optimization.offload_optimizer.super_offload", f"{_OFFLOAD_SUPPORTED}; remove the key")
    if autotp_size(engine) > 1:
        raise _refuse(f"zero_optimization.offload_optimizer with tensor_parallel.autotp_size {autotp_size(engine)}",
                      f"{_OFFLOAD_SUPPORTED} with data parallelism only; remove one of them")


def _check_stage3(engine) -> None:
    """Stage 3 (owner placement): DeepSpeed's parameter layout features that would fight it are refused."""
    import deepspeed

    offload_param = engine.zero_offload_param()
    if offload_param is not None and getattr(offload_param, "device", "none") not in (None, "none"):
        raise _refuse("zero_optimization.offload_param at stage 3",
                      "remove it (each parameter's shard is the whole tensor on its owner's device, and the "
                      "fetch broadcasts it from there; offload_optimizer {\"device\": \"cpu\"} is supported)")
    section = engine._config._param_dict.get("canzona") or {}
    if section.get("max_state_bytes_per_rank") is not None:
        raise CanzonaConfigError(
            "canzona.max_state_bytes_per_rank applies to ZeRO stages 1 and 2 (their bucketed plan); at stage 3 the "
            "owners are balanced on cost and memory together without a cap: remove the key or use stage 1 or 2")
    # Last, so the refusals above read the same on every release (scripts/compat.sh runs them).
    check_stage3_version(deepspeed.__version__)


def _mpu_size(mpu, *methods: str) -> int:
    for method in methods:
        if hasattr(mpu, method):
            return int(getattr(mpu, method)())
    return 1


def _mesh_size(mesh_device, dim: str) -> int:
    names = getattr(mesh_device, "mesh_dim_names", None) or ()
    return int(mesh_device.mesh.shape[names.index(dim)]) if dim in names else 1


def _check_pipeline(engine) -> None:
    if getattr(engine, "pipeline_parallelism", False):
        raise _refuse("pipeline parallelism (a deepspeed.pipe.PipelineModule)", "train a plain torch module")


def _check_parallelism(engine, params: dict[str, Any]) -> None:
    _check_pipeline(engine)  # DeepSpeed 0.19.4+ set the flag before _do_sanity_check
    if bool((params.get("expert_parallel") or {}).get("enabled", False)):
        # Probed with scripts/autoep_probe.py: DeepSpeed 0.19.8's AutoEP fails inside deepspeed.initialize with
        # transformers 5.24-5.25 (its presets call transformers' _CanRecordRegistry.get with a default), before
        # any optimizer is built, with or without this section; nothing of it could be tested here.
        raise _refuse("expert_parallel.enabled (AutoEP)",
                      "build the MoE layers with deepspeed.moe.layer.MoE, which ds_canzona trains at stages 1 and 2 "
                      "(DeepSpeed 0.19.8's AutoEP does not initialize with transformers 5.24-5.25), or set it to false")
    autotp = autotp_size(engine)
    if autotp > 1:
        _check_autotp(engine, autotp)
    sequence = params.get("sequence_parallel_size", 1)
    if isinstance(sequence, int) and sequence > 1:
        raise _refuse(f"sequence_parallel_size {sequence}", "set it to 1")
    mesh = getattr(engine, "mesh_device", None)
    if mesh is not None and _mesh_size(mesh, "sequence_parallel") > 1:
        raise _refuse("a device mesh with a sequence_parallel dimension above 1 (mesh_param)", "use data parallelism only")
    mpu = getattr(engine, "mpu", None)
    if mpu is None:
        return
    tensor = _mpu_size(mpu, "get_tensor_model_parallel_world_size", "get_model_parallel_world_size")
    if tensor > 1 and not (autotp > 1 and _is_autotp_mpu(mpu)):
        raise _refuse(f"an mpu with tensor/model parallel world size {tensor}",
                      "Muon would orthogonalise shards of each matrix; pass mpu=None or an mpu of size 1")
    pipe = _mpu_size(mpu, "get_pipeline_model_parallel_world_size", "get_pipe_parallel_world_size")
    if pipe > 1:
        raise _refuse(f"an mpu with pipeline parallel world size {pipe}", "pass mpu=None or an mpu of size 1")
    sequence = _mpu_size(mpu, "get_sequence_parallel_world_size")
    if sequence > 1:
        raise _refuse(f"an mpu with sequence parallel world size {sequence}", "pass mpu=None or an mpu of size 1")


def autotp_size(engine) -> int:
    """The engine's AutoTP size (``tensor_parallel.autotp_size``), 0 or 1 without AutoTP.

    Read through the engine method where the DeepSpeed release has one.
    """
    return (engine.autotp_size() if hasattr(engine, "autotp_size") else 0) or 0


def _is_autotp_mpu(mpu) -> bool:
    """AutoTP sets ``engine.mpu`` to DeepSpeed's own ``groups`` module; any other TP mpu is a user's."""
    from deepspeed.utils import groups
    return mpu is groups


def _check_autotp(engine, autotp: int) -> None:
    """AutoTP is supported with ZeRO-1/2 (ds_canzona.zero.tp); what that runtime lacks is refused here.

    Layouts AutoTP may produce that the runtime does not handle (those AutoTP marks unsupported;
    a fused sub-parameter weight under Shampoo or SOAP) are refused in ``ds_canzona.zero.tp_layout``
    and ``ds_canzona.zero.tp`` once the model is sharded, still before anything of ds_canzona is
    allocated.
    """
    mpu = getattr(engine, "mpu", None)
    if mpu is not None and not _is_autotp_mpu(mpu):
        raise _refuse(f"tensor_parallel.autotp_size {autotp} together with an mpu",
                      "let AutoTP make the groups (pass mpu=None)")
    if engine.zero_optimization_stage() not in (1, 2):
        raise _refuse(f"tensor_parallel.autotp_size {autotp} at ZeRO stage {engine.zero_optimization_stage()}",
                      "use stage 1 or 2")


# ZeRO++ and other ZeRO features built into DeepSpeed's own optimizers, by the key a user writes.
_ZERO_FEATURES = {
    "zero_quantized_weights": "ZeRO++ quantized weights (zero_optimization.zero_quantized_weights)",
    "zero_quantized_nontrainable_weights": "ZeRO++ quantized weights (zero_optimization.zero_quantized_nontrainable_weights)",
    "zero_quantized_gradients": "ZeRO++ quantized gradients (zero_optimization.zero_quantized_gradients)",
}


# DeepSpeed's ZeRO-1/2 asserts that its all-gather buckets start 4-byte aligned in 16-bit elements.
NCCL_START_ALIGNMENT_FACTOR = 2


def _check_zero_keys(engine, params: dict[str, Any]) -> None:
    zero = engine._config.zero_config
    allgather = int(getattr(zero, "allgather_bucket_size", 0) or 0)
    if engine.zero_optimization_stage() in (1, 2) and allgather % NCCL_START_ALIGNMENT_FACTOR:
        # ds_canzona's gathers do not use this size, but a config DeepSpeed refuses is refused here too.
        raise CanzonaConfigAssertion(
            f"zero_optimization.allgather_bucket_size {allgather}: allgather_bucket_size must be a multiple of "
            f"nccl_start_alignment_factor, {NCCL_START_ALIGNMENT_FACTOR} (DeepSpeed's ZeRO-1/2 refuses it too): "
            "use an even size")
    for key, what in _ZERO_FEATURES.items():
        if getattr(zero, key, False):
            raise _refuse(what, f"set zero_optimization.{key} to false")
    hpz = getattr(zero, "zero_hpz_partition_size", 1) or 1
    if hpz > 1:
        raise _refuse(f"ZeRO++ hierarchical partitioning (zero_optimization.zero_hpz_partition_size {hpz})",
                      "set it to 1")
    if getattr(zero, "zenflow", None) is not None:
        raise _refuse("ZenFlow (zero_optimization.zenflow)", "remove the zenflow section")
    if params.get("managed_gradient_accumulation", True) is False:
        raise _refuse("managed_gradient_accumulation: false (DeepSpeed would call "
                      "finalize_gradient_accumulation_boundary, which this optimizer does not have)",
                      "leave managed_gradient_accumulation at its default (true)")


def _check_precision_keys(engine) -> None:
    for method, key in (("bf16_master_weights_and_gradients", "bf16.bf16_master_weights_and_grads"),
                        ("bf16_optimizer_states", "bf16.bf16_optimizer_states"),
                        ("fp16_master_weights_and_gradients", "fp16.fp16_master_weights_and_grads")):
        if hasattr(engine, method) and getattr(engine, method)():
            raise _refuse(key, "remove it (ds_canzona keeps fp32 masters and fp32 optimizer state)")
    # DeepSpeed 0.19.8's ZeRO-1/2 skips its overflow check for bf16 with this key false, so a step
    # with an inf or NaN gradient is applied and the weights turn non-finite; its ZeRO-3 checks
    # only fp16 whatever the key says. ds_canzona's check is the clipping norm it computes anyway
    # (no extra synchronisation to save), and it always skips such a step.
    if engine.bfloat16_enabled() and not getattr(engine._config.bfloat16_config, "check_grad_overflow", True):
        raise _refuse("bf16.check_grad_overflow: false (applying a step whose gradient overflowed)",
                      "remove the key or set it to true (ds_canzona skips a step with an inf or NaN gradient, "
                      "at no extra cost)")


def _check_checkpoint_keys(params: dict[str, Any]) -> None:
    checkpoint = params.get("checkpoint") or {}
    if checkpoint.get("load_universal", False):
        raise _refuse("checkpoint.load_universal (universal checkpoints)",
                      "ds_canzona's own checkpoints load at any world size already; remove the key")
    if checkpoint.get("use_node_local_storage", False):
        raise _refuse("checkpoint.use_node_local_storage", "save to storage every rank can read; remove the key")
    if (checkpoint.get("parallel_write") or {}).get("pipeline_stage", False):
        raise _refuse("checkpoint.parallel_write.pipeline_stage", "remove the key (there are no pipeline stages)")
    if checkpoint.get("writer") is not None:
        raise _refuse("checkpoint.writer (DeepSpeed's checkpoint engines)",
                      "remove the key (ds_canzona writes its own per-tensor files)")


def _check_engine_features(params: dict[str, Any]) -> None:
    if params.get("compression_training"):
        raise _refuse("compression_training (DeepSpeed's compression library)", "remove the section")
    if bool((params.get("compile") or {}).get("deepcompile", False)):
        raise _refuse("compile.deepcompile", "set it to false")


__all__ = ["autotp_size", "check_config_supported", "check_model_supported"]
