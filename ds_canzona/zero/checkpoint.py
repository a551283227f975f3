"""ds_canzona's checkpoint format: items keyed by parameter name, committed atomically.

Layout of ``<save_dir>/``::

    latest                                   the tag of the newest committed checkpoint
    <tag>/canzona_meta.pt                    the manifest (rank 0), the commit point of the tag
    <tag>/canzona_rank00003-<save_id>.safetensors
                                             rank 3's fp32 masters and optimizer state, per item
                                             (a whole tensor, or a piece "<name>[start:stop]"):
                                             "master/<item>", "state/<item>/<key>"

The manifest holds the format, the save id, every shard file with its size, every saved item
(name, shape, optimizer kind, param group, which file holds it; a piece of a non-matrix tensor,
saved when the plan had ``split_numel``, also names its tensor, its element range and the
tensor's shape), the param groups' settings,
the loss scaler, the engine counters, the lr scheduler, the client state, and the module's
buffers and frozen parameters. docs/CHECKPOINTS.md describes every field.

Any plan loads it: a checkpoint saved at one world size, alpha, bucket size, stage or
``split_numel`` loads into another, because each rank reads, lazily, only the items it owns under
its own plan, from whichever files the manifest names (an item saved in other pieces is put
together from the element ranges that cover it).

Crash safety: a save writes shard files under names carrying a fresh save id (each written to a
temporary name, fsynced and renamed), agrees across ranks that every file is complete, and only
then does rank 0 replace the manifest (the tag's commit) and ``latest`` (the directory's commit),
each by an atomic rename. Older files of the same tag are removed after the commit. A crash at
any point leaves the previous manifest, the files it names and ``latest`` as they were.

Safety: nothing is unpickled into code. Shards are safetensors; the manifest is read with
``torch.load(weights_only=True)`` (tensors and plain Python values) and a save whose metadata a
weights-only load would refuse fails before anything is written.

Every step that can fail on one rank is followed by an agreement (one small all-gather), so a bad
file or a full disk on one rank is an error on every rank, never a hang.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import os
import re
import secrets
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

logger = logging.getLogger("ds_canzona")

FORMAT = "ds_canzona-1"
META_FILE = "canzona_meta.pt"
LATEST_FILE = "latest"
_TMP_MARK = ".tmp."
_SHARD_PATTERN = re.compile(r"^canzona_rank\d{5,}-[0-9a-f]{16}\.safetensors$")
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_META_KEYS = ("save_id", "world_size", "files", "tensors", "param_groups")


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, truncated, from another model, or that could not be written."""


# ----------------------------------------------------------------------------- names and files


def shard_name(rank: int, save_id: str) -> str:
    return f"canzona_rank{rank:05d}-{save_id}.safetensors"


def master_key(name: str) -> str:
    return f"master/{name}"


def state_key(name: str, key: str) -> str:
    return f"state/{name}/{key}"


def check_tag(tag: Any) -> str:
    """A tag is one directory name; anything that could leave ``save_dir`` is refused."""
    text = str(tag)
    if (not text or text in (".", "..") or text.startswith(".") or text != text.strip()
            or any(c in text for c in "/\\\0\n")):
        raise CheckpointError(f"invalid checkpoint tag {text!r}: a tag is one directory name "
                              "(no '/', '\\' or newline, not starting with '.')")
    return text


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str, write: Callable[[str], Any]) -> None:
    """``write(tmp)``, fsync, then rename to ``path``: readers see the old file or the whole new one."""
    tmp = f"{path}{_TMP_MARK}{os.getpid()}"
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(os.path.dirname(path) or ".")


def _write_bytes(data: bytes) -> Callable[[str], None]:
    def write(path: str) -> None:
        with open(path, "wb") as f:
            f.write(data)
    return write


def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    # A copy: masters are views into the flat buckets, and safetensors refuses shared storage.
    return tensor.detach().to("cpu", copy=True).contiguous()


# ----------------------------------------------------------------------------- reading


def read_meta(ckpt_dir: str) -> dict[str, Any]:
    """The manifest of one tag directory, loaded without executing anything."""
    path = os.path.join(ckpt_dir, META_FILE)
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"checkpoint directory is missing: {ckpt_dir}")
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint manifest is missing: {path} (an incomplete save, or not a ds_canzona "
                              "checkpoint)")
    try:
        meta = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise CheckpointError(f"checkpoint manifest is unreadable, truncated or not plain data: {path} "
                              f"({' '.join(str(error).split())[:300]})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(f"{path} is not a {FORMAT} checkpoint manifest (format {found!r})")
    missing = [k for k in _META_KEYS if k not in meta]
    if missing:
        raise CheckpointError(f"checkpoint manifest {path} lacks {missing}")
    return meta


def resolve_tag(load_dir: str, tag: Any = None) -> str | None:
    """``tag``, or the tag named by ``<load_dir>/latest``; None when there is neither."""
    if tag is not None:
        return check_tag(tag)
    latest = os.path.join(load_dir, LATEST_FILE)
    if not os.path.isfile(latest):
        return None
    with open(latest, encoding="utf-8") as f:
        text = f.read().strip()
    try:
        return check_tag(text)
    except CheckpointError as error:
        raise CheckpointError(f"{latest}: {error}") from None


class Checkpoint:
    """One committed checkpoint: its manifest, and lazy, validated reads from its shard files."""

    def __init__(self, directory: str, meta: dict[str, Any]):
        self.directory = directory
        self.meta = meta
        self.entries = {t["name"]: t for t in meta["tensors"]}
        self._handles: dict[int, Any] = {}
        self._masters: dict[int, set[str]] = {}
        self._index: dict[int, dict[str, dict[str, str]]] = {}
        self._scalars: dict[int, dict[str, dict[str, Any]]] = {}
        self._by_tensor: dict[str, list[dict[str, Any]]] | None = None

    @classmethod
    def open(cls, path: str, tag: Any = None) -> Checkpoint:
        """A tag directory, or a save directory plus ``tag`` (default: its ``latest``)."""
        path = os.fspath(path)
        if tag is None and os.path.isfile(os.path.join(path, META_FILE)):
            return cls(path, read_meta(path))
        resolved = resolve_tag(path, tag)
        if resolved is None:
            if not os.path.isdir(path):
                raise CheckpointError(f"checkpoint directory is missing: {path}")
            raise CheckpointError(f"{path} holds no '{LATEST_FILE}' file and no {META_FILE}: pass the tag "
                                  "directory or a tag")
        directory = os.path.join(path, resolved)
        return cls(directory, read_meta(directory))

    @property
    def names(self) -> list[str]:
        """Saved items: whole tensors by parameter name, pieces as ``name[start:stop]``."""
        return [t["name"] for t in self.meta["tensors"]]

    @property
    def tensor_names(self) -> list[str]:
        """The trained tensors' parameter names, in buffer order."""
        return list(self._tensor_items())

    def _tensor_items(self) -> dict[str, list[dict[str, Any]]]:
        """Per tensor name, its saved items in element order, each with ``start`` and ``stop``."""
        if self._by_tensor is None:
            by_tensor: dict[str, list[dict[str, Any]]] = {}
            for entry in self.meta["tensors"]:
                tensor = entry.get("tensor", entry["name"])
                numel = math.prod(entry["tensor_shape"] if "tensor_shape" in entry else entry["shape"])
                by_tensor.setdefault(tensor, []).append(
                    {**entry, "start": entry.get("start", 0), "stop": entry.get("stop", numel)})
            for items in by_tensor.values():
                items.sort(key=lambda item: item["start"])
            self._by_tensor = by_tensor
        return self._by_tensor

    def items_of(self, tensor: str) -> list[str]:
        """The saved item names of ``tensor``: itself, or its pieces in element order."""
        return [item["name"] for item in self._tensor_items()[tensor]]

    def tensor_shape(self, tensor: str) -> list[int]:
        first = self._tensor_items()[tensor][0]
        return list(first.get("tensor_shape", first["shape"]))

    def tensor_entry(self, tensor: str) -> dict[str, Any]:
        """The manifest entry of ``tensor`` (of its first item: kind and group are the same for all)."""
        return self._tensor_items()[tensor][0]

    def covering_items(self, tensor: str, start: int, stop: int) -> list[dict[str, Any]]:
        """The saved items of ``tensor`` that hold elements ``[start, stop)``; an error on a gap."""
        items = self._tensor_items().get(tensor)
        if items is None:
            raise CheckpointError(f"checkpoint {self.directory} holds no tensor {tensor!r}")
        covering = [item for item in items if item["start"] < stop and start < item["stop"]]
        position = start
        for item in covering:
            if item["start"] > position:
                break
            position = max(position, item["stop"])
        if position < stop:
            raise CheckpointError(f"checkpoint {self.directory} does not hold elements [{position}, {stop}) of "
                                  f"{tensor!r}")
        return covering

    def read_range(self, tensor: str, start: int, stop: int, shape: Sequence[int], *,
                   with_state: bool) -> tuple[torch.Tensor, dict]:
        """Elements ``[start, stop)`` of ``tensor``'s master and of its elementwise state, in ``shape``.

        State tensors shaped like their saved item are elementwise and are cut and joined like the
        master; the others (the step counter, plain values) are the same in every piece and come
        from the first.
        """
        masters, states = [], {}
        for number, item in enumerate(self.covering_items(tensor, start, stop)):
            lo, hi = max(start, item["start"]) - item["start"], min(stop, item["stop"]) - item["start"]
            masters.append(self.master(item["name"]).reshape(-1)[lo:hi])
            if not with_state:
                continue
            for key, value in self.state(item["name"]).items():
                if torch.is_tensor(value) and list(value.shape) == list(item["shape"]):
                    states.setdefault(key, []).append(value.reshape(-1)[lo:hi])
                elif number == 0:
                    states[key] = value
        joined = {key: torch.cat(value).reshape(shape) if isinstance(value, list) else value
                  for key, value in states.items()}
        return torch.cat(masters).reshape(shape), joined

    def tensor_master(self, tensor: str) -> torch.Tensor:
        """``tensor``'s fp32 master, whole, with its shape."""
        shape = self.tensor_shape(tensor)
        items = self._tensor_items()[tensor]
        if len(items) == 1:
            return self.master(items[0]["name"])
        return self.read_range(tensor, 0, math.prod(shape), shape, with_state=False)[0]

    def tensor_state(self, tensor: str) -> dict[str, Any]:
        """``tensor``'s optimizer state, whole (elementwise state in the tensor's shape)."""
        shape = self.tensor_shape(tensor)
        items = self._tensor_items()[tensor]
        if len(items) == 1:
            return self.state(items[0]["name"])
        return self.read_range(tensor, 0, math.prod(shape), shape, with_state=True)[1]

    def file_path(self, index: int) -> str:
        return os.path.join(self.directory, self.meta["files"][index]["name"])

    def _file(self, index: int):
        if index in self._handles:
            return self._handles[index]
        entry = self.meta["files"][index]
        path = self.file_path(index)
        if not os.path.isfile(path):
            raise CheckpointError(f"checkpoint shard file is missing: {path}")
        size = os.path.getsize(path)
        if size != entry["bytes"]:
            raise CheckpointError(f"checkpoint shard file {path} has {size} bytes, the manifest records "
                                  f"{entry['bytes']} (truncated or replaced)")
        try:
            handle = safe_open(path, framework="pt", device="cpu")
            metadata = handle.metadata() or {}
            keys = list(handle.keys())
        except Exception as error:
            raise CheckpointError(f"checkpoint shard file is truncated or corrupt: {path} ({error})") from None
        expected = {"format": FORMAT, "save_id": self.meta["save_id"], "rank": str(entry["rank"])}
        found = {k: metadata.get(k) for k in expected}
        if found != expected:
            raise CheckpointError(f"checkpoint shard file {path} does not belong to this checkpoint: its header says "
                                  f"{found}, the manifest {os.path.join(self.directory, META_FILE)} expects {expected}")
        masters: set[str] = set()
        index_of: dict[str, dict[str, str]] = {}
        for key in keys:
            if key.startswith("master/"):
                masters.add(key[len("master/"):])
            elif key.startswith("state/"):
                owner, _, state_name = key[len("state/"):].rpartition("/")
                index_of.setdefault(owner, {})[state_name] = key
        try:
            scalars = json.loads(metadata.get("scalars", "{}"))
        except ValueError:
            raise CheckpointError(f"checkpoint shard file {path} has an unreadable header") from None
        self._handles[index], self._masters[index] = handle, masters
        self._index[index], self._scalars[index] = index_of, scalars
        return handle

    def _where(self, name: str) -> int:
        if name not in self.entries:
            raise CheckpointError(f"checkpoint {self.directory} holds no tensor {name!r}")
        return self.entries[name]["file"]

    def _get(self, index: int, key: str) -> torch.Tensor:
        handle = self._file(index)
        try:
            return handle.get_tensor(key)
        except Exception as error:
            raise CheckpointError(f"cannot read {key!r} from {self.file_path(index)}: {error}") from None

    def master_shape(self, name: str) -> list[int]:
        index = self._where(name)
        handle = self._file(index)
        if name not in self._masters[index]:
            raise CheckpointError(f"checkpoint shard file {self.file_path(index)} lacks {master_key(name)!r}")
        return list(handle.get_slice(master_key(name)).get_shape())

    def master(self, name: str) -> torch.Tensor:
        self.master_shape(name)
        return self._get(self._where(name), master_key(name))

    def state_shapes(self, name: str) -> dict[str, list[int] | None]:
        """Saved state keys of ``name``: their shapes (None for a plain value)."""
        index = self._where(name)
        handle = self._file(index)
        shapes: dict[str, list[int] | None] = {k: list(handle.get_slice(key).get_shape())
                                               for k, key in self._index[index].get(name, {}).items()}
        shapes.update({k: None for k in self._scalars[index].get(name, {})})
        return shapes

    def state_tensor(self, name: str, key: str) -> torch.Tensor:
        index = self._where(name)
        self._file(index)
        if key not in self._index[index].get(name, {}):
            raise CheckpointError(f"checkpoint shard file {self.file_path(index)} lacks {state_key(name, key)!r}")
        return self._get(index, state_key(name, key))

    def nbytes(self, name: str, key: str | None = None) -> int:
        """Bytes of a master (``key=None``) or of one optimizer state tensor, from the file header."""
        index = self._where(name)
        info = self._file(index).get_slice(master_key(name) if key is None else state_key(name, key))
        return math.prod(info.get_shape()) * _DTYPE_BYTES.get(info.get_dtype(), 8)

    def state(self, name: str) -> dict[str, Any]:
        index = self._where(name)
        self._file(index)
        out: dict[str, Any] = {k: self._get(index, key) for k, key in self._index[index].get(name, {}).items()}
        out.update(self._scalars[index].get(name, {}))
        return out

    def validate(self) -> None:
        """Open every shard file and check it holds every tensor the manifest places in it."""
        for index in range(len(self.meta["files"])):
            self._file(index)
        for name in self.names:
            self.master_shape(name)


def check_same_model(meta: dict, shapes: dict[str, list[int]], where: str) -> None:
    """A clear error when the checkpoint's trained tensors are not this model's (by name and shape)."""
    theirs = {t.get("tensor", t["name"]): list(t.get("tensor_shape", t["shape"])) for t in meta["tensors"]}
    if theirs == shapes:
        return
    missing = [n for n in shapes if n not in theirs]
    extra = [n for n in theirs if n not in shapes]
    reshaped = [f"{n}: saved {theirs[n]}, model {shapes[n]}" for n in shapes if n in theirs and theirs[n] != shapes[n]]
    parts = []
    if missing:
        parts.append(f"{len(missing)} model tensors are not in it (e.g. {missing[:3]})")
    if extra:
        parts.append(f"it has {len(extra)} tensors the model lacks (e.g. {extra[:3]})")
    if reshaped:
        parts.append(f"{len(reshaped)} tensors differ in shape (e.g. {reshaped[:3]})")
    raise CheckpointError(f"checkpoint {where} is from a different model: {'; '.join(parts)}")


# ----------------------------------------------------------------------------- agreement


def _agree(zero, values: Iterable[int]) -> torch.Tensor:
    """Every rank's ``values`` as a [world, k] int64 CPU tensor (one all-gather on the DP group)."""
    mine = torch.tensor([int(v) for v in values], dtype=torch.int64, device=zero.device)
    if zero.world_size == 1:
        return mine.view(1, -1).cpu()
    import deepspeed.comm as dist

    everyone = torch.empty(zero.world_size * mine.numel(), dtype=torch.int64, device=zero.device)
    dist.all_gather_into_tensor(everyone, mine, group=zero.dp_process_group)
    return everyone.view(zero.world_size, -1).cpu()


def _check(rows: torch.Tensor, error: BaseException | None, rank: int, action: str) -> None:
    """Raise on every rank if ``action`` failed on any (column 0 is the success flag)."""
    if error is not None:
        if isinstance(error, CheckpointError):
            raise error
        raise CheckpointError(f"{action} failed on rank {rank}: {type(error).__name__}: {error}") from error
    failed = [r for r in range(rows.shape[0]) if int(rows[r, 0]) == 0]
    if failed:
        raise CheckpointError(f"{action} failed on rank(s) {failed}; rank {failed[0]}'s error says why")


def _tag_hash(tag: Any) -> int:
    return int.from_bytes(hashlib.sha256(str(tag).encode()).digest()[:7], "little")


# ----------------------------------------------------------------------------- saving


def _owned_payload(zero) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for owned in zero.owned_tensors():
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

    Buffers and frozen parameters are returned as they are; a state_dict entry that *is* a
    trained parameter under another name (tied weights) is an alias, not a copy.
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


def _build_meta(engine, zero, tag: str, client_state: dict | None, exclude_frozen: bool) -> dict[str, Any]:
    import deepspeed

    import ds_canzona

    group_index = {id(g): i for i, g in enumerate(zero.optimizer.param_groups)}
    extra, aliases = _module_extra(engine, zero, exclude_frozen=exclude_frozen)
    scheduler = getattr(engine, "lr_scheduler", None)
    plan = zero.plan
    return {
        "format": FORMAT,
        "save_id": None,  # set after the agreement
        "tag": tag,
        "versions": {"ds_canzona": str(ds_canzona.__version__), "deepspeed": str(deepspeed.__version__),
                     "torch": str(torch.__version__)},
        "world_size": zero.world_size,
        "stage": zero.stage,
        "plan": {"strategy": plan.strategy, "alpha": plan.alpha, "bucket_numel": plan.bucket_numel,
                 "cost_model": plan.cost_model, "digest": plan.digest()},
        "param_dtype": str(zero.dtype).removeprefix("torch."),
        "files": [],  # set after the shards are written
        "tensors": [_item_entry(zero, item, group_index) for item in range(len(plan.specs))],
        "param_groups": [_group_settings(g) for g in zero.optimizer.param_groups],
        "loss_scaler": _loss_scaler_state(zero.loss_scaler),
        "engine": {"global_steps": int(engine.global_steps), "global_samples": int(engine.global_samples),
                   "skipped_steps": int(engine.skipped_steps)},
        "lr_scheduler": scheduler.state_dict() if scheduler is not None and hasattr(scheduler, "state_dict") else None,
        "client_state": dict(client_state or {}),
        "module_extra": {k: _cpu_copy(v) for k, v in extra.items()},
        "frozen_excluded": bool(exclude_frozen),
        "aliases": aliases,
    }


def _item_entry(zero, item: int, group_index: dict[int, int]) -> dict[str, Any]:
    """The manifest entry of plan item ``item``: a whole tensor, or a piece that names its tensor."""
    plan = zero.plan
    tensor, start, stop = plan.pieces[item]
    param, group = zero.params[tensor], zero.groups[tensor]
    entry = {"name": plan.specs[item].name, "shape": list(plan.specs[item].shape), "kind": group["kind"],
             "group": group_index[id(group)], "file": plan.owner[item]}
    if stop - start != param.numel():
        entry.update(tensor=zero.names[tensor], start=start, stop=stop, tensor_shape=list(param.shape))
    return entry


def _weights_only_refusal(value: Any) -> str | None:
    """Why a weights-only load would refuse ``value`` once saved, or None."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    try:
        torch.load(io.BytesIO(buffer.getvalue()), map_location="cpu", weights_only=True)
    except Exception as error:
        text = " ".join(str(error).split())
        reason = text.partition("WeightsUnpickler error: ")[2].partition(" Please use")[0]
        return reason or text[:300]
    return None


def serialize_meta(meta: dict[str, Any]) -> bytes:
    """The manifest's bytes, refused unless a weights-only load reads them back."""
    buffer = io.BytesIO()
    torch.save(meta, buffer)
    data = buffer.getvalue()
    try:
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception:
        culprits = {key: why for key, value in meta.items() if (why := _weights_only_refusal(value)) is not None}
        raise CheckpointError("the checkpoint metadata holds objects that a safe (weights_only) load refuses, so it "
                              "would not load; client_state and the lr scheduler's state_dict must hold only tensors "
                              f"and plain Python values: {culprits}") from None
    return data


def _remove_stale(directory: str, keep: set[str]) -> None:
    """Shard files of older saves of this tag, and temporary files of crashed writes."""
    for entry in os.listdir(directory):
        stale_shard = _SHARD_PATTERN.match(entry) is not None and entry not in keep
        stale_tmp = _TMP_MARK in entry and entry.startswith(("canzona_", LATEST_FILE + _TMP_MARK))
        if stale_shard or stale_tmp:
            try:
                os.remove(os.path.join(directory, entry))
            except OSError:
                pass


def save_engine_checkpoint(engine, save_dir, *, tag=None, client_state: dict | None = None,
                           save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
    """engine.save_checkpoint for ds_canzona: every rank writes what it owns; rank 0 commits."""
    zero = engine.optimizer
    error: BaseException | None = None
    payload = meta = None
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
        if zero.rank == 0:
            meta = _build_meta(engine, zero, tag, client_state, exclude_frozen_parameters)
            serialize_meta(meta)
    except Exception as caught:
        error = caught
    rows = _agree(zero, [error is None, _tag_hash(tag), secrets.randbits(62)])
    _check(rows, error, zero.rank, "preparing the checkpoint")
    if len(set(rows[:, 1].tolist())) != 1:
        raise CheckpointError(f"ranks passed different checkpoint tags (this rank: {tag!r}); pass the same tag "
                              "on every rank")
    save_id = f"{int(rows[0, 2]):016x}"

    # 1. every rank writes its shard under a name no earlier save used
    path = os.path.join(ckpt_dir, shard_name(zero.rank, save_id))
    size = -1
    try:
        tensors, scalars = payload
        header = {"format": FORMAT, "save_id": save_id, "rank": str(zero.rank), "world_size": str(zero.world_size),
                  "scalars": json.dumps(scalars)}
        atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=header))
        size = os.path.getsize(path)
    except Exception as caught:
        error = caught
    payload = tensors = None  # the CPU copies: free them before waiting for the other ranks
    rows = _agree(zero, [error is None, size])
    if error is not None or bool((rows[:, 0] == 0).any()):
        try:
            os.remove(path)
        except OSError:
            pass
    _check(rows, error, zero.rank, f"writing checkpoint shard {path}")

    # 2. all shards are complete: rank 0 commits the tag (manifest), then the directory (latest)
    if zero.rank == 0:
        try:
            meta["save_id"] = save_id
            meta["files"] = [{"name": shard_name(r, save_id), "rank": r, "bytes": int(rows[r, 1])}
                             for r in range(zero.world_size)]
            atomic_write(os.path.join(ckpt_dir, META_FILE), _write_bytes(serialize_meta(meta)))
            if save_latest:
                atomic_write(os.path.join(save_dir, LATEST_FILE), _write_bytes(tag.encode()))
            _remove_stale(ckpt_dir, keep={f["name"] for f in meta["files"]})
            _remove_stale(save_dir, keep=set())
        except Exception as caught:
            error = caught
    rows = _agree(zero, [error is None])
    _check(rows, error, zero.rank, f"committing checkpoint {ckpt_dir}")
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
            _, start, stop = zero.plan.pieces[owned.index]
            for item in ckpt.covering_items(zero.names[owned.tensor], start, stop):
                shape = ckpt.master_shape(item["name"])
                if shape != list(item["shape"]):
                    raise CheckpointError(f"{master_key(item['name'])!r} has shape {shape} in "
                                          f"{ckpt.file_path(item['file'])}, the manifest says {item['shape']}")
                saved = ckpt.state_shapes(item["name"])
                if with_state and set(saved) != set(owned.state):
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
            _, start, stop = zero.plan.pieces[owned.index]
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
    with_state = load_optimizer_states and not load_module_only
    error: BaseException | None = None
    ckpt: Checkpoint | None = None
    found = False
    extra: dict[str, torch.Tensor] = {}
    try:
        if custom_load_fn is not None:
            raise CheckpointError("custom_load_fn is not supported with the 'canzona' section")
        load_dir = os.fspath(load_dir)
        resolved = resolve_tag(load_dir, tag)
        found = resolved is not None
        if found:
            ckpt = Checkpoint(os.path.join(load_dir, resolved), read_meta(os.path.join(load_dir, resolved)))
            check_same_model(ckpt.meta, {n: list(p.shape) for n, p in zip(zero.names, zero.params)}, ckpt.directory)
            if with_state:
                _check_kinds(ckpt, zero)
            _check_owned_reads(ckpt, zero.owned_tensors(), with_state, zero)
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
    except Exception as caught:
        error = caught
    rows = _agree(zero, [error is None, found])
    _check(rows, error, zero.rank, f"checking checkpoint {ckpt.directory if ckpt else load_dir}")
    if len(set(rows[:, 1].tolist())) != 1:
        raise CheckpointError(f"ranks disagree on whether {os.path.join(load_dir, LATEST_FILE)} exists "
                              "(is the checkpoint directory on a filesystem every rank sees?)")
    if not found:
        logger.warning(f"ds_canzona: no '{LATEST_FILE}' file in {load_dir} and no tag given; nothing loaded")
        return None, None

    try:
        _copy_owned(ckpt, zero.owned_tensors(), with_state, zero)
    except Exception as caught:
        error = caught
    rows = _agree(zero, [error is None])
    _check(rows, error, zero.rank, f"reading checkpoint {ckpt.directory}")
    zero.refresh_params_from_masters()
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
    return ckpt.directory, meta.get("client_state", {})
