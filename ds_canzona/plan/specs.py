"""What the planner knows about a parameter: its name, shape, whether it is a matrix, TP split.

Specs come from three places: a live ``nn.Module``, a HuggingFace ``config.json`` (the model is
built on the meta device, so nothing is allocated or downloaded) and a shapes JSON file. Only
:func:`specs_from_module` and :func:`specs_from_hf_config` touch torch, and both import it lazily:
the shapes-file path has to start in well under a second.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

__all__ = [
    "MatrixRule",
    "ParamSpec",
    "PlanError",
    "default_matrix_rule",
    "shard_for_tp",
    "specs_from_entries",
    "specs_from_hf_config",
    "specs_from_module",
    "specs_from_shapes_file",
    "tp_split_dim",
]

MatrixRule = Callable[[str, tuple[int, ...]], bool]


class PlanError(ValueError):
    """A problem with the planner's input that the user can fix; the CLI prints it in one line."""


@dataclass(frozen=True, kw_only=True)
class ParamSpec:
    """One trainable tensor, as it lies in the flat buffer of one rank.

    ``shape`` is the local shape: for a tensor-parallel shard it is the shard's shape, and the full
    matrix has ``shape[tp_dim] * tp_size`` rows (or columns) along ``tp_dim``. ``matrix`` says
    whether a matrix optimizer (Muon, Shampoo, SOAP) updates it; the rest go to AdamW.

    Which matrices a matrix tensor is updated as (priced by ``matrix_stack``): a 3-D tensor is a
    stack of ``shape[0]`` matrices (MoE experts), each its own; 4 or more dims are one
    ``(shape[0], rest)`` matrix (a convolution filter). ``heads`` > 1 (per-head Muon) makes a 2-D
    matrix ``heads`` matrices of ``shape[0] / heads`` rows. A 2-D tensor is owned whole either way; a
    3-D stack above the planner's ``split_numel`` is planned in pieces of whole experts (``item_bounds``).
    """

    name: str
    shape: tuple[int, ...]
    matrix: bool
    tp_dim: int | None = None
    tp_size: int = 1
    heads: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise PlanError(f"Invalid ParamSpec.name={self.name!r}: must be a non-empty string.")
        try:
            shape = tuple(self.shape)
        except TypeError:
            raise PlanError(
                f"Invalid ParamSpec.shape={self.shape!r} for {self.name!r}: must be a sequence of ints."
            ) from None
        if not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
            raise PlanError(f"Invalid ParamSpec.shape={shape!r} for {self.name!r}: dimensions must be ints.")
        if any(d <= 0 for d in shape):
            raise PlanError(f"Invalid ParamSpec.shape={shape!r} for {self.name!r}: dimensions must be positive.")
        if not isinstance(self.matrix, bool):
            raise PlanError(f"Invalid ParamSpec.matrix={self.matrix!r} for {self.name!r}: must be a bool.")
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise PlanError(f"Invalid ParamSpec.tp_size={self.tp_size!r} for {self.name!r}: must be an int >= 1.")
        if self.tp_dim is not None and not (isinstance(self.tp_dim, int) and 0 <= self.tp_dim < len(shape)):
            raise PlanError(f"Invalid ParamSpec.tp_dim={self.tp_dim!r} for {self.name!r}: must index shape {shape}.")
        if isinstance(self.heads, bool) or not isinstance(self.heads, int) or self.heads < 1:
            raise PlanError(f"Invalid ParamSpec.heads={self.heads!r} for {self.name!r}: must be an int >= 1.")
        if self.heads > 1 and (not self.matrix or len(shape) != 2 or shape[0] % self.heads):
            raise PlanError(f"Invalid ParamSpec.heads={self.heads} for {self.name!r}: per-head matrices are 2-D "
                            f"matrices whose rows split evenly into heads, got shape {shape}.")
        if self.tp_size > 1 and self.tp_dim is None:
            raise PlanError(
                f"Invalid ParamSpec.tp_dim=None for {self.name!r}: tp_size={self.tp_size} needs a split dim."
            )
        object.__setattr__(self, "shape", shape)

    # Cached: cost models and the packer read it in their inner loops. (A cached_property writes the
    # instance dict directly, which a frozen dataclass allows.)
    @functools.cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def full_shape(self) -> tuple[int, ...]:
        """The shape of the whole tensor, before the TP split."""
        if self.tp_dim is None or self.tp_size == 1:
            return self.shape
        dims = list(self.shape)
        dims[self.tp_dim] *= self.tp_size
        return tuple(dims)

    @property
    def matrix_stack(self) -> tuple[int, int, int]:
        """(count, rows, cols) of the matrices a matrix optimizer updates this (whole) tensor as."""
        shape = self.full_shape
        if len(shape) < 2:
            raise PlanError(f"A matrix optimizer needs a tensor with 2 or more dims, got shape {shape}.")
        if len(shape) == 3:
            return shape
        rows, cols = shape[0], math.prod(shape[1:])
        return self.heads, rows // self.heads, cols

    def to_dict(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"name": self.name, "shape": list(self.shape), "matrix": self.matrix}
        if self.tp_size > 1:
            entry["tp_dim"] = self.tp_dim
            entry["tp_size"] = self.tp_size
        if self.heads > 1:
            entry["heads"] = self.heads
        return entry


def default_matrix_rule(name: str, shape: Sequence[int]) -> bool:
    """Matrices are tensors with 2 or more dims, except embeddings and the output head.

    The same rule as DeepSpeed's Muon: embeddings and the head are lookup tables and a classifier,
    not hidden linear maps, and orthogonalising them hurts; they stay on AdamW.
    """
    lowered = name.lower()
    return len(shape) >= 2 and not any(key in lowered for key in ("embed", "lm_head"))


def specs_from_entries(entries: Iterable[Mapping[str, Any]], matrix_rule: MatrixRule | None = None) -> list[ParamSpec]:
    """Specs from dicts with ``name``, ``shape`` and optionally ``matrix``, ``tp_dim``, ``tp_size``, ``heads``.

    An explicit ``matrix_rule`` decides for every entry; without one an entry's own ``matrix`` flag
    wins, and the default rule fills in where it is missing.
    """
    specs = []
    for position, entry in enumerate(entries):
        if not isinstance(entry, Mapping):
            raise PlanError(f"Invalid shapes entry #{position}: expected an object, got {type(entry).__name__}.")
        unknown = set(entry) - {"name", "shape", "matrix", "tp_dim", "tp_size", "heads"}
        if unknown:
            raise PlanError(f"Invalid shapes entry #{position}: unknown field(s) {sorted(unknown)}.")
        for key in ("name", "shape"):
            if key not in entry:
                raise PlanError(f"Invalid shapes entry #{position}: missing field {key!r}.")
        shape = entry["shape"]
        if not isinstance(shape, list | tuple):
            raise PlanError(f"Invalid shapes entry #{position}: shape={shape!r} must be a list of ints.")
        name = entry["name"]
        if matrix_rule is not None:
            matrix = bool(matrix_rule(name, tuple(shape)))
        elif "matrix" in entry:
            matrix = entry["matrix"]
        else:
            matrix = default_matrix_rule(str(name), shape)
        specs.append(
            ParamSpec(
                name=name,
                shape=tuple(shape),
                matrix=matrix,
                tp_dim=entry.get("tp_dim"),
                tp_size=entry.get("tp_size", 1),
                heads=entry.get("heads", 1),
            )
        )
    _check_specs(specs)
    return specs


def specs_from_shapes_file(path: str | os.PathLike[str], matrix_rule: MatrixRule | None = None) -> list[ParamSpec]:
    """Specs from a JSON file holding a list of ``{"name", "shape", "matrix"}`` in buffer order."""
    try:
        with open(path, encoding="utf-8") as handle:
            entries = json.load(handle)
    except OSError as error:
        raise PlanError(f"Cannot read shapes file {os.fspath(path)!r}: {error.strerror or error}.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise PlanError(f"Shapes file {os.fspath(path)!r} is not valid JSON: {error}.") from None
    if not isinstance(entries, list):
        raise PlanError(f"Shapes file {os.fspath(path)!r} must hold a JSON list, got {type(entries).__name__}.")
    return specs_from_entries(entries, matrix_rule)


def specs_from_module(module: Any, matrix_rule: MatrixRule | None = None) -> list[ParamSpec]:
    """Specs of the trainable parameters of ``module``, in ``named_parameters()`` order.

    Tied parameters appear once (``named_parameters`` deduplicates them), as in DeepSpeed's buffers.
    """
    rule = matrix_rule or default_matrix_rule
    specs = [
        ParamSpec(name=name, shape=tuple(int(d) for d in param.shape), matrix=bool(rule(name, tuple(param.shape))))
        for name, param in module.named_parameters()
        if param.requires_grad
    ]
    _check_specs(specs)
    return specs


def specs_from_hf_config(
    path: str | os.PathLike[str],
    matrix_rule: MatrixRule | None = None,
    *,
    trust_remote_code: bool = False,
) -> list[ParamSpec]:
    """Specs of the model a HuggingFace ``config.json`` (a file, or a folder holding one) describes.

    The model is instantiated on the meta device, so no weights are allocated; only local files are
    read (``local_files_only``), so nothing is downloaded. Causal LMs get their head; other
    architectures fall back to ``AutoModel``.
    """
    if not os.path.exists(path):
        raise PlanError(f"Cannot read HuggingFace config {os.fspath(path)!r}: no such file or directory.")
    try:
        import torch
        import transformers
    except ImportError as error:
        raise PlanError(f"--hf-config needs torch and transformers installed ({error}).") from None
    try:
        config = transformers.AutoConfig.from_pretrained(
            os.fspath(path), local_files_only=True, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as error:
        raise PlanError(f"Cannot load HuggingFace config {os.fspath(path)!r}: {_first_line(error)}") from None
    defaulted = _defaulted_shape_fields(path, config)
    if defaulted:
        # An incomplete config.json plans transformers' defaults (e.g. Llama's 32 layers and 32000
        # tokens) without a word otherwise; say which sizes were not in the file.
        print(f"ds-canzona plan: {os.fspath(path)} does not set {', '.join(defaulted)}: "
              f"planning with {type(config).__name__}'s defaults for them", file=sys.stderr, flush=True)
    with torch.device("meta"):
        try:
            model = transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
        except ValueError:
            model = transformers.AutoModel.from_config(config, trust_remote_code=trust_remote_code)
    return specs_from_module(model, matrix_rule)


def _defaulted_shape_fields(path: str | os.PathLike[str], config: Any) -> list[str]:
    """``name=value`` for each size the loaded config has but its config.json does not set.

    Sizes are the integer fields (layers, widths, heads, vocabulary, ...) and the bias and
    tied-embedding switches; token ids and other integers that shape no tensor are left out.
    """
    file = os.path.join(path, "config.json") if os.path.isdir(path) else os.fspath(path)
    try:
        with open(file, encoding="utf-8") as handle:
            written = json.load(handle)
    except (OSError, ValueError):
        return []
    if not isinstance(written, dict):
        return []
    fields = []
    for name, value in config.to_dict().items():
        if name in written or name in _NOT_SHAPES or name.endswith("_token_id"):
            continue
        is_size = isinstance(value, int) and not isinstance(value, bool)
        is_switch = isinstance(value, bool) and (name.endswith("_bias") or name == "tie_word_embeddings")
        if is_size or is_switch:
            fields.append(f"{name}={value}")
    return fields


_NOT_SHAPES = frozenset({"chunk_size_feed_forward", "pretraining_tp", "max_position_embeddings"})


# Megatron-style splits, keyed by the last name component before ".weight"/".bias": column-parallel
# layers split their output features (dim 0 of an nn.Linear weight), row-parallel layers their
# input features (dim 1), and vocabulary-parallel embeddings and heads split the vocabulary (dim 0).
_COLUMN_PARALLEL = (
    "q_proj",
    "k_proj",
    "v_proj",
    "gate_proj",
    "up_proj",
    "query_key_value",
    "c_attn",
    "c_fc",
    "fc1",
    "w1",
    "w3",
)
_ROW_PARALLEL = ("o_proj", "down_proj", "dense", "c_proj", "out_proj", "fc2", "w2")
_VOCAB_PARALLEL = ("embed_tokens", "lm_head", "wte", "embed_in", "embed_out")


def tp_split_dim(name: str, shape: tuple[int, ...]) -> int | None:
    """The dim a Megatron-style TP layout splits this tensor along, or None if it is replicated."""
    parts = name.split(".")
    if len(parts) < 2 or len(shape) < 2 or parts[-1] != "weight":
        return None
    layer = parts[-2]
    if layer in _COLUMN_PARALLEL or layer in _VOCAB_PARALLEL:
        return 0
    if layer in _ROW_PARALLEL:
        return 1
    return None


def shard_for_tp(specs: Sequence[ParamSpec], tp_size: int) -> list[ParamSpec]:
    """Local TP-shard specs: each tensor :func:`tp_split_dim` splits is cut into ``tp_size`` shards.

    Tensors with a split already recorded, tensors the rule leaves replicated and tensors whose split
    dim does not divide evenly are returned unchanged.
    """
    if not isinstance(tp_size, int) or tp_size < 1:
        raise PlanError(f"Invalid tp_size={tp_size!r}: must be an int >= 1.")
    if tp_size == 1:
        return list(specs)
    sharded = []
    for spec in specs:
        dim = tp_split_dim(spec.name, spec.shape) if spec.tp_size == 1 else None
        if dim is None or spec.shape[dim] % tp_size:
            sharded.append(spec)
            continue
        shape = list(spec.shape)
        shape[dim] //= tp_size
        sharded.append(replace(spec, shape=tuple(shape), tp_dim=dim, tp_size=tp_size))
    return sharded


def _check_specs(specs: Sequence[ParamSpec]) -> None:
    if not specs:
        raise PlanError("No trainable parameters: the spec list is empty.")
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise PlanError(f"Duplicate parameter name {spec.name!r}: names must be unique.")
        seen.add(spec.name)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
