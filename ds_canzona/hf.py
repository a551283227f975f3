"""HuggingFace glue: what the Trainer (transformers + accelerate) needs to run ds_canzona.

Nothing here is needed for the optimizer itself: ``import ds_canzona`` and a DeepSpeed config
with ``"canzona"`` and ``"optimizer"`` sections are enough, because the Trainer hands DeepSpeed
a placeholder optimizer whenever the config has an ``"optimizer"`` section, and DeepSpeed then
builds it from the config (the path ds_canzona's engine hook takes over). What remains:

* ``load_ds_config``: transformers and accelerate read a config *path* with ``json.load``, so a
  commented HJSON file fails there. Load it here and pass the dict:
  ``TrainingArguments(deepspeed=load_ds_config("ds_configs/zero2_muon.hjson"), ...)``.
* ``cpu_only`` and ``check_world_size``: on a machine without GPUs, transformers/accelerate only
  see DeepSpeed's launcher ranks with ``TrainingArguments(use_cpu=True)``; without it every rank
  believes it is the only process (world size 1): ``"train_batch_size": "auto"`` is filled with
  the wrong value, the data is not sharded and every rank writes the checkpoint.
* ``check_trainer_config``: loads a path like ``load_ds_config`` and heads off what would
  otherwise fail late or silently (docs/USAGE.md, "Trainer traps"): ``"canzona": {"kernels":
  "auto"}``, which accelerate takes for one of its own placeholders and rejects (the key is
  dropped: "auto" is its default); a ``canzona`` section without an ``"optimizer"`` section (the
  Trainer would then build torch's AdamW, which ds_canzona refuses); optimizer offload (not
  supported with ``canzona``).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any


class ConfigFileError(ValueError):
    """A DeepSpeed config file that is missing or cannot be parsed; the message is one line."""


def load_ds_config(path: str | Path) -> dict[str, Any]:
    """A DeepSpeed config file (JSON, or HJSON with comments) as a dict.

    Raises ConfigFileError naming the file (and the line, for syntax errors) when the file is
    missing, unreadable, malformed or not a JSON object.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigFileError(f"DeepSpeed config not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigFileError(f"cannot read DeepSpeed config {path}: {error}") from None
    if path.suffix.lower() == ".json":
        try:
            config = json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigFileError(f"{path}: not valid JSON: {error.msg} at line {error.lineno}, "
                                  f"column {error.colno}") from None
    else:
        import hjson

        try:
            config = hjson.loads(text)
        except hjson.HjsonDecodeError as error:
            raise ConfigFileError(f"{path}: not valid HJSON: {error.msg} at line {error.lineno}, "
                                  f"column {error.colno}") from None
    if not isinstance(config, dict):
        raise ConfigFileError(f"{path}: a DeepSpeed config must be an object, got {type(config).__name__}")
    return _plain(config)


def _plain(value: Any) -> Any:
    """hjson returns OrderedDicts and Decimal-free floats; make the tree plain dicts and lists."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def check_trainer_config(config: str | Path | dict[str, Any]) -> dict[str, Any]:
    """The config as a dict ready for ``TrainingArguments(deepspeed=...)``, or a ConfigFileError.

    A path is loaded with ``load_ds_config`` (so HJSON works); a dict is checked as is.
    """
    config = load_ds_config(config) if not isinstance(config, dict) else copy.deepcopy(config)
    canzona = config.get("canzona")
    if isinstance(canzona, dict) and canzona.get("kernels") == "auto":
        # accelerate treats every "auto" value in the config as a placeholder it must fill and
        # raises for one it does not know; "auto" is canzona.kernels' default, so drop the key.
        del canzona["kernels"]
    enabled = isinstance(canzona, dict) and canzona.get("enabled", True) is not False
    if enabled:
        if "optimizer" not in config:
            raise ConfigFileError("with a 'canzona' section the DeepSpeed config needs an 'optimizer' section: "
                                  "without it the Trainer builds torch.optim.AdamW itself (and it drops "
                                  "Trainer(optimizers=...) under DeepSpeed)")
        offload = (config.get("zero_optimization") or {}).get("offload_optimizer") or {}
        if offload.get("device", "none") not in ("none", None):
            raise ConfigFileError("the 'canzona' section does not support zero_optimization.offload_optimizer")
    return config


def cpu_only() -> bool:
    """True when DeepSpeed runs on its CPU accelerator: pass ``TrainingArguments(use_cpu=cpu_only())``."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() == "cpu"


def check_world_size(training_args: Any) -> None:
    """Raise when the Trainer sees another world size than the launcher started (WORLD_SIZE).

    The mismatch is silent otherwise: each rank trains on the whole data set as if alone.
    """
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if training_args.world_size != launched:
        hint = " (on the CPU pass TrainingArguments(use_cpu=True))" if cpu_only() else ""
        raise RuntimeError(f"the Trainer sees world size {training_args.world_size} but the launcher started "
                           f"{launched} processes{hint}")


__all__ = ["ConfigFileError", "load_ds_config", "check_trainer_config", "cpu_only", "check_world_size"]
