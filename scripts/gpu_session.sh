#!/usr/bin/env bash
# The GPU checks that this CPU-only project cannot run in CI, as one short script for a session
# that is lent a GPU (about 5 minutes on an H200). Results go to $OUT (default: ./gpu_out):
#
#   kernels.txt / kernels.json   python -m ds_canzona.bench kernels --sweep: every Triton kernel against
#                                torch and cuBLAS, with its error against fp32 (the first GPU run of
#                                the kernels is also their first correctness check on a GPU)
#   calibrate.txt / .json        the roofline cost model's machine balance on this GPU
#                                (canzona.machine_balance; the GPU default, 150, is unmeasured)
#
# Needs torch with CUDA and triton (no DeepSpeed): the package is installed without its deps.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python3}

"$PYTHON" -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 \
    || "$PYTHON" -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/ds_canzona_site .
export PYTHONPATH=/tmp/ds_canzona_site${PYTHONPATH:+:$PYTHONPATH}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || echo "no nvidia-smi"; } \
    | tee "$OUT/gpu.txt"
"$PYTHON" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"

"$PYTHON" -m ds_canzona.bench calibrate --json "$OUT/calibrate.json" 2>&1 | tee "$OUT/calibrate.txt"
"$PYTHON" -m ds_canzona.bench kernels --sweep --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.txt"
