"""The patch surface into DeepSpeed's engine: three methods, version-checked.

DeepSpeed has no registry for third-party ZeRO optimizers, so ds_canzona wraps exactly these
``DeepSpeedEngine`` methods, and each wrapper hands over to the original unless the config has
an enabled ``canzona`` section:

- ``_do_sanity_check``: validates the ``canzona`` section (the first thing the engine does with
  the config, before any buffer exists) and lets "Shampoo"/"SOAP" pass DeepSpeed's name check;
- ``_configure_optimizer``: builds the ds_canzona optimizer and its ZeRO-1/2 runtime;
- ``save_checkpoint`` / ``load_checkpoint``: ds_canzona's per-tensor checkpoint format;

and one method of DeepSpeed's ``DeepSpeedConfig``, which checks the batch sizes before the engine
exists:

- ``_batch_assertion``: a world size the HuggingFace Trainer miscounted (or batch sizes that do not
  multiply out) becomes one error with the fix (``ds_canzona.zero.world_size``).
"""

from __future__ import annotations

import functools
import logging

# Neither DeepSpeed nor ds_canzona.config is imported at the top: this module is loaded while
# DeepSpeed's engine module is being imported, possibly from inside ds_canzona.config's own
# import of DeepSpeed, so either could be half-initialised here.

logger = logging.getLogger("ds_canzona")

SUPPORTED_DEEPSPEED = "0.19."
_PATCHED_FLAG = "_ds_canzona_patched"


def deepspeed_version_supported(version: str) -> bool:
    return version.startswith(SUPPORTED_DEEPSPEED)


def _canzona_enabled(engine) -> bool:
    return getattr(engine, "_canzona_config", None) is not None


def _wrap_sanity_check(original):

    @functools.wraps(original)
    def _do_sanity_check(self):
        from ds_canzona.config import CanzonaConfigError, parse_canzona_section

        import deepspeed

        config = parse_canzona_section(self._config._param_dict)
        if config is not None and not deepspeed_version_supported(deepspeed.__version__):
            raise CanzonaConfigError(f"ds_canzona supports deepspeed {SUPPORTED_DEEPSPEED}x, found "
                                     f"{deepspeed.__version__}; remove the 'canzona' section or install deepspeed 0.19")
        self._canzona_config = config
        if config is not None:
            _check_engine_config(self)
        return original(self)

    return _do_sanity_check


def _check_engine_config(engine) -> None:
    from ds_canzona.config import MATRIX_OPTIMIZERS, CanzonaConfigError

    stage = engine.zero_optimization_stage()
    if stage not in (1, 2):
        raise CanzonaConfigError(f"the 'canzona' section needs zero_optimization.stage 1 or 2, got {stage} "
                                 "(stage 3 is not supported yet)")
    if engine.zero_cpu_offload():
        raise CanzonaConfigError("the 'canzona' section does not support zero_optimization.offload_optimizer yet")
    name = engine.optimizer_name()
    if engine.client_optimizer is None and name is not None and name.lower() not in MATRIX_OPTIMIZERS \
            and name.lower() not in ("adamw", "adam"):
        raise CanzonaConfigError(f"the 'canzona' section supports optimizer types Muon, Shampoo, SOAP and AdamW, "
                                 f"got {name!r}")


def _wrap_is_supported_optimizer(original):

    @functools.wraps(original)
    def _is_supported_optimizer(self, optimizer_name):
        from ds_canzona.config import MATRIX_OPTIMIZERS

        if _canzona_enabled(self) and optimizer_name.lower() in MATRIX_OPTIMIZERS:
            return True
        return original(self, optimizer_name)

    return _is_supported_optimizer


def _wrap_configure_optimizer(original):

    @functools.wraps(original)
    def _configure_optimizer(self, client_optimizer, model_parameters):
        if not _canzona_enabled(self):
            return original(self, client_optimizer, model_parameters)
        from ds_canzona.zero.build import build_canzona_optimizer
        from ds_canzona.zero.timeouts import apply_comm_timeout
        apply_comm_timeout(self, self._canzona_config.comm_timeout_s)
        self.basic_optimizer, self.optimizer = build_canzona_optimizer(self, client_optimizer, model_parameters)

    return _configure_optimizer


def _wrap_save_checkpoint(original):

    @functools.wraps(original)
    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True, exclude_frozen_parameters=False):
        if not _canzona_enabled(self):
            return original(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
        from ds_canzona.zero.checkpoint import save_engine_checkpoint
        return save_engine_checkpoint(self, save_dir, tag=tag, client_state=client_state, save_latest=save_latest,
                                      exclude_frozen_parameters=exclude_frozen_parameters)

    return save_checkpoint


def _wrap_load_checkpoint(original):

    @functools.wraps(original)
    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        if not _canzona_enabled(self):
            return original(self, load_dir, tag, load_module_strict, load_optimizer_states, load_lr_scheduler_states,
                            load_module_only, custom_load_fn)
        from ds_canzona.zero.checkpoint import load_engine_checkpoint
        return load_engine_checkpoint(self, load_dir, tag=tag, load_module_strict=load_module_strict,
                                      load_optimizer_states=load_optimizer_states,
                                      load_lr_scheduler_states=load_lr_scheduler_states,
                                      load_module_only=load_module_only, custom_load_fn=custom_load_fn)

    return load_checkpoint


_WRAPPERS = {
    "_do_sanity_check": _wrap_sanity_check,
    "_is_supported_optimizer": _wrap_is_supported_optimizer,
    "_configure_optimizer": _wrap_configure_optimizer,
    "save_checkpoint": _wrap_save_checkpoint,
    "load_checkpoint": _wrap_load_checkpoint,
}


def install_engine_hook(engine_class: type) -> None:
    """Wrap the methods of DeepSpeed's engine class once; idempotent."""
    if getattr(engine_class, _PATCHED_FLAG, False):
        return
    for name, wrap in _WRAPPERS.items():
        setattr(engine_class, name, wrap(getattr(engine_class, name)))
    setattr(engine_class, _PATCHED_FLAG, True)
    from deepspeed.runtime.config import DeepSpeedConfig  # loaded: the engine module imports it
    from ds_canzona.zero.world_size import install_batch_check
    install_batch_check(DeepSpeedConfig)
