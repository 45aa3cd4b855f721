#!/usr/bin/env bash
# The whole GPU check and every GPU benchmark in ONE device call of at most CALL_S seconds; see benchmarks/gpu/README.md.
#
#   bash benchmarks/gpu/fetch_wheels.sh                  # first, where git and PyPI are: peers' wheels and .whl/source.json
#   bash benchmarks/gpu/run_all.sh [OUTDIR]               # OUTDIR default: $OUT, else gpu_out/ (carry .whl)
#   STEPS="sim infer envs doctor" bash benchmarks/gpu/run_all.sh   # only these steps
#   REHEARSE=1 bash benchmarks/gpu/run_all.sh OUTDIR      # on a CPU: every step's --quick variant, and each
#                                                         # step's estimate of its GPU run checked against its cap
#
# Writes OUTDIR/gpu_results.json (rewritten after every step, so a run cut short keeps what it finished),
# OUTDIR/gpu_run.log (everything printed), one OUTDIR/pytest_<chunk>.xml per test chunk, and at the end
# OUTDIR/gpu_results.md plus copies of benchmarks/RESULTS.md and README.md with their GPU blocks rendered from
# the JSON (benchmarks/gpu/render_gpu.py; run it here on the JSON that came back to update the real files).
# Every step's entry records the source it ran (benchmarks/gpu/source.py: git's HEAD, or .whl/source.json where the
# copy has no .git, with the files that differ), the GPU, the torch and its own start time.
# Steps, in this order, each under `timeout`, each recorded as it ends:
#   smoke (smoke_gpu.py: what one GPU can show: NCCL, the Trainer's DDP/FSDP/HSDP wrappers on a group of one, a
#     checkpoint from CUDA resumed, the Trainer at world size 2-8 on torch's fake process group, inference/sim/env)
#   tests_launch, tests_train, tests_work (pytest -m gpu on a third of tests/gpu each: a chunk cut by its cap
#     leaves the others' counts)
#   train (train_mfu.py, NVML sampler inside)   sim (sim_gpu.py)   infer (infer_gpu.py)   envs (envs_gpu.py)
#   ppo (ppo_gpu.py)   checkpoint (checkpoint_gpu.py: benchmarks/checkpoint_async.py --cuda)   doctor (doctor_gpu.py)
# Without a GPU it stops at once: one line, exit code 2, nothing written (unless REHEARSE=1).
# Knobs (environment): SMOKE_ARGS PYTEST_ARGS TRAIN_ARGS SIM_ARGS INFER_ARGS ENVS_ARGS PPO_ARGS CHECKPOINT_ARGS
#   DOCTOR_ARGS extra arguments; PYTHON (default python3); INSTALL=0 installs nothing (src/ on PYTHONPATH: a
#   development machine); the caps below.
set -uo pipefail
cd "$(dirname "$0")/../.."
# The time budget of one call, in seconds. tests/unit/test_gpu_suite.py adds these lines up: every cap, plus
# KILL_S for each bounded command (`timeout --kill-after`), must fit in CALL_S (the device runs one command for at
# most 600 s); the rehearsal checks each step's own estimate against its cap (benchmarks/gpu/budget.py).
CALL_S=585
# Set from the first GPU calls (one H200, 2026-11-27), seconds used: setup 44 (six Python starts; now three),
# smoke 11, tests_launch 31, tests_train 52, tests_work 66, train 65, infer 22, envs 29, doctor 9; sim was cut
# (its children's 5 s minimum pushed it past its cap); ppo, checkpoint and the smoke's new checks not yet run.
SETUP_S=${SETUP_S:-40}      # the GPU, the source, wheels, pip install, the machine record
SMOKE_S=${SMOKE_S:-45}
TESTS_LAUNCH_S=${TESTS_LAUNCH_S:-40}
TESTS_TRAIN_S=${TESTS_TRAIN_S:-65}
TESTS_WORK_S=${TESTS_WORK_S:-75}
TRAIN_S=${TRAIN_S:-75}
SIM_S=${SIM_S:-45}
INFER_S=${INFER_S:-30}
ENVS_S=${ENVS_S:-38}
PPO_S=${PPO_S:-40}
CHECKPOINT_S=${CHECKPOINT_S:-40}
DOCTOR_S=${DOCTOR_S:-20}
RENDER_S=${RENDER_S:-5}     # the summary and the Markdown (no torch)
KILL_S=2                    # after a cap, `timeout` waits this long before SIGKILL
BOUNDED=12                  # commands under timeout with --kill-after: the eleven steps and the render
BUDGET_S=$(( CALL_S - RENDER_S - KILL_S ))  # what setup and the steps may use, whatever the caps say
PY=${PYTHON:-python3}
OUTDIR=${1:-${OUT:-gpu_out}}
REHEARSE=${REHEARSE:-0}
START=$(date +%s)
TESTS_LAUNCH="tests/gpu/test_launch_gpu.py"
TESTS_TRAIN="tests/gpu/test_train_gpu.py tests/gpu/test_timing_gpu.py tests/gpu/test_nccl_gpu.py tests/gpu/test_device_gpu.py"
TESTS_WORK="tests/gpu/test_sim_gpu.py tests/gpu/test_infer_gpu.py tests/gpu/test_envs_gpu.py tests/gpu/test_monitor_doctor_gpu.py"
now() { date +%FT%T%z; }

if [ "$REHEARSE" = 1 ]; then  # a CPU rehearsal: nothing installed, every script's --quick, budgets checked
  INSTALL=0
  QUICK=--quick
  export CUDA_VISIBLE_DEVICES=""
  PROBE="rehearsal on the CPU: no GPU"
else
  QUICK=
  # no GPU, no run: say so in one line and write nothing (REHEARSE=1 runs every script's --quick instead)
  if ! PROBE=$(timeout 60 "$PY" -c "import sys, torch
if not torch.cuda.is_available(): sys.exit(1)
print('torch', torch.__version__, '| CUDA', torch.version.cuda, '| GPUs',
      [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())], '| NCCL', torch.cuda.nccl.version())" 2>/dev/null); then
    echo "run_all.sh: no GPU: $PY's torch sees no CUDA device here (or does not import; CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset}); nothing run, nothing written" >&2
    exit 2
  fi
fi
mkdir -p "$OUTDIR"
RESULTS=$OUTDIR/gpu_results.json
LOG=$OUTDIR/gpu_run.log
exec > >(tee -a "$LOG") 2>&1
STEPS=" ${STEPS:-smoke tests_launch tests_train tests_work train sim infer envs ppo checkpoint doctor} "
export PYTHONUNBUFFERED=1
TMP=$(mktemp -d)
export TORCHINDUCTOR_CACHE_DIR=$TMP/inductor  # one cache for both sides of train_mfu: the second compile is warm
rm -f "$RESULTS"
BUDGET_FAILED=0

echo "== machine ($(now))"
timeout 10 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1 || echo "nvidia-smi: not available"
echo "$PROBE"
echo "cores: $(nproc), python: $("$PY" -V 2>&1)"
# the source this call runs (git's HEAD, or the .whl/source.json fetch_wheels.sh wrote): in every step's entry
GPU_RUN_SOURCE=$(timeout 30 "$PY" benchmarks/gpu/source.py 2>/dev/null) || GPU_RUN_SOURCE='{"commit": null, "text": "unknown: benchmarks/gpu/source.py failed"}'
export GPU_RUN_SOURCE
echo "source: $GPU_RUN_SOURCE"

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
# the machine, the source, multigpu and the peers, in one Python start (multigpu must import; a missing peer is
# said here and in its step's row)
timeout 60 "$PY" benchmarks/gpu/collect.py "$RESULTS" --meta || { echo "multigpu does not import: stopping"; exit 1; }
echo "== setup took $(( $(date +%s) - START ))s (SETUP_S=$SETUP_S)"

remaining() { echo $(( BUDGET_S - ($(date +%s) - START) )); }

run_step() {  # NAME CAP_S COMMAND...: run if selected and if it fits; record its outcome either way
  local name=$1 cap=$2
  shift 2
  [[ $STEPS == *" $name "* ]] || return 0
  local left=$(( $(remaining) - KILL_S ))
  if (( left < cap / 2 )) && [ "$REHEARSE" != 1 ]; then  # less than half its cap left: better run whole next call
    echo "== $name: not run ($(remaining) s left of BUDGET_S=$BUDGET_S); run it with STEPS=\"$name\" bash benchmarks/gpu/run_all.sh"
    "$PY" benchmarks/gpu/collect.py "$RESULTS" --step "$name" --status skipped --started "$(now)" \
      --note "out of time: run with STEPS=$name"
    return 0
  fi
  local limit=$(( cap < left ? cap : left )) t0 rc status started
  [ "$REHEARSE" = 1 ] && limit=300  # the rehearsal's own time is not the GPU's
  echo "== $name (at most ${limit}s, started $(now)): $*"
  started=$(now)
  t0=$(date +%s)
  # the step's own budget, for a script that shares it between child processes (sim_gpu.py)
  STEP_BUDGET_S=$limit timeout --kill-after=$KILL_S "$limit" "$@"
  rc=$?
  if (( rc == 124 || rc == 137 )); then status=timeout; elif (( rc == 0 )); then status=ok; else status=failed; fi
  local extra=(--record "$TMP/$name.json")
  [[ $name == tests_* ]] && extra=(--junit "$OUTDIR/pytest_$name.xml")
  "$PY" benchmarks/gpu/collect.py "$RESULTS" --step "$name" --status "$status" --rc "$rc" \
    --seconds "$(( $(date +%s) - t0 ))" --started "$started" "${extra[@]}"
  echo "== $name: $status (rc $rc) after $(( $(date +%s) - t0 ))s; $(remaining)s of the budget left"
}

tests_step() {  # NAME CAP_S FILES: one chunk of the GPU tests, its own JUnit (the rehearsal: budget.py collects them)
  local name=$1 cap=$2 files=$3
  [ "$REHEARSE" = 1 ] && return 0
  # shellcheck disable=SC2086
  run_step "$name" "$cap" "$PY" -m pytest -m gpu $files -v -p no:cacheprovider -rfEs --timeout 90 \
    --junitxml="$OUTDIR/pytest_$name.xml" ${PYTEST_ARGS:-}
}

bench_step() {  # NAME CAP_S SCRIPT ARGS...: a benchmark writing its record as it goes (the rehearsal: --quick)
  local name=$1 cap=$2 script=$3
  shift 3
  run_step "$name" "$cap" "$PY" "$script" --json "$TMP/$name.json" $QUICK "$@"
}

if [ "$REHEARSE" = 1 ]; then  # every step's estimate of its GPU run against its cap, the tests collected (one process)
  echo "== budget"
  timeout 300 "$PY" benchmarks/gpu/budget.py --steps ${STEPS} || BUDGET_FAILED=1
fi

# shellcheck disable=SC2086  # the *_ARGS are word lists on purpose
{
bench_step smoke  "$SMOKE_S"  benchmarks/gpu/smoke_gpu.py ${SMOKE_ARGS:-}
tests_step tests_launch "$TESTS_LAUNCH_S" "$TESTS_LAUNCH"
tests_step tests_train  "$TESTS_TRAIN_S"  "$TESTS_TRAIN"
tests_step tests_work   "$TESTS_WORK_S"   "$TESTS_WORK"
bench_step train  "$TRAIN_S"  benchmarks/gpu/train_mfu.py ${TRAIN_ARGS:-}
bench_step sim    "$SIM_S"    benchmarks/gpu/sim_gpu.py ${SIM_ARGS:-}
bench_step infer  "$INFER_S"  benchmarks/gpu/infer_gpu.py ${INFER_ARGS:-}
bench_step envs   "$ENVS_S"   benchmarks/gpu/envs_gpu.py ${ENVS_ARGS:-}
bench_step ppo    "$PPO_S"    benchmarks/gpu/ppo_gpu.py ${PPO_ARGS:-}
bench_step checkpoint "$CHECKPOINT_S" benchmarks/gpu/checkpoint_gpu.py ${CHECKPOINT_ARGS:-}
bench_step doctor "$DOCTOR_S" benchmarks/gpu/doctor_gpu.py ${DOCTOR_ARGS:-}
}

echo "== summary and Markdown ($(( $(date +%s) - START ))s so far)"
cp benchmarks/RESULTS.md "$OUTDIR/RESULTS.md"
cp README.md "$OUTDIR/README.md"
timeout --kill-after=$KILL_S "$RENDER_S" bash -c '"$1" benchmarks/gpu/collect.py "$2" --summary &&
  "$1" benchmarks/gpu/render_gpu.py "$2" --results "$3/RESULTS.md" --readme "$3/README.md"' _ "$PY" "$RESULTS" "$OUTDIR"
echo "== done in $(( $(date +%s) - START ))s (one call: at most ${CALL_S}s)"
rm -rf "$TMP"
if [ "$REHEARSE" = 1 ] && [ "$BUDGET_FAILED" = 1 ]; then
  echo "run_all.sh: rehearsal: a step's estimate of its GPU run exceeds its cap (budget lines above)" >&2
  exit 1
fi
