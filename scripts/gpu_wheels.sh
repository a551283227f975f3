#!/usr/bin/env bash
# Prepare gpu_wheels/: the packages the GPU device's image lacks, as wheels to carry there (it has
# no network). The image has CPython 3.12 with torch, triton, transformers and DeepSpeed's other
# requirements, but not deepspeed, hjson or pydantic (nor pydantic's own requirements).
#
#   scripts/gpu_wheels.sh            # here, with network: downloads, builds, checks; about a minute
#
# - hjson, pydantic, pydantic-core, annotated-types, typing-inspection, typing-extensions: binary
#   wheels for CPython 3.12 manylinux x86_64, at the versions installed here (the ones the tests
#   ran with); scripts/gpu_session.sh installs typing-extensions only if the image's is too old;
# - deepspeed==0.19.8: PyPI has only its sdist, so a wheel is built here (DS_BUILD_OPS=0: no ops
#   compiled in; DeepSpeed JIT-builds ops on first use, and ds_canzona uses none);
# - the check: all of them installed into a temporary folder and imported with no GPU and no
#   compiler (CC/CXX false, no CUDA_HOME), and pydantic imported by CPython 3.12 when one is here;
# - the size: the folder travels with the working tree, 64 MiB in all; this stops above 32 MiB;
# - gpu_wheels/COMMIT: the commit and source digest the wheels were prepared at (the device copy
#   has no .git: gpu_session.sh prints this when git cannot tell).
#
# Wheels already in the folder are kept. Environment: PYTHON (default python3: needs pip,
# setuptools and torch, which deepspeed's setup.py imports), PYTHON312 (default python3.12, for
# the import check of the cp312 wheels), GPU_WHEELS (default gpu_wheels).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
PYTHON312=${PYTHON312:-python3.12}
DEST=${GPU_WHEELS:-gpu_wheels}
LIMIT_BYTES=$((32 * 1024 * 1024))
mkdir -p "$DEST"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_wheels.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

installed_version() { "$PYTHON" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }

BINARY=(hjson pydantic pydantic-core annotated-types typing-inspection typing-extensions)
pins=()
for package in "${BINARY[@]}"; do
    pins+=("$package==$(installed_version "$package")")
done
echo "binary wheels: ${pins[*]}"
"$PYTHON" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --no-deps -d "$DEST" "${pins[@]}"

if compgen -G "$DEST/deepspeed-0.19.8-*.whl" >/dev/null; then
    echo "deepspeed wheel: kept $(basename "$DEST"/deepspeed-0.19.8-*.whl)"
else
    echo "deepspeed wheel: building from the sdist (DS_BUILD_OPS=0)"
    DS_BUILD_OPS=0 "$PYTHON" -m pip wheel -q --no-deps --no-build-isolation --no-binary=:all: \
        -w "$DEST" deepspeed==0.19.8
fi

echo "check: install into a temporary folder and import, without GPU or compiler"
# The pure-Python wheels with this Python (pydantic-core's cp312 build cannot load in another
# version: this Python's own, same version, stands in for it), all of them with CPython 3.12 below.
"$PYTHON" -m pip install -q --no-index --no-deps --target "$WORK/site" "$DEST"/*-py3-none-any.whl
# shellcheck disable=SC2016  # $1 is python's
env -u CUDA_HOME CC=false CXX=false CUDA_VISIBLE_DEVICES="" PYTHONPATH="$WORK/site" DS_BUILD_OPS=0 \
    "$PYTHON" -c 'import deepspeed, hjson, pydantic, sys
from deepspeed.runtime.config_utils import DeepSpeedConfigModel  # the pydantic model the canzona section builds on
assert deepspeed.__file__.startswith(sys.argv[1]), deepspeed.__file__
print("  deepspeed", deepspeed.__version__, "hjson", hjson.__version__, "pydantic", pydantic.VERSION,
      "from", sys.argv[1])' \
    "$WORK/site"
if "$PYTHON312" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    # The compiled wheel (pydantic-core) on the device's Python version (no torch there: no deepspeed import).
    "$PYTHON312" -m pip install -q --no-index --no-deps --target "$WORK/site312" "$DEST"/*.whl
    PYTHONPATH="$WORK/site312" "$PYTHON312" -c 'import pydantic, pydantic_core, hjson
print("  CPython 3.12: pydantic", pydantic.VERSION, "pydantic-core", pydantic_core.__version__,
      "hjson", hjson.__version__)'
else
    echo "  (no CPython 3.12 here, PYTHON312=$PYTHON312: the cp312 wheel was not imported)"
fi

total=$(du -cb "$DEST"/*.whl | tail -n1 | cut -f1)
echo "gpu_wheels: $(find "$DEST" -name '*.whl' | wc -l) wheels, $((total / 1024)) KiB"
if ((total > LIMIT_BYTES)); then
    echo "gpu_wheels: more than $((LIMIT_BYTES / 1024 / 1024)) MiB; the working tree travels in 64 MiB" >&2
    exit 1
fi

digest=$(find ds_canzona kernels scripts -type f \( -name '*.py' -o -name '*.sh' -o -name '*.json' \) \
    -not -path '*/__pycache__/*' | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16)
head=$(git rev-parse HEAD 2>/dev/null || echo unknown)
[[ -n $(git status --porcelain --untracked-files=no 2>/dev/null) ]] && head+="+uncommitted"
printf '%s source-digest %s\n' "$head" "$digest" >"$DEST/COMMIT"
echo "wrote $DEST/COMMIT: $(cat "$DEST/COMMIT")"
