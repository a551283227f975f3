"""Rank side of tests/test_fragments.py: DeepSpeed's tensor-fragment functions on ds_canzona engines.

Each case trains TinyLM (``norm.weight`` frozen) for three steps and records, through
``deepspeed.utils``' functions only, what a user would see:

- step 0: after backward, every trainable tensor's full gradient; after the step, its full fp32
  value and per-element optimizer state;
- then every tensor's value and state are set to fresh numbers (the same on every rank) and read
  back; step 1 trains from them (its gradients recorded after backward);
- step 2: after backward, two gradients are set (a matrix by ``safe_set_full_grad``, a
  non-matrix tensor in pieces by ``safe_update_full_grad_vectorized``), read back, and the step
  runs on them.

Plus what should fail (an unknown state name, a gradient read after the step at stage 1/2) and,
at stage 3, the local API.
"""

from __future__ import annotations

import torch

from tiny_model import batches, make_model
from zero_workers import init_engine, make_config

OPTIMIZER = {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 0.003, "weight_decay": 0.01}}
FROZEN = "norm.weight"
SPLIT_NUMEL = 500  # the embedding and the head (61 x 24) are owned in pieces of 500
SET_GRADS = ("layers.0.q_proj.weight", "embed_tokens.weight")


def fragment_config(world_size: int, stage: int, **top) -> dict:
    return make_config(world_size, stage=stage, optimizer=OPTIMIZER, canzona={"split_numel": SPLIT_NUMEL},
                       gradient_accumulation_steps=1, **top)


def frozen_model():
    model = make_model()
    dict(model.named_parameters())[FROZEN].requires_grad_(False)
    return model


def fresh_values(params: dict, keys: dict, seed: int) -> dict:
    """New values for every trainable tensor and each of its state names (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    # exp_avg_sq must stay non-negative (its square root is taken); everything else is centred.
    return {name: {key: torch.rand(p.ds_shape if hasattr(p, "ds_shape") else p.shape, generator=g)
                   - (0.0 if key == "exp_avg_sq" else 0.5) for key in [None] + keys[name]}
            for name, p in params.items()}


def fragment_case(rank: int, world_size: int, stage: int, precision: dict | None = None) -> dict:
    import deepspeed
    from deepspeed.utils import (safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state,
                                 safe_set_full_fp32_param, safe_set_full_grad, safe_set_full_optimizer_state,
                                 safe_update_full_grad_vectorized)

    engine = init_engine(fragment_config(world_size, stage, **(precision or {})), model=frozen_model())
    named = dict(engine.module.named_parameters())
    trained = {n: p for n, p in named.items() if p.requires_grad}
    api = engine.optimizer.fragments
    keys = {n: api.state_keys(api.index_of[id(p)]) for n, p in trained.items()}
    out: dict = {"frozen": [safe_get_full_fp32_param(named[FROZEN]), safe_get_full_grad(named[FROZEN]),
                            safe_get_full_optimizer_state(named[FROZEN], "exp_avg")]}

    def backward(step: int) -> None:
        engine.backward(engine(batches(step, 0, rank, world_size, 2)))

    def full_state() -> dict:
        return {n: {"value": safe_get_full_fp32_param(p),
                    **{k: safe_get_full_optimizer_state(p, k) for k in keys[n]}} for n, p in trained.items()}

    backward(0)
    out["grads0"] = {n: safe_get_full_grad(p) for n, p in trained.items()}
    out["owned0"] = owned_gradients(engine)
    engine.step()
    out["after0"] = full_state()
    try:
        safe_get_full_grad(trained["layers.0.q_proj.weight"])
        out["grad_after_step"] = "no error"
    except ValueError as error:
        out["grad_after_step"] = str(error)
    try:
        safe_get_full_optimizer_state(trained["layers.0.q_proj.weight"], "exp_avg")
        out["unknown_key"] = "no error"
    except ValueError as error:
        out["unknown_key"] = str(error)

    values = fresh_values(trained, keys, seed=7)
    for n, p in trained.items():
        safe_set_full_fp32_param(p, values[n][None])
        for k in keys[n]:
            safe_set_full_optimizer_state(p, values[n][k], k)
    out["set"] = values
    out["read_back"] = full_state()
    # What the next forward sees on this rank (stage 1/2: the parameter itself; stage 3: fetched from the owners).
    with deepspeed.zero.GatheredParameters(list(trained.values()), enabled=stage == 3):
        out["params_after_set"] = {n: p.detach().float().clone() for n, p in trained.items()}

    backward(1)
    out["grads1"] = {n: safe_get_full_grad(p) for n, p in trained.items()}
    out["owned1"] = owned_gradients(engine)
    engine.step()

    backward(2)
    out["grads2"] = {n: safe_get_full_grad(p) for n, p in trained.items()}
    out["owned2"] = owned_gradients(engine)
    set_grads = fresh_values({n: trained[n] for n in SET_GRADS}, {n: [] for n in SET_GRADS}, seed=11)
    matrix, in_pieces = SET_GRADS
    safe_set_full_grad(trained[matrix], set_grads[matrix][None])
    # The other through the vectorized form: DeepSpeed's callback gets the current full gradient.
    seen = {}

    def new_gradient(current, param):
        seen[id(param)] = current.clone()
        return set_grads[in_pieces][None]

    safe_update_full_grad_vectorized([trained[in_pieces]], new_gradient)
    out["vectorized_saw"] = seen.get(id(trained[in_pieces]))
    out["set_grads"] = {n: v[None] for n, v in set_grads.items()}
    out["set_grads_read_back"] = {n: safe_get_full_grad(trained[n]) for n in SET_GRADS}
    engine.step()
    out["after2"] = full_state()
    out["params"] = {n: p.detach().clone() for n, p in engine.module.named_parameters()} if stage < 3 else None
    if stage == 3:
        out["local"] = local_api(trained)
    engine.destroy()
    return out


def owned_gradients(engine) -> dict:
    """The runtime's own averaged gradients of what this rank owns, by item name (what its step reads)."""
    return {name: grad.clone() for name, grad in engine.optimizer.owned_gradients().items()}


def local_api(trained: dict) -> dict:
    """ZeRO-3's local functions: this rank's part (as its ds_tensor), set and read back."""
    from deepspeed.utils import (safe_get_full_fp32_param, safe_get_local_fp32_param, safe_get_local_optimizer_state,
                                 safe_set_local_fp32_param, safe_set_local_optimizer_state)

    result = {}
    for n, p in trained.items():
        local = safe_get_local_fp32_param(p)
        full = safe_get_full_fp32_param(p).reshape(-1)
        # The owned pieces sit at their offsets in ds_tensor; they must be the full value's elements.
        expected = torch.zeros(p.ds_tensor.numel())
        for start, stop, offset in p.ds_canzona_local_pieces:
            expected[offset:offset + stop - start] = full[start:stop]
        g = torch.Generator().manual_seed(hash(n) % 1000)
        new = torch.rand(p.ds_tensor.numel(), generator=g)
        key = "momentum_buffer" if "momentum_buffer" in safe_keys(p) else "exp_avg"
        new_state = torch.rand(p.ds_tensor.numel(), generator=g)
        safe_set_local_fp32_param(p, new)
        safe_set_local_optimizer_state(p, new_state, key)
        result[n] = {"numel": local.numel(), "ds_numel": p.ds_tensor.numel(), "matches_full": torch.equal(local, expected),
                     "value_back": torch.equal(safe_get_local_fp32_param(p), new),
                     "state_back": torch.equal(safe_get_local_optimizer_state(p, key), new_state)}
    return result


def safe_keys(param) -> list[str]:
    return param._z3_optimizer.state_keys(param._z3_optimizer.index_of[id(param)])



def tp_fragment_checks(engine) -> dict:
    """AutoTP, after the fed run of tests/tp_workers.py: the API on this rank's TP slices.

    Reads every full value (it must be this rank's slice as the parameter holds it), sets fresh
    values and state (the same on both DP ranks of a TP rank) and reads them back, then steps with
    every learning rate 0: the published parameters must then be the set values, which for a
    sharded matrix means the set reached its host's whole master (the step recomputes the slices
    from it and sends them back).
    """
    from deepspeed.utils import groups
    from deepspeed.utils import (safe_get_full_fp32_param, safe_get_full_optimizer_state, safe_set_full_fp32_param,
                                 safe_set_full_optimizer_state)

    api = engine.optimizer.fragments
    trained = {n: p for n, p in engine.module.named_parameters() if p.requires_grad}
    keys = {n: api.state_keys(api.index_of[id(p)]) for n, p in trained.items()}
    result = {"full_equals_local": {n: torch.equal(safe_get_full_fp32_param(p), p.detach().float())
                                    for n, p in trained.items()}}
    g = torch.Generator().manual_seed(100 + groups.get_tensor_model_parallel_rank())
    values = {n: {k: torch.rand(p.shape, generator=g) for k in [None] + keys[n]} for n, p in trained.items()}
    for n, p in trained.items():
        safe_set_full_fp32_param(p, values[n][None])
        for k in keys[n]:
            safe_set_full_optimizer_state(p, values[n][k], k)
    result["read_back"] = {n: all(torch.equal(safe_get_full_fp32_param(p) if k is None
                                              else safe_get_full_optimizer_state(p, k), values[n][k])
                                  for k in [None] + keys[n]) for n, p in trained.items()}
    zero = engine.optimizer
    result["hosted"] = sorted(zero.names[zero.plan.pieces[j][0]] for j in zero._tp_items)
    for group in zero.param_groups:
        group["lr"] = 0.0
    engine.backward(sum((p * torch.ones_like(p)).sum() for p in trained.values()))
    engine.step()
    result["after_zero_lr_step"] = {n: torch.equal(p.detach().float(), values[n][None]) for n, p in trained.items()}
    return result
