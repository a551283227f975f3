"""Reading a committed checkpoint: items by name and element ranges, lazily, each file checked.

:class:`Checkpoint` opens shard files only when an item in them is asked for, checks each file
against the manifest (size, save id, rank) before trusting it, and puts a tensor together from the
items that cover an element range, so a reader need not know how the writer cut its tensors.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from typing import Any

import torch
from safetensors import safe_open

from ds_canzona.optim.base import join_stack_states, slice_stack_state
from ds_canzona.zero.checkpoint.files import resolve_tag
from ds_canzona.zero.checkpoint.format import (DTYPE_BYTES, FORMAT, LATEST_FILE, META_FILE, CheckpointError,
                                               master_key, read_meta, state_key)

_DTYPE_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


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
        if self.is_stack(tensor):
            return self._read_stack_range(tensor, start, stop, shape, with_state=with_state)
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

    def is_stack(self, tensor: str) -> bool:
        """Whether ``tensor`` is a 3-D stack of matrices (a matrix rule's: its pieces are whole experts)."""
        return len(self.tensor_shape(tensor)) == 3 and self.tensor_entry(tensor).get("kind") != "adamw"

    def stack_ranges(self, tensor: str, start: int, stop: int) -> list[tuple[dict[str, Any], int, int, int]]:
        """Per saved item covering experts ``[start, stop)`` (element bounds) of the stack ``tensor``:
        (item, its expert count, first and stop of the wanted experts within it)."""
        per_expert = math.prod(self.tensor_shape(tensor)[1:])
        if start % per_expert or stop % per_expert:
            raise CheckpointError(f"elements [{start}, {stop}) of the expert stack {tensor!r} are not whole experts "
                                  f"of {per_expert} elements")
        ranges = []
        for item in self.covering_items(tensor, start, stop):
            if item["start"] % per_expert or item["stop"] % per_expert:
                raise CheckpointError(f"checkpoint {self.directory} holds {item['name']!r}, not whole experts of "
                                      f"{per_expert} elements")
            lo, hi = max(start, item["start"]) - item["start"], min(stop, item["stop"]) - item["start"]
            ranges.append((item, (item["stop"] - item["start"]) // per_expert, lo // per_expert, hi // per_expert))
        return ranges

    def _read_stack_range(self, tensor: str, start: int, stop: int, shape: Sequence[int], *,
                          with_state: bool) -> tuple[torch.Tensor, dict]:
        """``read_range`` of a stack: its state cut and joined expert by expert (``slice_stack_state``)."""
        masters, parts = [], []
        for item, experts, first, last in self.stack_ranges(tensor, start, stop):
            masters.append(self.master(item["name"])[first:last])
            if with_state:
                parts.append((last - first, slice_stack_state(self.state(item["name"]), experts, first, last)))
        return torch.cat(masters).reshape(shape), join_stack_states(parts) if with_state else {}

    def stack_state_nbytes(self, tensor: str) -> dict[str, int | None]:
        """Per key of the whole stack's state (as ``tensor_state`` joins it from the saved pieces), its
        bytes, from the file headers (None for a plain value)."""
        parts, plain, scalars = [], set(), {}
        for item, experts, _, _ in self.stack_ranges(tensor, 0, math.prod(self.tensor_shape(tensor))):
            sized = {}
            for key, shape in self.state_shapes(item["name"]).items():
                if shape is None:
                    plain.add(key)
                elif not shape:  # 0-dim (the step counter): shared, from the first piece
                    scalars.setdefault(key, self.nbytes(item["name"], key))
                else:  # a byte per element byte, so that joining the pieces joins their sizes
                    width = self.nbytes(item["name"], key) // math.prod(shape)
                    sized[key] = torch.empty([*shape, width], dtype=torch.uint8, device="meta")
            parts.append((experts, sized))
        joined = {key: value.numel() for key, value in join_stack_states(parts).items()}
        return {**joined, **scalars, **{key: None for key in plain}}

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
        return math.prod(info.get_shape()) * DTYPE_BYTES.get(info.get_dtype(), 8)

    def master_dtype(self, name: str) -> str:
        """The dtype of a saved master ("float32"; "float64" for an fp64 model), from the file header."""
        self.master_shape(name)
        dtype = self._file(self._where(name)).get_slice(master_key(name)).get_dtype()
        return _DTYPE_NAMES.get(dtype, dtype.lower())

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
