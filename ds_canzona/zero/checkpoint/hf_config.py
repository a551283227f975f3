"""The trained module's HuggingFace config files, carried by the checkpoint into the export.

Without ``config.json`` beside the weights, ``AutoModel...from_pretrained(export)`` cannot know
the model, and ``Qwen3ForCausalLM.from_pretrained(export)`` builds transformers' default Qwen3
(8B parameters) before it reads a single weight. So a save records, when the module has them, its
``config`` and ``generation_config`` as the JSON text ``save_pretrained`` would write, in the
manifest (committed with it, atomically), and ``ds-canzona consolidate`` writes them as files.
"""

from __future__ import annotations

import json
import logging
from typing import Any

logger = logging.getLogger("ds_canzona")

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"


def hf_config_files(module: Any) -> dict[str, str]:
    """``{file name: JSON text}`` for the module's HuggingFace configs; empty for other modules.

    A config that cannot be serialized is left out with a warning: it must not cost the save.
    """
    files: dict[str, str] = {}
    config = getattr(module, "config", None)
    if config is not None and callable(getattr(config, "to_json_string", None)) and hasattr(config, "model_type"):
        try:
            settings = json.loads(config.to_json_string(use_diff=False))
            if not settings.get("architectures"):
                # as save_pretrained does: what AutoModel... uses to pick the class
                settings["architectures"] = [type(module).__name__]
            files[CONFIG_FILE] = json.dumps(settings, indent=2, sort_keys=True) + "\n"
        except Exception as error:
            logger.warning("ds_canzona: the module's HuggingFace config could not be saved with the checkpoint "
                           f"({type(error).__name__}: {error}); the export will lack {CONFIG_FILE}")
    generation = getattr(module, "generation_config", None)
    if CONFIG_FILE in files and generation is not None and callable(getattr(generation, "to_json_string", None)):
        try:
            files[GENERATION_CONFIG_FILE] = generation.to_json_string()
        except Exception as error:
            logger.warning("ds_canzona: the module's generation config could not be saved with the checkpoint "
                           f"({type(error).__name__}: {error})")
    return files


def config_for_export(text: str, weights_dtype: str) -> str:
    """``config.json`` for weights saved in ``weights_dtype`` (e.g. "float32"), as save_pretrained records it.

    The export holds the fp32 masters whatever dtype the model trained in, and transformers loads
    a checkpoint in the dtype its config names.
    """
    settings = json.loads(text)
    keys = [key for key in ("dtype", "torch_dtype") if key in settings] or ["torch_dtype"]
    for key in keys:
        settings[key] = weights_dtype
    return json.dumps(settings, indent=2, sort_keys=True) + "\n"
