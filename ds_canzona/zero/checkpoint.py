"""ds_canzona's checkpoint format: whole tensors keyed by parameter name.

Layout of ``<save_dir>/<tag>/``::

    canzona_meta.pt               rank 0: names, shapes, kinds, owners under the saving plan,
                                  param-group hyper-parameters, loss scaler, engine counters,
                                  lr scheduler, client state, module buffers and frozen params
    canzona_rank00003.safetensors rank 3: fp32 master and optimizer state of every tensor it owns

Because every tensor lives whole on one rank, a checkpoint loads into any other plan (another
world size, alpha, bucket size or stage): each rank reads, lazily, just the tensors it owns now,
from whichever file holds them. Nothing is unpickled into code: tensors come from safetensors and
the metadata file is read with ``torch.load(weights_only=True)``.

Crash safety: every file is written under a temporary name and renamed into place, and
``latest`` is rewritten (the same way) only after a barrier that every rank reaches after its
files are complete. A crash during a save leaves ``latest`` pointing at the previous checkpoint.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import deepspeed.comm as dist

FORMAT = "ds_canzona-1"
META_FILE = "canzona_meta.pt"
LATEST_FILE = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, truncated, or does not belong to this model."""


def rank_file(rank: int) -> str:
    return f"canzona_rank{rank:05d}.safetensors"


def _atomic_write(path: str, write) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    write(tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _state_tensors(name: str, master: torch.Tensor, state: dict) -> tuple[dict, dict]:
    tensors = {f"master/{name}": master.detach().to("cpu", copy=True).contiguous()}
    scalars = {}
    for key, value in state.items():
        if torch.is_tensor(value):
            tensors[f"state/{name}/{key}"] = value.detach().to("cpu", copy=True).contiguous()
        else:
            scalars[key] = value
    return tensors, scalars


def _scheduler_state(engine) -> dict | None:
    scheduler = getattr(engine, "lr_scheduler", None)
    return scheduler.state_dict() if scheduler is not None and hasattr(scheduler, "state_dict") else None


def _loss_scaler_state(scaler) -> dict:
    keys = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
    return {k: getattr(scaler, k) for k in keys if hasattr(scaler, k)}


def _param_group_settings(optimizer) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def save_engine_checkpoint(engine, save_dir: str, *, tag=None, client_state: dict | None = None,
                           save_latest: bool = True) -> bool:
    """engine.save_checkpoint for ds_canzona: every rank writes what it owns."""
    if not save_dir:
        raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
    zero = engine.optimizer
    group = zero.dp_process_group
    tag = str(tag if tag is not None else f"global_step{engine.global_steps}")
    ckpt_dir = os.path.join(save_dir, tag)
    os.makedirs(ckpt_dir, exist_ok=True)

    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict] = {}
    for owned in zero.owned_tensors():
        t, s = _state_tensors(owned.name, owned.master, owned.state)
        tensors.update(t)
        if s:
            scalars[owned.name] = s
    metadata = {"format": FORMAT, "rank": str(zero.rank), "world_size": str(zero.world_size),
                "plan_digest": zero.plan.digest(), "scalars": json.dumps(scalars)}
    _atomic_write(os.path.join(ckpt_dir, rank_file(zero.rank)),
                  lambda path: save_file(tensors, path, metadata=metadata))

    if zero.rank == 0:
        trained = set(zero.names)
        extra = {k: v.detach().to("cpu", copy=True) for k, v in engine.module.state_dict().items() if k not in trained}
        meta = {
            "format": FORMAT,
            "world_size": zero.world_size,
            "names": list(zero.names),
            "shapes": [list(p.shape) for p in zero.params],
            "kinds": [g["kind"] for g in zero.groups],
            "owners": list(zero.plan.owner),
            "param_groups": _param_group_settings(zero.optimizer),
            "loss_scaler": _loss_scaler_state(zero.loss_scaler),
            "engine": {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
                       "skipped_steps": engine.skipped_steps, "micro_steps": engine.micro_steps},
            "lr_scheduler": _scheduler_state(engine),
            "client_state": dict(client_state or {}),
            "module_extra": extra,
        }
        _atomic_write(os.path.join(ckpt_dir, META_FILE), lambda path: torch.save(meta, path))

    # Every rank's files are complete before `latest` may name this tag.
    dist.barrier(group=group)
    if save_latest and zero.rank == 0:
        def write_latest(path):
            with open(path, "w") as f:
                f.write(tag)
        _atomic_write(os.path.join(save_dir, LATEST_FILE), write_latest)
    dist.barrier(group=group)
    return True


def read_meta(ckpt_dir: str) -> dict[str, Any]:
    path = os.path.join(ckpt_dir, META_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint metadata file is missing: {path}")
    try:
        meta = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise CheckpointError(f"checkpoint metadata file is unreadable or truncated: {path} ({error})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a {FORMAT} checkpoint")
    return meta


def resolve_tag(load_dir: str, tag) -> str | None:
    if tag is not None:
        return str(tag)
    latest = os.path.join(load_dir, LATEST_FILE)
    if not os.path.isfile(latest):
        return None
    with open(latest) as f:
        return f.read().strip()


class ShardReader:
    """Lazy reads of named tensors from the rank files of one checkpoint."""

    def __init__(self, ckpt_dir: str, meta: dict):
        self.ckpt_dir = ckpt_dir
        self.owner = dict(zip(meta["names"], meta["owners"]))
        self.world_size = meta["world_size"]
        self._open: dict[int, Any] = {}
        self._scalars: dict[int, dict] = {}

    def _file(self, rank: int):
        if rank not in self._open:
            path = os.path.join(self.ckpt_dir, rank_file(rank))
            if not os.path.isfile(path):
                raise CheckpointError(f"checkpoint shard file is missing: {path}")
            try:
                handle = safe_open(path, framework="pt", device="cpu")
                metadata = handle.metadata() or {}
            except Exception as error:
                raise CheckpointError(f"checkpoint shard file is truncated or corrupt: {path} ({error})") from None
            if metadata.get("format") != FORMAT or metadata.get("rank") != str(rank):
                raise CheckpointError(f"checkpoint shard file {path} does not belong to this checkpoint")
            self._open[rank] = handle
            self._scalars[rank] = json.loads(metadata.get("scalars", "{}"))
        return self._open[rank]

    def tensor(self, name: str, key: str) -> torch.Tensor:
        rank = self.owner[name]
        handle = self._file(rank)
        try:
            return handle.get_tensor(key)
        except Exception as error:
            path = os.path.join(self.ckpt_dir, rank_file(rank))
            raise CheckpointError(f"cannot read {key!r} from {path}: {error}") from None

    def state_keys(self, name: str) -> list[str]:
        prefix = f"state/{name}/"
        return [k[len(prefix):] for k in self._file(self.owner[name]).keys() if k.startswith(prefix)]

    def scalars(self, name: str) -> dict:
        self._file(self.owner[name])
        return dict(self._scalars[self.owner[name]].get(name, {}))


def check_same_model(meta: dict, names: list[str], shapes: list[list[int]], where: str) -> None:
    if meta["names"] == names and meta["shapes"] == shapes:
        return
    ours = dict(zip(names, shapes))
    theirs = dict(zip(meta["names"], meta["shapes"]))
    missing = [n for n in ours if n not in theirs][:3]
    extra = [n for n in theirs if n not in ours][:3]
    reshaped = [n for n in ours if n in theirs and ours[n] != theirs[n]][:3]
    raise CheckpointError(f"checkpoint {where} is from a different model: missing {missing}, unexpected {extra}, "
                          f"different shapes {reshaped}")


def load_engine_checkpoint(engine, load_dir: str, *, tag=None, load_optimizer_states: bool = True,
                           load_lr_scheduler_states: bool = True, load_module_only: bool = False):
    """engine.load_checkpoint for ds_canzona: each rank reads the tensors it owns under its plan."""
    zero = engine.optimizer
    tag = resolve_tag(load_dir, tag)
    if tag is None:
        return None, None
    ckpt_dir = os.path.join(load_dir, tag)
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"checkpoint directory is missing: {ckpt_dir}")
    meta = read_meta(ckpt_dir)
    check_same_model(meta, list(zero.names), [list(p.shape) for p in zero.params], ckpt_dir)
    reader = ShardReader(ckpt_dir, meta)

    with torch.no_grad():
        for owned in zero.owned_tensors():
            owned.master.copy_(reader.tensor(owned.name, f"master/{owned.name}"))
            if load_optimizer_states and not load_module_only:
                _load_state(reader, owned)
        zero.refresh_params_from_masters()
        extra = meta.get("module_extra") or {}
        if extra:
            engine.module.load_state_dict(extra, strict=False)

    if not load_module_only:
        if load_optimizer_states:
            for group, saved in zip(zero.optimizer.param_groups, meta["param_groups"]):
                group.update({k: v for k, v in saved.items() if k != "params"})
            for key, value in meta.get("loss_scaler", {}).items():
                setattr(zero.loss_scaler, key, value)
        counters = meta.get("engine", {})
        engine.global_steps = counters.get("global_steps", engine.global_steps)
        engine.global_samples = counters.get("global_samples", engine.global_samples)
        engine.skipped_steps = counters.get("skipped_steps", engine.skipped_steps)
        engine.micro_steps = counters.get("micro_steps", engine.micro_steps)
        scheduler = getattr(engine, "lr_scheduler", None)
        if load_lr_scheduler_states and scheduler is not None and meta.get("lr_scheduler") is not None:
            scheduler.load_state_dict(meta["lr_scheduler"])
    return ckpt_dir, meta.get("client_state", {})


def _load_state(reader: ShardReader, owned) -> None:
    saved_keys = set(reader.state_keys(owned.name)) | set(reader.scalars(owned.name))
    if saved_keys != set(owned.state):
        raise CheckpointError(f"optimizer state of {owned.name!r} has keys {sorted(saved_keys)}, expected "
                              f"{sorted(owned.state)} (saved with a different optimizer?)")
    scalars = reader.scalars(owned.name)
    for key in list(owned.state):
        if key in scalars:
            owned.state[key] = scalars[key]
        else:
            value = reader.tensor(owned.name, f"state/{owned.name}/{key}")
            current = owned.state[key]
            if torch.is_tensor(current) and current.shape == value.shape:
                current.copy_(value)
            else:
                owned.state[key] = value.to(owned.master.device)
