#!/usr/bin/env bash
# The whole GPU check and every GPU benchmark in one command (issue #14); see benchmarks/gpu/README.md.
#
#   bash benchmarks/gpu/run_all.sh [OUTDIR]               # OUTDIR default: $OUT, else gpu_out/
#   STEPS="sim infer envs doctor" bash benchmarks/gpu/run_all.sh   # only these steps (a second call)
#
# Writes OUTDIR/gpu_results.json (rewritten after every step, so a run cut short keeps what it finished),
# OUTDIR/gpu_run.log (everything printed) and OUTDIR/pytest_gpu.xml. Steps, in this order, each bounded:
#   tests  (pytest -m gpu tests/gpu)   train (train_mfu.py, NVML sampler inside)   sim (sim_gpu.py)
#   infer  (infer_gpu.py)              envs  (envs_gpu.py)                          doctor (doctor_gpu.py)
# Knobs (environment): BUDGET_S whole call in seconds (default 540: one 10-minute device command);
#   TESTS_S TRAIN_S SIM_S INFER_S ENVS_S DOCTOR_S per-step caps; PYTEST_ARGS TRAIN_ARGS SIM_ARGS INFER_ARGS
#   ENVS_ARGS DOCTOR_ARGS extra arguments; PYTHON (default python3); INSTALL=0 installs nothing (src/ on
#   PYTHONPATH: for a development machine). A step that no longer fits the budget is
#   recorded as skipped, with the STEPS= line that runs it (a step needs half its cap left to start).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUTDIR=${1:-${OUT:-gpu_out}}
mkdir -p "$OUTDIR"
RESULTS=$OUTDIR/gpu_results.json
LOG=$OUTDIR/gpu_run.log
exec > >(tee -a "$LOG") 2>&1
START=$(date +%s)
BUDGET_S=${BUDGET_S:-540}
PY=${PYTHON:-python3}
STEPS=" ${STEPS:-tests train sim infer envs doctor} "
export PYTHONUNBUFFERED=1
TMP=$(mktemp -d)
rm -f "$RESULTS"

echo "== machine ($(date -u +%FT%TZ))"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1 || echo "nvidia-smi: not available"
"$PY" -c "import torch; print('torch', torch.__version__, '| CUDA', torch.version.cuda, '| GPUs', [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())], '| NCCL', torch.cuda.nccl.version() if torch.cuda.is_available() else None)"
echo "cores: $(nproc), python: $("$PY" -V 2>&1)"

echo "== install"
if [ "${INSTALL:-1}" = 0 ]; then  # INSTALL=0: leave this Python alone (a development machine); use src/ as it is
  export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
else
  for folder in .whl .whl-envpool; do  # wheels carried from a machine with network (fetch_wheels.sh)
    if compgen -G "$folder/*.whl" >/dev/null; then
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$folder"/*.whl && echo "installed $(ls "$folder" | tr '\n' ' ')into /tmp/site" || echo "wheels in $folder: install failed"
    fi
  done
  [ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  if "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$TMP/pip.log" 2>&1; then
    echo "multigpu: installed with pip install --no-deps -e ."
  else
    echo "multigpu: pip install -e . failed ($(tail -n 1 "$TMP/pip.log")); using PYTHONPATH=src"
    export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
  fi
fi
"$PY" -c "import multigpu; print('multigpu', multigpu.__version__ if hasattr(multigpu, '__version__') else '', 'from', multigpu.__file__)" \
  || { echo "multigpu does not import: stopping"; exit 1; }
"$PY" -c "import monai, gymnasium; print('monai', monai.__version__, '| gymnasium', gymnasium.__version__)" 2>&1 | tail -n 1
"$PY" benchmarks/gpu/collect.py "$RESULTS" --meta

remaining() { echo $(( BUDGET_S - ($(date +%s) - START) )); }

run_step() {  # NAME CAP_S COMMAND...: run if selected and if it fits; record its outcome either way
  local name=$1 cap=$2
  shift 2
  [[ $STEPS == *" $name "* ]] || return 0
  local left=$(( $(remaining) - 20 ))
  if (( left < cap / 2 )); then  # less than half its cap left: better run whole in the next call
    echo "== $name: not run ($(remaining) s left of BUDGET_S=$BUDGET_S); run it with STEPS=\"$name\" bash benchmarks/gpu/run_all.sh"
    "$PY" benchmarks/gpu/collect.py "$RESULTS" --step "$name" --status skipped --note "out of time: run with STEPS=$name"
    return 0
  fi
  local limit=$(( cap < left ? cap : left )) t0 rc status
  echo "== $name (at most ${limit}s): $*"
  t0=$(date +%s)
  timeout --kill-after=15 "$limit" "$@"
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
run_step tests  "${TESTS_S:-300}"  "$PY" -m pytest -m gpu tests/gpu -v -p no:cacheprovider -rfEs --timeout 150 \
                                   --junitxml="$OUTDIR/pytest_gpu.xml" ${PYTEST_ARGS:-}
run_step train  "${TRAIN_S:-220}"  "$PY" benchmarks/gpu/train_mfu.py --json "$TMP/train.json" ${TRAIN_ARGS:-}
run_step sim    "${SIM_S:-150}"    "$PY" benchmarks/gpu/sim_gpu.py --json "$TMP/sim.json" ${SIM_ARGS:-}
run_step infer  "${INFER_S:-120}"  "$PY" benchmarks/gpu/infer_gpu.py --json "$TMP/infer.json" ${INFER_ARGS:-}
run_step envs   "${ENVS_S:-120}"   "$PY" benchmarks/gpu/envs_gpu.py --json "$TMP/envs.json" ${ENVS_ARGS:-}
run_step doctor "${DOCTOR_S:-90}"  "$PY" benchmarks/gpu/doctor_gpu.py --json "$TMP/doctor.json" ${DOCTOR_ARGS:-}
}

echo "== summary ($(( $(date +%s) - START ))s in all)"
"$PY" benchmarks/gpu/collect.py "$RESULTS" --summary
rm -rf "$TMP"
