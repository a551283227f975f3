#!/usr/bin/env bash
# Runs a short runtime subset of the tests against each DeepSpeed release, each in a throwaway venv.
#
#   bash scripts/compat.sh                 # every release ds_canzona declares (ds_canzona/zero/hook.py)
#   bash scripts/compat.sh 0.19.3 0.19.8   # just these
#
# Each release gets a fresh venv with torch 2.13.0 (the CPU build), the test dependencies and that
# DeepSpeed; ds_canzona is imported from a snapshot of the committed tree (git archive HEAD),
# so editing the working tree during a run changes nothing. One summary line per release, then
# the commit; the install and pytest output of each is kept in $COMPAT_LOGS (default: a new
# temporary folder, printed at the end).
# The subset (about 6 minutes per release on an idle 2-core machine, plus the install): the
# refusals and the version check (tests/test_support.py), distributed == single-process at DP 2,
# stage 1 and 2, with gradient accumulation, the loss-scale and overflow path, and a checkpoint
# save at DP 4 / load at DP 2 / resume.
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
commit=$(git rev-parse --short HEAD)

if [ $# -gt 0 ]; then
  versions=("$@")
else
  read -r -a versions < <(PYTHONPATH=$repo python -c \
    "from ds_canzona.zero.hook import SUPPORTED_DEEPSPEED_VERSIONS as v; print(' '.join(v))")
fi

tests=(
  tests/test_support.py
  "tests/test_zero_stage12.py::test_muon_is_bitwise_the_single_process_step[2]"
  tests/test_zero_runtime.py::test_dynamic_loss_scale_and_overflow_without_fp16
  "tests/test_checkpoint.py::test_same_world_size_resume_equals_not_stopping[2]"
)

work=$(mktemp -d)
logs=${COMPAT_LOGS:-$work/logs}
mkdir -p "$logs"
snapshot=$work/tree
mkdir -p "$snapshot"
git archive HEAD | tar -x -C "$snapshot"
ln -s ../kernels "$snapshot/ds_canzona/kernels"   # as in a checkout (ignored by git)

# torch and the test dependencies once, in a base venv that each release's venv starts as a copy
# of (a venv is relocatable when run as venv/bin/python -m ...); DeepSpeed goes into the copy.
base=$work/venv-base
{
  python -m venv "$base" &&
  "$base/bin/python" -m pip install -q --disable-pip-version-check torch==2.13.0 &&
  "$base/bin/python" -m pip install -q --disable-pip-version-check hjson pytest transformers accelerate safetensors
} > "$logs/base.log" 2>&1 || { echo "the base venv did not install; see $logs/base.log"; exit 1; }

summary=()
for version in "${versions[@]}"; do
  venv=$work/venv-$version
  log=$logs/deepspeed-$version.log
  start=$(date +%s)
  cp -a "$base" "$venv"
  if ! "$venv/bin/python" -m pip install -q --disable-pip-version-check "deepspeed==$version" > "$log" 2>&1; then
    line="deepspeed $version: FAIL (install; see $log)"
  else
    # A fresh extensions folder: DeepSpeed's CPU comm op is compiled against this release, once,
    # here (as scripts/setup.sh does), not inside the first test's timeout.
    export TORCH_EXTENSIONS_DIR=$venv/torch_extensions
    "$venv/bin/python" -c "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder as B; B().load(verbose=False)" \
      >> "$log" 2>&1 || echo "note: the shared-memory comm op did not build; gloo works without it" >> "$log"
    (cd "$snapshot" && PYTHONPATH=$snapshot "$venv/bin/python" -m pytest -q -p no:cacheprovider "${tests[@]}") \
      >> "$log" 2>&1
    status=$?
    counts=$(grep -E "^[0-9]+ (passed|failed)|^=+ .*(passed|failed)" "$log" | tail -1 | tr -d '=' | xargs)
    found=$("$venv/bin/python" -c "import deepspeed; print(deepspeed.__version__)" 2>/dev/null | tail -1)
    verdict=$([ $status -eq 0 ] && echo PASS || echo FAIL)
    line="deepspeed $version (imports as $found): $verdict ($counts) in $(( $(date +%s) - start )) s"
  fi
  echo "$line"
  summary+=("$line")
  rm -rf "$venv"
done

echo
echo "ds_canzona commit $commit, torch 2.13.0 (CPU), $(date -u +%Y-%m-%d)"
printf '%s\n' "${summary[@]}"
echo "logs: $logs"
rm -rf "$snapshot" "$base"
! printf '%s\n' "${summary[@]}" | grep -q ": FAIL"
