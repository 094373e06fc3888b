"""Each optimizer's update compiled for a TPU without one (`benchmarks/tpu_compile.py`).

The real TPU compiler (libtpu, ``pip install -e .[tpu-check]``) compiles the
update of the scaled GPT-like tree (``--scale 4``: 4.8M float32 parameters,
9 leaves quantized) for a v5e device, for ``optax.adamw`` and
``adamw_4bit()`` (``"auto"``, traced for the TPU: the Pallas TPU kernels of
`optax4bit.tpu`), and the compiled step must stay within `BUDGETS`. The
README's test command installs libtpu (the ``tpu-check`` extra), so CI runs
them. The tests that compile skip without libtpu, where it cannot describe
the v5e topology, or where it does not compile the installed jax's Pallas
TPU kernels; the HLO parsing and the sentinel arithmetic are checked
everywhere. About 35 s on 2 CPU cores (mostly the adamw_4bit compile).
"""

from __future__ import annotations

import importlib.util
import os

# Before libtpu initializes (the script sets them too): no TPU metadata server,
# and no one-process-at-a-time lockfile (nothing runs on a chip here).
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import optax4bit  # noqa: E402

from conftest import benchmark_script  # noqa: E402

tpu_compile = benchmark_script("tpu_compile")

SCALE = 4
# What the compiled update of the scaled tree (v5e, float32) may cost with
# implementation="auto", which on a TPU is the Pallas TPU engine: ~15% over
# what it measured with libtpu 0.0.42.1 on 2026-11-29 (in brackets; optax.adamw:
# 15 fusions, no loop, 81.4 bytes accessed per parameter, no temp, 73.2 MiB in
# all). Tighten them as the step improves (issue 49's targets: no loop, bytes
# <= 0.7x, <= 4 fusions per quantized leaf; the jnp engine had 24 loops, the
# XLA engine 2.47x the bytes: docs/kernels.md).
BUDGETS = {
    # gathers anywhere in the optimized HLO (a table lookup per element) [0]
    "adamw_4bit gathers": 0,
    # cost_analysis "bytes accessed" plus the kernels' operands and results
    # (tpu_compile's docstring), over optax.adamw's [0.99]. It counts XLA's
    # prefetches into on-chip memory (copy-start, slice-start), whose number
    # moves with the schedule: 0.83 before the kernels were jitted per (plan,
    # step), with the same fusions, copies and kernel bytes (1.02 both at scale 1)
    "adamw_4bit bytes accessed / adamw's": 1.10,
    # memory_analysis temp bytes over the parameters' bytes [0.0]
    "adamw_4bit temp / param bytes": 0.05,
    # arguments + outputs - aliased + temp, over optax.adamw's [0.57]
    "adamw_4bit total bytes / adamw's": 0.65,
    # (entry fusions - adamw's) per quantized leaf [2.8]
    "adamw_4bit fusions per quantized leaf": 4.0,
    # Pallas TPU kernels per quantized leaf: a stats pass and a step pass [2]
    "adamw_4bit kernels per quantized leaf": 2,
    # while loops in the entry computation [0]
    "adamw_4bit while loops": 0,
    # copy instructions in the entry computation [43]
    "adamw_4bit copies": 50,
}


@pytest.fixture(scope="module")
def v5e():
  if importlib.util.find_spec("libtpu") is None:
    pytest.skip("libtpu is not installed: pip install -e .[tpu-check] to compile for TPUs")
  try:
    device = tpu_compile.tpu_device("v5e")
  except Exception as e:  # pylint: disable=broad-except  (JaxRuntimeError, RuntimeError...)
    pytest.skip(f"libtpu cannot describe {tpu_compile.TOPOLOGIES['v5e']}: {e}")
  error = tpu_compile.kernels_compile_error(device)
  if error:
    pytest.skip(error)
  return device


@pytest.fixture(scope="module")
def update_rows(v5e):
  del v5e
  return tpu_compile.run(["adamw_4bit", "adamw_4bit_factor"], implementation="auto",
                         scale=SCALE)


# --- Everywhere: the parsing and the arithmetic. ---


def test_hlo_counts_read_the_entry_computation_and_the_custom_calls():
  hlo = """HloModule m, entry_computation_layout={(f32[8]{0})->f32[8]{0}}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %f = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused
  %g = f32[8]{0} gather(%x, %i), offset_dims={}
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %f)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %c = f32[8]{0} copy(%a)
  %w = (s32[], f32[8]{0}) while(%t0), condition=%cond, body=%body
  %cc = f32[8]{0} custom-call(%s0, %s1), custom_call_target="ConcatBitcast"
  %ab = f32[8]{0} custom-call(), custom_call_target="AllocateBuffer"
  ROOT %f = f32[8]{0} fusion(%c, %cc), kind=kLoop, calls=%fused.1
}
"""
  counts = tpu_compile.hlo_counts(hlo)
  assert counts == {"fusions": 1, "while_loops": 1, "copies": 1, "gathers": 1,
                    "custom_calls": {"ConcatBitcast": 1, "AllocateBuffer": 1}}


def test_custom_call_bytes_count_a_pallas_kernels_operands_and_results():
  hlo = """HloModule m

ENTRY %main (a: f32[8,128], b: u8[8,64]) -> (f32[8,128], u8[8,64]) {
  %a = f32[8,128]{1,0} parameter(0)
  %b = u8[8,64]{1,0} parameter(1)
  %k = (f32[8,128]{1,0}, u8[8,64]{1,0}) custom-call(%a, %b), custom_call_target="tpu_custom_call"
  %c = f32[8,128]{1,0} custom-call(%a), custom_call_target="ConcatBitcast"
  ROOT %t = (f32[8,128]{1,0}, u8[8,64]{1,0}) tuple(%c, %b)
}
"""
  assert tpu_compile.hlo_text.custom_call_bytes(hlo, "tpu_custom_call") == 2 * (4096 + 512)


def _row(**kwargs):
  fields = dict(generation="v5e", setting="update", dtype="float32", optimizer="x",
                implementation="jnp", params=1000, quantized_leaves=2, fusions=10,
                while_loops=0, gathers=0, copies=0, custom_calls={}, bytes_accessed=8000.0,
                argument_bytes=100, output_bytes=100, alias_bytes=80, temp_bytes=5,
                state_bytes=0, compile_s=1.0, optimal_seconds=0.001, flops=0.0, kernel_bytes=0)
  return tpu_compile.Row(**{**fields, **kwargs})


def test_sentinels_are_separated_from_the_estimate():
  row = _row(custom_calls={"ConcatBitcast": 2, "AllocateBuffer": 9},
             optimal_seconds=-1.9990930557)
  assert row.unestimated == 2 and row.estimate_trusted
  assert row.estimated_seconds == pytest.approx(0.000906944, abs=1e-9)
  assert row.total_bytes == 125 and row.bytes_per_param == 8.0
  # A custom call of a target never seen, or a sentinel left over: no estimate.
  assert not _row(custom_calls={"SomethingNew": 1}).estimate_trusted
  assert not _row(optimal_seconds=-0.999).estimate_trusted
  base = _row(fusions=4, bytes_accessed=4000.0, optimal_seconds=0.0005)
  row = tpu_compile.compare(_row(), base)
  assert (row.bytes_ratio, row.optimal_ratio, row.fusions_per_quantized_leaf) == (2.0, 2.0, 3.0)
  assert "| 8.0 | 0.0 | 2.00 |" in tpu_compile.format_row(row)
  # A Pallas TPU kernel's bytes, which the cost model leaves out, are added.
  assert _row(kernel_bytes=2000).bytes_per_param == 10.0


def test_the_update_tree_has_the_documented_size():
  count = lambda tree: sum(x.size for x in jax.tree.leaves(tree))  # noqa: E731
  assert count(tpu_compile.update_tree()) == 76_689_408  # 76.7M
  leaves = jax.tree.leaves(tpu_compile.update_tree(SCALE))
  assert sum(x.size > tpu_compile.QUANTIZED_ABOVE for x in leaves) == 9


# --- With libtpu: compiled for a v5e. ---


def test_each_concat_bitcast_adds_minus_one_second(v5e):
  """The docstring's finding, on the installed libtpu: 4 transposes of large
  arrays compile to 2 ConcatBitcast custom calls and -2 + e seconds."""
  sharding = jax.sharding.SingleDeviceSharding(v5e)
  args = [jax.ShapeDtypeStruct((2048 + 128 * i, 4096), jnp.float32, sharding=sharding)
          for i in range(4)]
  compiled = jax.jit(lambda *a: tuple(x.T for x in a)).lower(*args).compile()
  analysis = tpu_compile.cost(compiled)
  counts = tpu_compile.hlo_counts(compiled.as_text())
  sentinels = counts["custom_calls"].get("ConcatBitcast", 0)
  assert sentinels >= 1, counts
  assert analysis["flops"] == -sentinels
  assert 0 < analysis["optimal_seconds"] + sentinels < 0.01


def test_adamw_4bit_update_is_within_its_budgets(update_rows):
  base, row, _ = update_rows
  assert (base.optimizer, row.optimizer) == ("optax.adamw", "adamw_4bit")
  assert base.gathers == 0 and base.while_loops == 0
  # The cost model has no estimate for a Pallas TPU kernel.
  assert base.estimate_trusted and not row.estimate_trusted, (base, row)
  measured = {
      "adamw_4bit gathers": row.gathers,
      "adamw_4bit bytes accessed / adamw's": row.bytes_ratio,
      "adamw_4bit temp / param bytes": row.temp_bytes / (4 * row.params),
      "adamw_4bit total bytes / adamw's": row.total_bytes / base.total_bytes,
      "adamw_4bit fusions per quantized leaf": row.fusions_per_quantized_leaf,
      "adamw_4bit kernels per quantized leaf":
          row.custom_calls.get(tpu_compile.PALLAS_TPU_TARGET, 0) / row.quantized_leaves,
      "adamw_4bit while loops": row.while_loops,
      "adamw_4bit copies": row.copies,
  }
  assert set(measured) == set(BUDGETS)
  over = {k: (v, BUDGETS[k]) for k, v in measured.items() if v > BUDGETS[k]}
  assert not over, ("over budget (measured, budget): "
                    f"{over}\n{tpu_compile.HEADER}\n{tpu_compile.format_row(base)}\n"
                    f"{tpu_compile.format_row(row)}")
  # The state is what shrinks: 4-bit moments and their scales, against 2 x 4 bytes.
  assert row.state_bytes < 0.2 * base.state_bytes


def test_factor_update_has_no_loop_and_few_fusions(update_rows):
  """Factor's update: no loop, and per quantized leaf at most issue 49's 4
  fusions beyond optax.adamw's (the factors' sums, their two EMAs, the
  parameter update) [3.8 at scale 1, 2026-11-29; 6.3 before the EMAs' sums
  were held in their layout by a barrier and the hash bases computed in the
  kernel]."""
  base, _, row = update_rows
  assert row.optimizer == "adamw_4bit_factor" and row.baseline == base.optimizer
  assert row.while_loops == 0 and row.gathers == 0
  assert row.fusions_per_quantized_leaf <= 4.0, tpu_compile.format_row(row)


@pytest.mark.parametrize("name", ["adamw_4bit_factor", "adamw_8bit"])
def test_stacked_leaves_compile_to_the_kernels(v5e, name):
  """A stack of matrices (layers under ``jax.lax.scan``), Factor's per-slab
  side inputs included, and a leaf whose rows end in a ragged program: the
  kernels lower for the TPU (interpret mode does not lower them); 8-bit
  codes, blocks of 256 and the tables' closed form included."""
  tx = tpu_compile.OPTIMIZERS[name][0]("auto")
  sharding = jax.sharding.SingleDeviceSharding(v5e)
  params = {"stack": jax.ShapeDtypeStruct((2, 64, 512), jnp.float32, sharding=sharding),
            "tall": jax.ShapeDtypeStruct((1100, 256), jnp.float32, sharding=sharding)}
  state = jax.eval_shape(tx.init, params)
  state = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), state)
  hlo = jax.jit(tx.update).lower(params, state, params).compile().as_text()
  counts = tpu_compile.hlo_counts(hlo)
  assert counts["while_loops"] == 0
  assert counts["custom_calls"].get(tpu_compile.PALLAS_TPU_TARGET, 0) >= 2


def test_sharded_update_compiles_to_the_kernels_per_shard(v5e):
  """Explicit mesh axes over the v5e slice's 4 devices: each shard runs the
  kernels (under shard_map), with no loop. (On ``Auto`` axes the engines'
  ``custom_partitioning`` does not compile without a TPU: "Custom emitter
  for CustomSPMDPartitioning not found", the jnp engine's too.)"""
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
  topology = tpu_compile._topology(tpu_compile.TOPOLOGIES["v5e"])  # pylint: disable=protected-access
  mesh = jax.sharding.Mesh(np.array(topology.devices).reshape(2, 2), ("data", "model"),
                           axis_types=(AxisType.Explicit,) * 2)
  specs = {"w": ((1024, 1024), P("data", "model")),
           "stack": ((2, 256, 1024), P(None, "data", "model"))}
  params = {k: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))
            for k, (shape, spec) in specs.items()}
  tx = optax4bit.adamw_4bit(1e-3)
  state = jax.eval_shape(tx.init, params)
  with jax.set_mesh(mesh):
    hlo = jax.jit(tx.update).lower(params, state, params).compile().as_text()
  counts = tpu_compile.hlo_counts(hlo)
  assert counts["while_loops"] == 0
  assert counts["custom_calls"].get(tpu_compile.PALLAS_TPU_TARGET, 0) >= 4


tpu_update_floor = benchmark_script("tpu_update_floor")


@pytest.mark.parametrize("name", ["adamw_4bit", "sgdm_4bit"])
@pytest.mark.parametrize("writes_params", [False, True])
def test_minimal_update_kernels_move_the_traffic_they_model(v5e, name, writes_params):
  """`tpu_update_floor`'s kernels read and write what its `Traffic` says, per
  matrix leaf ``(R, C)``: a stats pass (g and a moment's codes in, a float32
  per row out) where there is one; a step of g, every moment's codes and block
  scales (a float32 per 128) and a float32 per row in, the same codes and
  scales and the update out, the params in too where it writes them."""
  del v5e
  traffic = tpu_update_floor.TRAFFIC[name]
  codes = sum(traffic.code_bytes)
  scales = sum(traffic.block_scaled) * 4 / 128
  expected = 0
  for leaf in jax.tree.leaves(tpu_compile.update_tree(SCALE)):
    if leaf.ndim != 2:
      continue
    rows, size = leaf.shape[0], leaf.size
    if traffic.stats_moment is not None:
      expected += (4 + traffic.code_bytes[traffic.stats_moment]) * size + 4 * rows
    expected += (4 + 2 * codes + 2 * scales + 4 + 4 * writes_params) * size + 4 * rows
  _, kernels, _ = tpu_update_floor.floor_bytes(name, writes_params, scale=SCALE)
  assert kernels == expected
