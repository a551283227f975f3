"""Building the ds_canzona optimizer and its ZeRO-1/2 runtime from an engine's config."""

from __future__ import annotations

import math
from typing import Any

import torch

from ds_canzona.config import MATRIX_OPTIMIZERS, CanzonaConfigError

# DeepSpeed's Muon config keys and what they mean for ds_canzona's Muon: the shared lr and
# weight_decay apply to both halves unless muon_lr / adam_lr say otherwise; betas and eps are the
# auxiliary AdamW's (DeepSpeed's _muon_param_groups). Shampoo and SOAP have betas and eps of
# their own, so there the auxiliary AdamW's are spelled adam_betas / adam_eps.
_ADAM_KEYS = {"betas": "adam_betas", "eps": "adam_eps"}
_IGNORED_KEYS = {"adam_w_mode", "torch_adam", "fp32_optimizer_states"}


def translate_optimizer_params(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed-style ``optimizer.params`` -> keyword arguments of the ds_canzona optimizer class."""
    kwargs: dict[str, Any] = {}
    params = dict(params or {})
    shared_lr = params.pop("lr", None)
    muon_lr = params.pop("muon_lr", None)
    adam_lr = params.pop("adam_lr", None)
    if name == "adamw":
        if shared_lr is not None:
            kwargs["lr"] = shared_lr
    else:
        if muon_lr is not None or shared_lr is not None:
            kwargs["lr"] = muon_lr if muon_lr is not None else shared_lr
        if adam_lr is not None or shared_lr is not None:
            kwargs["adam_lr"] = adam_lr if adam_lr is not None else shared_lr
    for key, value in params.items():
        if key in _IGNORED_KEYS:
            continue
        if name == "muon" and key in _ADAM_KEYS:
            kwargs[_ADAM_KEYS[key]] = tuple(value) if key == "betas" else value
        elif key == "betas":
            kwargs[key] = tuple(value)
        else:
            kwargs[key] = value
    return kwargs


def optimizer_from_config(engine):
    """The ds_canzona optimizer named by the config's "optimizer" section, over the engine's model."""
    from ds_canzona import optim

    name = (engine.optimizer_name() or "").lower()
    classes = {"muon": optim.Muon, "shampoo": optim.Shampoo, "soap": optim.SOAP, "adamw": optim.AdamW,
               "adam": optim.AdamW}
    if name not in classes:
        raise CanzonaConfigError(f"the 'canzona' section needs an optimizer of type Muon, Shampoo, SOAP or AdamW "
                                 f"(in the config or as a ds_canzona.optim client optimizer), got {name!r}")
    kwargs = translate_optimizer_params("adamw" if name == "adam" else name, engine.optimizer_params() or {})
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    try:
        return classes[name](named, **kwargs)
    except (TypeError, ValueError) as error:
        raise CanzonaConfigError(f"invalid optimizer.params for {name}: {error}") from None


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


def build_canzona_optimizer(engine, client_optimizer):
    """(basic optimizer, ZeRO optimizer) for an engine whose config enables ``canzona``."""
    from ds_canzona.zero.stage12 import CanzonaZeroOptimizer

    config = engine._canzona_config
    numerics = gradient_numerics(engine)  # refused before anything is built
    if client_optimizer is None:
        basic = optimizer_from_config(engine)
    elif callable(client_optimizer) and not hasattr(client_optimizer, "param_groups"):
        basic = client_optimizer(list(engine.module.parameters()))
    else:
        basic = client_optimizer
    if not all("kind" in group for group in getattr(basic, "param_groups", [])):
        raise CanzonaConfigError(f"with the 'canzona' section the optimizer must come from ds_canzona.optim "
                                 f"(Muon, Shampoo, SOAP, AdamW), got {type(basic).__name__}")
    basic.param_groups[:] = [g for g in basic.param_groups if g["params"]]

    from ds_canzona import kernels
    if hasattr(kernels, "set_backend"):
        kernels.set_backend(config.kernels)

    bucket_numel = config.bucket_numel or int(engine.zero_reduce_bucket_size())
    zero = CanzonaZeroOptimizer(
        basic,
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


__all__ = ["build_canzona_optimizer", "gradient_numerics", "optimizer_from_config", "translate_optimizer_params",
           "MATRIX_OPTIMIZERS"]
