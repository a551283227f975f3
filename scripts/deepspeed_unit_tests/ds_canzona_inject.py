"""Turn ds_canzona on in every DeepSpeed engine a process builds (for running DeepSpeed's own tests).

``install()`` imports ds_canzona (its engine hook) and wraps ``deepspeed.initialize``: an engine
with ZeRO stage 1, 2 or 3 and an optimizer (a config ``optimizer`` section or a client optimizer)
gets ``"canzona": {"enabled": true}`` added to a copy of its config; any other engine is built as
given. Each injection appends one line to ``$DS_CANZONA_INJECT_LOG`` when that is set, so a run
can say how many ds_canzona engines it built.

``sitecustomize.py`` beside this file calls ``install()`` in every Python process started with
``DS_CANZONA_INJECT=1`` and this folder on ``PYTHONPATH``: DeepSpeed's DistributedTest runs each
rank in a forkserver or spawned process, which a pytest plugin in the parent would not reach.
"""

from __future__ import annotations

import copy
import functools
import json
import os

INSTALLED = "_ds_canzona_injecting"


def canzona_config(config):
    """A copy of ``config`` with ds_canzona enabled, or None if the engine is not one ds_canzona replaces."""
    if isinstance(config, (str, os.PathLike)):
        with open(config) as handle:
            config = json.load(handle)
    if not isinstance(config, dict):
        return None
    stage = (config.get("zero_optimization") or {}).get("stage", 0)
    if stage not in (1, 2, 3) or "canzona" in config:
        return None
    config = copy.deepcopy(config)
    config["canzona"] = {"enabled": True}
    return config


def install() -> None:
    import deepspeed

    import ds_canzona  # noqa: F401  (installs the engine hook)

    if getattr(deepspeed.initialize, INSTALLED, False):
        return
    original = deepspeed.initialize

    @functools.wraps(original)
    def initialize(*args, **kwargs):
        has_optimizer = kwargs.get("optimizer") is not None
        for key in ("config", "config_params"):
            config = kwargs.get(key)
            if config is None:
                continue
            if isinstance(config, (str, os.PathLike)):
                with open(config) as handle:
                    has_optimizer = has_optimizer or "optimizer" in json.load(handle)
            elif isinstance(config, dict):
                has_optimizer = has_optimizer or "optimizer" in config
            injected = canzona_config(config) if has_optimizer else None
            if injected is not None:
                kwargs[key] = injected
                _log(injected)
            break
        return original(*args, **kwargs)

    setattr(initialize, INSTALLED, True)
    deepspeed.initialize = initialize


def _log(config: dict) -> None:
    path = os.environ.get("DS_CANZONA_INJECT_LOG")
    if path:
        with open(path, "a") as handle:
            handle.write(json.dumps({"pid": os.getpid(), "stage": config["zero_optimization"]["stage"]}) + "\n")
