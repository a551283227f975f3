"""Rank-side functions of the ZeRO runtime tests (spawned by tests/distributed.py)."""

from __future__ import annotations

import copy
from collections import Counter

import torch

from tiny_model import batches, make_checkpointed_model, make_hf_model, make_hf_moe_model, make_model, make_moe_model, uses_branch

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
    config.pop("train_batch_size", None)
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

                def update_(self, params, grads, states, **kwargs):
                    outer.updates[group["kind"]] += len(params)
                    return rule.update_(params, grads, states, **kwargs)

            return Proxy()

        stage12.rule_for_group = counting_rule_for_group


def train(rank: int, world_size: int, config: dict, steps: int, *, capture_grads: bool = True,
          count_updates: bool = False, inject: dict | None = None, model_name: str = "tiny") -> dict:
    """Train a test model; returns final params, per-step losses and the captured averaged grads.

    ``inject`` = {"step": s, "name": param name, "ranks": [...]} puts a NaN into that parameter's
    local gradient on those ranks during the last micro-batch of step s, before any reduction.
    """
    counter = CountingRules() if count_updates else None
    engine = init_engine(config, model=MODELS[model_name]())
    zero = engine.optimizer
    captured: list[dict] = []
    original_step = zero.step

    def step_with_capture(*args, **kwargs):
        if capture_grads:
            captured.append({k: v.clone() for k, v in zero.owned_gradients().items()})
        return original_step(*args, **kwargs)

    zero.step = step_with_capture
    # The most gradient buckets held at once (stage 2 allocates one on its first gradient and
    # releases it once its reduce-scatter is done).
    held = {"peak": 0}
    original_grad_bucket = zero._grad_bucket

    def grad_bucket_with_count(b):
        flat = original_grad_bucket(b)
        held["peak"] = max(held["peak"], sum(f is not None for f in zero.grad_flat))
        return flat

    zero._grad_bucket = grad_bucket_with_count
    losses = []
    around_inject: list[dict] = []
    ga = engine.gradient_accumulation_steps()
    for step in range(steps):
        for micro in range(ga):
            loss = engine(batches(step, micro, rank, world_size, config["train_micro_batch_size_per_gpu"]))
            handle = None
            if inject and inject["step"] == step and micro == ga - 1 and rank in inject["ranks"]:
                param = dict(engine.module.named_parameters())[inject["name"]]
                handle = param.register_hook(_poison)
            engine.backward(loss)
            if handle is not None:
                handle.remove()
            at_inject = inject is not None and inject["step"] == step and micro == ga - 1
            if at_inject:
                around_inject = [snapshot(zero)]
            engine.step()
            if at_inject:
                around_inject.append(snapshot(zero))
            losses.append(float(loss.detach()))
    return {
        "params": {n: p.detach().clone() for n, p in engine.module.named_parameters()},
        "grads": captured,
        "losses": losses,
        "owned": [t.name for t in zero.owned_tensors()],
        "updates": dict(counter.updates) if counter else None,
        "skipped": engine.skipped_steps,
        "state_numel": sum(v.numel() for t in zero.owned_tensors() for v in t.state.values() if torch.is_tensor(v)),
        "comm": dict(zero.comm.bytes),
        "around_inject": around_inject,
        "grad_buckets_held": sum(flat is not None for flat in zero.grad_flat),
        "grad_buckets_peak": held["peak"],
        "buckets": len(zero.plan.buckets),
        "master_dtypes": sorted({str(t.master.dtype) for t in zero.owned_tensors()}),
        "masters_match_params": all(torch.equal(zero.item_view(t.index), t.master.to(zero.dtype))
                                    for t in zero.owned_tensors()),
    }


def train_many(rank: int, world_size: int, configs: list[dict], steps: int, model_name: str = "tiny") -> list[dict]:
    """``train`` for each config in turn, in one spawn (one engine after another on the same ranks)."""
    return [train(rank, world_size, config, steps, model_name=model_name) for config in configs]


def _poison(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    grad.view(-1)[0] = float("nan")
    return grad


def snapshot(zero) -> dict:
    """Every owned master and state tensor, cloned, keyed by name."""
    out = {}
    for t in zero.owned_tensors():
        out[f"master/{t.name}"] = t.master.detach().clone()
        for k, v in t.state.items():
            out[f"state/{t.name}/{k}"] = v.detach().clone() if torch.is_tensor(v) else v
    return out


# --------------------------------------------------------------------------- instrumentation

COLLECTIVES = ("all_reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_fn", "all_gather",
               "all_gather_into_tensor", "broadcast", "all_to_all_single", "reduce", "all_reduce_coalesced",
               "all_gather_coalesced")


class CollectiveLog:
    """Wraps deepspeed.comm's collectives and records (phase, name, bytes) for every call.

    Bytes are the payload a rank hands to the collective: the input list or tensor for
    reduce-scatter and all-reduce, the output for all-gather; the same rule for every system.
    """

    def __init__(self):
        import deepspeed.comm as dist
        self.calls: list[tuple[str, str, int]] = []
        self.phase = "other"
        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if original is None:
                continue
            setattr(dist, name, self._wrap(name, original))

    def _wrap(self, name, original):
        log = self

        def wrapped(*args, **kwargs):
            log.calls.append((log.phase, name, _payload_bytes(name, args, kwargs)))
            return original(*args, **kwargs)

        return wrapped

    def bytes_by(self, phase: str | None = None) -> dict[str, int]:
        out: dict[str, int] = {}
        for p, name, n in self.calls:
            if phase is None or p == phase:
                out[name] = out.get(name, 0) + n
        return out


def _payload_bytes(name, args, kwargs) -> int:
    def size(t):
        if torch.is_tensor(t):
            return t.numel() * t.element_size()
        if isinstance(t, (list, tuple)):
            return sum(size(x) for x in t)
        return 0

    if name in ("all_gather", "all_gather_into_tensor", "all_gather_coalesced"):
        target = kwargs.get("tensor_list", kwargs.get("output_tensor", args[0] if args else None))
    elif name in ("reduce_scatter", "reduce_scatter_fn"):
        target = kwargs.get("input_list", kwargs.get("input_tensor", args[1] if len(args) > 1 else None))
    elif name == "reduce_scatter_tensor":
        target = kwargs.get("input_tensor", args[1] if len(args) > 1 else None)
    else:
        target = kwargs.get("tensor", args[0] if args else None)
    return size(target)


def instrumented_train(rank: int, world_size: int, config: dict, steps: int, *, model_name: str = "tiny") -> dict:
    """Train with every deepspeed.comm collective logged, split into backward and step phases."""
    import ds_canzona.optim.muon as muon_module

    log = CollectiveLog()
    ns_calls = {"count": 0}
    original_orthogonalize = muon_module.orthogonalize

    def counting_orthogonalize(*args, **kwargs):
        ns_calls["count"] += 1
        return original_orthogonalize(*args, **kwargs)

    muon_module.orthogonalize = counting_orthogonalize
    counter = CountingRules()
    engine = init_engine(config, model=MODELS[model_name]())
    zero = engine.optimizer
    log.calls.clear()
    ns_per_step = []
    ga = engine.gradient_accumulation_steps()
    for step in range(steps):
        ns_calls["count"] = 0
        for micro in range(ga):
            log.phase = "backward"
            engine.backward(engine(batches(step, micro, rank, world_size, config["train_micro_batch_size_per_gpu"])))
            log.phase = "step"
            engine.step()
            log.phase = "other"
        ns_per_step.append(ns_calls["count"])
    steps_logged = [c for c in log.calls]
    return {
        "calls": steps_logged,
        "ns_per_step": ns_per_step,
        "owned_matrices": [t.name for t in zero.owned_tensors() if t.group["kind"] != "adamw"]
        if hasattr(zero, "owned_tensors") else None,
        "updates": dict(counter.updates),
        "n_params": len(zero.params) if hasattr(zero, "params") else None,
        "buckets": len(zero.plan.buckets) if hasattr(zero, "plan") else None,
        "state_bytes": optimizer_state_bytes(engine),
        "owned_state_bytes": owned_state_bytes(zero) if hasattr(zero, "owned_tensors") else None,
        "plan_summary": zero.plan_summary() if hasattr(zero, "plan_summary") else None,
        "params": {n: p.detach().clone() for n, p in engine.module.named_parameters()},
    }


def instrumented_trains(rank: int, world_size: int, configs: list[dict], steps: int) -> list[dict]:
    """:func:`instrumented_train` for each config in turn, in one world (a spawn costs ~10 s here).

    Each run's instrumentation is undone before the next, so no run counts another's calls.
    """
    import gc

    import deepspeed.comm as dist

    import ds_canzona.optim.muon as muon_module
    import ds_canzona.zero.stage12 as stage12

    results = []
    for config in configs:
        saved = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
        orthogonalize, rule_for_group = muon_module.orthogonalize, stage12.rule_for_group
        try:
            results.append(instrumented_train(rank, world_size, config, steps))
        finally:
            for name, original in saved.items():
                setattr(dist, name, original)
            muon_module.orthogonalize, stage12.rule_for_group = orthogonalize, rule_for_group
            gc.collect()
    return results


def optimizer_state_bytes(engine) -> int:
    """Bytes of every optimizer-state tensor a rank holds, found by walking the optimizer objects.

    Counts each storage once; parameters and gradients (and their fp32 partitions) are not state.
    """
    seen: set[int] = set()
    total = 0

    def visit(obj, depth=0):
        nonlocal total
        if depth > 4:
            return
        if torch.is_tensor(obj):
            key = obj.untyped_storage().data_ptr()
            if key not in seen and obj.numel() > 0:
                seen.add(key)
                total += obj.untyped_storage().nbytes()
        elif isinstance(obj, dict):
            for v in obj.values():
                visit(v, depth + 1)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                visit(v, depth + 1)

    zero = engine.optimizer
    if hasattr(zero, "owned_tensors"):
        for t in zero.owned_tensors():
            visit(t.state)
        return total
    basic = zero.optimizer
    visit(dict(basic.state))
    for attr in ("_muon_pending_momentum", "muon_momentum_buffers", "momentum_buffers"):
        visit(getattr(zero, attr, None))
    return total


def owned_state_bytes(zero) -> int:
    return sum(v.numel() * v.element_size() for t in zero.owned_tensors() for v in t.state.values()
               if torch.is_tensor(v))


def three_tensor_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(61, 8), torch.nn.Linear(8, 61, bias=True))


class _ThreeTensorLM(torch.nn.Module):

    def __init__(self):
        super().__init__()
        self.net = three_tensor_model()

    def forward(self, tokens):
        logits = self.net(tokens[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 61), tokens[:, 1:].reshape(-1))


MODELS = {"tiny": make_model, "three": _ThreeTensorLM, "checkpointed": make_checkpointed_model, "hf": make_hf_model,
          "moe": make_moe_model, "hf_moe": make_hf_moe_model}


def allocated_state_bytes(rank: int, world_size: int, scenarios: list[dict]) -> list[dict]:
    """For each config, the bytes this rank allocated for its items, measured from the tensors.

    Masters (a copy, not a view of the parameter buffer), every optimizer-state tensor but the
    0-dim step counter (kept on the host), and the reduced-gradient segments; next to them what
    the plan predicted for this rank and what the plan summary prints.
    """
    import re
    out = []
    from ds_canzona.config import CanzonaConfigError
    for config in scenarios:
        try:
            engine = init_engine(config)
        except CanzonaConfigError as error:
            out.append({"error": str(error)})
            continue
        zero = engine.optimizer
        buffers = {flat.untyped_storage().data_ptr() for flat in zero.param_flat}
        masters = sum(t.master.numel() * t.master.element_size() for t in zero.owned_tensors()
                      if t.master.untyped_storage().data_ptr() not in buffers)
        state = 0
        for t in zero.owned_tensors():
            for key, value in t.state.items():
                if key == "step":
                    assert value.dim() == 0 and value.device.type == "cpu"
                    continue
                state += value.numel() * value.element_size()
        segments = sum(s.numel() * s.element_size() for s in zero.grad_segment)
        summary = zero.plan_summary()
        printed = re.search(rf"rank {rank}: cost \S+, (\d+) state bytes", summary)
        out.append({"measured": masters + state + segments, "masters": masters, "state": state,
                    "segments": segments, "planned": zero.plan.rank_memory()[rank],
                    "printed": int(printed.group(1)) if printed else None, "memory_label": zero.plan.memory_label})
    return out




# --------------------------------------------------------------------------- several engines in one spawn

def train_runs(rank: int, world_size: int, runs: list[dict]) -> list[dict]:
    """One engine per run, built and trained in a row in this process (one spawn, many scenarios).

    A run is {"config", "model": (name in MODELS, kwargs), "steps", "branch": pass ``use_branch``
    (``tiny_model.uses_branch``) to the model, "raw": also capture the reduced segments before
    averaging, "double_backward": run a second backward before the first step}. Each result has the
    per-step averaged gradients ("grads", as ``train``), the final parameters, each owned item's
    fp32 master, how many buckets stage 2 had reduce-scattered before the flush at the end of each
    boundary backward ("launched_before_flush"), whether it still launches during backward
    ("early_launch"), or
    "error" with the message of the GradientAfterReductionError that ended the run, or
    "init_error" with that of the CanzonaConfigError that deepspeed.initialize raised.
    """
    return [_train_run(rank, world_size, run) for run in runs]


def _train_run(rank: int, world_size: int, run: dict) -> dict:
    from ds_canzona.config import CanzonaConfigError
    from ds_canzona.zero.owned import GradientAfterReductionError

    config = run["config"]
    name, kwargs = run["model"]
    try:
        engine = init_engine(config, model=MODELS[name](**kwargs))
    except CanzonaConfigError as error:
        return {"init_error": str(error)}
    zero = engine.optimizer
    ga = engine.gradient_accumulation_steps()
    grads, raw, launched_before_flush = [], [], []
    from ds_canzona.zero.compat import at_accumulation_boundary

    flush = zero.overlapping_partition_gradients_reduce_epilogue  # the engine calls it after each backward

    def counting_flush():
        if at_accumulation_boundary(zero):
            launched_before_flush.append(len(zero.plan.buckets) - 1 - zero._next_bucket)
        flush()

    zero.overlapping_partition_gradients_reduce_epilogue = counting_flush
    try:
        for step in range(run["steps"]):
            for micro in range(ga):
                tokens = batches(step, micro, rank, world_size, config["train_micro_batch_size_per_gpu"])
                forward = {"use_branch": uses_branch(step, rank)} if run.get("branch") else {}
                engine.backward(engine(tokens, **forward))
                if run.get("double_backward"):
                    engine.backward(engine(tokens, **forward))
                if micro == ga - 1:
                    grads.append({k: v.clone() for k, v in zero.owned_gradients().items()})
                    if run.get("raw"):
                        raw.append({t.name: zero._segment_grad(t.index).clone() for t in zero.owned_tensors()})
                engine.step()
    except GradientAfterReductionError as error:
        return {"error": str(error)}
    return {
        "params": {n: p.detach().clone() for n, p in engine.module.named_parameters()},
        "grads": grads,
        "raw": raw,
        "masters": {t.name: t.master.detach().clone() for t in zero.owned_tensors()},
        "early_launch": zero.early_launch,
        "launched_before_flush": launched_before_flush,
        "skipped": engine.skipped_steps,
        # The dtypes the gradient buffers actually have (stage 1 keeps its flat buffers between steps).
        "flat_dtypes": sorted({str(f.dtype) for f in zero.grad_flat if f is not None}),
        "segment_dtypes": sorted({str(s.dtype) for s in zero.grad_segment}),
    }


def unused_parameter_steps(rank: int, world_size: int, cases: list[tuple[int, bool, list[int]]]) -> list[list]:
    """Per case (stage, ignore_unused_parameters, steps): what each step did on this rank.

    The model is ``CheckpointedLM`` without checkpointing, whose ``branch`` runs only at the steps
    and ranks ``tiny_model.uses_branch`` says. Per step: "stepped", or ("raised", message, whether
    the error is an AssertionError, whether every owned master kept its value).
    """
    import torch
    from ds_canzona.zero.owner_runtime import UnusedParametersError
    from tiny_model import make_checkpointed_model

    results = []
    for stage, ignore, steps in cases:
        config = make_config(world_size, stage=stage)
        config["zero_optimization"]["ignore_unused_parameters"] = ignore
        engine = init_engine(config, make_checkpointed_model(checkpoint=None))
        outcomes = []
        for step in steps:
            micros = config["gradient_accumulation_steps"]
            for micro in range(micros):
                tokens = batches(step, micro, rank, world_size)
                engine.backward(engine(tokens, use_branch=uses_branch(step, rank)))
                if micro < micros - 1:
                    engine.step()  # not a boundary: no optimizer step
            before = [t.master.clone() for t in engine.optimizer.owned_tensors()]
            try:
                engine.step()
                outcomes.append("stepped")
            except UnusedParametersError as error:
                after = [t.master for t in engine.optimizer.owned_tensors()]
                kept = all(torch.equal(a, b) for a, b in zip(before, after))
                outcomes.append(("raised", str(error), isinstance(error, AssertionError), kept))
                break
        results.append(outcomes)
    return results
