#!/usr/bin/env bash
# Installs ds_canzona and everything its tests, examples and benchmarks need, on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."

export PIP_DISABLE_PIP_VERSION_CHECK=1
# A bare `torch` requirement with no torch installed pulls a multi-GB CUDA build: pin the CPU
# build (on these machines it installs from local disk) before anything else can ask for torch.
# On a GPU machine, install the torch build you want first; this step then leaves it alone.
if ! python -c "import torch" >/dev/null 2>&1; then
  python -m pip install -q torch==2.13.0
fi
python -m pip install -q -e ".[test,hf,plots]"

# DeepSpeed's CPU accelerator compiles a small shared-memory comm op on its first start on a
# machine (about a minute). Build it once here, not inside a test's or the demo's timeout.
python - <<'PY'
import warnings
warnings.filterwarnings("ignore")
from deepspeed.accelerator import get_accelerator
if get_accelerator().device_name() == "cpu":
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder
    try:
        ShareMemCommBuilder().load(verbose=False)
    except Exception as error:  # an optimisation only: gloo works without it
        print(f"note: DeepSpeed's shared-memory comm op did not build ({error}); gloo works without it")
print(f"ds_canzona set up; DeepSpeed accelerator: {get_accelerator().device_name()}")
PY
