"""Rank-side functions of the optimizer offload tests (tests/test_offload.py), spawned by tests/distributed.py."""

from __future__ import annotations

import torch

from tiny_model import batches, make_model
from zero3_workers import gathered_params
from zero_workers import init_engine


def offload_runs(rank: int, world_size: int, runs: list[dict]) -> list[dict]:
    """One engine per run, trained in a row in this process (one spawn, many engines).

    A run is {"config", "steps", optional "load": (dir, tag), "save": (dir, tag, after_steps)}.
    Each result: the final parameters gathered whole, the owned masters and state, and with
    offload the per-step bytes copied host <-> device and where the owned tensors live.
    """
    return [_offload_run(rank, world_size, run) for run in runs]


def _offload_run(rank: int, world_size: int, run: dict) -> dict:
    from ds_canzona.config import CanzonaConfigError
    from ds_canzona.zero.offload import OffloadedDeviceMemory

    config = run["config"]
    try:
        engine = init_engine(config, model=make_model())
    except CanzonaConfigError as error:
        return {"init_error": str(error)}
    zero = engine.optimizer
    memory = OffloadedDeviceMemory(zero._state_memory_model()) if zero.stage < 3 and zero.offload else None
    first = 0
    if "load" in run:
        load_dir, tag = run["load"]
        engine.load_checkpoint(load_dir, tag=tag)
        first = int(run.get("first", 0))
    loaded = _owned_snapshot(zero)
    ga = engine.gradient_accumulation_steps()
    step_bytes = []
    for step in range(first, first + run["steps"]):
        for micro in range(ga):
            engine.backward(engine(batches(step, micro, rank, world_size, config["train_micro_batch_size_per_gpu"])))
            engine.step()
        if zero.offload is not None:
            step_bytes.append((zero.offload.counter.to_device, zero.offload.counter.to_host))
        if "save" in run and step + 1 == run["save"][2]:
            engine.save_checkpoint(run["save"][0], tag=run["save"][1])
    offload = zero.offload
    result = {
        "params": gathered_params(engine),
        "owned": _owned_snapshot(zero),
        "loaded": loaded,
        "step_bytes": step_bytes,
        "param_bytes": zero.params[0].element_size(),
        "owned_kinds": {t.name: t.group["kind"] for t in zero.owned_tensors()},
        "owned_numel": {t.name: t.master.numel() for t in zero.owned_tensors()},
        "owned_state_numel": {t.name: sum(v.numel() for k, v in t.state.items() if torch.is_tensor(v) and k != "step")
                              for t in zero.owned_tensors()},
        "masters_on_host": all(t.master.device.type == "cpu" for t in zero.owned_tensors()),
        # At fp32 without offload the master is the parameter's own storage; offloaded, never.
        "masters_share_params": any(t.master.data_ptr() == _view(zero, t.index).data_ptr()
                                    for t in zero.owned_tensors()),
        "host_bytes": offload.host_bytes if offload is not None else 0,
        "summary": offload.summary() if offload is not None else None,
        # The plan's host bytes of this rank's items (the memory model), to compare with what was allocated.
        "plan_host_bytes": (sum(memory.host_bytes(zero.plan.specs[t.index]) for t in zero.owned_tensors())
                            if isinstance(memory, OffloadedDeviceMemory) else None),
        "plan_summary": zero.plan_summary(),
    }
    engine.destroy()
    return result


def _view(zero, item: int) -> torch.Tensor:
    return zero.item_shard(item) if zero.stage == 3 else zero.item_view(item)


def _owned_snapshot(zero) -> dict:
    return {t.name: {"master": t.master.detach().clone(),
                     **{k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in t.state.items()}}
            for t in zero.owned_tensors()}


def host_adam_runs(rank: int, world_size: int, configs: list[dict], steps: int) -> list[dict]:
    """Final parameters of one engine per config (the host AdamW choices side by side)."""
    out = []
    for config in configs:
        engine = init_engine(config, model=make_model())
        for step in range(steps):
            engine.backward(engine(batches(step, 0, rank, world_size, config["train_micro_batch_size_per_gpu"])))
            engine.step()
        out.append({"params": gathered_params(engine),
                    "kinds": {name: group["kind"] for name, group in zip(engine.optimizer.names, engine.optimizer.groups)},
                    "summary": engine.optimizer.offload.summary()})
        engine.destroy()
    return out


def deepspeed_offload_parity(rank: int, world_size: int, stage: int) -> dict:
    """DeepSpeed 0.19.8's offloaded Muon, then ds_canzona offloaded, on the DeepSpeed-parity model and groups.

    The setup of tests/param_group_workers.py (fp32 Newton-Schulz "standard" on both sides, per-head
    Muon, the experts and the norms in groups of their own, an LR schedule), plus
    ``offload_optimizer: {"device": "cpu"}`` on both engines.
    """
    import logging

    import deepspeed
    import ds_canzona  # noqa: F401  (registers the engine hook)
    from deepspeed.runtime.zero.muon import original_muon
    from param_group_workers import _initialize, _train, make_config

    for name in ("DeepSpeed", "deepspeed", "ds_canzona"):
        logging.getLogger(name).setLevel(logging.WARNING)
    original_muon.ns_compute_dtype = lambda ns_method="gram": torch.float32
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    out = {}
    for label, canzona in (("deepspeed", False), ("ours", True)):
        config = make_config(stage, canzona=canzona)
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
        engine = _initialize(config)
        out[label] = _train(engine, rank, world_size, capture=False)["params"]
        if canzona:
            out["offloaded"] = engine.optimizer.offload is not None
        else:
            out["bytes"] = _metered_step(engine, rank, world_size)
    return out


def _metered_step(engine, rank: int, world_size: int) -> dict:
    """One more step of DeepSpeed's offloaded Muon, its host<->device copies metered and counted from its code."""
    from ds_canzona.bench.standins.offload_bytes import (HostDeviceCopyMeter, deepspeed_host_storages,
                                                         deepspeed_zero2_step_bytes)
    from param_group_workers import MICRO_BATCH, STEPS

    zero = engine.optimizer
    no_grad = {id(p) for n, p in engine.module.named_parameters() if n.startswith("unused.")}
    from_code = deepspeed_zero2_step_bytes(zero, momentum_exists=True, without_grad=no_grad)
    meter = HostDeviceCopyMeter(lambda: deepspeed_host_storages(zero))
    with meter:
        engine.backward(engine(batches(STEPS, 0, rank, world_size, MICRO_BATCH)))
        engine.step()
    muon_slices = sum(zero.grad_position[zero.get_param_id(p)][3] for params in zero.params_in_partition
                      for p in params if getattr(p, "use_muon", False))
    return {"metered": meter.count, "from_code": from_code, "muon_slice_numel": muon_slices,
            "partition_numel": sum(int(n) for n in zero.partition_size)}
