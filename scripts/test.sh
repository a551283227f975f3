#!/usr/bin/env bash
# The test command: the whole suite on the CPU (gloo ranks, Triton's interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m pytest tests -q -ra -p no:cacheprovider "$@"
