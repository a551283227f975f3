#!/usr/bin/env bash
# Runs DeepSpeed's own unit tests twice, stock and with ds_canzona injected, and prints the table.
#
#   bash scripts/deepspeed_unit_tests.sh                       # the default list (below)
#   bash scripts/deepspeed_unit_tests.sh unit/runtime/zero/test_zero_tensor_fragment.py -k Update
#   DS_TESTS_SOURCE=~/src/DeepSpeed bash scripts/deepspeed_unit_tests.sh      # a checkout of yours
#   DS_TESTS_SOURCE=/path/to/DeepSpeed.git DS_TESTS_REF=v0.19.8 bash scripts/deepspeed_unit_tests.sh
#   DS_TESTS_SOURCE=/path/to/DeepSpeed.git DS_TESTS_REF=HEAD bash ...  # a clone without the installed tag
#
# Arguments are pytest arguments relative to DeepSpeed's tests/ folder (node ids, -k ...); none:
# the default list. Where the tests come from, first found:
#   1. DS_TESTS_SOURCE: a DeepSpeed checkout (its tests/ folder is copied) or a git directory
#      (bare or not; DS_TESTS_REF, default v<installed version>, is exported with git archive);
#   2. the registry's source distribution of the installed version (pip download --no-binary),
#      if it contains tests/ (0.19.x's do not);
#   3. git clone --depth 1 --branch v<installed version> of github.com/microsoft/DeepSpeed.
# Tests of another release than the installed one can be run (1.), and the table's header says
# which were run against which.
#
# The injected run starts every Python process with DS_CANZONA_INJECT=1 and
# scripts/deepspeed_unit_tests/ first on PYTHONPATH: its sitecustomize.py imports ds_canzona and
# adds "canzona": {"enabled": true} to every deepspeed.initialize with ZeRO 1/2/3 and an optimizer
# (ds_canzona_inject.py). DeepSpeed's test ranks are forkserver/spawned processes, which a pytest
# plugin of the parent would not reach. Both runs load the pytest plugin ds_unit_harness.py there:
# each DistributedTest case gets fresh rank processes (DS_UNIT_REUSE_DIST_ENV=1 keeps DeepSpeed's
# pool reuse, which hung on CPU ranks here).
#
# DS_UNIT_ACCELERATOR (default cpu) is exported as DS_ACCELERATOR, LOCAL_SIZE (default 8) for
# the CPU accelerator's device count, DS_UNITTEST_TIMEOUT (default 300 s) DeepSpeed's per-case
# limit; DS_UNIT_PARALLEL=1 runs stock and injected at the same time; DS_UNIT_WORK (default a new
# temporary folder) keeps the tests, both JUnit reports, the logs and the table (table.md).
# Not part of CI (docs/NOTES.md has the last table and how long it took).
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
helpers=$repo/scripts/deepspeed_unit_tests

version=$(python -c "import deepspeed; print(deepspeed.__version__)" 2>/dev/null | tail -1)
[ -n "$version" ] || { echo "deepspeed is not importable"; exit 2; }
work=${DS_UNIT_WORK:-$(mktemp -d)}
mkdir -p "$work"
tests=$work/DeepSpeed/tests
rm -rf "$work/DeepSpeed"
mkdir -p "$work/DeepSpeed"

source_label=""
if [ -n "${DS_TESTS_SOURCE:-}" ]; then
  if [ -d "$DS_TESTS_SOURCE/tests/unit" ]; then
    cp -r "$DS_TESTS_SOURCE/tests" "$tests"
    source_label="$DS_TESTS_SOURCE (checkout, $(git -C "$DS_TESTS_SOURCE" describe --tags --always 2>/dev/null || echo 'no git'))"
  else
    ref=${DS_TESTS_REF:-v$version}
    if ! git --git-dir="$DS_TESTS_SOURCE" archive "$ref" tests | tar -x -C "$work/DeepSpeed"; then
      echo "DS_TESTS_SOURCE=$DS_TESTS_SOURCE has no tests/unit folder and no ref $ref to export"; exit 2
    fi
    source_label="$DS_TESTS_SOURCE at $ref ($(git --git-dir="$DS_TESTS_SOURCE" describe --tags --always "$ref" 2>/dev/null), $(git --git-dir="$DS_TESTS_SOURCE" show -s --format=%cs "$ref"))"
  fi
else
  sdist=$work/sdist
  mkdir -p "$sdist"
  if pip download "deepspeed==$version" --no-deps --no-binary :all: -d "$sdist" -q >/dev/null 2>&1 \
      && tar -tzf "$sdist"/deepspeed-*.tar.gz | grep -q "^deepspeed-$version/tests/unit/"; then
    tar -xzf "$sdist"/deepspeed-*.tar.gz -C "$sdist"
    cp -r "$sdist/deepspeed-$version/tests" "$tests"
    source_label="the source distribution of deepspeed $version"
  elif git clone -q --depth 1 --branch "v$version" https://github.com/microsoft/DeepSpeed "$work/clone" 2>/dev/null; then
    cp -r "$work/clone/tests" "$tests"
    source_label="github.com/microsoft/DeepSpeed at v$version"
  else
    echo "no DeepSpeed tests found: the source distribution of $version has no tests/ and cloning v$version"
    echo "failed. Point DS_TESTS_SOURCE at a DeepSpeed checkout or git directory (DS_TESTS_REF picks the ref)."
    exit 2
  fi
fi

if [ $# -gt 0 ]; then
  selection=("$@")
else
  # The default list: cases of the tensor-fragment API file (issue 23) that run on CPU ranks,
  # without offload and with optimizer offload at stage 2, and DeepSpeed's Muon tests that run
  # without fp16 where the tests have them. The file's other cases skip inside their ranks (local
  # API at stage 1/2, NVMe, fp16 and bf16-optimizer cases on a CPU) or repeat these at another
  # dtype or stage, and cost a spawn each; name the file itself to run all of them. DeepSpeed
  # renamed the classes in 0.16.9: the set-and-read class TestTensorFragmentUpdate became
  # TestTensorFragmentSet, TestTensorFragmentGet took a dtype, and a new TestTensorFragmentUpdate
  # tests safe_update_full_grad_vectorized (with and without torch_adam).
  file=unit/runtime/zero/test_zero_tensor_fragment.py
  selection=()
  if grep -q "class TestTensorFragmentSet" "$tests/$file"; then
    for case in none-1-full-dtype2-False none-2-full-dtype2-False none-3-full-dtype2-False none-3-full-dtype2-True \
                none-3-local-dtype2-False none-2-full-dtype0-False; do  # dtype2 fp32, dtype0 bf16
      selection+=("$file::TestTensorFragmentGet::test_zero_fragments[$case]")
    done
    for case in none-1-full-dtype2 none-2-full-dtype2 none-3-full-dtype2 none-3-local-dtype2 cpu-2-full-dtype2; do
      selection+=("$file::TestTensorFragmentSet::test_zero_fragments[$case]")
    done
    for case in none-1-False-dtype2 none-2-True-dtype2 none-3-False-dtype2 cpu-2-False-dtype2; do
      selection+=("$file::TestTensorFragmentUpdate::test_zero_fragments[$case]")
    done
    muon=unit/ops/muon/test_muon_partial_training.py  # test_muon.py skips without fp16
    [ -f "$tests/$muon" ] && selection+=("$muon")
  else
    for frozen in True False; do
      for case in none-1-full none-2-full none-3-full none-3-local; do
        selection+=("$file::TestTensorFragmentGet::test_zero_fragments[$case-$frozen]")
      done
    done
    for dtype in dtype0 dtype2; do  # bf16, fp32 (dtype1, fp16, skips without fp16 support)
      for case in none-1-full none-2-full none-3-full none-3-local; do
        selection+=("$file::TestTensorFragmentUpdate::test_zero_fragments[$case-$dtype]")
      done
    done
    selection+=("$file::TestTensorFragmentUpdate::test_zero_fragments[cpu-2-full-dtype2]")
  fi
fi

export DS_ACCELERATOR=${DS_UNIT_ACCELERATOR:-cpu}
# DeepSpeed's DistributedTest skips a case when the accelerator counts fewer devices than ranks;
# the CPU accelerator counts LOCAL_SIZE (each rank sets its own).
export LOCAL_SIZE=${LOCAL_SIZE:-8}
# A hung case fails after this many seconds instead of DeepSpeed's 600.
export DS_UNITTEST_TIMEOUT=${DS_UNITTEST_TIMEOUT:-300}
run() {  # run NAME [env...]: pytest over the selection, a JUnit report and a log
  local name=$1
  shift
  echo "== $name: ${#selection[@]} arguments, log $work/$name.log"
  (cd "$tests" && env PYTHONPATH="$helpers${PYTHONPATH:+:$PYTHONPATH}" "$@" python -m pytest -p no:cacheprovider \
    -p ds_unit_harness -q -rfEs --junitxml="$work/$name.xml" "${selection[@]}" > "$work/$name.log" 2>&1)
  tail -n 1 "$work/$name.log"
}

rm -f "$work/injections.log"
run_injected() {
  run injected DS_CANZONA_INJECT=1 DS_CANZONA_INJECT_LOG="$work/injections.log" \
    PYTHONPATH="$helpers:$repo${PYTHONPATH:+:$PYTHONPATH}"
}
start=$SECONDS
if [ "${DS_UNIT_PARALLEL:-0}" = 1 ]; then
  # Both runs at once; DeepSpeed's tests take their ports from 29500 + 1000 x the xdist worker
  # number, so the injected run poses as worker 1 to keep to ports of its own.
  run stock &
  PYTEST_XDIST_WORKER=gw1 run_injected
  wait
  stock_s=$((SECONDS - start))
  injected_s=$stock_s
else
  run stock
  stock_s=$((SECONDS - start))
  start=$SECONDS
  run_injected
  injected_s=$((SECONDS - start))
fi

{
  echo "DeepSpeed's unit tests from $source_label, run against deepspeed $version"
  echo "(ds_canzona $(git -C "$repo" rev-parse --short HEAD), DS_ACCELERATOR=$DS_ACCELERATOR; stock ${stock_s} s, injected ${injected_s} s)"
  echo
  python "$helpers/table.py" "$work/stock.xml" "$work/injected.xml" "$work/injections.log"
} | tee "$work/table.md"
echo "reports and logs: $work"
