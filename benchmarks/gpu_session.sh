#!/usr/bin/env bash
# Everything a short GPU lease should measure, in one call, each stage time-boxed so
# that an overrun loses one stage, not the lease. Logs go to $OUT (default /tmp/gpu_session).
#
#   OUT=/tmp/gpu_session bash benchmarks/gpu_session.sh
#
# Stages: the machine (GPU, CPU, versions); gpu_step.py's Pallas == jnp check and the
# 110M step timings; the offloaded state's device memory (synthetic and GPT steps); the
# tests; and, beside them on two other pinned cores, the C++ CPU kernel built there and
# timed on that machine's CPU (every ISA path it has).
set -u
OUT=${OUT:-/tmp/gpu_session}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
last_core=$(($(nproc) - 1))

{ nvidia-smi; lscpu; $PY -c "import sys, jax, jaxlib, optax; print(sys.version); \
print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'optax', optax.__version__); \
print(jax.devices())"; } > "$OUT/machine.txt" 2>&1

# The CPU kernel, built first (the GPU stages import the package), then timed on two
# cores of its own beside the GPU stages, so that its paired ratios compare with a
# 2-core machine. Every ISA path this CPU can run is forced in turn.
$PY setup.py build_ext --inplace > "$OUT/cpu_build.txt" 2>&1
isas=$($PY -c "import optax4bit.cpu as c; print(' '.join(c.isas() or ()))" 2>>"$OUT/cpu_build.txt")
taskset -c "$((last_core - 1)),$last_core" env JAX_PLATFORMS=cpu timeout 400 \
  $PY benchmarks/optimizer_speed.py --tree spec --rounds 30 --optimizers optax.adamw \
  adamw_4bit "adamw_4bit (jnp)" "adamw_4bit (cpu)" "adamw_4bit (paper, cpu)" \
  "adamw_4bit_factor (cpu)" "adamw_8bit (cpu)" "optax.sgd(momentum)" "sgdm_4bit (cpu)" \
  --cpu-isas $isas > "$OUT/cpu_speed.txt" 2>&1 &
gpu_cores=0-$((last_core - 2))

timeout "${GPU_STEP_SECONDS:-280}" taskset -c "$gpu_cores" $PY benchmarks/gpu_step.py \
  --skip-compile-check --sizes 100M --dtypes float32 bfloat16 \
  --optimizers optax.adamw "pallas adamw_4bit" "pallas adamw_4bit paper recipe" \
  "pallas adamw_4bit offloaded" "pallas adamw_4bit_factor" \
  --json "$OUT/gpu_step.json" > "$OUT/gpu_step.txt" 2>&1
echo "gpu_step exit $?" >> "$OUT/gpu_step.txt"

# The offloaded state's device memory, compiled for this GPU (compile only; first measured
# on an H200 on 2026-11-26, benchmarks/history/log-to-2026-11.md "Host offload on XLA:GPU").
timeout "${OFFLOAD_SECONDS:-90}" taskset -c "$gpu_cores" $PY benchmarks/offload_memory.py \
  --configs 124M > "$OUT/offload_memory.txt" 2>&1
echo "offload_memory exit $?" >> "$OUT/offload_memory.txt"

# The GPT step with and without the 4-bit state offloaded, compiled for this GPU (H200 with
# JAX 0.11.2 and an H100 target with JAX 0.10.2: benchmarks/history/log-to-2026-11.md,
# "Host offload on XLA:GPU"; the offloaded 1.5B step should plan about the state, 1.6 GB,
# less than the plain one).
timeout "${TRAINING_MEMORY_SECONDS:-150}" taskset -c "$gpu_cores" $PY benchmarks/training_memory.py \
  --skip-search --optimizers adamw_4bit adamw_4bit_offloaded --out "$OUT/training_memory.json" \
  --plot "$OUT/training_memory.png" > "$OUT/training_memory.txt" 2>&1
echo "training_memory exit $?" >> "$OUT/training_memory.txt"

# The files that ran on an H100 (2026-11-25), about 3 minutes with -n 12; the sharding and
# GSPMD files need several devices.
timeout "${PYTEST_SECONDS:-240}" taskset -c "$gpu_cores" $PY -m pytest -p no:cacheprovider \
  -n 12 -v -rfE tests/test_pallas_optim.py tests/test_optim_state.py tests/test_offload.py \
  tests/test_optim_equivalence.py tests/test_quantize_state.py tests/test_optim_dtypes.py \
  tests/test_overflow.py tests/test_checkpoint.py tests/test_optim_integration.py \
  tests/test_presets.py tests/test_recipes.py tests/test_sharding_flax.py \
  tests/test_optim_errors.py tests/test_optim_docstrings.py tests/test_diagnostics.py \
  tests/test_pallas_quant.py tests/test_properties.py tests/test_optim_convergence.py \
  tests/test_quant_array.py tests/test_quant_encode.py tests/test_cpu_kernel.py \
  tests/test_cpu_codec.py > "$OUT/pytest.txt" 2>&1
echo "pytest exit $?" >> "$OUT/pytest.txt"

# The files that had not run on a GPU before (2026-11-26): the multi-device ones spawn
# children with forced host devices; the notebooks and packaging files need tools that
# the GPU machine lacks and are left out.
timeout "${PYTEST_REST_SECONDS:-200}" taskset -c "$gpu_cores" $PY -m pytest -p no:cacheprovider \
  -n 12 -v -rfE tests/test_pallas_sharded.py tests/test_sharding.py tests/test_gspmd_auto.py \
  tests/test_multihost.py tests/test_examples.py tests/test_tpu_export.py \
  tests/test_gpu_compile.py tests/test_optax_alias_suite.py tests/test_quant_tables.py \
  tests/test_architecture.py > "$OUT/pytest_rest.txt" 2>&1
echo "pytest exit $?" >> "$OUT/pytest_rest.txt"

wait
