"""Rank-side functions of the ZeRO runtime tests (spawned by tests/distributed.py)."""

from __future__ import annotations

import copy
from collections import Counter

import torch

from tiny_model import batches, make_model

BASE_CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "steps_per_print": 10_000,
    "zero_optimization": {"stage": 2},
    "optimizer": {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 0.003, "weight_decay": 0.01}},
    "canzona": {"bucket_numel": 4000, "log_plan": False},
}


def make_config(world_size: int, *, stage: int = 2, optimizer: dict | None = None, canzona: dict | None = None,
                **top) -> dict:
    config = copy.deepcopy(BASE_CONFIG)
    config["zero_optimization"]["stage"] = stage
    if optimizer is not None:
        config["optimizer"] = optimizer
    if canzona is not None:
        config["canzona"].update(canzona)
    config.update(top)
    config["train_batch_size"] = (config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] *
                                  world_size)
    return config


def init_engine(config: dict, model=None):
    import deepspeed
    import ds_canzona  # noqa: F401  (registers the engine hook)
    model = model if model is not None else make_model()
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    return engine


class CountingRules:
    """Counts, per step, which tensors each per-tensor rule updated on this rank."""

    def __init__(self):
        import ds_canzona.zero.stage12 as stage12
        self.updates: Counter = Counter()
        original = stage12.rule_for_group

        def counting_rule_for_group(group):
            rule = original(group)
            outer = self

            class Proxy:
                def __getattr__(self, name):
                    return getattr(rule, name)

                def update_(self, params, grads, states, *, lr):
                    outer.updates[group["kind"]] += len(params)
                    return rule.update_(params, grads, states, lr=lr)

            return Proxy()

        stage12.rule_for_group = counting_rule_for_group


def train(rank: int, world_size: int, config: dict, steps: int, *, capture_grads: bool = True,
          count_updates: bool = False, inject: dict | None = None) -> dict:
    """Train the tiny model; returns final params, per-step losses and the captured averaged grads."""
    counter = CountingRules() if count_updates else None
    engine = init_engine(config)
    zero = engine.optimizer
    captured: list[dict] = []
    original_step = zero.step

    def step_with_capture(*args, **kwargs):
        if capture_grads:
            captured.append({k: v.clone() for k, v in zero.owned_gradients().items()})
        return original_step(*args, **kwargs)

    zero.step = step_with_capture
    losses = []
    ga = engine.gradient_accumulation_steps()
    for step in range(steps):
        for micro in range(ga):
            loss = engine(batches(step, micro, rank, world_size, config["train_micro_batch_size_per_gpu"]))
            engine.backward(loss)
            if inject and inject["step"] == step and micro == ga - 1 and rank in inject["ranks"]:
                _poison_gradient(zero, inject["name"])
            engine.step()
            losses.append(float(loss))
    return {
        "params": {n: p.detach().clone() for n, p in engine.module.named_parameters()},
        "grads": captured,
        "losses": losses,
        "owned": [t.name for t in zero.owned_tensors()],
        "updates": dict(counter.updates) if counter else None,
        "skipped": engine.skipped_steps,
        "state_numel": sum(v.numel() for t in zero.owned_tensors() for v in t.state.values() if torch.is_tensor(v)),
        "comm": dict(zero.comm.bytes),
    }


def _poison_gradient(zero, name: str) -> None:
    i = zero.names.index(name)
    zero._finish_reduction()
    b = zero.plan.bucket_of[i]
    # Poison this rank's copy of the gradient: the reduce-scatter has already run, so write into
    # the owner's reduced segment when this rank owns it, else nothing reaches the owner.
    if zero.plan.owner[i] == zero.rank:
        zero._segment_grad(i).view(-1)[0] = float("nan")
