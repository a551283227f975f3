"""The checkpoint format: names of files and items, the manifest, and what makes it valid.

A checkpoint is a set of *items* keyed by name: a whole tensor under its parameter name, or a
piece ``"<name>[start:stop]"`` that names its tensor, its element range and the tensor's shape.
Each item has an fp32 master (``"master/<item>"``) and optimizer state (``"state/<item>/<key>"``)
in one rank's shard file. The manifest lists the items, the files and everything that is not a
tensor of the optimizer. Nothing here knows how a runtime lays tensors out in memory: a layout
(ZeRO-1/2 buckets today) decides which items a rank writes and reads, the format only names them.
"""

from __future__ import annotations

import io
import os
import re
from typing import Any

import torch

FORMAT = "ds_canzona-1"
META_FILE = "canzona_meta.pt"
LATEST_FILE = "latest"
TMP_MARK = ".tmp."
SHARD_PATTERN = re.compile(r"^canzona_rank\d{5,}-[0-9a-f]{16}\.safetensors$")
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
META_KEYS = ("save_id", "world_size", "files", "tensors", "param_groups")


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, truncated, from another model, or that could not be written."""


# ----------------------------------------------------------------------------- names


def shard_name(rank: int, save_id: str) -> str:
    return f"canzona_rank{rank:05d}-{save_id}.safetensors"


def master_key(name: str) -> str:
    return f"master/{name}"


def state_key(name: str, key: str) -> str:
    return f"state/{name}/{key}"


def shard_header(save_id: str, rank: int, world_size: int, scalars_json: str) -> dict[str, str]:
    """The safetensors header of a shard file: what ties it to one save and one rank."""
    return {"format": FORMAT, "save_id": save_id, "rank": str(rank), "world_size": str(world_size),
            "scalars": scalars_json}


def check_tag(tag: Any) -> str:
    """A tag is one directory name; anything that could leave ``save_dir`` is refused."""
    text = str(tag)
    if (not text or text in (".", "..") or text.startswith(".") or text != text.strip()
            or any(c in text for c in "/\\\0\n")):
        raise CheckpointError(f"invalid checkpoint tag {text!r}: a tag is one directory name "
                              "(no '/', '\\' or newline, not starting with '.')")
    return text


# ----------------------------------------------------------------------------- the manifest


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
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise CheckpointError(f"checkpoint manifest {path} lacks {missing}")
    return meta


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
