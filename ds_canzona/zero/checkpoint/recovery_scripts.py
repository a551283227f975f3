"""The ``zero_to_fp32.py`` and ``zero_to_torch.py`` a save leaves in its directory, as DeepSpeed does.

DeepSpeed copies its conversion scripts into every save directory, and users run them by habit.
ds_canzona's are two small files with DeepSpeed 0.19.8's command lines: each imports
``ds_canzona.zero.deepspeed_tools`` (which lets DeepSpeed's conversion read this format) and runs
DeepSpeed's conversion; docs/CHECKPOINTS.md, "DeepSpeed's tools".
"""

from __future__ import annotations

import os

from ds_canzona.zero.checkpoint.files import _umask, atomic_write

SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")

_SCRIPT = '''#!/usr/bin/env python
"""{name}, written by ds_canzona's engine.save_checkpoint where DeepSpeed writes its script of this name.

The same command line as DeepSpeed's, on ds_canzona's checkpoint format: it imports ds_canzona,
which lets DeepSpeed's conversion read the format, and runs that conversion. For example:

    python {name} CHECKPOINT_DIR OUTPUT_DIR{example}

`ds-canzona consolidate CHECKPOINT_DIR OUTPUT_DIR` writes the same weights (model.safetensors),
and the optimizer state too with --optimizer-states.
"""
import sys

from ds_canzona.zero.deepspeed_tools import main

sys.exit(main({kind!r}))
'''


def write_recovery_scripts(save_dir: str) -> None:
    """``zero_to_fp32.py`` and ``zero_to_torch.py`` in ``save_dir``, executable, as DeepSpeed leaves them."""
    examples = {"fp32": " [--safe_serialization] [--max_shard_size 5GB] [-t TAG]",
                "torch": " --dtype bf16 [--safe_serialization] [-t TAG]"}
    for name in SCRIPTS:
        kind = "fp32" if name == "zero_to_fp32.py" else "torch"
        text = _SCRIPT.format(name=name, kind=kind, example=examples[kind])

        def write(path: str, text: str = text) -> None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)

        path = os.path.join(save_dir, name)
        atomic_write(path, write)
        try:
            os.chmod(path, 0o777 & ~_umask())  # what a new executable gets under the umask
        except OSError:  # a file share may refuse it; `python zero_to_fp32.py` still works
            pass


__all__ = ["SCRIPTS", "write_recovery_scripts"]
