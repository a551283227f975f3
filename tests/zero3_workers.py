"""Rank-side functions of the ZeRO-3 (owner placement) tests, spawned by tests/distributed.py."""

from __future__ import annotations

import torch

from tiny_model import CheckpointedLM, LoRALinear, TinyLM, batches, make_model, make_moe_model
from zero_workers import CollectiveLog, init_engine


class WideLM(TinyLM):
    """TinyLM with a wide MLP: its up/gate matrices (64 x 24 = 1536 elements) exceed the tests'
    ``reduce_bucket_size`` of 1000, where DeepSpeed 0.19.8's ZeRO-3 Muon falls back to SGD."""

    def __init__(self):
        super().__init__(hidden=64)


def make_wide_model(seed: int = 0) -> WideLM:
    torch.manual_seed(seed)
    return WideLM()


MODELS = {"tiny": make_model, "wide": make_wide_model, "moe": make_moe_model}


def build_model(name: str, config: dict, zero_init: bool):
    """The test model, built normally or under ``deepspeed.zero.Init`` (as the HF Trainer does at stage 3)."""
    if not zero_init:
        return MODELS[name]()
    import deepspeed
    with deepspeed.zero.Init(config_dict_or_path=config):
        return MODELS[name]()


def gathered_params(engine) -> dict[str, torch.Tensor]:
    import deepspeed
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def train_runs(rank: int, world_size: int, runs: list[dict]) -> list[dict]:
    """One engine per run, built and trained in a row in this process (one spawn, many scenarios).

    A run is {"config", "model": name in MODELS, "zero_init": build it under zero.Init, "steps",
    "log": record every deepspeed.comm collective by phase}. Each result has the per-step averaged
    gradients each owner saw ("grads"), the final parameters gathered whole, each owned tensor's
    fp32 master, the plan's owners, the kinds the optimizer gave each tensor, or "init_error".
    """
    return [_train_run(rank, world_size, run) for run in runs]


def _train_run(rank: int, world_size: int, run: dict) -> dict:
    from ds_canzona.config import CanzonaConfigError

    import ds_canzona.zero.stage3 as stage3

    config = run["config"]
    log = CollectiveLog() if run.get("log") else None
    # "zero3_mode": the ZeRO-3 collectives mode forced on this backend (gloo's "default" is per piece;
    # "priced", the default elsewhere, is reached this way).
    choose = stage3.zero3_collectives
    if run.get("zero3_mode"):
        stage3.zero3_collectives = lambda choice, group: run["zero3_mode"]
    try:
        engine = init_engine(config, model=build_model(run.get("model", "tiny"), config, run.get("zero_init", False)))
    except CanzonaConfigError as error:
        return {"init_error": str(error)}
    finally:
        stage3.zero3_collectives = choose
    zero = engine.optimizer
    ga = engine.gradient_accumulation_steps()
    grads, norms = [], []
    if log is not None:
        log.calls.clear()
    for step in range(run["steps"]):
        for micro in range(ga):
            tokens = batches(step, micro, rank, world_size, config["train_micro_batch_size_per_gpu"])
            if log is not None:
                log.phase = "forward_backward"
            engine.backward(engine(tokens))
            if micro == ga - 1:
                if log is not None:
                    log.phase = "other"
                grads.append({k: v.clone() for k, v in zero.owned_gradients().items()})
            if log is not None:
                log.phase = "step"
            engine.step()
            if micro == ga - 1:
                norms.append(float(zero._global_grad_norm))
            if log is not None:
                log.phase = "other"
    result = {
        "params": gathered_params(engine),
        "grads": grads,
        "norms": norms,
        "masters": {t.name: t.master.detach().clone() for t in zero.owned_tensors()},
        # Per plan item (a tensor, or "name[start:stop]" for a piece): its owner and its tensor's name.
        "owners": {spec.name: owner for spec, owner in zip(zero.plan.specs, zero.plan.owner)},
        "item_tensor": {spec.name: zero.names[tensor] for spec, (tensor, _, _) in zip(zero.plan.specs, zero.plan.pieces)},
        "n_items": len(zero.plan.specs),
        "plan_digest": zero.plan.digest(),
        "kinds": {name: group["kind"] for name, group in zip(zero.names, zero.groups)},
        "skipped": engine.skipped_steps,
        "calls": list(log.calls) if log is not None else None,
        "n_params": len(zero.params),
        "local_shard_numel": {name: int(p.ds_tensor.numel()) for name, p in zip(zero.names, zero.params)},
        "collectives": zero.collectives,
        "comm_kinds": sorted(k for k, n in zero.comm.calls.items() if n),
        "persistent": sorted(name for name, p in zip(zero.names, zero.params) if p.ds_persist),
        "leaf_modules": sorted(name for name, m in engine.module.named_modules() if getattr(m, "_z3_leaf", False)),
    }
    engine.destroy()
    return result


# --------------------------------------------------------------------------- checkpoints

def _train_capture(engine, rank: int, world_size: int, first: int, count: int) -> list[dict]:
    zero = engine.optimizer
    ga = engine.gradient_accumulation_steps()
    grads = []
    for step in range(first, first + count):
        for micro in range(ga):
            engine.backward(engine(batches(step, micro, rank, world_size, engine.train_micro_batch_size_per_gpu())))
            if micro == ga - 1:
                grads.append({k: v.clone() for k, v in zero.owned_gradients().items()})
            engine.step()
    return grads


def _owned_snapshot(zero) -> dict:
    return {t.name: {"master": t.master.detach().clone(),
                     **{k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in t.state.items()}}
            for t in zero.owned_tensors()}


def _params_any_stage(engine) -> dict[str, torch.Tensor]:
    if engine.zero_optimization_stage() == 3:
        return gathered_params(engine)
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def checkpoint_save(rank: int, world_size: int, config: dict, save_dir: str, export_dir: str, steps: int) -> dict:
    """Train ``steps`` steps at stage 3, save tag 'saved', consolidate it (rank 0)."""
    import deepspeed.comm as dist

    engine = init_engine(config, model=make_model())
    _train_capture(engine, rank, world_size, 0, steps)
    engine.save_checkpoint(save_dir, tag="saved")
    deepspeeds_reading = None
    if rank == 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        from ds_canzona.consolidate import consolidate_checkpoint
        consolidate_checkpoint(f"{save_dir}/saved", export_dir, optimizer_states=True)
        deepspeeds_reading = get_fp32_state_dict_from_zero_checkpoint(save_dir, tag="saved")
    dist.barrier()
    described = engine.optimizer.state_dict()  # the torch state API: this rank's owned state
    described = {**described, "state": {n: {k: v.clone() for k, v in s.items()} for n, s in described["state"].items()}}
    return {"owned": _owned_snapshot(engine.optimizer), "params": _params_any_stage(engine),
            "described": described, "deepspeeds_reading": deepspeeds_reading}


def checkpoint_resume(rank: int, world_size: int, config: dict, save_dir: str, first: int, steps: int,
                      frozen_dir: str | None = None) -> dict:
    """A fresh engine (any stage, any DP size) loads tag 'saved' and trains ``steps`` more steps.

    With ``frozen_dir``, a second engine of the same config does the same with the LoRA model
    and the stage-3 checkpoint of ``frozen_checkpoint_runs`` (its tag 'frozen', saved after
    ``FROZEN_SAVE_STEPS``), under the result's "frozen".
    """
    engine = init_engine(config, model=make_model(seed=5))  # other initial values: the load must replace them
    engine.load_checkpoint(save_dir, tag="saved")
    loaded = {"owned": _owned_snapshot(engine.optimizer), "params": _params_any_stage(engine),
              "global_steps": engine.global_steps, "collectives": getattr(engine.optimizer, "collectives", None)}
    grads = _train_capture(engine, rank, world_size, first, steps)
    result = {**loaded, "grads": grads, "final": _params_any_stage(engine)}
    if frozen_dir is not None:
        engine.destroy()
        result["frozen"] = _load_and_continue(config, frozen_dir, "frozen", rank, world_size, capture=True)
    return result


# --------------------------------------------------------------------------- frozen parameters in checkpoints

FROZEN_SAVE_STEPS, FROZEN_RESUME_STEPS = 3, 2
# Parameters of at most this many elements are persistent (kept gathered between uses within a
# step): the model's norms and ``frozen_scale``; its matrices are not.
PERSISTENCE_THRESHOLD = 100


def make_lora_model(seed: int = 0) -> TinyLM:
    """TinyLM as a LoRA fine-tune: every base parameter frozen, the output head tied to the
    embedding (one frozen parameter under two names), trainable rank-2 adapters on each q and v
    projection, and ``frozen_scale``, a frozen parameter of 7 elements (unused by forward).

    ``seed`` sets every value, frozen ones included (the norms' weights too, which would all be
    ones otherwise). Width 20 and the 7 elements make DeepSpeed pad the last partition of several
    frozen tensors at DP=2 (``frozen_scale``) and DP=3.
    """
    model = make_model(seed, dim=20)
    model.lm_head.weight = model.embed_tokens.weight
    model.requires_grad_(False)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.copy_(1.0 + 0.1 * torch.randn(param.shape))
    for layer in model.layers:
        layer.q_proj = LoRALinear(layer.q_proj, 2)
        layer.v_proj = LoRALinear(layer.v_proj, 2)
    model.frozen_scale = torch.nn.Parameter(torch.randn(7), requires_grad=False)
    return model


def _load_and_continue(config: dict, save_dir: str, tag: str, rank: int, world_size: int, *,
                       capture: bool = False, save_tag: str | None = None) -> dict:
    """A fresh LoRA engine (other values, frozen ones too) loads ``tag``, optionally saves it again
    as ``save_tag`` at once, and trains FROZEN_RESUME_STEPS steps; the parameters after the load and
    at the end, gathered whole (at stage 3 by ``GatheredParameters``), and with ``capture`` the
    owners' averaged gradients of each step."""
    engine = init_engine(config, model=make_lora_model(seed=5))
    engine.load_checkpoint(save_dir, tag=tag)
    out = {"loaded": _params_any_stage(engine), "global_steps": engine.global_steps}
    if save_tag is not None:
        engine.save_checkpoint(save_dir, tag=save_tag)
    grads = _train_capture(engine, rank, world_size, FROZEN_SAVE_STEPS, FROZEN_RESUME_STEPS)
    out.update(final=_params_any_stage(engine), grads=grads if capture else None)
    engine.destroy()
    return out


def _failing_frozen_saves(engine, rank: int, save_dir: str) -> dict[str, str | None]:
    """Two saves that must fail on every rank, neither hanging: the ranks disagree on which frozen
    parameters to gather (rank 1 leaves them out), and rank 0 fails to copy the second one to the
    CPU (it must still take part in the gathers of the rest). The error each rank raised, by case."""
    import ds_canzona.zero.checkpoint.frozen as frozen
    from ds_canzona.zero.checkpoint import CheckpointError

    errors: dict[str, str | None] = {}
    try:
        engine.save_checkpoint(save_dir, tag="bad_lists", exclude_frozen_parameters=rank == 1)
        errors["lists"] = None
    except CheckpointError as error:
        errors["lists"] = str(error)

    real, copies = frozen._cpu_value, []

    def fail_second(param):
        copies.append(param)
        if len(copies) == 2:
            raise MemoryError("injected: no CPU memory for the copy")
        return real(param)

    if rank == 0:
        frozen._cpu_value = fail_second
    try:
        engine.save_checkpoint(save_dir, tag="bad_copy")
        errors["copy"] = None
    except CheckpointError as error:
        errors["copy"] = str(error)
    finally:
        frozen._cpu_value = real
    return errors


def frozen_checkpoint_runs(rank: int, world_size: int, stage3_config: dict, stage2_config: dict, save_dir: str,
                           export_dir: str) -> dict:
    """Stage-3 checkpoints of a model with frozen (even-layout) parameters, saved and loaded both ways.

    1. A stage-3 engine trains FROZEN_SAVE_STEPS steps, saves tag 'frozen' and tag 'no_frozen'
       (``exclude_frozen_parameters=True``), rank 0 consolidates 'frozen', and it trains on
       (the uninterrupted run).
    2. Stage 3 loads 'frozen' and continues; stage 2 loads 'frozen', saves it as 'stage2' and
       continues (gradients captured); stage 3 loads 'stage2' and continues.
    3. Stage 3 loads 'no_frozen' (its frozen parameters keep their own values), fails two saves
       (``_failing_frozen_saves``), runs the first micro-batch of a step, and saves tag 'mid' there
       (a persistent parameter is gathered then, the others are not): that save pairs its gathers
       only if the failed ones left every rank in step.
    """
    import deepspeed.comm as dist

    engine = init_engine(stage3_config, model=make_lora_model())
    _train_capture(engine, rank, world_size, 0, FROZEN_SAVE_STEPS)
    engine.save_checkpoint(save_dir, tag="frozen")
    engine.save_checkpoint(save_dir, tag="no_frozen", exclude_frozen_parameters=True)
    if rank == 0:
        from ds_canzona.consolidate import consolidate_checkpoint
        consolidate_checkpoint(f"{save_dir}/frozen", export_dir, optimizer_states=True)
    dist.barrier()
    out = {"saved": gathered_params(engine)}
    _train_capture(engine, rank, world_size, FROZEN_SAVE_STEPS, FROZEN_RESUME_STEPS)
    out["uninterrupted"] = gathered_params(engine)
    engine.destroy()

    out["stage3"] = _load_and_continue(stage3_config, save_dir, "frozen", rank, world_size)
    out["stage2"] = _load_and_continue(stage2_config, save_dir, "frozen", rank, world_size, capture=True,
                                       save_tag="stage2")
    out["stage3_from_stage2"] = _load_and_continue(stage3_config, save_dir, "stage2", rank, world_size)

    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    engine = init_engine(stage3_config, model=make_lora_model(seed=5))
    engine.load_checkpoint(save_dir, tag="no_frozen")
    out["no_frozen"] = gathered_params(engine)
    out["failed_saves"] = _failing_frozen_saves(engine, rank, save_dir)
    engine.backward(engine(batches(0, 0, rank, world_size, engine.train_micro_batch_size_per_gpu())))
    out["gathered_at_mid_save"] = sorted(n for n, p in engine.module.named_parameters()
                                         if not p.requires_grad and p.ds_status == ZeroParamStatus.AVAILABLE)
    engine.save_checkpoint(save_dir, tag="mid")
    engine.destroy()
    return out


# --------------------------------------------------------------------------- everyday features at stage 3

class RankGatedLM(CheckpointedLM):
    """CheckpointedLM (non-reentrant, no branch module) with ``gate``, a matrix of the root module
    itself that ``forward`` uses only when told ``use_branch`` (``tiny_model.uses_branch``: on no
    rank, on every rank, on rank 0 only). Unlike a skipped submodule, whose ZeRO-3 fetch would
    run on some ranks only, the root's parameters are fetched on every rank, so only the gradient
    is rank-dependent: the ranks without one must still take part in its reduce."""

    def __init__(self):
        super().__init__("non_reentrant", branch=False)
        self.gate = torch.nn.Parameter(0.1 * torch.randn(24, 24))

    def forward(self, tokens: torch.Tensor, use_branch: bool = False) -> torch.Tensor:
        x = self.embed_tokens(tokens[:, :-1])
        for layer in self.layers:
            x = self._run_block(layer, x)
        if use_branch:
            x = x + x @ self.gate
        logits = self.lm_head(self.norm(x))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                 tokens[:, 1:].reshape(-1))


def make_rank_gated_model(seed: int = 0) -> RankGatedLM:
    torch.manual_seed(seed)
    return RankGatedLM()


def feature_models() -> dict:
    from zero_workers import MODELS as STAGE12_MODELS
    return {**STAGE12_MODELS, "rank_gated": make_rank_gated_model}


def feature_runs(rank: int, world_size: int, runs: list[dict]) -> list[dict]:
    """One engine per run, in a row (tests/test_zero3_features.py).

    A run is {"config", "model": (name in ``feature_models()``, kwargs), "steps", "branch": pass
    ``use_branch`` (``tiny_model.uses_branch``), "compile": call ``engine.compile()``,
    "scheduler": a LambdaLR of ``schedule``, "groups": pass ``model_parameters`` as two groups (no
    weight decay on 1-D tensors, another lr), "client": a callable ds_canzona.optim.Muon instead
    of the config's optimizer}. Each result has the per-step averaged gradients the owners saw
    ("grads") and their sums before division ("raw"), the parameters gathered whole, the owners'
    fp32 masters, the lr of each group per step, the bytes this rank sent into reduces, or "error"
    (the GradientAfterReductionError that ended the run) or "init_error".
    """
    return [_feature_run(rank, world_size, run) for run in runs]


def schedule(step: int) -> float:
    return 1.0 / (1.0 + 0.5 * step)


def feature_groups(model) -> list[dict]:
    no_decay = [p for p in model.parameters() if p.ndim < 2 and p.requires_grad]
    rest = [p for p in model.parameters() if p.ndim >= 2 and p.requires_grad]
    return [{"params": rest}, {"params": no_decay, "weight_decay": 0.0, "lr": 0.001}]


def _feature_run(rank: int, world_size: int, run: dict) -> dict:
    import copy

    import deepspeed

    import ds_canzona  # noqa: F401  (registers the engine hook)
    from ds_canzona.config import CanzonaConfigError
    from ds_canzona.zero.owned import GradientAfterReductionError
    from tiny_model import uses_branch

    config = copy.deepcopy(run["config"])
    name, kwargs = run["model"]
    model = feature_models()[name](**kwargs)
    extra = {}
    if run.get("groups"):
        extra["model_parameters"] = feature_groups(model)
    if run.get("scheduler"):
        extra["lr_scheduler"] = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    if run.get("client"):
        from ds_canzona.optim import Muon
        config.pop("optimizer", None)
        extra["optimizer"] = lambda params: Muon(params, lr=0.02, adam_lr=0.003, weight_decay=0.01, ns_method="gram")
    try:
        engine, _, _, _ = deepspeed.initialize(model=model, config=config, **extra)
    except CanzonaConfigError as error:
        return {"init_error": str(error)}
    if run.get("compile"):
        engine.compile()
    zero = engine.optimizer
    ga = engine.gradient_accumulation_steps()
    grads, lrs, raw, accumulate_dtypes = [], [], [], set()
    try:
        for step in range(run["steps"]):
            lrs.append([group["lr"] for group in zero.param_groups])
            for micro in range(ga):
                tokens = batches(step, micro, rank, world_size, config["train_micro_batch_size_per_gpu"])
                forward = {"use_branch": uses_branch(step, rank)} if run.get("branch") else {}
                engine.backward(engine(tokens, **forward))
                if micro == ga - 1:
                    grads.append({k: v.clone() for k, v in zero.owned_gradients().items()})
                    # The owners' sums before any division, in the accumulation dtype.
                    raw.append({t.name: zero._accumulated[t.index].clone() for t in zero.owned_tensors()
                                if zero._accumulated[t.index] is not None})
                    accumulate_dtypes |= {str(a.dtype) for a in raw[-1].values()}
                engine.step()
    except GradientAfterReductionError as error:
        return {"error": str(error)}
    result = {
        "params": gathered_params(engine),
        "grads": grads,
        "raw": raw,
        "accumulate_dtypes": sorted(accumulate_dtypes),
        "reduce_bytes": int(zero.comm.bytes["reduce"]),
        "lrs": lrs,
        "masters": {t.name: t.master.detach().clone() for t in zero.owned_tensors()},
        # Per plan item (a tensor, or "name[start:stop]" for a piece): its owner and its tensor's name.
        "owners": {spec.name: owner for spec, owner in zip(zero.plan.specs, zero.plan.owner)},
        "item_tensor": {spec.name: zero.names[tensor] for spec, (tensor, _, _) in zip(zero.plan.specs, zero.plan.pieces)},
        "n_items": len(zero.plan.specs),
        "kinds": {n: g["kind"] for n, g in zip(zero.names, zero.groups)},
        "group_settings": [{k: v for k, v in g.items() if k in ("lr", "weight_decay", "kind")}
                           for g in zero.param_groups],
        "skipped": engine.skipped_steps,
        "loss_scale": float(zero.loss_scale),
    }
    engine.destroy()
    return result
