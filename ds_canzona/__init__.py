"""ds_canzona: atomic, load-balanced matrix optimizers (Muon, NorMuon, AdaMuon, Shampoo, SOAP) for DeepSpeed ZeRO.

``import ds_canzona`` registers the DeepSpeed engine hook (``ds_canzona.zero.hook``), so that a
config with a ``canzona`` section builds ds_canzona's ZeRO-1/2 optimizer, and lets DeepSpeed's
``zero_to_fp32`` functions read ds_canzona checkpoints (``ds_canzona.zero.deepspeed_tools``). The hook is installed
when DeepSpeed's engine module is imported, not here: importing ds_canzona stays cheap (the
planner CLI never loads torch or DeepSpeed), and the import order of the two packages does not
matter.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

__version__ = "0.1.0"

_ENGINE_MODULE = "deepspeed.runtime.engine"


def _install(module) -> None:
    from ds_canzona.zero.deepspeed_tools import install_deepspeed_tools
    from ds_canzona.zero.hook import install_engine_hook
    install_engine_hook(module.DeepSpeedEngine)
    # DeepSpeed's engine module has imported its zero_to_fp32 by now: let it read our checkpoints.
    install_deepspeed_tools()


class _PatchAfterExec(importlib.abc.Loader):
    """Runs the real loader, then installs the hook into the freshly executed module."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _install(module)


class _EngineImportWatcher(importlib.abc.MetaPathFinder):

    def find_spec(self, fullname, path, target=None):
        if fullname != _ENGINE_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchAfterExec(spec.loader)
        return spec


def register_deepspeed_hook() -> None:
    """Install the engine hook now if DeepSpeed's engine is loaded, else when it is imported."""
    if _ENGINE_MODULE in sys.modules:
        _install(sys.modules[_ENGINE_MODULE])
    elif not any(isinstance(f, _EngineImportWatcher) for f in sys.meta_path):
        sys.meta_path.insert(0, _EngineImportWatcher())


register_deepspeed_hook()
