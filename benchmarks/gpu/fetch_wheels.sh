#!/usr/bin/env bash
# Before every GPU call, here (a machine with git that reaches PyPI): download the wheels the GPU machine lacks
# into .whl/ (gitignored; it has no network, so they travel with the run: carry ".whl"), and write
# .whl/source.json, the commit and its files' blobs, so a device copy without .git still says what it ran
# (benchmarks/gpu/source.py). The wheels are for CPython 3.12 on x86-64; already there, they are not fetched again.
#   bash benchmarks/gpu/fetch_wheels.sh
# The GPU machine already has torch, numpy, cloudpickle, typing-extensions, pyyaml, rich, psutil, nvidia-ml-py,
# pytest(-timeout), hypothesis, matplotlib, pillow and tifffile; these are what the GPU tests and peers need beyond.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
MONAI=${MONAI:-monai==1.6.1}            # the versions the CPU tests here run against
GYMNASIUM=${GYMNASIUM:-gymnasium==1.4.0}
mkdir -p .whl
fetch() {  # SPEC...: binary wheels only, no dependencies (each needed one is named)
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl "$@"
}
fetch "$MONAI" "$GYMNASIUM" farama-notifications || { echo "fetch_wheels: monai/gymnasium download failed" >&2; exit 1; }
# envpool is optional (its peer is skipped without it) and large (~61 MB): a device run carries at most 64 MiB,
# so it goes to .whl-envpool/, to carry alone in the call that runs the envs step (ENVPOOL=1 to fetch it)
if [ "${ENVPOOL:-0}" = 1 ]; then
  mkdir -p .whl-envpool
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl-envpool envpool dm-env optree "$GYMNASIUM" farama-notifications \
    || echo "envpool: no wheel for CPython 3.12 x86-64; its peer will be skipped"
  du -sh .whl-envpool
fi
"$PY" benchmarks/gpu/source.py --write .whl/source.json || { echo "fetch_wheels: source.json not written" >&2; exit 1; }
ls -l .whl
du -sh .whl
