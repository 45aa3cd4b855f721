#!/usr/bin/env bash
# The whole GPU check and every GPU benchmark in ONE device call of at most 9.5 minutes (issue 22); see
# benchmarks/gpu/README.md.
#
#   bash benchmarks/gpu/run_all.sh [OUTDIR]               # OUTDIR default: $OUT, else gpu_out/
#   STEPS="sim infer envs doctor" bash benchmarks/gpu/run_all.sh   # only these steps
#
# Writes OUTDIR/gpu_results.json (rewritten after every step, so a run cut short keeps what it finished),
# OUTDIR/gpu_run.log (everything printed), OUTDIR/pytest_gpu.xml, and at the end OUTDIR/gpu_results.md plus
# copies of benchmarks/RESULTS.md and README.md with their GPU blocks rendered from the JSON
# (benchmarks/gpu/render_gpu.py; run it here on the JSON that came back to update the real files).
# Steps, in this order, each under `timeout`:
#   tests  (pytest -m gpu tests/gpu)   train (train_mfu.py, NVML sampler inside)   sim (sim_gpu.py)
#   infer  (infer_gpu.py)              envs  (envs_gpu.py)                          doctor (doctor_gpu.py)
# Without a GPU it stops at once: one line, exit code 2, nothing written.
# Knobs (environment): PYTEST_ARGS TRAIN_ARGS SIM_ARGS INFER_ARGS ENVS_ARGS DOCTOR_ARGS extra arguments;
#   PYTHON (default python3); INSTALL=0 installs nothing (src/ on PYTHONPATH: a development machine); the caps below.
set -uo pipefail
cd "$(dirname "$0")/../.."
# The time budget of one call, in seconds. tests/unit/test_gpu_suite.py adds these lines up: every cap, plus
# KILL_S for each bounded command (`timeout --kill-after`), must fit in CALL_S (9.5 minutes).
CALL_S=570
SETUP_S=${SETUP_S:-45}      # machine facts, wheels, pip install, the machine record
TESTS_S=${TESTS_S:-140}
TRAIN_S=${TRAIN_S:-120}
SIM_S=${SIM_S:-65}
INFER_S=${INFER_S:-55}
ENVS_S=${ENVS_S:-50}
DOCTOR_S=${DOCTOR_S:-40}
RENDER_S=${RENDER_S:-15}    # the summary and the Markdown
KILL_S=5                    # after a cap, `timeout` waits this long before SIGKILL
BOUNDED=7                   # commands under timeout with --kill-after: the six steps and the render
BUDGET_S=$(( CALL_S - RENDER_S - KILL_S ))  # what setup and the steps may use, whatever the caps say
PY=${PYTHON:-python3}
OUTDIR=${1:-${OUT:-gpu_out}}
START=$(date +%s)

# no GPU, no run: say so in one line and write nothing (the CPU tier runs every script's --quick instead)
if ! timeout 60 "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "run_all.sh: no GPU: $PY's torch sees no CUDA device here (or does not import; CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset}); nothing run, nothing written" >&2
  exit 2
fi
mkdir -p "$OUTDIR"
RESULTS=$OUTDIR/gpu_results.json
LOG=$OUTDIR/gpu_run.log
exec > >(tee -a "$LOG") 2>&1
STEPS=" ${STEPS:-tests train sim infer envs doctor} "
export PYTHONUNBUFFERED=1
TMP=$(mktemp -d)
rm -f "$RESULTS"

echo "== machine ($(date -u +%FT%TZ))"
timeout 10 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1 || echo "nvidia-smi: not available"
timeout 30 "$PY" -c "import torch; print('torch', torch.__version__, '| CUDA', torch.version.cuda, '| GPUs', [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())], '| NCCL', torch.cuda.nccl.version() if torch.cuda.is_available() else None)"
echo "cores: $(nproc), python: $("$PY" -V 2>&1)"

echo "== install"
if [ "${INSTALL:-1}" = 0 ]; then  # INSTALL=0: leave this Python alone (a development machine); use src/ as it is
  export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
else
  for folder in .whl .whl-envpool; do  # wheels carried from a machine with network (fetch_wheels.sh)
    if compgen -G "$folder/*.whl" >/dev/null; then
      timeout 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$folder"/*.whl && echo "installed $(ls "$folder" | tr '\n' ' ')into /tmp/site" || echo "wheels in $folder: install failed"
    fi
  done
  [ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  if timeout 60 "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$TMP/pip.log" 2>&1; then
    echo "multigpu: installed with pip install --no-deps -e ."
  else
    echo "multigpu: pip install -e . failed ($(tail -n 1 "$TMP/pip.log")); using PYTHONPATH=src"
    export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
  fi
fi
timeout 30 "$PY" -c "import multigpu; print('multigpu', multigpu.__version__ if hasattr(multigpu, '__version__') else '', 'from', multigpu.__file__)" \
  || { echo "multigpu does not import: stopping"; exit 1; }
timeout 30 "$PY" -c "import monai, gymnasium; print('monai', monai.__version__, '| gymnasium', gymnasium.__version__)" 2>&1 | tail -n 1
timeout 30 "$PY" benchmarks/gpu/collect.py "$RESULTS" --meta
echo "== setup took $(( $(date +%s) - START ))s (SETUP_S=$SETUP_S)"

remaining() { echo $(( BUDGET_S - ($(date +%s) - START) )); }

run_step() {  # NAME CAP_S COMMAND...: run if selected and if it fits; record its outcome either way
  local name=$1 cap=$2
  shift 2
  [[ $STEPS == *" $name "* ]] || return 0
  local left=$(( $(remaining) - KILL_S ))
  if (( left < cap / 2 )); then  # less than half its cap left: better run whole in the next call
    echo "== $name: not run ($(remaining) s left of BUDGET_S=$BUDGET_S); run it with STEPS=\"$name\" bash benchmarks/gpu/run_all.sh"
    "$PY" benchmarks/gpu/collect.py "$RESULTS" --step "$name" --status skipped --note "out of time: run with STEPS=$name"
    return 0
  fi
  local limit=$(( cap < left ? cap : left )) t0 rc status
  echo "== $name (at most ${limit}s): $*"
  t0=$(date +%s)
  timeout --kill-after=$KILL_S "$limit" "$@"
  rc=$?
  if (( rc == 124 || rc == 137 )); then status=timeout; elif (( rc == 0 )); then status=ok; else status=failed; fi
  local extra=(--record "$TMP/$name.json")
  [[ $name == tests ]] && extra=(--junit "$OUTDIR/pytest_gpu.xml")
  "$PY" benchmarks/gpu/collect.py "$RESULTS" --step "$name" --status "$status" --rc "$rc" \
    --seconds "$(( $(date +%s) - t0 ))" "${extra[@]}"
  echo "== $name: $status (rc $rc) after $(( $(date +%s) - t0 ))s; $(remaining)s of the budget left"
}

# shellcheck disable=SC2086  # the *_ARGS are word lists on purpose
{
run_step tests  "$TESTS_S"  "$PY" -m pytest -m gpu tests/gpu -v -p no:cacheprovider -rfEs --timeout 90 \
                            --junitxml="$OUTDIR/pytest_gpu.xml" ${PYTEST_ARGS:-}
run_step train  "$TRAIN_S"  "$PY" benchmarks/gpu/train_mfu.py --json "$TMP/train.json" ${TRAIN_ARGS:-}
run_step sim    "$SIM_S"    "$PY" benchmarks/gpu/sim_gpu.py --json "$TMP/sim.json" ${SIM_ARGS:-}
run_step infer  "$INFER_S"  "$PY" benchmarks/gpu/infer_gpu.py --json "$TMP/infer.json" ${INFER_ARGS:-}
run_step envs   "$ENVS_S"   "$PY" benchmarks/gpu/envs_gpu.py --json "$TMP/envs.json" ${ENVS_ARGS:-}
run_step doctor "$DOCTOR_S" "$PY" benchmarks/gpu/doctor_gpu.py --json "$TMP/doctor.json" ${DOCTOR_ARGS:-}
}

echo "== summary and Markdown ($(( $(date +%s) - START ))s so far)"
cp benchmarks/RESULTS.md "$OUTDIR/RESULTS.md"
cp README.md "$OUTDIR/README.md"
timeout --kill-after=$KILL_S "$RENDER_S" bash -c '"$1" benchmarks/gpu/collect.py "$2" --summary &&
  "$1" benchmarks/gpu/render_gpu.py "$2" --results "$3/RESULTS.md" --readme "$3/README.md"' _ "$PY" "$RESULTS" "$OUTDIR"
echo "== done in $(( $(date +%s) - START ))s (one call: at most ${CALL_S}s)"
rm -rf "$TMP"
