"""Shipped model configs and a torch-free shape generator for the Qwen3 architecture.

The configs under ``ds_canzona/data/qwen3/`` are the public ``config.json`` values of the Qwen3
dense family, so reports and benchmarks run offline on real shapes, and one small config of the
same architecture, ``qwen3-h128`` (8 layers, hidden 128, vocabulary 1024), on which benchmarks
count collectives with small buckets in seconds. :func:`qwen3_specs` lists the
parameters ``Qwen3ForCausalLM`` would create, in ``named_parameters()`` order, without importing
torch; a test checks it against the meta-device model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from importlib import resources
from typing import Any

from .specs import MatrixRule, ParamSpec, PlanError, default_matrix_rule

__all__ = ["load_model_config", "model_specs", "qwen3_specs", "shipped_models"]

_FAMILIES = ("qwen3",)


def shipped_models() -> list[str]:
    """Names accepted by ``--model``, e.g. ``qwen3-32b``, sorted by family then size."""
    names = []
    for family in _FAMILIES:
        folder = resources.files("ds_canzona").joinpath("data", family)
        entries = [entry.name[: -len(".json")] for entry in folder.iterdir() if entry.name.endswith(".json")]
        names.extend(sorted(entries, key=_size_key))
    return names


def load_model_config(name: str) -> dict[str, Any]:
    """The shipped ``config.json`` of ``name`` (case-insensitive, e.g. ``Qwen3-32B``)."""
    key = name.lower()
    family = key.split("-", 1)[0]
    if family not in _FAMILIES:
        raise PlanError(f"Unknown model {name!r}: shipped models are {', '.join(shipped_models())}.")
    path = resources.files("ds_canzona").joinpath("data", family, f"{key}.json")
    if not path.is_file():
        raise PlanError(f"Unknown model {name!r}: shipped models are {', '.join(shipped_models())}.")
    return json.loads(path.read_text(encoding="utf-8"))


def model_config_path(name: str) -> str:
    """A filesystem path to the shipped config, for tools (transformers) that want a file."""
    load_model_config(name)  # validates the name with the same error
    key = name.lower()
    return os.fspath(resources.files("ds_canzona").joinpath("data", key.split("-", 1)[0], f"{key}.json"))


def model_specs(name: str, matrix_rule: MatrixRule | None = None) -> list[ParamSpec]:
    """Specs of a shipped model, from its config alone (no torch)."""
    return qwen3_specs(load_model_config(name), matrix_rule)


def qwen3_specs(config: Mapping[str, Any], matrix_rule: MatrixRule | None = None) -> list[ParamSpec]:
    """The parameters of ``Qwen3ForCausalLM(config)`` in ``named_parameters()`` order.

    Per layer: q/k/v/o projections (with biases when ``attention_bias``), the per-head q/k RMSNorms,
    the SwiGLU MLP (gate, up, down; never biased) and the two layer norms. A tied head is the
    embedding itself, so ``named_parameters`` lists it once, as ``model.embed_tokens.weight``.
    """
    rule = matrix_rule or default_matrix_rule
    try:
        hidden = int(config["hidden_size"])
        inter = int(config["intermediate_size"])
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        vocab = int(config["vocab_size"])
    except KeyError as error:
        raise PlanError(f"Qwen3 config is missing {error.args[0]!r}.") from None
    bias = bool(config.get("attention_bias", False))
    tied = bool(config.get("tie_word_embeddings", False))

    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for layer in range(layers):
        prefix = f"model.layers.{layer}"
        for proj, out_features, in_features in (
            ("q_proj", heads * head_dim, hidden),
            ("k_proj", kv_heads * head_dim, hidden),
            ("v_proj", kv_heads * head_dim, hidden),
            ("o_proj", hidden, heads * head_dim),
        ):
            shapes.append((f"{prefix}.self_attn.{proj}.weight", (out_features, in_features)))
            if bias:
                shapes.append((f"{prefix}.self_attn.{proj}.bias", (out_features,)))
        shapes.append((f"{prefix}.self_attn.q_norm.weight", (head_dim,)))
        shapes.append((f"{prefix}.self_attn.k_norm.weight", (head_dim,)))
        shapes.append((f"{prefix}.mlp.gate_proj.weight", (inter, hidden)))
        shapes.append((f"{prefix}.mlp.up_proj.weight", (inter, hidden)))
        shapes.append((f"{prefix}.mlp.down_proj.weight", (hidden, inter)))
        shapes.append((f"{prefix}.input_layernorm.weight", (hidden,)))
        shapes.append((f"{prefix}.post_attention_layernorm.weight", (hidden,)))
    shapes.append(("model.norm.weight", (hidden,)))
    if not tied:
        shapes.append(("lm_head.weight", (vocab, hidden)))
    return [ParamSpec(name=name, shape=shape, matrix=bool(rule(name, shape))) for name, shape in shapes]


def _size_key(name: str) -> tuple[float, str]:
    size = name.rsplit("-", 1)[-1].rstrip("b")
    try:
        return float(size), name
    except ValueError:
        return float("inf"), name
