"""Building the ds_canzona optimizer and its ZeRO-1/2 or ZeRO-3 runtime from an engine's config."""

from __future__ import annotations

import math
from typing import Any

import torch

from ds_canzona.config import MATRIX_OPTIMIZERS, CanzonaConfigError
from ds_canzona.zero.support import autotp_size

# DeepSpeed's Muon config keys and what they mean for ds_canzona's Muon: the shared lr and
# weight_decay apply to both halves unless muon_lr / adam_lr say otherwise; betas and eps are the
# auxiliary AdamW's (DeepSpeed's _muon_param_groups). Shampoo and SOAP have betas and eps of
# their own, so there the auxiliary AdamW's are spelled adam_betas / adam_eps.
_ADAM_KEYS = {"betas": "adam_betas", "eps": "adam_eps"}
# NorMuon and AdaMuon are not DeepSpeed types; they carry Muon's auxiliary Adam (its adam_w_mode
# and torch_adam), but their own beta2 and eps, so their auxiliary AdamW's are adam_betas / adam_eps.
_MUON_FAMILY = ("muon", "normuon", "adamuon")
# Read here, not passed to the optimizer class: per-head Muon comes from DeepSpeed's head tags.
_PER_HEAD_KEY = "per_head_muon"

# DeepSpeed 0.19.8's choice of Adam class (engine.get_optimizer_configuration; with offload_optimizer
# it would pick DeepSpeedCPUAdam, which canzona.offload_host_adam selects here instead): torch_adam picks torch.optim.AdamW
# (decoupled) or torch.optim.Adam (L2), else FusedAdam. Each class's keys with the value that
# leaves ds_canzona's math unchanged (None: any value, no numeric effect on a step); a key not
# listed would be a TypeError in DeepSpeed and is one clear error here.
_FUSED_ADAM_KEYS = {"bias_correction": True, "amsgrad": False, "set_grad_none": None}
_TORCH_ADAM_KEYS = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": None,
                    "differentiable": None, "fused": None}
_FUSED_ADAM_WEIGHT_DECAY = 0.0  # FusedAdam's default (and DeepSpeedCPUAdam's)
_TORCH_ADAMW_WEIGHT_DECAY = 0.01  # torch.optim.AdamW's default; torch.optim.Adam's is 0
# Popped by DeepSpeed before it builds any Adam class; it changes only DeepSpeedCPUAdam's state dtype.
_CPU_ADAM_ONLY_KEY = "fp32_optimizer_states"


def _refuse_key(type_name: str, key: str, value: Any, why: str) -> CanzonaConfigError:
    return CanzonaConfigError(f"optimizer.params.{key}={value!r} (optimizer type {type_name}) is not supported "
                              f"with the 'canzona' section: {why}; remove the key, or remove the 'canzona' "
                              "section to use DeepSpeed's own optimizer")


def _adam_w_mode(type_name: str, params: dict[str, Any]) -> bool:
    """Pop DeepSpeed's adam_w_mode; whether the weight decay is decoupled, as 0.19.8 decides it.

    Type "AdamW" is decoupled whatever adam_w_mode says (DeepSpeed: "Optimizer name of Adam
    forces AdamW logic unless adam_w_mode is explicitly set"); "Adam" follows adam_w_mode
    (default true); Muon's auxiliary Adam follows adam_w_mode.
    """
    value = params.pop("adam_w_mode", True)
    if not isinstance(value, bool):
        raise CanzonaConfigError(f"optimizer.params.adam_w_mode must be true or false, got {value!r}")
    return True if type_name == "adamw" else value


def _check_class_keys(type_name: str, params: dict[str, Any], allowed: dict[str, Any], class_name: str) -> None:
    """Pop the Adam class's own keys, refusing a value whose math ds_canzona does not run."""
    for key, neutral in allowed.items():
        if key in params:
            value = params.pop(key)
            if neutral is not None and value != neutral:
                raise _refuse_key(type_name, key, value, f"DeepSpeed would give it to {class_name}, and ds_canzona's "
                                  f"Adam runs only {key}={neutral!r}")


def _adam_class_kwargs(type_name: str, params: dict[str, Any]) -> dict[str, Any]:
    """Type "Adam" / "AdamW": ds_canzona.optim.AdamW's keywords for what DeepSpeed 0.19.8 would build.

    Pops every key it reads from ``params``; what is left is lr, betas, eps and weight_decay.
    """
    w_mode = _adam_w_mode(type_name, params)
    params.pop(_CPU_ADAM_ONLY_KEY, None)
    torch_adam = params.pop("torch_adam", False)
    if not isinstance(torch_adam, bool):
        raise CanzonaConfigError(f"optimizer.params.torch_adam must be true or false, got {torch_adam!r}")
    if torch_adam and w_mode:
        allowed, class_name, default_decay = _TORCH_ADAM_KEYS, "torch.optim.AdamW", _TORCH_ADAMW_WEIGHT_DECAY
    elif torch_adam:
        allowed, class_name, default_decay = _TORCH_ADAM_KEYS, "torch.optim.Adam", 0.0
        decoupled = params.pop("decoupled_weight_decay", False)
        if not isinstance(decoupled, bool):
            raise CanzonaConfigError(f"optimizer.params.decoupled_weight_decay must be true or false, "
                                     f"got {decoupled!r}")
        w_mode = decoupled  # torch.optim.Adam(decoupled_weight_decay=True) is AdamW, with Adam's default decay
    else:
        allowed, class_name, default_decay = _FUSED_ADAM_KEYS, "FusedAdam", _FUSED_ADAM_WEIGHT_DECAY
    _check_class_keys(type_name, params, allowed, class_name)
    unknown = sorted(set(params) - {"lr", "betas", "eps", "weight_decay"})
    if unknown:
        raise CanzonaConfigError(f"optimizer.params {unknown} (optimizer type {type_name}): DeepSpeed would pass "
                                 f"them to {class_name}, which has no such keywords; remove them")
    return {"weight_decay": params.pop("weight_decay", default_decay), "adam_w_mode": w_mode}


def _muon_adam_kwargs(type_name: str, params: dict[str, Any]) -> dict[str, Any]:
    """Muon's Adam keys: its auxiliary Adam's weight-decay mode; the class it would run has no math of its own.

    DeepSpeed's MuonWithAuxAdam gives the auxiliary Adam's groups explicit lr, betas, eps and
    weight_decay (its own defaults), so torch_adam or FusedAdam changes no value; adam_w_mode
    false makes that Adam L2 in every one of its paths.
    """
    w_mode = _adam_w_mode(type_name, params)
    params.pop(_CPU_ADAM_ONLY_KEY, None)
    torch_adam = params.pop("torch_adam", False)
    if torch_adam:
        params.pop("foreach", None)  # DeepSpeed pops it for the torch class
    return {"adam_w_mode": w_mode}


def translate_optimizer_params(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed-style ``optimizer.params`` of type ``name`` (lower case) -> ds_canzona optimizer keywords.

    Types "adam" and "adamw" give ds_canzona.optim.AdamW's keywords with DeepSpeed 0.19.8's
    meaning (weight decay 0 unless torch_adam picks torch.optim.AdamW; adam_w_mode; see
    ``_adam_class_kwargs``); "muon" its auxiliary Adam's adam_w_mode too, and so do "normuon" and
    "adamuon" (whose own beta2 and eps leave the auxiliary AdamW's as adam_betas / adam_eps).
    Shampoo and SOAP are not DeepSpeed types: DeepSpeed's Adam keys are refused there, but for
    their defaults.
    """
    kwargs: dict[str, Any] = {}
    params = dict(params or {})
    params.pop(_PER_HEAD_KEY, None)
    if name in ("adam", "adamw"):
        kwargs.update(_adam_class_kwargs(name, params))
    elif name in _MUON_FAMILY:
        kwargs.update(_muon_adam_kwargs(name, params))
    else:
        for key, neutral in (("adam_w_mode", True), ("torch_adam", False)):
            if key in params and params.pop(key) != neutral:
                raise _refuse_key(name, key, not neutral, "DeepSpeed defines it for Adam, AdamW and Muon only, and "
                                  f"ds_canzona's {name} runs a decoupled-decay AdamW for its non-matrix tensors")
        params.pop(_CPU_ADAM_ONLY_KEY, None)
    shared_lr = params.pop("lr", None)
    muon_lr = params.pop("muon_lr", None)
    adam_lr = params.pop("adam_lr", None)
    if name in ("adam", "adamw"):
        if shared_lr is not None:
            kwargs["lr"] = shared_lr
    else:
        if muon_lr is not None or shared_lr is not None:
            kwargs["lr"] = muon_lr if muon_lr is not None else shared_lr
        if adam_lr is not None or shared_lr is not None:
            kwargs["adam_lr"] = adam_lr if adam_lr is not None else shared_lr
    for key, value in params.items():
        if name == "muon" and key in _ADAM_KEYS:
            kwargs[_ADAM_KEYS[key]] = tuple(value) if key == "betas" else value
        elif key == "betas":
            kwargs[key] = tuple(value)
        else:
            kwargs[key] = value
    return kwargs


def translate_group_keys(name: str, group: dict[str, Any]) -> dict[str, Any]:
    """One incoming param group's own keys -> overrides of the optimizer class's keywords.

    DeepSpeed 0.19.8's ``_muon_param_groups`` splits each group into a Muon and an Adam half and
    lets the group's keys override the config's, most specific last: a group's ``lr`` and
    ``weight_decay`` set both halves (over ``muon_lr`` / ``adam_lr``), ``momentum`` and
    ``ns_method`` the Muon half, ``betas`` and ``eps`` the Adam half. A key that is already one
    of the class's keywords (``adam_lr``, ``ns_steps``, ...) keeps that meaning. Shampoo and SOAP
    read ``lr`` and ``weight_decay`` the same way; their ``betas`` / ``eps`` are their own.
    """
    out: dict[str, Any] = {}
    # The shared lr and weight_decay first, so a group's own adam_lr / adam_weight_decay wins.
    for key in sorted(group, key=lambda k: k not in ("lr", "weight_decay")):
        value = group[key]
        if key == "params":
            continue
        if name != "adamw" and key == "lr":
            out.update(lr=value, adam_lr=value)
        elif name != "adamw" and key == "weight_decay":
            out.update(weight_decay=value, adam_weight_decay=value)
        elif name == "muon" and key in _ADAM_KEYS:
            out[_ADAM_KEYS[key]] = tuple(value) if key == "betas" else value
        elif key == "betas":
            out[key] = tuple(value)
        else:
            out[key] = value
    return out


def named_parameter_groups(engine, model_parameters) -> list[dict[str, Any]]:
    """``model_parameters`` as param groups of (name, parameter) pairs, names from the engine's module.

    Groups (dicts) keep their keys; loose tensors form one more group after them, as in
    DeepSpeed's ``_muon_param_groups``. ``None`` means every parameter of the module. Names are
    what the matrix rule reads (embeddings and the head stay on AdamW) and what checkpoints key
    the state by, so a parameter that is not the module's is an error.
    """
    names = {param: name for name, param in engine.module.named_parameters()}
    if model_parameters is None:
        model_parameters = list(engine.module.parameters())
    items = [model_parameters] if isinstance(model_parameters, dict) else list(model_parameters)
    groups = [dict(item) for item in items if isinstance(item, dict)]
    loose = [item for item in items if not isinstance(item, dict)]
    if loose or not groups:
        groups.append({"params": loose})
    for index, group in enumerate(groups):
        params = group.get("params")
        params = [params] if isinstance(params, torch.Tensor) else list(params or [])
        named = []
        for param in params:
            if isinstance(param, tuple):  # already (name, tensor)
                param = param[1]
            if param not in names:
                raise CanzonaConfigError(f"model_parameters group {index} holds a tensor of shape {tuple(param.shape)} "
                                         "that is not a parameter of the model; ds_canzona keys optimizer state "
                                         "by parameter name, so pass the model's own parameters")
            named.append((names[param], param))
        group["params"] = named
    return groups


def _split_by_head_count(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each group split by DeepSpeed's per-head tags: tagged projections get a ``num_heads`` group.

    ``deepspeed.initialize`` tags every parameter with ``muon_num_heads`` when the config asks
    for ``per_head_muon`` (DeepSpeed's own rule: q/k/v projections whose rows are heads x
    head_dim by the model's config; None elsewhere), and refuses a config under which nothing
    could be tagged. Reading its tags keeps ds_canzona's choice of heads identical to DeepSpeed's.
    """
    out = []
    for group in groups:
        by_heads: dict[int | None, list] = {}
        for name, param in group["params"]:
            by_heads.setdefault(getattr(param, "muon_num_heads", None), []).append((name, param))
        for heads in sorted(by_heads, key=lambda h: -1 if h is None else h):
            split = {**group, "params": by_heads[heads]}
            if heads is not None:
                split["num_heads"] = int(heads)
            out.append(split)
    return out


def optimizer_from_config(engine, model_parameters=None):
    """The ds_canzona optimizer named by the config's "optimizer" section, over ``model_parameters``.

    ``model_parameters`` is what ``deepspeed.initialize`` got (tensors or param groups; None: the
    whole module); trainable parameters only, as DeepSpeed's Muon does.
    """
    from ds_canzona import optim

    name = (engine.optimizer_name() or "").lower()
    classes = {"muon": optim.Muon, "normuon": optim.NorMuon, "adamuon": optim.AdaMuon, "shampoo": optim.Shampoo,
               "soap": optim.SOAP, "adamw": optim.AdamW, "adam": optim.AdamW}
    if name not in classes:
        raise CanzonaConfigError(f"the 'canzona' section needs an optimizer of type Muon, NorMuon, AdaMuon, Shampoo, "
                                 f"SOAP or AdamW "
                                 f"(in the config or as a ds_canzona.optim client optimizer), got {name!r}")
    config_params = engine.optimizer_params() or {}
    kwargs = translate_optimizer_params(name, config_params)  # DeepSpeed's meaning of the type's keys
    name = "adamw" if name == "adam" else name
    groups = named_parameter_groups(engine, model_parameters)
    for group in groups:
        group["params"] = [(n, p) for n, p in group["params"] if p.requires_grad]
    groups = [group for group in groups if group["params"]]
    if config_params.get(_PER_HEAD_KEY, False):
        if name != "muon":
            raise CanzonaConfigError(f"optimizer.params.{_PER_HEAD_KEY} applies to Muon only, not {name}")
        if autotp_size(engine) > 1:
            # DeepSpeed re-tags each shard with its own head count after AutoTP splits it, which
            # differs between TP ranks where KV heads divide unevenly; the whole-matrix update
            # would need the logical count. Not built yet.
            raise CanzonaConfigError(f"optimizer.params.{_PER_HEAD_KEY} together with tensor_parallel.autotp_size "
                                     "is not supported with the 'canzona' section: remove one of them, or remove the "
                                     "'canzona' section to use DeepSpeed's own optimizer")
        params = [p for group in groups for _, p in group["params"]]
        if not any(hasattr(p, "muon_num_heads") for p in params):
            raise CanzonaConfigError(f"optimizer.params.{_PER_HEAD_KEY} is set but DeepSpeed tagged no parameter "
                                     "with a head count (deepspeed.initialize does so for a Muon config); build "
                                     "the engine with deepspeed.initialize, or give ds_canzona.optim.Muon param "
                                     "groups with 'num_heads' as a client optimizer")
        groups = _split_by_head_count(groups)
    try:
        overrides = [{"params": group["params"], **translate_group_keys(name, group)} for group in groups]
        return classes[name](overrides, **kwargs)
    except (TypeError, ValueError) as error:
        raise CanzonaConfigError(f"invalid optimizer.params or param group for {name}: {error}") from None


def gradient_numerics(engine) -> dict[str, Any]:
    """DeepSpeed's gradient numerics keys, as CanzonaZeroOptimizer's arguments; refused where not honoured.

    ``data_types.grad_accum_dtype`` (the parameter dtype or fp32), ``communication_data_type``
    (DeepSpeed's default: the parameter dtype), ``prescale_gradients`` and
    ``gradient_predivide_factor``; docs/ARCHITECTURE.md says what each does here.
    """
    param_dtype, accum_dtype = engine.get_data_types()
    if accum_dtype not in (param_dtype, torch.float32):
        raise CanzonaConfigError(
            f"data_types.grad_accum_dtype {_dtype_name(accum_dtype)} with {_dtype_name(param_dtype)} parameters is "
            f"not supported with the 'canzona' section: gradients accumulate in the parameter dtype or in fp32 "
            f"(set it to fp32 or {_dtype_name(param_dtype)}, or remove it)")
    factor = engine.gradient_predivide_factor()
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
        raise CanzonaConfigError(f"gradient_predivide_factor must be a positive number, got {factor!r}")
    return {
        "grad_accum_dtype": accum_dtype,
        "communication_dtype": engine.communication_data_type,
        "gradient_predivide_factor": float(factor),
        "postscale_gradients": engine.postscale_gradients(),
        "gradient_average": engine.gradient_average,
    }


def _dtype_name(dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, str(dtype))


def build_canzona_optimizer(engine, client_optimizer, model_parameters=None):
    """(basic optimizer, ZeRO optimizer) for an engine whose config enables ``canzona``.

    ``model_parameters`` is what ``deepspeed.initialize`` got. A callable client optimizer
    receives it as DeepSpeed would pass it, but with every tensor as a (name, parameter) pair,
    so the matrix rule sees the names (embeddings and the head on AdamW).
    """
    from ds_canzona.zero.stage12 import CanzonaZeroOptimizer

    from ds_canzona.zero.offload import offload_settings

    config = engine._canzona_config
    numerics = gradient_numerics(engine)  # refused before anything is built
    numerics["offload"] = offload_settings(engine, config)
    # DeepSpeed reads this key at stages 1/2 only (its docs: "just used in stage 2"); stage 3
    # trains on as DeepSpeed's does.
    numerics["ignore_unused_parameters"] = (engine.zero_optimization_stage() == 3
                                            or bool(engine.zero_ignore_unused_parameters()))
    if client_optimizer is None:
        basic = optimizer_from_config(engine, model_parameters)
    elif callable(client_optimizer) and not hasattr(client_optimizer, "param_groups"):
        groups = named_parameter_groups(engine, model_parameters)
        given_groups = model_parameters is not None and any(isinstance(item, dict) for item in model_parameters)
        basic = client_optimizer(groups if given_groups else groups[0]["params"])
    else:
        basic = client_optimizer
    if not all("kind" in group for group in getattr(basic, "param_groups", [])):
        raise CanzonaConfigError(f"with the 'canzona' section the optimizer must come from ds_canzona.optim "
                                 f"(Muon, NorMuon, AdaMuon, Shampoo, SOAP, AdamW), got {type(basic).__name__}")
    basic.param_groups[:] = [g for g in basic.param_groups if g["params"]]

    from ds_canzona import kernels
    if hasattr(kernels, "set_backend"):
        kernels.set_backend(config.kernels)

    if engine.zero_optimization_stage() == 3:
        return basic, _build_stage3(engine, basic, numerics)
    bucket_numel = config.bucket_numel or int(engine.zero_reduce_bucket_size())
    runtime, extra = CanzonaZeroOptimizer, {}
    if autotp_size(engine) > 1:  # AutoTP: the micro-group pipeline (ds_canzona/zero/tp.py)
        from deepspeed.utils import groups
        from ds_canzona.zero.tp import CanzonaTPZeroOptimizer
        runtime, extra = CanzonaTPZeroOptimizer, {"tp_process_group": groups.get_tensor_model_parallel_group()}
    elif getattr(engine, "has_moe_layers", False):  # a family per expert group (ds_canzona/zero/expert_parallel.py)
        from ds_canzona.zero.expert_parallel import CanzonaExpertParallelOptimizer, expert_groups
        trained = {p: n for p, n in engine.param_names.items() if p.requires_grad}
        found = expert_groups(engine.module, trained)
        if found:
            runtime, extra = CanzonaExpertParallelOptimizer, {"expert_groups": found, "module": engine.module}
    zero = runtime(
        basic,
        **extra,
        param_names=engine.param_names,
        config=config,
        stage=engine.zero_optimization_stage(),
        dp_process_group=engine.seq_data_parallel_group,
        clip_grad=engine.gradient_clipping(),
        bucket_numel=bucket_numel,
        static_loss_scale=engine.loss_scale(),
        dynamic_loss_scale=engine.dynamic_loss_scale(),
        dynamic_loss_args=engine.dynamic_loss_scale_args(),
        **numerics,
    )
    return basic, zero


def zero3_offload_kwargs(engine) -> dict[str, Any]:
    """DeepSpeedZeRoOffload's keyword arguments (all but the module and the group), as DeepSpeed's stage 3 builds them."""
    from deepspeed.utils.timer import NoopTimer

    kwargs = {
        "timers": engine.timers if engine.wall_clock_breakdown() else NoopTimer(),
        "ds_config": engine.config,
        "overlap_comm": engine.zero_overlap_comm(),
        "prefetch_bucket_size": engine.zero_prefetch_bucket_size(),
        "max_reuse_distance": engine.zero_max_reuse_distance(),
        "max_live_parameters": engine.zero_max_live_parameters(),
        "param_persistence_threshold": engine.zero_param_persistence_threshold(),
        "model_persistence_threshold": engine.zero_model_persistence_threshold(),
        "offload_param_config": None,  # refused in support.py
        "mpu": engine.mpu,
        "zero_module_granularity_threshold": engine.zero_module_granularity_threshold(),
    }
    if hasattr(engine, "zero_log_trace_cache_warnings"):
        kwargs["log_trace_cache_warnings"] = engine.zero_log_trace_cache_warnings()
    return kwargs


def _build_stage3(engine, basic, numerics: dict[str, Any]):
    from ds_canzona.zero.stage3 import CanzonaZero3Optimizer

    return CanzonaZero3Optimizer(
        basic,
        module=engine.module,
        param_names=engine.param_names,
        config=engine._canzona_config,
        dp_process_group=engine.seq_data_parallel_group,
        clip_grad=engine.gradient_clipping(),
        offload_kwargs=zero3_offload_kwargs(engine),
        reduce_bucket_numel=int(engine.zero_reduce_bucket_size()),
        static_loss_scale=engine.loss_scale(),
        dynamic_loss_scale=engine.dynamic_loss_scale(),
        dynamic_loss_args=engine.dynamic_loss_scale_args(),
        **numerics,
    )


__all__ = ["build_canzona_optimizer", "gradient_numerics", "named_parameter_groups",
           "optimizer_from_config", "translate_group_keys", "translate_optimizer_params", "zero3_offload_kwargs", "MATRIX_OPTIMIZERS"]
