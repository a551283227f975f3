"""The patch surface into DeepSpeed's engine: five methods, version-checked.

DeepSpeed has no registry for third-party ZeRO optimizers, so ds_canzona wraps exactly these
``DeepSpeedEngine`` methods, and each wrapper hands over to the original unless the config has
an enabled ``canzona`` section:

- ``_do_sanity_check``: checks the DeepSpeed version, validates the ``canzona`` section and
  refuses what the runtime does not implement (``ds_canzona.zero.support``): the first thing the
  engine does with the config, before any buffer exists;
- ``_is_supported_optimizer``: lets "Shampoo"/"SOAP" pass DeepSpeed's name check;
- ``_configure_optimizer``: refuses MoE models, then builds the ds_canzona optimizer and its
  ZeRO-1/2 runtime (or the ZeRO-3 owner-placement runtime, ``ds_canzona.zero.stage3``, whose
  per-parameter patches of DeepSpeed's ZeRO-3 are listed in ``ds_canzona.zero.owner_placement``),
  and sets the engine attributes the original sets for later engine methods;
- ``save_checkpoint`` / ``load_checkpoint``: ds_canzona's per-tensor checkpoint format.

Checked against DeepSpeed 0.19.0-0.19.8 (``SUPPORTED_DEEPSPEED_VERSIONS``; ``scripts/compat.sh``
runs a runtime subset of the tests against each). Where those releases differ in what these
wrappers touch: 0.19.0-0.19.6 end ``_configure_optimizer`` by setting ``engine.quantizer`` and
``engine.compression_scheduler`` (read by ``_take_model_step``), 0.19.7 dropped both; 0.19.0-0.19.4
hand the accumulation boundary to the optimizer as a bool attribute, 0.19.5+ through
``set_gradient_accumulation_boundary`` (``ds_canzona.zero.compat.at_accumulation_boundary``
reads either); 0.19.0-0.19.3 set ``engine.pipeline_parallelism`` only after ``_do_sanity_check``
(the pipeline refusal is repeated in ``_configure_optimizer``); ``managed_gradient_accumulation``
exists from 0.19.4 on.

and one method of DeepSpeed's ``DeepSpeedConfig``, which checks the batch sizes before the engine
exists:

- ``_batch_assertion``: a world size the HuggingFace Trainer miscounted (or batch sizes that do not
  multiply out) becomes one error with the fix (``ds_canzona.zero.world_size``).
"""

from __future__ import annotations

import functools
import logging

from ds_canzona.zero.versions import check_deepspeed_version

# Neither DeepSpeed nor ds_canzona.config is imported at the top: this module is loaded while
# DeepSpeed's engine module is being imported, possibly from inside ds_canzona.config's own
# import of DeepSpeed, so either could be half-initialised here.

logger = logging.getLogger("ds_canzona")

_PATCHED_FLAG = "_ds_canzona_patched"


def _canzona_enabled(engine) -> bool:
    return getattr(engine, "_canzona_config", None) is not None


def _wrap_sanity_check(original):

    @functools.wraps(original)
    def _do_sanity_check(self):
        from ds_canzona.config import parse_canzona_section

        import deepspeed

        config = parse_canzona_section(self._config._param_dict)
        if config is not None:
            check_deepspeed_version(deepspeed.__version__)
            from ds_canzona.zero.support import check_config_supported
            check_config_supported(self)
        self._canzona_config = config
        return original(self)

    return _do_sanity_check


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
        from ds_canzona.zero.support import check_model_supported
        from ds_canzona.zero.timeouts import apply_comm_timeout
        check_model_supported(self)
        apply_comm_timeout(self, self._canzona_config.comm_timeout_s)
        self.basic_optimizer, self.optimizer = build_canzona_optimizer(self, client_optimizer, model_parameters)
        if hasattr(self, "_configure_compression_scheduler"):
            # DeepSpeed 0.19.0-0.19.6: the original ends by setting these, and _take_model_step
            # reads them on every step (compression_training itself is refused).
            self.compression_scheduler = self._configure_compression_scheduler()
            self.quantizer = self._configure_quantization()

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
