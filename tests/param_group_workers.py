"""Rank-side functions of the param-group and DeepSpeed-parity tests (spawned by tests/distributed.py).

One spawn per ZeRO stage builds several engines in a row: DeepSpeed 0.19.8's own Muon, ds_canzona
on the same config, groups and data, and (stage 2) a checkpoint round trip and a callable client
optimizer.
"""

from __future__ import annotations

import copy
import logging
from types import SimpleNamespace

import torch

from tiny_model import batches, make_moe_model

STEPS = 8
MICRO_BATCH = 2

# DeepSpeed's Muon config keys; ns_method "standard" so both sides run the same iteration (fp32);
# per-head Muon on the attention projections (DeepSpeed tags them from the model's config).
MUON_PARAMS = {"lr": 0.02, "adam_lr": 0.003, "weight_decay": 0.01, "momentum": 0.95, "betas": [0.9, 0.95],
               "eps": 1e-10, "ns_method": "standard", "per_head_muon": True}
# What DeepSpeed's per-head tagging reads (a HuggingFace config's fields): TinyMoELM's attention has
# 4 query heads and 2 key/value heads of width 4.
MODEL_CONFIG = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 16, "head_dim": 4}

# The incoming groups, in DeepSpeed's vocabulary: the experts at their own lr and momentum; norms
# and biases without weight decay at another lr; everything else with the config's settings.
EXPERT_GROUP = {"lr": 0.01, "momentum": 0.9}
NO_DECAY_GROUP = {"weight_decay": 0.0, "lr": 0.002}


def schedule(step: int) -> float:
    """The lr factor of the LambdaLR both sides run: every group's lr edited at every step."""
    return 1.0 / (1.0 + 0.1 * step)


def deepspeed_groups(model) -> list:
    """``model_parameters`` as a DeepSpeed user writes them (all groups: DeepSpeed 0.19.8 fails on a
    list mixing groups and loose tensors, in ``_model_parameters_need_remap``)."""
    experts = [p for n, p in model.named_parameters() if n.startswith("experts_")]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    taken = {id(p) for p in experts + no_decay}
    rest = [p for p in model.parameters() if id(p) not in taken]
    return [{"params": experts, **EXPERT_GROUP}, {"params": no_decay, **NO_DECAY_GROUP}, {"params": rest}]


def make_config(stage: int, *, canzona: bool, optimizer: bool = True) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "train_batch_size": MICRO_BATCH * 2,
        "gradient_clipping": 0.0,
        "steps_per_print": 10_000,
        "zero_optimization": {"stage": stage},
    }
    if optimizer:
        config["optimizer"] = {"type": "Muon", "params": dict(MUON_PARAMS)}
    if canzona:
        config["canzona"] = {"bucket_numel": 1500, "log_plan": False}
    return config


def _initialize(config: dict, *, conv: bool = False, **kwargs):
    import deepspeed

    model = make_moe_model(conv=conv)
    model.config = SimpleNamespace(**MODEL_CONFIG)
    if "optimizer" in config:
        kwargs.setdefault("model_parameters", deepspeed_groups(model))
    kwargs.setdefault("lr_scheduler", lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule))
    engine, _, _, _ = deepspeed.initialize(model=model, config=copy.deepcopy(config), **kwargs)
    return engine


def _train(engine, rank: int, world_size: int, *, capture: bool) -> dict:
    grads = []
    zero = engine.optimizer
    for step in range(STEPS):
        loss = engine(batches(step, 0, rank, world_size, MICRO_BATCH))
        engine.backward(loss)
        if capture:
            grads.append({k: v.clone() for k, v in zero.owned_gradients().items()})
        engine.step()
    return {"params": {n: p.detach().clone() for n, p in engine.module.named_parameters()}, "grads": grads}


def _group_settings(optimizer) -> list[dict]:
    return [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in optimizer.param_groups]


def stage_run(rank: int, world_size: int, stage: int, checkpoint_dir: str | None = None) -> dict:
    """DeepSpeed's Muon, then ds_canzona, on the same model, groups and data; more checks on request."""
    import deepspeed
    import ds_canzona  # noqa: F401  (registers the engine hook)
    from deepspeed.runtime.zero.muon import original_muon

    for name in ("DeepSpeed", "deepspeed", "ds_canzona"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # DeepSpeed's CPU accelerator would run Newton-Schulz in bf16 (standard); ds_canzona runs fp32
    # on the CPU. Force DeepSpeed's to fp32 so both sides compute the same iteration.
    original_muon.ns_compute_dtype = lambda ns_method="gram": torch.float32
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)

    theirs = _train(_initialize(make_config(stage, canzona=False)), rank, world_size, capture=False)
    engine = _initialize(make_config(stage, canzona=True))
    ours = _train(engine, rank, world_size, capture=True)
    out = {"deepspeed": theirs["params"], "ours": ours["params"], "grads": ours["grads"],
           "groups": [{**settings, "names": list(g.get("param_names", []))}
                      for settings, g in zip(_group_settings(engine.basic_optimizer),
                                             engine.basic_optimizer.param_groups)]}
    if checkpoint_dir is not None:
        out.update(_checkpoint_round_trip(engine, checkpoint_dir, stage))
        out["callable_kinds"] = _callable_client_kinds(stage)
        out["conv"] = _conv_trains(rank, world_size, stage)
    return out


def _checkpoint_round_trip(engine, checkpoint_dir: str, stage: int) -> dict:
    """Save after training, load into a fresh engine: group settings, the schedule and weights survive."""
    engine.save_checkpoint(checkpoint_dir, tag="groups")
    fresh = _initialize(make_config(stage, canzona=True))
    before = _group_settings(fresh.basic_optimizer)
    fresh.load_checkpoint(checkpoint_dir, tag="groups")
    return {
        "saved_groups": _group_settings(engine.basic_optimizer),
        "loaded_groups": _group_settings(fresh.basic_optimizer),
        "fresh_groups": before,
        "saved_scheduler": engine.lr_scheduler.state_dict(),
        "loaded_scheduler": fresh.lr_scheduler.state_dict(),
        "loaded_params": {n: p.detach().clone() for n, p in fresh.module.named_parameters()},
    }


def _callable_client_kinds(stage: int) -> dict[str, str]:
    """Each parameter's kind when the optimizer is a callable client (no "optimizer" section)."""
    from ds_canzona.optim import Muon

    engine = _initialize(make_config(stage, canzona=True, optimizer=False), optimizer=lambda params: Muon(params),
                         lr_scheduler=None)
    names = {p: n for n, p in engine.module.named_parameters()}
    return {names[p]: group["kind"] for group in engine.basic_optimizer.param_groups for p in group["params"]}


def _conv_trains(rank: int, world_size: int, stage: int) -> dict:
    """ds_canzona's Muon on a model with a 4-D convolution filter: trains, and the filter moves."""
    engine = _initialize(make_config(stage, canzona=True), conv=True)
    start = engine.module.conv.weight.detach().clone()
    losses = []
    for step in range(3):
        loss = engine(batches(step, 0, rank, world_size, MICRO_BATCH))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    kinds = {n: g["kind"] for g in engine.basic_optimizer.param_groups for n in g.get("param_names", [])}
    return {"losses": losses, "moved": float((engine.module.conv.weight - start).norm()),
            "kind": kinds.get("conv.weight")}
