"""DeepSpeed's own checkpoint tools on ds_canzona checkpoints: ``zero_to_fp32`` and its functions.

Users convert a DeepSpeed checkpoint by habit, with the ``zero_to_fp32.py`` script DeepSpeed
leaves in every checkpoint folder or with the functions of ``deepspeed.utils.zero_to_fp32``
(``get_fp32_state_dict_from_zero_checkpoint``, ``convert_zero_checkpoint_to_fp32_state_dict``,
``convert_zero_checkpoint_to_state_dict``, ``load_state_dict_from_zero_checkpoint``; the last
is what the HuggingFace docs recommend). On ds_canzona's format (no ``*_model_states.pt``) those
would fail with a bare FileNotFoundError. Two pieces make them work instead:

- ``install_deepspeed_tools`` wraps the one function all of them read a tag folder through
  (``_get_fp32_state_dict_from_zero_checkpoint``): a folder holding ds_canzona's manifest is read
  by ``ds_canzona.consolidate`` (the fp32 masters, buffers, frozen and tied parameters, exactly as
  ``ds-canzona consolidate`` writes them); any other folder goes to DeepSpeed's code unchanged.
  Everything around it (the ``latest`` tag, lazy mode, the output dtype, sharding, file names,
  the index) stays DeepSpeed's. ``import ds_canzona`` installs it when DeepSpeed's engine is
  imported (``ds_canzona/__init__.py``); a process that never imports ds_canzona keeps
  DeepSpeed's error.
- ``main`` is the entry of the ``zero_to_fp32.py`` and ``zero_to_torch.py`` that every
  ``engine.save_checkpoint`` writes into the save directory, as DeepSpeed does
  (``ds_canzona.zero.checkpoint.recovery_scripts``): DeepSpeed's command lines, which import
  ds_canzona and then run DeepSpeed's conversion.

Nothing from DeepSpeed or torch is imported at the top: this module is loaded while DeepSpeed's
engine module is still being imported.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

_DEEPSPEED_MODULE = "deepspeed.utils.zero_to_fp32"
_READER = "_get_fp32_state_dict_from_zero_checkpoint"
_MANIFEST = "canzona_meta.pt"  # format.META_FILE (a test checks they agree); not imported here, see above


def is_canzona_checkpoint(tag_dir: str) -> bool:
    """Whether ``tag_dir`` is one tag of a ds_canzona checkpoint (it holds the manifest)."""
    return os.path.isfile(os.path.join(os.fspath(tag_dir), _MANIFEST))


def _canzona_fp32_state_dict(ds_checkpoint_dir: str, exclude_frozen_parameters: bool) -> dict:
    from ds_canzona.consolidate import fp32_state_dict_from_checkpoint
    from ds_canzona.zero.checkpoint import CheckpointError

    if exclude_frozen_parameters:
        # The manifest keeps buffers and frozen parameters together (the module's state that no
        # optimizer owns), so they cannot be told apart here.
        raise CheckpointError(
            f"{ds_checkpoint_dir} is a ds_canzona checkpoint, whose manifest does not tell frozen parameters from "
            "buffers, so exclude_frozen_parameters cannot be honoured when converting it: convert without it, or "
            "save with engine.save_checkpoint(save_dir, exclude_frozen_parameters=True)")
    return fp32_state_dict_from_checkpoint(ds_checkpoint_dir)


def install_deepspeed_tools(module=None) -> bool:
    """Wrap DeepSpeed's zero_to_fp32 tag-folder reader (once); False when that module is not there to wrap."""
    module = module if module is not None else sys.modules.get(_DEEPSPEED_MODULE)
    original = getattr(module, _READER, None)
    if original is None:
        return False
    if getattr(original, "_reads_ds_canzona", False):
        return True

    @functools.wraps(original)
    def read_tag_folder(ds_checkpoint_dir, exclude_frozen_parameters=False):
        if is_canzona_checkpoint(ds_checkpoint_dir):
            return _canzona_fp32_state_dict(ds_checkpoint_dir, exclude_frozen_parameters)
        return original(ds_checkpoint_dir, exclude_frozen_parameters)

    read_tag_folder._reads_ds_canzona = True
    setattr(module, _READER, read_tag_folder)
    return True


def _parser(kind: str, dtype_names) -> argparse.ArgumentParser:
    """DeepSpeed 0.19.8's command line of zero_to_fp32.py ("fp32") or zero_to_torch.py ("torch")."""
    parser = argparse.ArgumentParser(description="Write the consolidated weights of a ds_canzona (or DeepSpeed) "
                                     "checkpoint with DeepSpeed's conversion")
    parser.add_argument("checkpoint_dir", type=str, help="the save directory (the one holding 'latest')")
    parser.add_argument("output_dir", type=str, help="where to write the weights")
    if kind == "torch":
        parser.add_argument("--dtype", type=str, choices=dtype_names, required=True, help="weights' dtype")
    parser.add_argument("--max_shard_size", type=str, default="5GB", help="largest file, e.g. 5GB or 500MB")
    parser.add_argument("--safe_serialization", default=False, action="store_true",
                        help="write safetensors instead of torch pickles")
    parser.add_argument("-t", "--tag", type=str, default=None, help="the tag to convert (default: 'latest')")
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="leave frozen parameters out")
    parser.add_argument("-d", "--debug", action="store_true", help="DeepSpeed's debug output")
    return parser


def main(kind: str, argv: list[str] | None = None) -> int:
    """The recovery scripts' entry: parse DeepSpeed's command line, run DeepSpeed's conversion."""
    import importlib

    import ds_canzona  # noqa: F401  (installs the wrapper once DeepSpeed's engine is imported)

    zero_to_fp32 = importlib.import_module(_DEEPSPEED_MODULE)
    install_deepspeed_tools(zero_to_fp32)
    dtype_names = sorted(getattr(zero_to_fp32, "OUTPUT_DTYPE_NAMES", ("fp32", "fp16", "bf16")))
    args = _parser(kind, dtype_names).parse_args(argv)
    zero_to_fp32.debug = args.debug
    zero_to_fp32.convert_zero_checkpoint_to_state_dict(
        args.checkpoint_dir, args.output_dir, dtype=getattr(args, "dtype", "fp32"),
        max_shard_size=args.max_shard_size, safe_serialization=args.safe_serialization, tag=args.tag,
        exclude_frozen_parameters=args.exclude_frozen_parameters)
    return 0


__all__ = ["install_deepspeed_tools", "is_canzona_checkpoint", "main"]
