"""Rank side of the DeepSpeed-Muon checks in tests/test_fragments.py (run in the fragment spawn).

DeepSpeed's own Muon tests (tests/unit/ops/muon/test_muon.py of its repository, 0.19.x) run only
in fp16 and skip on a processor without it; these cases run their logic on ds_canzona in fp32 and
bf16. Each case is one optimizer step of TinyLM over two micro-batches per rank, with DeepSpeed's
Muon keys (``lr``, ``momentum``, ``ns_method``; ``weight_decay`` left at DeepSpeed's default),
no clipping, and one set of the ZeRO keys DeepSpeed's test varies (``reduce_scatter``,
``overlap_comm``, ``contiguous_gradients``, a ``reduce_bucket_size`` smaller than a matrix,
stage 3's ``save_muon_momentum_buffer_in_memory`` with optimizer offload). It records, through
``deepspeed.utils``' functions only, as DeepSpeed's test does: the fp32 values before and after
the step, the averaged gradient the step used (read after the boundary backward) and the Muon
momentum after the step; the parent compares them with DeepSpeed's ``muon_update``.
"""

from __future__ import annotations

from tiny_model import batches, make_model
from zero_workers import init_engine, make_config

LR = 0.02
MOMENTUM = 0.95
GA = 2
MICRO_BATCH = 2

# name -> (stage, precision section, ns_method, zero_optimization keys)
MUON_CASES = {
    "z1-fp32-gram": (1, {}, "gram", {"reduce_scatter": False}),
    "z2-fp32-standard-rs-small-buckets": (2, {}, "standard", {"reduce_scatter": True, "overlap_comm": True,
                                                               "contiguous_gradients": False,
                                                               "reduce_bucket_size": 500}),
    "z2-bf16-gram-rs": (2, {"bf16": {"enabled": True}}, "gram", {"reduce_scatter": True}),
    "z3-bf16-standard-offload": (3, {"bf16": {"enabled": True}}, "standard",
                                 {"offload_optimizer": {"device": "cpu"},
                                  "save_muon_momentum_buffer_in_memory": True}),
}


def muon_config(world_size: int, name: str) -> dict:
    stage, precision, ns_method, zero_keys = MUON_CASES[name]
    optimizer = {"type": "Muon", "params": {"lr": LR, "momentum": MOMENTUM, "ns_method": ns_method}}
    config = make_config(world_size, stage=stage, optimizer=optimizer, gradient_clipping=0.0,
                         gradient_accumulation_steps=GA, train_micro_batch_size_per_gpu=MICRO_BATCH, **precision)
    config["zero_optimization"].update(zero_keys)
    return config


def muon_case(rank: int, world_size: int, name: str) -> dict:
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state

    engine = init_engine(muon_config(world_size, name), model=make_model())
    trained = {n: p for n, p in engine.module.named_parameters() if p.requires_grad}
    api = engine.optimizer.fragments
    out = {"optimizer_class": type(engine.optimizer.optimizer).__name__,
           "before": {n: safe_get_full_fp32_param(p) for n, p in trained.items()}}
    for micro in range(GA):
        engine.backward(engine(batches(0, micro, rank, world_size, MICRO_BATCH)))
        if micro == GA - 1:  # the boundary: the step's averaged gradient exists until engine.step()
            out["grads"] = {n: safe_get_full_grad(p) for n, p in trained.items()}
        engine.step()
    out["after"] = {n: safe_get_full_fp32_param(p) for n, p in trained.items()}
    out["momentum"] = {n: safe_get_full_optimizer_state(p, "momentum_buffer") for n, p in trained.items()
                       if "momentum_buffer" in api.state_keys(api.index_of[id(p)])}
    engine.destroy()
    return out
