#!/usr/bin/env bash
# Runs a short runtime subset of the tests against each DeepSpeed release, each in a throwaway venv.
#
#   bash scripts/compat.sh                 # every release ds_canzona declares (ds_canzona/zero/hook.py)
#   bash scripts/compat.sh 0.19.3 0.19.8   # just these
#   COMPAT_SUBSET=stage3 bash scripts/compat.sh 0.19.5   # the ZeRO-3 subset instead (below)
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
# COMPAT_SUBSET=stage3 runs the ZeRO-3 (owner placement) subset instead: distributed == single
# process and plain torch at DP 2 (Muon, accumulation 3), a zero.Init model, the step's only
# collective being the norm all-reduce, and a checkpoint saved and resumed at DP 2. Stage 3 is
# refused on releases outside versions.STAGE3_DEEPSPEED_VERSIONS, so for each release the
# snapshot's copy of that tuple (never the working tree or the shipped code) is rewritten to the
# release under test before its tests run; a release passes when the runtime works there.
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
commit=$(git rev-parse --short HEAD)

if [ $# -gt 0 ]; then
  versions=("$@")
else
  read -r -a versions < <(PYTHONPATH=$repo python -c \
    "from ds_canzona.zero.versions import SUPPORTED_DEEPSPEED_VERSIONS as v; print(' '.join(v))")
fi

subset=${COMPAT_SUBSET:-stage12}
case $subset in
  stage12) ;;
  stage3) ;;
  *) echo "COMPAT_SUBSET must be stage12 or stage3, not '$subset'"; exit 2 ;;
esac

tests=(
  tests/test_support.py
  "tests/test_zero_stage12.py::test_muon_is_bitwise_the_single_process_step[2]"
  tests/test_zero_runtime.py::test_dynamic_loss_scale_and_overflow_without_fp16
  "tests/test_checkpoint.py::test_same_world_size_resume_equals_not_stopping[2]"
)
if [ "$subset" = stage3 ]; then
  tests=(
    "tests/test_zero3.py::test_stage3_equals_single_process_and_plain_torch[2-muon_fp32_ga3_wide]"
    tests/test_zero3.py::test_zero_init_model_gets_the_same_plan_and_result_and_large_matrices_get_muon
    tests/test_zero3.py::test_step_runs_no_collective_but_the_norm_all_reduce
    "tests/test_zero3.py::test_stage3_checkpoint_loads_at_other_stages_and_sizes_and_training_continues_exactly[2-2]"
  )
fi

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
    if [ "$subset" = stage3 ]; then
      # The snapshot's gate accepts exactly the release under test (see the header).
      gate=$snapshot/ds_canzona/zero/versions.py
      sed -i "s/^STAGE3_DEEPSPEED_VERSIONS = .*/STAGE3_DEEPSPEED_VERSIONS = (\"$version\",)/" "$gate"
      grep -qx "STAGE3_DEEPSPEED_VERSIONS = (\"$version\",)" "$gate" ||
        { echo "could not set STAGE3_DEEPSPEED_VERSIONS in the snapshot"; exit 1; }
    fi
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
echo "ds_canzona commit $commit, subset $subset, torch 2.13.0 (CPU), $(date -u +%Y-%m-%d)"
printf '%s\n' "${summary[@]}"
echo "logs: $logs"
rm -rf "$snapshot" "$base"
! printf '%s\n' "${summary[@]}" | grep -q ": FAIL"
