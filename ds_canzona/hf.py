"""HuggingFace glue: what the Trainer (transformers + accelerate) needs to run ds_canzona.

Nothing here is needed for the optimizer itself: ``import ds_canzona`` and a DeepSpeed config
with ``"canzona"`` and ``"optimizer"`` sections are enough, because the Trainer hands DeepSpeed
a placeholder optimizer whenever the config has an ``"optimizer"`` section, and DeepSpeed then
builds it from the config (the path ds_canzona's engine hook takes over). What remains:

* ``training_arguments(config, **kwargs)``: the one call that makes ``TrainingArguments`` for a
  ds_canzona config, JSON or commented HJSON, so that the Trainer accepts it the first time. The
  Trainer compares the optimizer values a config sets concretely (``lr``, ``betas``, ``eps``,
  ``weight_decay``, ...) with its own arguments and stops on a mismatch; here they are taken
  from the config. It also sets ``use_cpu`` on a machine without GPUs (``cpu_only``) and checks
  the world size the Trainer sees (``check_world_size``).
* ``load_ds_config``: transformers and accelerate read a config *path* with ``json.load``, so a
  commented HJSON file fails there (DeepSpeed itself reads HJSON paths). Load it here and pass
  the dict.
* ``check_trainer_config``: loads a path like ``load_ds_config`` and heads off what would
  otherwise fail late or silently (docs/USAGE.md, "Trainer traps"): a ``canzona`` section without
  an ``"optimizer"`` section (the Trainer would then build torch's AdamW, which ds_canzona
  refuses); ``"kernels": "auto"``, which the Trainer would take for one of its placeholders (the
  value is ``"default"``). Optimizer offload to the host passes: ds_canzona takes it (zero/offload.py),
  and what it refuses (NVMe, a ratio below 1) is refused by the engine with its own message.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # transformers is imported only when training_arguments runs
    from transformers import TrainingArguments


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
        # Without this, accelerate stops with "canzona.kernels not found in kwargs": it takes every
        # "auto" in the config for a placeholder of its own.
        raise ConfigFileError("'canzona.kernels': write \"default\" (Triton on CUDA where supported), not \"auto\", "
                              "which the HuggingFace Trainer takes for a placeholder of its own")
    enabled = isinstance(canzona, dict) and canzona.get("enabled", True) is not False
    if enabled:
        if "optimizer" not in config:
            raise ConfigFileError("with a 'canzona' section the DeepSpeed config needs an 'optimizer' section: "
                                  "without it the Trainer builds torch.optim.AdamW itself (and it drops "
                                  "Trainer(optimizers=...) under DeepSpeed)")
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


# What the Trainer compares between the DeepSpeed config and TrainingArguments, and stops on when
# they differ (transformers' HfTrainerDeepSpeedConfig.trainer_config_process): a dotted config key
# and the TrainingArguments fields holding the same value.
TRAINER_MATCHED_KEYS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("train_micro_batch_size_per_gpu", ("per_device_train_batch_size",)),
    ("gradient_accumulation_steps", ("gradient_accumulation_steps",)),
    ("gradient_clipping", ("max_grad_norm",)),
    ("optimizer.params.lr", ("learning_rate",)),
    ("optimizer.params.betas", ("adam_beta1", "adam_beta2")),
    ("optimizer.params.eps", ("adam_epsilon",)),
    ("optimizer.params.weight_decay", ("weight_decay",)),
    ("fp16.enabled", ("fp16",)),
    ("bf16.enabled", ("bf16",)),
)


def _config_value(config: dict[str, Any], dotted: str) -> Any:
    node: Any = config
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def trainer_values_from_config(config: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """The TrainingArguments values the config fixes, for the fields ``given`` leaves open.

    A value the config sets concretely (not ``"auto"``, not absent) is what the Trainer will insist
    on; a field in ``given`` that says otherwise is a ConfigFileError naming both.
    """
    values: dict[str, Any] = {}
    for dotted, fields in TRAINER_MATCHED_KEYS:
        value = _config_value(config, dotted)
        if value is None or value == "auto":
            continue
        if len(fields) > 1 and (not isinstance(value, (list, tuple)) or len(value) != len(fields)):
            raise ConfigFileError(f"'{dotted}' must be a list of {len(fields)} values, got {value!r}")
        wanted = dict(zip(fields, value)) if len(fields) > 1 else {fields[0]: value}
        for field, field_value in wanted.items():
            if field in given and given[field] != field_value:
                raise ConfigFileError(f"TrainingArguments({field}={given[field]!r}) disagrees with the DeepSpeed "
                                      f"config's '{dotted}': {value!r}; drop one of them or write \"auto\" in "
                                      "the config")
            if field not in given:
                values[field] = field_value
    return values


def training_arguments(config: str | Path | dict[str, Any], **kwargs: Any) -> TrainingArguments:
    """``transformers.TrainingArguments(deepspeed=config, **kwargs)`` that the Trainer accepts as it is.

    ``config``: a path (JSON or HJSON) or a dict, checked by ``check_trainer_config``. Each value
    the Trainer compares with its own arguments and that the config sets concretely becomes the
    TrainingArguments value (``learning_rate`` from ``optimizer.params.lr``, ``adam_beta1/2`` from
    ``betas``, ``weight_decay``, ``adam_epsilon``, ``max_grad_norm``, the batch and precision
    keys), unless ``kwargs`` set it too: then the two must agree. Where the config says ``"auto"``
    the Trainer fills it from ``kwargs`` or its defaults. ``use_cpu`` defaults to ``cpu_only()``, and
    ``check_world_size`` runs on the result.

    At ZeRO stage 3 the Trainer builds the model under ``deepspeed.zero.Init``, whose config counts
    the ranks through ``deepspeed.comm``; on the CPU accelerate sets up only torch.distributed, so
    ``deepspeed.comm`` is initialized here (over that process group), or zero.Init would count one rank.
    """
    from transformers import TrainingArguments

    checked = check_trainer_config(config)
    kwargs.setdefault("use_cpu", cpu_only())
    arguments = TrainingArguments(deepspeed=checked, **kwargs, **trainer_values_from_config(checked, kwargs))
    check_world_size(arguments)
    if (checked.get("zero_optimization") or {}).get("stage") == 3 and arguments.use_cpu:
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    return arguments


__all__ = ["ConfigFileError", "TRAINER_MATCHED_KEYS", "check_trainer_config", "check_world_size", "cpu_only",
           "load_ds_config", "trainer_values_from_config", "training_arguments"]
