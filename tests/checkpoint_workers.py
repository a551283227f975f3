"""Rank-side functions of the checkpoint tests (spawned on gloo ranks).

The model is the runtime tests' TinyLM plus what a checkpoint has to carry besides optimizer
state: a buffer, a frozen parameter and a tied output head. The optimizer mixes every kind:
layer 0's matrices run Muon, layer 1's attention inputs Shampoo, its other matrices SOAP, and
the rest AdamW, so one checkpoint holds momentum, Shampoo statistics and roots, SOAP bases and
moments, AdamW moments and every kind's step count. The lr follows DeepSpeed's WarmupLR.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import signal
import time
import traceback

import torch

from tiny_model import batches, make_model
from zero_workers import make_config

WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.004, "warmup_num_steps": 12}}


def ckpt_config(world_size: int, *, stage: int = 2, top: dict | None = None, **canzona) -> dict:
    config = make_config(world_size, stage=stage, canzona=canzona, scheduler=WARMUP, **(top or {}))
    del config["optimizer"]  # the client optimizer below
    return config


def make_ckpt_model(seed: int = 0, **kwargs):
    model = make_model(seed, **kwargs)
    model.lm_head.weight = model.embed_tokens.weight  # tied: an alias in the checkpoint
    g = torch.Generator().manual_seed(seed + 100)
    model.register_buffer("position_scale", torch.randn(7, generator=g))
    frozen = model.layers[1].norm2.weight
    frozen.requires_grad_(False)
    with torch.no_grad():
        frozen.copy_(1.0 + 0.1 * torch.randn(frozen.shape, generator=g))
    return model


@functools.cache
def _kind_settings() -> dict[str, dict]:
    from ds_canzona import optim

    w = [("w", torch.zeros(3, 3))]
    groups = [optim.Muon(w, lr=0.02, weight_decay=0.01).param_groups[0],
              optim.Shampoo(w, lr=0.003, precondition_frequency=2).param_groups[0],
              optim.SOAP(w, lr=0.003, precondition_frequency=2).param_groups[0],
              optim.AdamW(w, lr=0.003, betas=(0.9, 0.95)).param_groups[0],
              optim.NorMuon(w, lr=0.02, weight_decay=0.01).param_groups[0],
              optim.AdaMuon(w, lr=0.003).param_groups[0]]
    return {g["kind"]: {k: v for k, v in g.items() if k not in ("params", "param_names", "kind")} for g in groups}


def _kind_of(name: str, p: torch.Tensor) -> str:
    if p.dim() < 2 or "embed" in name or "lm_head" in name:
        return "adamw"
    if name.startswith("layers.0."):
        # NorMuon's row moments and AdaMuon's element-wise one go through the reshards too.
        return {"q_proj": "normuon", "k_proj": "adamuon"}.get(name.split(".")[2], "muon")
    return "shampoo" if name.split(".")[2] in ("q_proj", "k_proj", "v_proj") else "soap"


def make_optimizer(model):
    """A single-process ds_canzona optimizer whose groups are of all six kinds."""
    from ds_canzona.optim.single_process import RuleOptimizer

    class MixedRules(RuleOptimizer):

        def _split(self, settings):
            return _kind_settings()

    by_kind: dict[str, list] = {"muon": [], "normuon": [], "adamuon": [], "shampoo": [], "soap": [], "adamw": []}
    for name, p in model.named_parameters():
        if p.requires_grad:
            by_kind[_kind_of(name, p)].append((name, p))
    return MixedRules([{"params": items, "kind": kind} for kind, items in by_kind.items()], {})


def init_engine(config: dict, *, seed: int = 0, model=None):
    import deepspeed

    import ds_canzona  # noqa: F401  (registers the engine hook)

    model = model if model is not None else make_ckpt_model(seed)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=make_optimizer(model), config=config)
    return engine


def run_steps(engine, first: int, count: int, rank: int, world_size: int, *, capture: bool = False) -> list:
    """Optimizer steps first .. first+count-1; with ``capture``, each step's averaged grads and lrs."""
    zero = engine.optimizer
    captured: list = []
    original = zero.step
    if capture:
        def step(*args, **kwargs):
            captured.append({"grads": {k: v.clone() for k, v in zero.owned_gradients().items()},
                             "lrs": [g["lr"] for g in zero.optimizer.param_groups]})
            return original(*args, **kwargs)
        zero.step = step
    ga = engine.gradient_accumulation_steps()
    micro_batch = engine.train_micro_batch_size_per_gpu()
    try:
        for s in range(first, first + count):
            for micro in range(ga):
                engine.backward(engine(batches(s, micro, rank, world_size, micro_batch)))
                engine.step()
    finally:
        if capture:
            del zero.step
    return captured


def owned_state(engine) -> dict:
    return {t.name: {"master": t.master.detach().clone(), **{k: v.clone() for k, v in t.state.items()}}
            for t in engine.optimizer.owned_tensors()}


def snapshot(engine) -> dict:
    return {
        "owned": owned_state(engine),
        "module": {k: v.detach().clone() for k, v in engine.module.state_dict().items()},
        "params": {n: p.detach().clone() for n, p in engine.module.named_parameters()},
        "scheduler": engine.lr_scheduler.state_dict(),
        "lrs": [g["lr"] for g in engine.optimizer.param_groups],
        "counters": (engine.global_steps, engine.global_samples, engine.skipped_steps),
    }


def params(engine) -> dict:
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


SCALER_STATE = {"cur_scale": 64.0, "cur_iter": 17, "last_overflow_iter": 5, "cur_hysteresis": 1}


def dynamic_scaler(**state):
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    scaler = DynamicLossScaler(init_scale=2.0**8, scale_window=1000, min_scale=1.0, delayed_shift=2,
                               consecutive_hysteresis=False)
    for key, value in state.items():
        setattr(scaler, key, value)
    return scaler


@contextlib.contextmanager
def logged_warnings():
    """The messages ds_canzona logs at WARNING and above inside the block."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = Collect(logging.WARNING)
    log = logging.getLogger("ds_canzona")
    log.addHandler(handler)
    try:
        yield messages
    finally:
        log.removeHandler(handler)


# ----------------------------------------------------------------------------- runs


def save_run(rank: int, world_size: int, config: dict, save_dir: str, steps: int) -> dict:
    """Train, save tag 'dp<N>' (latest), and a second tag 'scaler' carrying a dynamic loss scaler."""
    engine = init_engine(config)
    run_steps(engine, 0, steps, rank, world_size)
    engine.save_checkpoint(save_dir, tag=f"dp{world_size}", client_state={"note": "hello", "ids": torch.arange(3)})
    result = snapshot(engine)
    zero = engine.optimizer
    result["torch_state_api"] = torch_state_api(zero)
    static, zero.loss_scaler = zero.loss_scaler, dynamic_scaler(**SCALER_STATE)
    engine.save_checkpoint(save_dir, tag="scaler", save_latest=False)
    zero.loss_scaler = static
    return result


def torch_state_api(zero) -> dict:
    """What the torch state API of the runtime and of the optimizer it wraps says (tensors cloned)."""
    def cloned(state_dict):
        state = {name: {k: v.clone() for k, v in entry.items()} for name, entry in state_dict["state"].items()}
        return {**state_dict, "state": state}

    refusals = []
    for optimizer in (zero, zero.optimizer):
        try:
            optimizer.load_state_dict(optimizer.state_dict())
            refusals.append(None)
        except NotImplementedError as error:
            refusals.append(str(error))
    return {"runtime": cloned(zero.state_dict()), "basic": cloned(zero.optimizer.state_dict()),
            "load_refusals": refusals}


def load_owned(rank: int, world_size: int, config: dict, save_dir: str) -> dict:
    """A fresh engine's owned masters and state after loading ``save_dir``."""
    engine = init_engine(config, seed=1)
    engine.load_checkpoint(save_dir)
    return owned_state(engine)


def _try_load(engine, directory: str) -> str | None:
    from ds_canzona.zero.checkpoint import CheckpointError

    try:
        engine.load_checkpoint(directory)
    except CheckpointError as error:
        return str(error)
    return None


def init_from_export(config: dict, export_dir: str):
    """An engine given the saved state directly (consolidated files), not through load_checkpoint."""
    import json

    from ds_canzona.consolidate import load_consolidated_model, load_consolidated_optimizer

    model = make_ckpt_model(seed=3)
    model.load_state_dict(load_consolidated_model(export_dir), strict=True)
    engine = init_engine(config, model=model)
    states = load_consolidated_optimizer(export_dir)
    with open(os.path.join(export_dir, "training_state.json")) as f:
        training = json.load(f)
    zero = engine.optimizer
    for t in zero.owned_tensors():
        tensor, start, stop = zero.plan.pieces[t.index]
        for key, value in states[zero.names[tensor]].items():
            if t.state[key].shape != value.shape:  # a piece: its elements of the whole tensor's state
                value = value.reshape(-1)[start:stop]
            t.state[key].copy_(value)
    for group, saved in zip(engine.optimizer.param_groups, training["param_groups"]):
        group["lr"] = saved["lr"]
    engine.lr_scheduler.load_state_dict(training["lr_scheduler"])
    engine.global_steps = training["engine"]["global_steps"]
    return engine


def reshard_run(rank: int, world_size: int, config: dict, save_dir: str, bad_dirs: dict, export_dir: str,
                mid_dir: str, wrong_config: dict | None) -> dict:
    """Load the DP=4 checkpoint at this world size and continue; every comparison's raw material."""
    from ds_canzona.zero.checkpoint import CheckpointError

    out: dict = {}
    engine = init_engine(config, seed=1)
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    out["errors"] = {label: _try_load(engine, d) for label, d in bad_dirs.items()}
    after = engine.module.state_dict()
    out["untouched"] = all(torch.equal(before[k], after[k]) for k in before) and engine.global_steps == 0

    zero = engine.optimizer
    static, zero.loss_scaler = zero.loss_scaler, dynamic_scaler()
    engine.load_checkpoint(save_dir, tag="scaler")
    out["scaler"] = {k: getattr(zero.loss_scaler, k) for k in SCALER_STATE}
    zero.loss_scaler = static

    with logged_warnings() as out["load_warnings"]:
        _, out["client_state"] = engine.load_checkpoint(save_dir)
    out["loaded"] = snapshot(engine)
    start = engine.global_steps
    run_steps(engine, start, 2, rank, world_size)
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        engine.save_checkpoint(mid_dir, tag="mid")
    out["save_printed"] = printed.getvalue()
    out["captured"] = run_steps(engine, start + 2, 3, rank, world_size, capture=True)
    out["continued"] = params(engine)

    same_size = init_engine(config, seed=2)
    with logged_warnings() as out["same_size_load_warnings"]:
        same_size.load_checkpoint(mid_dir)
    run_steps(same_size, start + 2, 3, rank, world_size)
    out["resumed"] = params(same_size)

    reference = init_from_export(config, export_dir)
    run_steps(reference, start, 5, rank, world_size)
    out["reference"] = params(reference)

    other = init_engine(config, model=make_ckpt_model(0, hidden=40))
    out["errors"]["different_model"] = _try_load(other, save_dir)
    if wrong_config is not None:
        import deepspeed

        plain = deepspeed.initialize(model=make_ckpt_model(0), config=wrong_config)[0]
        try:
            plain.load_checkpoint(save_dir)
            out["errors"]["other_kinds"] = None
        except CheckpointError as error:
            out["errors"]["other_kinds"] = str(error)
    return out


# ----------------------------------------------------------------------------- failures


def _mark(outdir: str, name: str) -> None:
    with open(os.path.join(outdir, name), "w") as f:
        f.write(repr(time.time()))


def _die_while_writing(outdir: str):
    """A save_file that writes half a file, then SIGKILLs its own process."""
    from safetensors.torch import save_file as real_save_file

    def save_file(tensors, path, metadata=None):
        real_save_file(tensors, path, metadata=metadata)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        _mark(outdir, "killed")
        os.kill(os.getpid(), signal.SIGKILL)

    return save_file


def crash_during_save(rank: int, world_size: int, config: dict, save_dir: str, outdir: str) -> None:
    """Commit tag 'last' at step 3, train to step 5, save 'last' again: rank 1 dies mid-write."""
    engine = init_engine(config)
    run_steps(engine, 0, 3, rank, world_size)
    engine.save_checkpoint(save_dir, tag="last")
    torch.save(owned_state(engine), os.path.join(outdir, f"committed{rank}.pt"))
    run_steps(engine, 3, 2, rank, world_size)
    torch.save(params(engine), os.path.join(outdir, f"step5_{rank}.pt"))
    if rank == 1:
        import ds_canzona.zero.checkpoint.files as checkpoint_files
        checkpoint_files.save_file = _die_while_writing(outdir)
    engine.save_checkpoint(save_dir, tag="last")


def resume_then_die(rank: int, world_size: int, config: dict, save_dir: str, outdir: str) -> None:
    """Resume from 'latest', redo steps 3 and 4, then rank 1 is SIGKILLed in the middle of training."""
    engine = init_engine(config, seed=5)
    engine.load_checkpoint(save_dir)
    torch.save({"owned": owned_state(engine), "global_steps": engine.global_steps},
               os.path.join(outdir, f"resumed{rank}.pt"))
    run_steps(engine, engine.global_steps, 2, rank, world_size)
    torch.save(params(engine), os.path.join(outdir, f"resumed_step5_{rank}.pt"))
    if rank == 1:
        _mark(outdir, "killed")
        os.kill(os.getpid(), signal.SIGKILL)
    run_steps(engine, 5, 3, rank, world_size)


def hang_in_training(rank: int, world_size: int, config: dict, outdir: str) -> None:
    """Rank 1 stops answering (alive, sockets open) after one step; the others must time out."""
    engine = init_engine(config)
    run_steps(engine, 0, 1, rank, world_size)
    if rank == 1:
        _mark(outdir, "killed")
        time.sleep(600)
    run_steps(engine, 1, 3, rank, world_size)


def failure_entry(rank: int, world_size: int, port: int, outdir: str, fn, args) -> None:
    """A rank of the failure tests: its error (traceback and time) goes to rank<r>.err."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_SIZE=str(world_size), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        fn(rank, world_size, *args)
    except BaseException:
        with open(os.path.join(outdir, f"rank{rank}.err"), "w") as f:
            f.write(f"{time.time()!r}\n{traceback.format_exc()}")
        raise


# ----------------------------------------------------------------------------- HuggingFace export

QWEN3_TINY = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64,
              "tie_word_embeddings": True, "use_cache": False, "bos_token_id": 1, "eos_token_id": 2,
              "pad_token_id": 0}


def make_qwen3(seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(**QWEN3_TINY))


def qwen3_tokens(seed: int, rows: int, length: int = 16) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, QWEN3_TINY["vocab_size"], (rows, length), generator=generator)


EVAL_SEED = 999


@torch.no_grad()
def eval_loss(model) -> torch.Tensor:
    tokens = qwen3_tokens(EVAL_SEED, rows=4)
    was_training = model.training
    model.eval()
    loss = model(input_ids=tokens, labels=tokens).loss.detach().clone()
    model.train(was_training)
    return loss


def hf_export_run(rank: int, world_size: int, config: dict, save_dir: str, steps: int) -> dict:
    """Train a tiny transformers Qwen3 ``steps`` steps and save; rank 0 returns the live weights and eval loss."""
    from zero_workers import init_engine as init_plain_engine

    engine = init_plain_engine(config, model=make_qwen3())
    ga, micro_batch = engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu()
    for step in range(steps):
        for micro in range(ga):
            tokens = qwen3_tokens(1000 * step + 10 * micro + rank, rows=micro_batch)
            engine.backward(engine(input_ids=tokens, labels=tokens).loss)
            engine.step()
    engine.save_checkpoint(save_dir, tag="hf")
    if rank != 0:
        return {}
    return {"loss": eval_loss(engine.module),
            "weights": {k: v.detach().clone() for k, v in engine.module.state_dict().items()},
            "config": engine.module.config.to_dict()}


def stack_reshard_run(rank: int, world_size: int, configs: list[tuple[dict, dict]], save_dir: str, steps: int) -> list:
    """Per (save config, load config): train the MoE model ``steps`` steps and save; go on ``steps`` more
    (the params of not stopping); then a fresh engine of the load config loads the save and takes
    the same ``steps`` steps. The two configs plan the expert stacks differently (whole, or in
    pieces of whole experts), so the load cuts or joins each stack's state at expert boundaries."""
    from tiny_model import make_moe_model
    from zero_workers import init_engine

    def train(engine, first):
        ga = engine.gradient_accumulation_steps()
        for s in range(first, first + steps):
            for micro in range(ga):
                engine.backward(engine(batches(s, micro, rank, world_size, engine.train_micro_batch_size_per_gpu())))
                engine.step()

    out = []
    for index, (save_config, load_config) in enumerate(configs):
        directory = os.path.join(save_dir, f"stacks{index}")
        engine = init_engine(save_config, model=make_moe_model())
        train(engine, 0)
        engine.save_checkpoint(directory, tag="mid")
        train(engine, steps)
        saved_items = [t.name for t in engine.optimizer.owned_tensors()]
        going_on = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        loaded = init_engine(load_config, model=make_moe_model(seed=1))
        loaded.load_checkpoint(directory)
        loaded_items = [t.name for t in loaded.optimizer.owned_tensors()]
        train(loaded, steps)
        out.append({"going_on": going_on, "saved_items": saved_items, "loaded_items": loaded_items,
                    "resumed": {n: p.detach().clone() for n, p in loaded.module.named_parameters()}})
    return out
