#!/usr/bin/env bash
# The one prepared GPU run: everything this project cannot check on CPU ranks, in one script of
# at most 8 minutes on one GPU (planned for ~5 on an H200), results under $OUT (default ./gpu_out):
#
#   session.log          everything printed, ending with a PASS/FAIL/TIMEOUT/SKIP line per phase
#   session.json         the phases' verdicts, rewritten after each phase ("complete": false until the end)
#   validate.json        phase "validate": every kernel x fp16/bf16/fp32 x shapes with tails, strided
#                        views and stacks, through the public functions, backend forced to "triton"
#                        and then "default", against float64, with thresholds (a miss fails the run)
#   engine.json          phase "engine": deepspeed.initialize on one GPU (DP=1, NCCL), ZeRO-1/2/3 x
#                        Muon/Shampoo/SOAP and the offload and reentrant-checkpointing variants, bf16,
#                        a Qwen3-0.6B-shaped model from its config: forward, backward and step times,
#                        host syncs per step, losses
#   ns_time.json         phase "ns-time": Muon's Newton-Schulz, Triton against torch, at the model's shapes
#   calibrate.json       phase "calibrate": the roofline cost model's machine balance on this device
#   kernels_sweep.json   phase "sweep" (only if time remains): bench kernels --sweep
#
# Each phase runs in its own process under its own time limit (the shell phase "install" too); one
# that fails or times out does not stop the next. Every JSON is rewritten as its phase goes (after
# each case or row; renamed into place, never half written), so a phase stopped at its limit keeps
# what it finished. The exit status is non-zero when any phase failed, missed or timed out.
#
# Before the device call (here, with network; docs/BENCHMARKS.md "The GPU session"):
#
#   bash scripts/gpu_wheels.sh            # prepares gpu_wheels/ and checks it for the device's CPython 3.12
#   bash scripts/gpu_wheels.sh --check    # the check alone, right before the call
#
# then call the device with carry ["gpu_wheels"] (it is git-ignored) and `bash scripts/gpu_session.sh`,
# with a timeout of at least GPU_SESSION_BUDGET_S + 60 s.
#
# Environment:
#   OUT                   results folder (default gpu_out in the checkout)
#   PYTHON                interpreter (default /opt/torch/.venv/bin/python3 if present, else python3)
#   GPU_WHEELS            the carried wheels (default gpu_wheels in the checkout)
#   GPU_SESSION_DRY_RUN=1 the same phases on the CPU: TRITON_INTERPRET=1, tiny shapes, a 2-layer
#                         model on gloo; needs no network (CI runs it: tests/test_gpu_session.py)
#   GPU_SESSION_PHASES    comma-separated subset of install,validate,engine,ns-time,calibrate,sweep
#   GPU_SESSION_BUDGET_S  seconds for the whole run (default 450); a phase gets at most what is left
#   GPU_SESSION_CAPS      per-phase limits overriding the defaults, e.g. "install=60,engine=200"
#   GPU_SESSION_SWEEP     auto (default: run the sweep when 120 s remain), 1 always, 0 never
#   GPU_SESSION_LAYERS    decoder layers of the engine model (default 28, the 0.6B model's)
#
# Dependencies: the device image has torch, Triton and transformers but not DeepSpeed, hjson or
# pydantic, and no network. When an import is missing, the install phase first runs the preflight
# (ds_canzona/bench/gpu/preflight.py --here: the wheels' tags against this Python and glibc, their
# requirements against what is carried and installed) and fails at once, naming what is wrong, when
# the wheels cannot work; no package registry is tried (the device reaches none). Otherwise it
# installs them into a temporary folder. Without them the engine phase is skipped (SKIP, with the
# reason) and the phases that need only torch and Triton still run. ds_canzona itself is not
# installed: a temporary package view (symlinks to ds_canzona/ and kernels/, as setup.py maps them)
# goes first on PYTHONPATH, the phases run in an empty temporary directory (see below), and bytecode
# and the Triton cache go to the temporary folder, so the run writes nothing in the tree outside $OUT.
set -uo pipefail  # not -e: a failing phase is recorded and the next one runs

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-$REPO/gpu_out}  # a relative OUT is taken from where the script is started
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 2
cd "$REPO" || exit 2
DRY=${GPU_SESSION_DRY_RUN:-0}
BUDGET=${GPU_SESSION_BUDGET_S:-450}
PHASES=${GPU_SESSION_PHASES:-install,validate,engine,ns-time,calibrate,sweep}
SWEEP=${GPU_SESSION_SWEEP:-auto}
CAPS=${GPU_SESSION_CAPS:-}
WHEELS=${GPU_WHEELS:-$REPO/gpu_wheels}
[[ -d $WHEELS ]] && WHEELS=$(cd "$WHEELS" && pwd)
PREFLIGHT=$REPO/ds_canzona/bench/gpu/preflight.py
if [[ -z ${PYTHON:-} ]]; then
    if [[ -x /opt/torch/.venv/bin/python3 ]]; then PYTHON=/opt/torch/.venv/bin/python3; else PYTHON=python3; fi
fi
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_session.XXXXXX") || exit 2
trap 'rm -rf "$WORK"' EXIT
START=$SECONDS

mkdir -p "$WORK/cwd" "$WORK/logs" "$WORK/cache"
export OUT PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX="$WORK/cache/pycache"
export TRITON_CACHE_DIR="$WORK/cache/triton" TORCHINDUCTOR_CACHE_DIR="$WORK/cache/inductor"
export DS_BUILD_OPS=0  # DeepSpeed, if built here, builds no ops (ds_canzona needs none of them)
if [[ $DRY == 1 ]]; then
    # The CPU even where a GPU is visible: DeepSpeed's CPU accelerator, gloo, Triton's interpreter.
    export GPU_SESSION_DRY_RUN=1 TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES="" DS_ACCELERATOR=cpu
    DRY_FLAG=--dry-run
else
    DRY_FLAG=
fi

# --------------------------------------------------------------------------- the package view

SITE="$WORK/site"
mkdir -p "$SITE/ds_canzona"
for entry in "$REPO"/ds_canzona/*; do
    name=$(basename "$entry")
    [[ $name == kernels || $name == __pycache__ ]] && continue
    ln -s "$entry" "$SITE/ds_canzona/$name"
done
ln -s "$REPO/kernels" "$SITE/ds_canzona/kernels"
DEPS="$WORK/deps"  # where the install phase puts missing packages (on the path from the start: phases are subshells)
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}:$DEPS"
# Python puts its working directory first on sys.path. From the checkout's root that would import
# ds_canzona from the tree, where ds_canzona.kernels does not exist (setup.py maps it), and offer
# kernels/ as a top-level `kernels` package, which transformers takes for HuggingFace's. So every
# phase runs in an empty directory of its own.
cd "$WORK/cwd" || exit 2

# --------------------------------------------------------------------------- helpers

declare -a SUMMARY=() RESULTS=() PHASE_JSON=()
FAILED=0

wanted() { [[ ",$PHASES," == *",$1,"* ]]; }
remaining() { echo $((BUDGET - (SECONDS - START))); }

# cap NAME DEFAULT: the phase's limit, GPU_SESSION_CAPS's if it names one.
cap() {
    local entry
    for entry in ${CAPS//,/ }; do
        [[ ${entry%%=*} == "$1" ]] && { echo "${entry#*=}"; return; }
    done
    echo "$2"
}

json_text() { local text=${1//\\/ }; printf '"%s"' "${text//\"/\'}"; }

# session.json, replaced whole after every phase: a run stopped part way keeps the verdicts so far.
write_session_json() {
    local complete=$1 partial="$OUT/session.json.partial" joined
    joined=$(IFS=,; echo "${PHASE_JSON[*]}")
    printf '{"commit": %s, "source_digest": %s, "dry_run": %s, "budget_s": %s, "elapsed_s": %s, "complete": %s, "phases": [%s]}\n' \
        "$(json_text "$GPU_SESSION_COMMIT")" "$(json_text "$DIGEST")" "$([[ $DRY == 1 ]] && echo true || echo false)" \
        "$BUDGET" "$((SECONDS - START))" "$complete" "$joined" >"$partial" && mv -f "$partial" "$OUT/session.json"
}

# record_phase NAME VERDICT DETAIL [EXIT SECONDS LIMIT]: its summary line and session.json entry.
record_phase() {
    local name=$1 verdict=$2 detail=$3
    SUMMARY+=("$(printf '%-7s' "$verdict") $name ($detail)")
    PHASE_JSON+=("{\"phase\": $(json_text "$name"), \"verdict\": $(json_text "$verdict"), \"detail\": $(json_text "$detail")${4:+, \"exit\": $4, \"seconds\": $5, \"limit_s\": $6}}")
    write_session_json false
}

# run_phase NAME CAP_SECONDS COMMAND...: the command under min(CAP, time left), its verdict and its
# RESULT lines recorded. A shell function of this script runs in a child bash under the same limit.
run_phase() {
    local name=$1 left limit started rc verdict log="$WORK/logs/$1.log" line
    wanted "$name" || return 0
    local cap_s
    cap_s=$(cap "$name" "$2")
    shift 2
    left=$(remaining)
    if ((left < 15)); then
        record_phase "$name" SKIP "only ${left}s of the ${BUDGET}s budget left"
        return 0
    fi
    limit=$((cap_s < left ? cap_s : left))
    echo
    echo "=== $name (limit ${limit}s, $((SECONDS - START))s into the run) ==="
    started=$SECONDS
    if declare -F "$1" >/dev/null; then
        # The function and what it uses, defined again in the child: a timeout needs a process.
        timeout -k 10 "$limit" bash -c "$(declare -p PYTHON REPO DEPS DRY WHEELS PREFLIGHT WORK NEEDED); $(declare -f); \"\$@\"" \
            _ "$@" 2>&1 | tee "$log"
    else
        timeout -k 10 "$limit" "$@" 2>&1 | tee "$log"
    fi
    rc=${PIPESTATUS[0]}
    if ((rc == 0)); then verdict=PASS; elif ((rc == 124 || rc == 137)); then verdict=TIMEOUT; else verdict=FAIL; fi
    [[ $verdict == PASS ]] || FAILED=1
    record_phase "$name" "$verdict" "exit $rc, $((SECONDS - started))s" "$rc" "$((SECONDS - started))" "$limit"
    while IFS= read -r line; do RESULTS+=("$line"); done < <(grep -E '^RESULT |^  FAILED ' "$log")
}

source_digest() {
    # The tracked sources' content, so the run names the code exactly even without git.
    "$PYTHON" "$PREFLIGHT" --digests | sed -n 's/^source-digest //p'
}

commit() {
    local head
    if head=$(git -C "$REPO" rev-parse HEAD 2>/dev/null); then
        [[ -n $(git -C "$REPO" status --porcelain --untracked-files=no 2>/dev/null) ]] && head+="+uncommitted"
        echo "$head"
    elif [[ -f $REPO/COMMIT ]]; then
        echo "$(head -n1 "$REPO/COMMIT") (from COMMIT)"
    elif [[ -f $WHEELS/COMMIT ]]; then
        echo "$(sed -n 's/^commit //p' "$WHEELS/COMMIT") (from gpu_wheels/COMMIT)"
    else
        echo unknown
    fi
}

# The modules of "$@" that cannot be found (a quick look: nothing is imported).
missing_modules() {
    "$PYTHON" - "$@" <<'PY'
import importlib.util, sys
def found(module):
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder that refuses it, a broken package: missing too
        return False
print(" ".join(m for m in sys.argv[1:] if not found(m)))
PY
}
NEEDED=(torch triton deepspeed hjson pydantic transformers)

# Install the carried wheels into $DEPS: those whose distribution is not installed, or all of them
# (all=1) when that was not enough (say pydantic needs a newer typing_extensions than the image's).
install_wheels() {
    local all=$1
    "$PYTHON" - "$WHEELS" "$DEPS" "$all" <<'PY'
import importlib.metadata as md, pathlib, subprocess, sys, zipfile
wheels, deps, everything = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3] == "1"
def installed(dist):
    try:
        md.version(dist)
        return True
    except md.PackageNotFoundError:
        return False
chosen = [w for w in sorted(wheels.glob("*.whl")) if everything or not installed(w.name.split("-")[0])]
print("installing from gpu_wheels:", ", ".join(w.name for w in chosen) or "nothing")
if not chosen:
    sys.exit(0)
pip = [sys.executable, "-m", "pip"]
has_pip = subprocess.run(pip + ["--version"], capture_output=True).returncode == 0
if not has_pip:  # a venv without pip: ensurepip works offline
    has_pip = subprocess.run([sys.executable, "-m", "ensurepip", "--default-pip"], capture_output=True).returncode == 0
if has_pip:
    cmd = pip + ["install", "-q", "--no-index", "--no-deps", "--no-compile", "--upgrade", "--target", str(deps)]
    cmd += [str(w) for w in chosen]
    sys.exit(subprocess.run(cmd).returncode)
print("no pip here: unpacking the wheels (they are plain zip archives)")
for w in chosen:
    zipfile.ZipFile(w).extractall(deps)
PY
}

imports_work() { "$PYTHON" -c "import deepspeed, hjson, pydantic, transformers" >/dev/null 2>&1; }

install_phase() {
    local missing
    missing=$(missing_modules "${NEEDED[@]}")
    if [[ -z $missing ]]; then
        echo "every import present (${NEEDED[*]})"
        touch "$WORK/imports_ok"
        "$PYTHON" -m ds_canzona.bench gpu-check env  # the versions
        return
    fi
    echo "missing: $missing"
    # Whether the carried wheels can work here, before anything is installed; no registry is tried
    # (the device reaches none): what is wrong is named at once.
    "$PYTHON" "$PREFLIGHT" --wheels "$WHEELS" --here || {
        echo "install: the carried wheels cannot provide: $missing (prepare them with scripts/gpu_wheels.sh, carry gpu_wheels)"
        return 1
    }
    install_wheels 0 && imports_work || install_wheels 1
    missing=$(missing_modules "${NEEDED[@]}")
    if [[ -n $missing ]]; then
        echo "still missing after installing the wheels: $missing"
        return 1
    fi
    "$PYTHON" -c "import deepspeed, pydantic; print('imported deepspeed', deepspeed.__version__, pydantic.VERSION)" || return 1
    touch "$WORK/imports_ok"
    "$PYTHON" -m ds_canzona.bench gpu-check env
}

# The engine phase needs DeepSpeed: known from the install phase, or asked when it did not run.
engine_ready() { [[ -f $WORK/imports_ok ]] || { ! wanted install && imports_work; }; }

# --------------------------------------------------------------------------- the run

main() {
    local kind="GPU run"
    [[ $DRY == 1 ]] && kind="DRY RUN on the CPU"
    echo "gpu_session: $(date -u +%Y-%m-%dT%H:%M:%SZ), $kind"
    DIGEST=$(source_digest)
    echo "commit $(commit); source digest $DIGEST"
    echo "python $PYTHON ($("$PYTHON" -c 'import sys; print(sys.version.split()[0])' 2>&1))"
    { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null ||
        echo "no nvidia-smi"; } | sed 's/^/gpu: /'
    export GPU_SESSION_COMMIT
    GPU_SESSION_COMMIT=$(commit)
    write_session_json false

    run_phase install 240 install_phase

    run_phase validate 180 "$PYTHON" -m ds_canzona.bench gpu-check validate $DRY_FLAG --out "$OUT"
    # The engine phase skips its remaining cases once its budget is spent: 180 s, or less when the
    # run is late, so that the case in progress has a minute to finish within the run's budget.
    local engine_budget=$(($(remaining) - 60))
    ((engine_budget > 180)) && engine_budget=180
    ((engine_budget < 30)) && engine_budget=30
    if ! wanted engine; then
        :
    elif engine_ready; then
        run_phase engine 240 "$PYTHON" -m ds_canzona.bench gpu-check engine $DRY_FLAG --out "$OUT" \
            --budget-s "$engine_budget" ${GPU_SESSION_LAYERS:+--layers "$GPU_SESSION_LAYERS"}
    else
        record_phase engine SKIP "deepspeed, hjson, pydantic or transformers cannot be imported: see install"
        FAILED=1
    fi
    run_phase ns-time 90 "$PYTHON" -m ds_canzona.bench gpu-check ns-time $DRY_FLAG --out "$OUT"
    if [[ $DRY == 1 ]]; then
        run_phase calibrate 60 "$PYTHON" -m ds_canzona.bench calibrate --matrix 64 --vector 4096 --repeats 1 \
            --json "$OUT/calibrate.json"
    else
        run_phase calibrate 90 "$PYTHON" -m ds_canzona.bench calibrate --json "$OUT/calibrate.json"
    fi
    if [[ $SWEEP == 1 || ($SWEEP == auto && $(remaining) -ge 120) ]]; then
        if [[ $DRY == 1 ]]; then  # no GPU: the bench's CPU path (torch reference, tiny shapes)
            run_phase sweep 60 "$PYTHON" -m ds_canzona.bench kernels --cpu --repeats 1 --warmup 0 \
                --json "$OUT/kernels_sweep.json"
        else
            run_phase sweep 600 "$PYTHON" -m ds_canzona.bench kernels --sweep --json "$OUT/kernels_sweep.json"
        fi
    elif wanted sweep; then
        record_phase sweep SKIP "GPU_SESSION_SWEEP=$SWEEP, $(remaining)s left"
    fi

    echo
    echo "=== summary ($((SECONDS - START))s; commit $GPU_SESSION_COMMIT) ==="
    printf '%s\n' "${SUMMARY[@]}"
    ((${#RESULTS[@]})) && printf '%s\n' "${RESULTS[@]}"
    if ((FAILED)); then echo "gpu_session: FAILED"; else echo "gpu_session: all phases passed"; fi
    write_session_json true
    return "$FAILED"
}

main 2>&1 | tee "$OUT/session.log"
exit "${PIPESTATUS[0]}"
