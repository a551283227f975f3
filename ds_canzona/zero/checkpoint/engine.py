"""engine.save_checkpoint and engine.load_checkpoint for ds_canzona's ZeRO-1/2 and ZeRO-3 optimizers.

The only part of the checkpoint package that knows :class:`CanzonaZeroOptimizer` (and
:class:`CanzonaZero3Optimizer`, whose items are always whole tensors on their owners): which items a
rank owns under its plan (its fp32 masters and optimizer state), what the manifest records about
the engine (counters, lr scheduler, loss scaler, param groups, the module's buffers and frozen
parameters), and the order of a save (write shards, agree, commit) and of a load (check
everything, agree, copy, agree). The format, the file I/O and the agreement live beside it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
from typing import Any

import torch

from ds_canzona.optim.base import join_stack_states, slice_stack_state
from ds_canzona.zero.checkpoint.agreement import Agreement, tag_hash
from ds_canzona.zero.checkpoint.batch import batch_change_warning, batch_record
from ds_canzona.zero.checkpoint.files import atomic_write, remove_stale, resolve_tag, write_bytes, write_shard
from ds_canzona.zero.checkpoint.format import (FORMAT, LATEST_FILE, META_FILE, CheckpointError, check_same_model,
                                               check_tag, master_key, read_meta, serialize_meta, shard_header,
                                               shard_name, state_key)
from ds_canzona.zero.checkpoint.frozen import (check_value, digest, gather_to_cpu, is_partitioned, partitioned_frozen,
                                               write_full_value)
from ds_canzona.zero.checkpoint.hf_config import hf_config_files
from ds_canzona.zero.checkpoint.reader import Checkpoint
from ds_canzona.zero.checkpoint.recovery_scripts import write_recovery_scripts

logger = logging.getLogger("ds_canzona")


def _agreement(zero) -> Agreement:
    """The ranks that write one shard file each: the DP group, or the whole DP x TP world under AutoTP."""
    rank, world_size, group = zero.checkpoint_ranks()
    return Agreement(rank=rank, world_size=world_size, group=group, device=zero.device)


def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    # A copy: masters are views into the flat buckets, and safetensors refuses shared storage.
    return tensor.detach().to("cpu", copy=True).contiguous()


# ----------------------------------------------------------------------------- saving


def _owned_payload(zero) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for owned in zero.checkpoint_items():
        tensors[master_key(owned.name)] = _cpu_copy(owned.master)
        for key, value in owned.state.items():
            if "/" in key:
                raise CheckpointError(f"optimizer state key {key!r} of {owned.name!r} contains '/'")
            if torch.is_tensor(value):
                tensors[state_key(owned.name, key)] = _cpu_copy(value)
            else:
                scalars.setdefault(owned.name, {})[key] = value
    try:
        json.dumps(scalars)
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"optimizer state holds a value that is neither a tensor nor JSON: {error}") from None
    return tensors, scalars


def _module_extra(engine, zero, *, exclude_frozen: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The module's state that the optimizer does not own, and the aliases of trained tensors.

    Buffers and frozen parameters are returned as they are (a ZeRO-3 frozen parameter as the
    live parameter, whose local data is a placeholder: ``frozen`` gathers it); a state_dict
    entry that *is* a trained parameter under another name (tied weights) is an alias, not a copy.
    """
    trained = {id(p): name for p, name in zip(zero.params, zero.names)}
    extra: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for key, value in engine.module.state_dict(keep_vars=True).items():
        if id(value) in trained:
            if key != trained[id(value)]:
                aliases[key] = trained[id(value)]
            continue
        if exclude_frozen and isinstance(value, torch.nn.Parameter):
            continue
        extra[key] = value
    return extra, aliases


def _loss_scaler_state(scaler) -> dict[str, Any]:
    dynamic = bool(getattr(scaler, "dynamic", False))
    state: dict[str, Any] = {"dynamic": dynamic, "cur_scale": float(scaler.cur_scale)}
    if dynamic:
        for key in ("cur_iter", "last_overflow_iter", "cur_hysteresis"):
            if hasattr(scaler, key):
                state[key] = int(getattr(scaler, key))
    return state


def _group_settings(group: dict) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


def _batch(engine, zero) -> dict[str, int]:
    return batch_record(train_batch_size=engine.train_batch_size(), micro_batch=engine.train_micro_batch_size_per_gpu(),
                        accumulation=engine.gradient_accumulation_steps(), ranks=zero.world_size)


def _owned_entries(zero) -> list:
    """What this rank contributes to the manifest's tensor list (no collective).

    Without expert parallelism rank 0 can tell every item's entry alone (the plan is the same on
    every rank): all of them there, nothing elsewhere. An expert-parallel runtime's other EP ranks
    own other experts, so each rank gives (order key, entry) for what it owns and
    ``_gathered_entries`` collects them.
    """
    group_index = {id(g): i for i, g in enumerate(zero.optimizer.param_groups)}
    if not hasattr(zero, "checkpoint_parts"):
        return [_item_entry(zero, item, group_index) for item in range(len(zero.plan.specs))] if zero.rank == 0 else []
    mine = []
    keys = iter(zero.owned_entry_keys())
    for part in zero.checkpoint_parts():
        for owned in part.owned_tensors():
            entry = _item_entry(part, owned.index, group_index)
            entry["file"] = zero.rank  # this rank's shard, whichever group the item's plan is over
            mine.append((next(keys), entry))
    return mine


def _gathered_entries(zero, mine: list | None) -> list:
    """Every rank's ``_owned_entries`` where they must be collected (a collective every rank reaches,
    ``None`` from a rank that failed before), in one order; else this rank's own."""
    if not hasattr(zero, "checkpoint_parts"):
        return mine or []
    import deepspeed.comm as dist

    everyone: list = [None] * zero.world_size
    dist.all_gather_object(everyone, mine, group=zero.dp_process_group)
    if any(rank is None for rank in everyone):
        return []  # the agreement after this reports the failure
    return [entry for _, entry in sorted((pair for rank in everyone for pair in rank), key=lambda pair: pair[0])]


def _model_shapes(zero) -> dict[str, list[int]]:
    """The trained tensors of the whole model by name, as the manifest must list them."""
    if hasattr(zero, "model_shapes"):
        return zero.model_shapes()
    return {n: list(s) for n, s in zip(zero.names, zero.logical_shapes)}


def _load_parts(zero) -> list:
    """The runtimes whose plans say what a rank reads (one, or an expert-parallel runtime's families)."""
    return zero.checkpoint_parts() if hasattr(zero, "checkpoint_parts") else [zero]


def _build_meta(engine, zero, tag: str, client_state: dict | None, exclude_frozen: bool,
                extra: dict[str, torch.Tensor], aliases: dict[str, str], entries: list[dict[str, Any]]
                ) -> dict[str, Any]:
    """The manifest; a ZeRO-3 frozen parameter's value is None here, filled in once gathered."""
    import deepspeed

    import ds_canzona

    scheduler = getattr(engine, "lr_scheduler", None)
    return {
        "format": FORMAT,
        "save_id": None,  # set after the agreement
        "tag": tag,
        "versions": {"ds_canzona": str(ds_canzona.__version__), "deepspeed": str(deepspeed.__version__),
                     "torch": str(torch.__version__)},
        "world_size": zero.world_size,
        "stage": zero.stage,
        "plan": _plan_record(zero.plan, zero.stage),
        "param_dtype": str(zero.dtype).removeprefix("torch."),
        "files": [],  # set after the shards are written
        "tensors": entries,
        "param_groups": [_group_settings(g) for g in zero.optimizer.param_groups],
        "loss_scaler": _loss_scaler_state(zero.loss_scaler),
        "engine": {"global_steps": int(engine.global_steps), "global_samples": int(engine.global_samples),
                   "skipped_steps": int(engine.skipped_steps)},
        "batch": _batch(engine, zero),
        "lr_scheduler": scheduler.state_dict() if scheduler is not None and hasattr(scheduler, "state_dict") else None,
        "client_state": dict(client_state or {}),
        "module_extra": {k: None if is_partitioned(v) else _cpu_copy(v) for k, v in extra.items()},
        "frozen_excluded": bool(exclude_frozen),
        "aliases": aliases,
        "hf_config_files": hf_config_files(engine.module),
    }


def _plan_record(plan, stage: int) -> dict[str, Any]:
    """What the manifest says about the layout it was saved under (informative; any layout loads it)."""
    if stage == 3:
        return {"layout": "owner", "cost_model": plan.cost_model, "split_numel": plan.split_numel,
                "digest": plan.digest()}
    return {"strategy": plan.strategy, "alpha": plan.alpha, "bucket_numel": plan.bucket_numel,
            "cost_model": plan.cost_model, "digest": plan.digest()}


def _item_tensor_range(zero, item: int) -> tuple[int, int, int]:
    """(tensor index, start, stop) of plan item ``item`` (a whole tensor or a canonical piece, at every stage)."""
    return zero.plan.pieces[item]


def _item_entry(zero, item: int, group_index: dict[int, int]) -> dict[str, Any]:
    """The manifest entry of plan item ``item``: a whole tensor, or a piece that names its tensor."""
    plan = zero.plan
    tensor, start, stop = _item_tensor_range(zero, item)
    group = zero.groups[tensor]
    # The tensor's logical shape: under AutoTP its unsharded one, under ZeRO-3 its ds_shape.
    shape = zero.logical_shapes[tensor]
    entry = {"name": plan.specs[item].name, "shape": list(plan.specs[item].shape), "kind": group["kind"],
             "group": group_index[id(group)], "file": zero.item_file(item)}
    if stop - start != math.prod(shape):
        entry.update(tensor=zero.names[tensor], start=start, stop=stop, tensor_shape=list(shape))
    return entry


def save_engine_checkpoint(engine, save_dir, *, tag=None, client_state: dict | None = None,
                           save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
    """engine.save_checkpoint for ds_canzona: every rank writes what it owns; rank 0 commits."""
    zero = engine.optimizer
    ranks = _agreement(zero)
    error: BaseException | None = None
    payload = meta = mine = None
    frozen = []
    frozen_digest = 0
    ckpt_dir = ""
    try:
        if not save_dir or not isinstance(save_dir, (str, os.PathLike)):
            raise ValueError(f"save_dir must be a non-empty path, got {save_dir!r}")
        save_dir = os.fspath(save_dir)
        tag = check_tag(tag if tag is not None else f"global_step{engine.global_steps}")
        if engine.micro_steps % engine.gradient_accumulation_steps() != 0:
            logger.warning("ds_canzona: saving a checkpoint in the middle of gradient accumulation; the "
                           "accumulated gradients are not saved")
        ckpt_dir = os.path.join(save_dir, tag)
        os.makedirs(ckpt_dir, exist_ok=True)
        payload = _owned_payload(zero)
        extra, aliases = _module_extra(engine, zero, exclude_frozen=exclude_frozen_parameters)
        frozen = partitioned_frozen(extra)
        frozen_digest = digest(frozen)
        mine = _owned_entries(zero)
    except Exception as caught:
        error = caught
    entries = _gathered_entries(zero, mine if error is None else None)
    if ranks.rank == 0 and error is None:
        try:
            meta = _build_meta(engine, zero, tag, client_state, exclude_frozen_parameters, extra, aliases, entries)
            serialize_meta(meta)
        except Exception as caught:
            error = caught
    rows = ranks.gather([error is None, tag_hash(tag), secrets.randbits(62), frozen_digest])
    ranks.check(rows, error, "preparing the checkpoint")
    if len(set(rows[:, 1].tolist())) != 1:
        raise CheckpointError(f"ranks passed different checkpoint tags (this rank: {tag!r}); pass the same tag "
                              "on every rank")
    if len(set(rows[:, 3].tolist())) != 1:
        raise CheckpointError("ranks hold different ZeRO-3 frozen parameters (names, shapes, or gathered on some "
                              "ranks only); save between steps, with the same module on every rank")
    save_id = f"{int(rows[0, 2]):016x}"

    # ZeRO-3 frozen parameters: every rank gathers each in turn (a collective), rank 0 keeps them
    if frozen:
        values, error = gather_to_cpu(frozen, keep=ranks.rank == 0)
        if ranks.rank == 0 and error is None:
            try:
                meta["module_extra"] = {k: values[k] if v is None else v for k, v in meta["module_extra"].items()}
            except Exception as caught:
                error = caught
        rows = ranks.gather([error is None])
        ranks.check(rows, error, "gathering the ZeRO-3 frozen parameters")

    # 1. every rank writes its shard under a name no earlier save used
    path = os.path.join(ckpt_dir, shard_name(ranks.rank, save_id))
    size = -1
    try:
        tensors, scalars = payload
        size = write_shard(path, tensors, shard_header(save_id, ranks.rank, ranks.world_size, json.dumps(scalars)))
    except Exception as caught:
        error = caught
    payload = tensors = None  # the CPU copies: free them before waiting for the other ranks
    rows = ranks.gather([error is None, size])
    if error is not None or bool((rows[:, 0] == 0).any()):
        try:
            os.remove(path)
        except OSError:
            pass
    ranks.check(rows, error, f"writing checkpoint shard {path}")

    # 2. all shards are complete: rank 0 commits the tag (manifest), then the directory (latest)
    if ranks.rank == 0:
        try:
            meta["save_id"] = save_id
            meta["files"] = [{"name": shard_name(r, save_id), "rank": r, "bytes": int(rows[r, 1])}
                             for r in range(ranks.world_size)]
            atomic_write(os.path.join(ckpt_dir, META_FILE), write_bytes(serialize_meta(meta)))
            if save_latest:
                atomic_write(os.path.join(save_dir, LATEST_FILE), write_bytes(tag.encode()))
            remove_stale(ckpt_dir, keep={f["name"] for f in meta["files"]})
            remove_stale(save_dir, keep=set())
            write_recovery_scripts(save_dir)  # DeepSpeed's zero_to_fp32.py command line, on this format
        except Exception as caught:
            error = caught
    rows = ranks.gather([error is None])
    ranks.check(rows, error, f"committing checkpoint {ckpt_dir}")
    if engine.global_rank == 0:
        # Printed, as the plan summary: DeepSpeed's ranks log at WARNING by default.
        print(f"ds_canzona: saved checkpoint {tag!r} to {os.path.abspath(ckpt_dir)} ({ranks.world_size} shard "
              f"files{', latest updated' if save_latest else ''})", flush=True)
    return True


# ----------------------------------------------------------------------------- loading


def _check_kinds(ckpt: Checkpoint, zero) -> None:
    """Optimizer state loads only into the same optimizer kinds and the same param groups."""
    saved_groups = [g.get("kind") for g in ckpt.meta["param_groups"]]
    groups = [g["kind"] for g in zero.optimizer.param_groups]
    if saved_groups != groups:
        raise CheckpointError(f"checkpoint {ckpt.directory} has param groups of kinds {saved_groups}, this optimizer "
                              f"{groups}; pass load_optimizer_states=False to load only the weights")
    group_index = {id(g): i for i, g in enumerate(zero.optimizer.param_groups)}
    saved = {name: ckpt.tensor_entry(name) for name in zero.names}
    differ = [f"{name}: saved {saved[name]['kind']} (group {saved[name]['group']}), now "
              f"{group['kind']} (group {group_index[id(group)]})"
              for name, group in zip(zero.names, zero.groups)
              if (saved[name]["kind"], saved[name]["group"]) != (group["kind"], group_index[id(group)])]
    if differ:
        raise CheckpointError(f"checkpoint {ckpt.directory} was trained with other optimizer kinds or groups for "
                              f"{len(differ)} tensors (e.g. {differ[:3]}); pass load_optimizer_states=False to load "
                              "only the weights")


def _saved_as_is(ckpt: Checkpoint, owned) -> bool:
    """Whether ``owned`` was saved as the same item (a whole tensor, or the same piece)."""
    return owned.name in ckpt.entries and list(ckpt.entries[owned.name]["shape"]) == list(owned.master.shape)


def _check_owned_reads(ckpt: Checkpoint, owned_tensors: list, with_state: bool, zero) -> None:
    """Every item this rank will copy exists in the shards the manifest names, with its shape."""
    for owned in owned_tensors:
        if not _saved_as_is(ckpt, owned):
            # Saved in other pieces (another split_numel, or whole): the items covering its
            # element range must exist, with their shapes and state keys (file headers only).
            _, start, stop = _item_tensor_range(zero, owned.index)
            tensor = zero.names[owned.tensor]
            if ckpt.is_stack(tensor):
                # Whole experts: the covering items' keys, cut to the experts read and joined (renumbered).
                ranges = ckpt.stack_ranges(tensor, start, stop)
                covering = [(item, None) for item, _, _, _ in ranges]
                if with_state:
                    keys = set(join_stack_states([
                        (last - first, slice_stack_state(ckpt.state_shapes(item["name"]), experts, first, last))
                        for item, experts, first, last in ranges]))
                    if keys != set(owned.state):
                        raise CheckpointError(f"optimizer state of {owned.name!r} read from {ckpt.directory} has keys "
                                              f"{sorted(keys)}, this optimizer expects {sorted(owned.state)}")
            else:
                covering = [(item, None) for item in ckpt.covering_items(tensor, start, stop)]
            for item, _ in covering:
                shape = ckpt.master_shape(item["name"])
                if shape != list(item["shape"]):
                    raise CheckpointError(f"{master_key(item['name'])!r} has shape {shape} in "
                                          f"{ckpt.file_path(item['file'])}, the manifest says {item['shape']}")
                saved = ckpt.state_shapes(item["name"])
                if with_state and not ckpt.is_stack(tensor) and set(saved) != set(owned.state):
                    raise CheckpointError(f"optimizer state of {item['name']!r} in {ckpt.file_path(item['file'])} "
                                          f"has keys {sorted(saved)}, this optimizer expects {sorted(owned.state)}")
            continue
        shape = ckpt.master_shape(owned.name)
        if shape != list(owned.master.shape):
            raise CheckpointError(f"{master_key(owned.name)!r} in {ckpt.file_path(ckpt._where(owned.name))} has shape "
                                  f"{shape}, expected {list(owned.master.shape)}")
        if not with_state:
            continue
        saved = ckpt.state_shapes(owned.name)
        if set(saved) != set(owned.state):
            raise CheckpointError(f"optimizer state of {owned.name!r} in {ckpt.file_path(ckpt._where(owned.name))} has "
                                  f"keys {sorted(saved)}, this optimizer expects {sorted(owned.state)} "
                                  "(other hyper-parameters, e.g. a different max_preconditioner_dim?)")
        for key, value in owned.state.items():
            if torch.is_tensor(value) and saved[key] != list(value.shape):
                raise CheckpointError(f"optimizer state {owned.name!r}[{key!r}] has shape {saved[key]} in the "
                                      f"checkpoint, expected {list(value.shape)}")


@torch.no_grad()
def _copy_owned(ckpt: Checkpoint, owned_tensors: list, with_state: bool, zero) -> None:
    for owned in owned_tensors:
        if _saved_as_is(ckpt, owned):
            master = ckpt.master(owned.name)
            state = ckpt.state(owned.name) if with_state else {}
        else:
            _, start, stop = _item_tensor_range(zero, owned.index)
            master, state = ckpt.read_range(zero.names[owned.tensor], start, stop, owned.master.shape,
                                            with_state=with_state)
        owned.master.copy_(master)
        if not with_state:
            continue
        for key, value in state.items():
            current = owned.state[key]
            if torch.is_tensor(current):
                current.copy_(value)
            else:
                owned.state[key] = value


def _restore_loss_scaler(zero, saved: dict[str, Any]) -> None:
    scaler = zero.loss_scaler
    dynamic = bool(getattr(scaler, "dynamic", False))
    if saved.get("dynamic") and dynamic:
        for key, value in saved.items():
            if key != "dynamic" and hasattr(scaler, key):
                setattr(scaler, key, value)
    elif bool(saved.get("dynamic")) != dynamic:
        logger.warning("ds_canzona: the checkpoint's loss scaler is %s, this engine's is %s; keeping the engine's",
                       "dynamic" if saved.get("dynamic") else "static", "dynamic" if dynamic else "static")


def load_engine_checkpoint(engine, load_dir, *, tag=None, load_module_strict: bool = True,
                           load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                           load_module_only: bool = False, custom_load_fn=None):
    """engine.load_checkpoint for ds_canzona: each rank reads the whole tensors it owns under its plan.

    Returns ``(tag directory, client_state)``, or ``(None, None)`` when ``load_dir`` has no
    ``latest`` and no tag is given (as DeepSpeed does). Every check runs before anything is
    copied, so a checkpoint that fails them leaves the engine untouched, on every rank.
    """
    zero = engine.optimizer
    ranks = _agreement(zero)
    with_state = load_optimizer_states and not load_module_only
    error: BaseException | None = None
    ckpt: Checkpoint | None = None
    found = False
    extra: dict[str, torch.Tensor] = {}
    current_extra: dict[str, torch.Tensor] = {}
    try:
        if custom_load_fn is not None:
            raise CheckpointError("custom_load_fn is not supported with the 'canzona' section")
        load_dir = os.fspath(load_dir)
        resolved = resolve_tag(load_dir, tag)
        found = resolved is not None
        if found:
            ckpt = Checkpoint(os.path.join(load_dir, resolved), read_meta(os.path.join(load_dir, resolved)))
            check_same_model(ckpt.meta, _model_shapes(zero), ckpt.directory)
            if with_state:
                _check_kinds(ckpt, zero)
            for part in _load_parts(zero):
                _check_owned_reads(ckpt, part.load_targets(), with_state, part)
            current_extra, _ = _module_extra(engine, zero)
            saved_extra = ckpt.meta.get("module_extra") or {}
            missing = {k for k in set(current_extra) - set(saved_extra)
                       if not (ckpt.meta.get("frozen_excluded") and isinstance(current_extra[k], torch.nn.Parameter))}
            unexpected = set(saved_extra) - set(current_extra)
            if load_module_strict and (missing or unexpected):
                raise CheckpointError(
                    f"checkpoint {ckpt.directory} has other buffers / frozen parameters than the model: missing "
                    f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]} (load_module_strict=False loads the "
                    "common ones)")
            extra = {k: v for k, v in saved_extra.items() if k in current_extra}
            for key, value in extra.items():
                check_value(key, current_extra[key], value)
    except Exception as caught:
        error = caught
    rows = ranks.gather([error is None, found])
    ranks.check(rows, error, f"checking checkpoint {ckpt.directory if ckpt else load_dir}")
    if len(set(rows[:, 1].tolist())) != 1:
        raise CheckpointError(f"ranks disagree on whether {os.path.join(load_dir, LATEST_FILE)} exists "
                              "(is the checkpoint directory on a filesystem every rank sees?)")
    if not found:
        logger.warning(f"ds_canzona: no '{LATEST_FILE}' file in {load_dir} and no tag given; nothing loaded")
        return None, None

    try:
        for part in _load_parts(zero):
            _copy_owned(ckpt, part.load_targets(), with_state, part)
        # ZeRO-3 frozen parameters: each rank writes its slice of the full value (no collective).
        for key in [k for k in extra if is_partitioned(current_extra[k])]:
            write_full_value(current_extra[key], extra.pop(key))
    except Exception as caught:
        error = caught
    rows = ranks.gather([error is None])
    ranks.check(rows, error, f"reading checkpoint {ckpt.directory}")
    zero.after_load()
    if extra:
        with torch.no_grad():
            engine.module.load_state_dict(extra, strict=False)

    meta = ckpt.meta
    if not load_module_only:
        if with_state:
            for group, saved in zip(zero.optimizer.param_groups, meta["param_groups"]):
                group.update(saved)
            _restore_loss_scaler(zero, meta.get("loss_scaler", {}))
        counters = meta.get("engine", {})
        engine.global_steps = counters.get("global_steps", engine.global_steps)
        engine.global_samples = counters.get("global_samples", engine.global_samples)
        engine.skipped_steps = counters.get("skipped_steps", engine.skipped_steps)
        scheduler = getattr(engine, "lr_scheduler", None)
        if load_lr_scheduler_states and scheduler is not None and meta.get("lr_scheduler") is not None:
            scheduler.load_state_dict(meta["lr_scheduler"])
        warning = batch_change_warning(meta.get("batch"), int(meta["world_size"]), _batch(engine, zero))
        if warning is not None and engine.global_rank == 0:
            logger.warning(warning)
    return ckpt.directory, meta.get("client_state", {})
