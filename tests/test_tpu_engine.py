"""The TPU engine (`optax4bit.tpu`, ``implementation="tpu"``) in Pallas
interpret mode against the jnp reference on CPU: codes and scales bit for
bit, updates to float32 rounding, for every hand-written 4-bit optimizer and
`adamw_8bit`,
float32 and bfloat16, sharded and not; the leaves it covers run its kernels
(and no loop), the others the jnp engine. `tests/test_tpu_compile.py`
compiles it for a TPU."""


import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax4bit
from conftest import sharded_against_unsharded_jnp
from optax4bit import dispatch
from optax4bit._steps import FusedStep
from optax4bit.quant import array as qarray
from optax4bit.quant.spec import QuantSpec
from optax4bit.tpu import _kernel

OPTIMIZERS = {
    "adamw_4bit": lambda impl: optax4bit.adamw_4bit(1e-2, implementation=impl),
    "adamw_4bit paper": lambda impl: optax4bit.adamw_4bit(1e-2, recipe="paper",
                                                          implementation=impl),
    "adamw_4bit nesterov": lambda impl: optax4bit.adamw_4bit(1e-2, nesterov=True,
                                                             implementation=impl),
    # The default's m rounds by the stall rule: m stochastic everywhere, and
    # the rule on v too.
    "adamw_4bit m stochastic": lambda impl: optax4bit.adamw_4bit(
        1e-2, first_moment=QuantSpec.parse("B128/NF", stochastic=True), implementation=impl),
    "adamw_4bit stall v": lambda impl: optax4bit.adamw_4bit(
        1e-2, second_moment=QuantSpec.parse("Rank-1/SqrtLinear", stochastic=True, stall_only=True),
        implementation=impl),
    "adamw_4bit_factor": lambda impl: optax4bit.adamw_4bit_factor(1e-2, implementation=impl),
    "sgdm_4bit": lambda impl: optax4bit.sgdm_4bit(1e-2, momentum=0.9, implementation=impl),
    # 8-bit codes (a byte per element) in blocks of 256 (a chunk: both pieces' maximum).
    "adamw_8bit": lambda impl: optax4bit.adamw_8bit(1e-2, implementation=impl),
    "adamw_4bit m B256": lambda impl: optax4bit.adamw_4bit(
        1e-2, first_moment=QuantSpec.parse("B256/NF"), implementation=impl),
    # 4-bit and 8-bit moments in one leaf; 8-bit with rank-1 scales and without zero.
    "adamw_4bit v 8-bit DE-0": lambda impl: optax4bit.adamw_4bit(
        1e-2, second_moment=QuantSpec("block", "DE-0", bits=8, block_size=256),
        implementation=impl),
    "adamw_4bit v 8-bit rank-1": lambda impl: optax4bit.adamw_4bit(
        1e-2, second_moment=QuantSpec.parse("Rank-1/DE", bits=8, signed=False, stochastic=True),
        implementation=impl),
}


def _params(dtype, names=None):
  """Covered leaves (matrices with rows of 256 and 768 elements, few rows,
  more rows than one program's with a ragged last tile, a stack of matrices),
  a leaf the kernels decline (a last axis not a multiple of 256) and one that
  is not quantized (small)."""
  shapes = {"wide": (32, 512), "few_rows": (20, 256), "tall": (520, 256),
            "stack": (2, 32, 256), "ragged": (64, 257), "small": (64,)}
  keys = jax.random.split(jax.random.key(0), len(shapes))
  return {name: (jax.random.normal(k, shape) * 0.1).astype(dtype)
          for k, (name, shape) in zip(keys, sorted(shapes.items()))
          if names is None or name in names}


def _run(tx, params, steps=3):
  state = tx.init(params)
  update = jax.jit(tx.update)
  for t in range(steps):
    grads = jax.tree.map(
        lambda p, t=t: (jnp.sin(7.0 * p.astype(jnp.float32) + t) * 0.5).astype(p.dtype), params)
    updates, state = update(grads, state, params)
  return updates, state


def _assert_equal_to_jnp(name, dtype, ref, got):
  ref_updates, ref_state = ref
  updates, state = got
  for (path, ref_leaf), leaf in zip(jax.tree_util.tree_leaves_with_path(ref_state),
                                    jax.tree.leaves(state)):
    where = jax.tree_util.keystr(path)
    if where.endswith((".row", ".col")) or (dtype != jnp.float32 and "'small'" in where):
      # Factor's float32 factors: whole-leaf sums against the jnp engine's chunked
      # ones; the float32 moments of the unquantized leaf, with bf16 gradients: XLA
      # contracts a product into an FMA in one fusion and not in the other.
      np.testing.assert_allclose(leaf, ref_leaf, rtol=1e-4, err_msg=where)
    else:
      np.testing.assert_array_equal(np.asarray(leaf), np.asarray(ref_leaf), err_msg=where)
  for ref_leaf, leaf in zip(jax.tree.leaves(ref_updates), jax.tree.leaves(updates)):
    chex.assert_trees_all_close(leaf.astype(jnp.float32), ref_leaf.astype(jnp.float32),
                                rtol=1e-5 if dtype == jnp.float32 else 1e-2, atol=1e-7)


# The default run: the default recipe in float32 (CI's time), and Factor's per-slab side
# inputs on the stacked leaf alone (`test_factor_on_a_stack`); the rest, adamw_8bit
# included (its closed-form tables are bit for bit in tests/test_dynamic_map.py), with -m slow.
_DEFAULT_RUN = {("adamw_4bit", "f32")}
CASES = [pytest.param(name, dtype, id=f"{name}-{dtype_id}",
                      marks=() if (name, dtype_id) in _DEFAULT_RUN else pytest.mark.slow)
         for name in OPTIMIZERS for dtype, dtype_id in ((jnp.float32, "f32"),
                                                        (jnp.bfloat16, "bf16"))]


@pytest.mark.parametrize("name,dtype", CASES)
def test_codes_and_updates_equal_the_jnp_engine(name, dtype):
  params = _params(dtype)
  _assert_equal_to_jnp(name, dtype, _run(OPTIMIZERS[name]("jnp"), params),
                       _run(OPTIMIZERS[name]("tpu_interpret"), params))


def test_factor_on_a_stack():
  params = _params(jnp.float32, names=("stack",))
  name = "adamw_4bit_factor"
  _assert_equal_to_jnp(name, jnp.float32, _run(OPTIMIZERS[name]("jnp"), params),
                       _run(OPTIMIZERS[name]("tpu_interpret"), params))


@pytest.mark.parametrize("name", ["adamw_4bit", "adamw_8bit"])
def test_extreme_gradients_keep_the_jnp_engines_codes(name):
  """All-zero rows, inf and NaN gradients, huge and tiny values."""
  g = np.full((64, 512), 1e-3, np.float32)
  g[0] = 0.0
  g[1, :7] = [np.inf, -np.inf, np.nan, 3e38, -3e38, 1e-40, 1e30]
  g[2] = 1e-38
  params = {"w": jnp.zeros((64, 512))}
  grads = {"w": jnp.asarray(g)}
  out = []
  for impl in ("jnp", "tpu_interpret"):
    tx = OPTIMIZERS[name](impl)
    state = tx.init(params)
    for _ in range(2):
      updates, state = jax.jit(tx.update)(grads, state, params)
    out.append((updates, state))
  _assert_equal_to_jnp(name, jnp.float32, out[0], out[1])


@pytest.mark.parametrize("name,kernels", [("adamw_4bit", 2), ("adamw_4bit paper", 2),
                                          ("adamw_4bit_factor", 1), ("sgdm_4bit", 1),
                                          ("adamw_8bit", 1)])
def test_covered_leaves_run_the_kernels_without_a_loop(name, kernels):
  """A stats pass where a moment has rank-1 scales, then the step pass; the
  plain (unquantized) leaf runs as XLA ops, also without a loop."""
  tx = OPTIMIZERS[name]("tpu_interpret")
  params = {"w": jnp.zeros((64, 512)), "b": jnp.zeros((50,))}
  jaxpr = str(jax.make_jaxpr(tx.update)(params, tx.init(params), params))
  assert jaxpr.count("pallas_call") == kernels
  assert "while" not in jaxpr


@pytest.mark.parametrize("shape", [(64, 257), (3, 4, 600), (2, 20, 512), (5000,), (64, 16384)])
def test_uncovered_shapes_are_declined(shape):
  spec = QuantSpec.parse("B128/NF")
  moments = (qarray.zeros(shape, jnp.float32, spec),)
  step = FusedStep.heavy_ball(0.9, False)
  assert dispatch.resolve("tpu_interpret").steps.run(step, jnp.ones(shape), moments) is None


def test_other_block_sizes_are_declined():
  spec = QuantSpec.parse("B512/DE", bits=8)
  moments = (qarray.zeros((64, 512), jnp.float32, spec),)
  step = FusedStep.heavy_ball(0.9, False)
  assert dispatch.resolve("tpu_interpret").steps.run(step, jnp.ones((64, 512)), moments) is None


def test_block_rows():
  assert _kernel.block_rows(50304, 1024) == 128  # 393 programs
  assert _kernel.block_rows(50257, 1024) == 128  # the last one ragged
  assert _kernel.block_rows(1024, 4096) == 32
  assert _kernel.block_rows(12, 3072) == 12      # all rows in one program
  assert _kernel.block_rows(12 * 768, 3072, slab_rows=768) == 32
  assert _kernel.block_rows(2 * 20, 512, slab_rows=20) is None


def test_shuffle_matrices_spread_and_gather_every_byte():
  """The MXU products of the kernels, in float32 numpy: every byte value at
  every lane spreads to its two nibbles and gathers back."""
  matrices = _kernel.shuffle_matrices()  # pylint: disable=protected-access
  assert set(np.unique(matrices)) == {0.0, 1.0, 16.0}
  packed = np.arange(128 * 256).reshape(256, 128) % 256
  spread = [packed @ matrices[:, p * 128:(p + 1) * 128] for p in range(2)]
  odd = np.arange(128) % 2 == 1
  codes = [np.where(odd, s.astype(np.int64) >> 4, s.astype(np.int64) & 15) for s in spread]
  expected = np.stack([packed & 15, packed >> 4], -1).reshape(256, 256)
  np.testing.assert_array_equal(np.concatenate(codes, 1), expected)
  gathered = sum(codes[p] @ matrices[:, (2 + p) * 128:(3 + p) * 128] for p in range(2))
  np.testing.assert_array_equal(gathered, packed)


def test_auto_runs_the_tpu_engine_on_tpus():
  assert dispatch.resolve("auto", "tpu") == dispatch.resolve("tpu")
  assert dispatch.resolve("tpu").whole_leaves




@pytest.mark.slow
def test_sharded_codes_equal_the_unsharded_jnp_engine():
  """Per shard, each element hashed at its index in the global leaf and the
  rank-1 maxima reduced over the shards: the unsharded jnp engine's codes."""
  out = sharded_against_unsharded_jnp("tpu_interpret")
  for name, result in out.items():
    assert result["codes"] >= 2, (name, result)
    assert result["codes_equal"], (name, result)
    assert result["update_err"] < 1e-6, (name, result)
