#!/usr/bin/env bash
# Prepare gpu_wheels/: the packages the GPU device's image lacks, as wheels to carry there (it has
# no network). The image has CPython 3.12 with torch, triton, transformers and DeepSpeed's other
# requirements, but not deepspeed, hjson or pydantic (nor pydantic's own requirements).
#
#   bash scripts/gpu_wheels.sh           # here, with network: downloads, builds, checks; about a minute
#   bash scripts/gpu_wheels.sh --check   # the check alone (no network): run it right before a device call
#
# Then the device call carries the folder (it is git-ignored): carry ["gpu_wheels"], and the
# command `bash scripts/gpu_session.sh` (docs/BENCHMARKS.md "The GPU session").
#
# - hjson, pydantic, pydantic-core, annotated-types, typing-inspection, typing-extensions: binary
#   wheels for CPython 3.12 manylinux x86_64, at the versions installed here (the ones the tests
#   ran with); scripts/gpu_session.sh installs typing-extensions only if the image's is too old;
# - deepspeed==0.19.8: PyPI has only its sdist, so a wheel is built here (DS_BUILD_OPS=0: no ops
#   compiled in; DeepSpeed JIT-builds ops on first use, and ds_canzona uses none);
# - the check: all of them installed into a temporary folder and imported with no GPU and no
#   compiler (CC/CXX false, no CUDA_HOME), and pydantic imported by CPython 3.12 when one is here;
# - the size: the folder travels with the working tree, 64 MiB in all; this stops above 32 MiB;
# - gpu_wheels/COMMIT: the commit, the source digest and this recipe's digest the wheels were
#   prepared with (the device copy has no .git: gpu_session.sh prints the commit when git cannot tell);
# - the preflight (ds_canzona/bench/gpu/preflight.py, standard library only): every wheel's tags
#   installable by CPython 3.12 on x86-64 Linux, one version per distribution, every requirement
#   among the carried wheels met at its pinned version, deepspeed/hjson/pydantic all provided, the
#   size within 32 MiB, and COMMIT written by this recipe. The session runs it again on the device
#   (--here: the device's own Python, glibc and packages) before it installs anything.
#
# Wheels already in the folder are kept. Environment: PYTHON (default python3: needs pip,
# setuptools and torch, which deepspeed's setup.py imports), PYTHON312 (default python3.12, for
# the import check of the cp312 wheels), GPU_WHEELS (default gpu_wheels).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
DEST=${GPU_WHEELS:-gpu_wheels}
preflight() { "$PYTHON" ds_canzona/bench/gpu/preflight.py --wheels "$DEST" --python 3.12; }
if [[ ${1:-} == --check ]]; then
    preflight
    exit
elif [[ $# -gt 0 ]]; then
    echo "usage: bash scripts/gpu_wheels.sh [--check]" >&2
    exit 2
fi
PYTHON312=${PYTHON312:-python3.12}
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

head=$(git rev-parse HEAD 2>/dev/null || echo unknown)
[[ -n $(git status --porcelain --untracked-files=no 2>/dev/null) ]] && head+="+uncommitted"
{ echo "commit $head"; "$PYTHON" ds_canzona/bench/gpu/preflight.py --digests; } >"$DEST/COMMIT"
echo "wrote $DEST/COMMIT:" $(cat "$DEST/COMMIT")
preflight
