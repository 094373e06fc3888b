#!/usr/bin/env bash
# Issue 35's GPU session in one device call of at most 8 minutes: benchmarks/gpu_session.py
# (machine, copy bandwidth, Pallas == jnp checks, every optimizer's update and train step at
# 110M and 1B, float32 and bfloat16, in a 420 s budget) writing $OUT/gpu_session.json after
# every row, with its log and nvidia-smi beside it. Arguments go to gpu_session.py.
#
#   OUT=/tmp/gpu_session bash benchmarks/gpu_session.sh [--budget-seconds 420 ...]
#
# The package runs from this tree on PYTHONPATH, as in every earlier GPU session (the GPU
# machine's python3 has JAX with its CUDA plugin, optax and numpy; it cannot download, and
# the Pallas path needs no C++ build). Only where that import fails is the tree installed,
# offline and without dependencies.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_session}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi > "$OUT/nvidia_smi.txt" 2>&1
$PY -c "import optax4bit" 2>/dev/null || $PY -m pip install --no-deps --no-build-isolation \
  --no-index -e . > "$OUT/install.txt" 2>&1
$PY benchmarks/gpu_session.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_session.log"
