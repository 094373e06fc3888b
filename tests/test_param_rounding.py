"""`optax4bit.round_params_stochastically` (issue 36): exact landing of
``optax.apply_updates``, unbiasedness, reproducible draws, and the places an
optimizer runs (jit, sharded, offloaded, checkpointed, ``nnx.Optimizer``)."""

from __future__ import annotations

import doctest
import os
import tempfile

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import optax4bit
from optax4bit import checkpoint
from optax4bit import param_rounding
from optax4bit.quant import maps
from conftest import assert_trees_bitwise, train_nnx_beside_functional, training_step
from subprocess_json import TESTS, run_json

DTYPES = (jnp.bfloat16, jnp.float16)


def _values_of(dtype) -> np.ndarray:
  """Every non-negative finite value of ``dtype`` in float64, ascending."""
  bits = np.arange(2**16, dtype=np.uint16)
  values = bits.view(ml_dtypes.bfloat16 if dtype == jnp.bfloat16 else np.float16)
  with np.errstate(invalid="ignore"):
    values = values.astype(np.float64)
  return np.unique(values[np.isfinite(values) & (values >= 0)])


def reference_round(total, uniform, dtype) -> np.ndarray:
  """Brute force in float64: ``|total|`` between its neighbours in the table
  of all the dtype's values, up with probability (distance to the lower one)
  / gap; past the largest finite value the gap is the last one's."""
  total = np.asarray(total, np.float64)
  table = _values_of(dtype)
  magnitude = np.abs(total)
  lower_index = np.clip(np.searchsorted(table, magnitude, side="right") - 1, 0, table.size - 1)
  lower = table[lower_index]
  upper = np.where(lower_index + 1 < table.size, table[np.minimum(lower_index + 1, table.size - 1)],
                   np.inf)
  gap = np.where(np.isinf(upper), table[-1] - table[-2], upper - lower)
  with np.errstate(invalid="ignore"):
    up = np.asarray(uniform, np.float64) < (magnitude - lower) / gap
  result = np.where(up, upper, lower)
  result = np.where(magnitude == lower, lower, result)  # exact, inf included
  result = np.where(magnitude == np.inf, np.inf, result)
  result = np.copysign(result, total) * (result != 0) + 0.0  # a zero is +0
  return np.where(np.isnan(total), np.nan, result)


def _flushes_subnormals() -> bool:
  """Whether XLA here flushes float32 subnormals to zero (XLA on CPU does)."""
  return float(jax.jit(lambda a, b: a + b)(np.float32(1e-40), np.float32(0))) == 0


def reference_new_params(params, updates, uniform, dtype) -> np.ndarray:
  """What ``optax.apply_updates`` must give: ``float32(params) +
  float32(updates)``, by numpy with XLA's flushing of float32 subnormals,
  rounded stochastically by `reference_round`."""
  flush = _flushes_subnormals()

  def f32(x):
    x = np.asarray(x, np.float32)
    return np.where(flush & (np.abs(x) < np.finfo(np.float32).tiny), np.float32(0) * x, x)

  with np.errstate(all="ignore"):
    total = f32(f32(np.asarray(params).astype(np.float32))
                + f32(np.asarray(updates).astype(np.float32)))
  return reference_round(total, uniform, dtype)


def _one_step(params, updates, seed=0):
  """``(new params, rounding update, reference new params)`` of one step of
  the transform on one leaf."""
  tx = optax4bit.round_params_stochastically(seed)
  out, _ = tx.update(updates, tx.init(params), params)
  uniform = param_rounding.leaf_uniform(seed, jnp.int32(1), 0, params.shape)
  return (optax.apply_updates(params, out), out,
          reference_new_params(params, updates, uniform, params.dtype))


def _assert_same(actual, expected, dtype):
  actual = np.asarray(actual).astype(np.float64)
  expected = np.asarray(expected, np.float64)
  both_nan = np.isnan(actual) & np.isnan(expected)
  same = (actual == expected) & (np.signbit(actual) == np.signbit(expected))
  bad = ~(same | both_nan)
  assert not bad.any(), (dtype, actual[bad][:8], expected[bad][:8])


def test_docstring_example():
  result = doctest.testmod(param_rounding, optionflags=doctest.ELLIPSIS, report=True)
  assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=["bfloat16", "float16"])
def test_lands_exactly_on_corner_cases(dtype):
  big = float(jnp.finfo(dtype).max)
  tiny = float(jnp.finfo(dtype).smallest_subnormal)
  inf, nan = np.inf, np.nan
  cases = [  # (param, update)
      (1.0, -1.5), (-2.0, 3.0), (0.5, -0.5000001),  # sign changes
      (0.0, 0.0), (-0.0, -0.0), (-0.0, 0.0), (0.0, 1e-3), (1.0, -1.0), (0.0, -1e-30),  # zeros
      (1e-3, 5.0), (-3.0, 1000.0), (1.0, 1e6), (2.0**-20, -7.0),  # update larger than param
      (tiny, tiny / 3), (tiny, 0.0), (3 * tiny, -tiny), (1.0, tiny), (tiny, 1.0),  # subnormals
      (1e-38, 1e-39), (1.2e-38, -1.1e-38), (0.0, 1e-40),  # float32 subnormal sums
      (inf, 1.0), (-inf, -5.0), (1.0, inf), (1.0, -inf), (inf, -inf), (inf, inf),  # inf
      (big, big), (big, -big), (-big, -big / 64), (big, float(jnp.finfo(jnp.float32).max)),
      (nan, 1.0), (1.0, nan), (nan, nan), (inf, nan),  # NaN
      (1.0, 1e-4), (1.0, -1e-4), (3.0, 2.0**-9), (1.0, 2.0**-8), (-1.0, -2.0**-8),  # small ones
  ]
  params = jnp.asarray(np.array([c[0] for c in cases]), dtype)
  updates = jnp.asarray(np.array([c[1] for c in cases], np.float32))
  new, rounding_update, expected = _one_step(params, updates)
  assert new.dtype == dtype and rounding_update.dtype == jnp.float32
  _assert_same(new, expected, dtype)
  # The same from updates in the params' dtype (what their optimizer returns).
  new, _, expected = _one_step(params, updates.astype(dtype))
  _assert_same(new, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bfloat16", "float16"])
def test_lands_exactly_for_every_param_value(dtype):
  """Every bit pattern of the dtype as a param, with updates of every scale,
  near-cancelling ones and ones that flip the sign; also under jit."""
  params = jnp.asarray(np.arange(2**16, dtype=np.uint16)).view(dtype)
  p32 = np.asarray(params.astype(jnp.float32))
  rng = np.random.default_rng(0)
  top = np.log10(float(jnp.finfo(dtype).max))
  with np.errstate(all="ignore"):
    update_sets = [u.astype(np.float32) for u in [
        rng.standard_normal(p32.size) * 10.0 ** rng.uniform(-45, top, p32.size),
        -p32 * (1 + rng.standard_normal(p32.size) * 1e-6),
        -p32 * (1 + rng.standard_normal(p32.size) * 1e-3),
        -2.0 * p32,
    ]]
  tx = optax4bit.round_params_stochastically(3)
  state = tx.init(params)
  update = jax.jit(tx.update)
  for i, u in enumerate(update_sets):
    u = jnp.asarray(u)
    out, state = update(u, state, params)
    eager, _ = tx.update(u, state._replace(count=state.count - 1), params)
    np.testing.assert_array_equal(np.asarray(out, np.float32),
                                  np.asarray(eager, np.float32))  # jit == eager
    uniform = param_rounding.leaf_uniform(3, jnp.int32(i + 1), 0, params.shape)
    _assert_same(optax.apply_updates(params, out),
                 reference_new_params(params, u, uniform, dtype), dtype)


def test_draws_are_the_states_hash_per_step_and_leaf():
  seed, count, leaf, shape = 5, 7, 1, (3, 40)
  step_seed = maps.rounding_seed(jax.random.fold_in(jax.random.key(seed), count))
  # `maps.stream_key`'s seed, mix32(mix32(seed) ^ stream): the params' stream, then the leaf's.
  stream = np.uint32(param_rounding._PARAM_STREAM)  # pylint: disable=protected-access
  params_seed = maps.mix32(maps.mix32(step_seed) ^ stream)
  leaf_seed = maps.mix32(maps.mix32(params_seed) ^ np.uint32(leaf))
  np.testing.assert_array_equal(
      param_rounding.leaf_uniform(seed, jnp.int32(count), leaf, shape),
      maps.hashed_uniform(leaf_seed, shape))
  # Two identical leaves, and two steps, round differently.
  params = {"a": jnp.ones((4096,), jnp.bfloat16), "b": jnp.ones((4096,), jnp.bfloat16)}
  updates = jax.tree.map(lambda p: jnp.full(p.shape, 2.0**-9, jnp.float32), params)
  tx = optax4bit.round_params_stochastically()
  first, state = tx.update(updates, tx.init(params), params)
  second, _ = tx.update(updates, state, params)
  assert not np.array_equal(first["a"], first["b"])
  assert not np.array_equal(first["a"], second["a"])
  assert int(state.count) == 1


def test_float32_leaves_pass_through_and_params_are_needed_for_bfloat16():
  params = {"w": jnp.ones((8, 8)), "h": jnp.ones((8,), jnp.bfloat16)}
  updates = {"w": jnp.full((8, 8), 1e-9), "h": jnp.full((8,), 1e-9)}
  tx = optax4bit.round_params_stochastically()
  out, _ = tx.update(updates, tx.init(params), params)
  assert out["w"] is updates["w"]
  only_f32 = {"w": updates["w"]}
  out, _ = tx.update(only_f32, tx.init(None))  # nothing to round: params not needed
  assert out is only_f32
  with pytest.raises(ValueError, match="needs `params` in update"):
    tx.update({"h": jnp.ones((8,), jnp.bfloat16)}, tx.init(None))
  with pytest.raises(ValueError, match="seed must be an int"):
    optax4bit.round_params_stochastically(seed=0.5)


def test_unbiased_mean_error_over_2_to_20_identical_small_updates():
  """2**20 params of 1.0 each get an update of 1/8 ulp: the mean rounding
  error is below 1% of one ulp (nearest rounding: 12.5%)."""
  ulp = 2.0**-7
  params = jnp.ones((2**10, 2**10), jnp.bfloat16)
  updates = jnp.full(params.shape, ulp / 8, jnp.float32)
  new, _, _ = _one_step(params, updates)
  error = np.asarray(new, np.float64) - (1.0 + ulp / 8)
  assert abs(error.mean()) < 0.01 * ulp
  assert set(np.unique(np.asarray(new, np.float64))) == {1.0, 1.0 + ulp}
  nearest = np.asarray(optax.apply_updates(params, updates), np.float64) - (1.0 + ulp / 8)
  assert abs(nearest.mean()) > 0.1 * ulp  # the control: rounding to nearest is biased


@pytest.mark.parametrize("param, update", [(1.0, -1.003), (0.01, -0.0137), (-3.0, 3.0 + 2e-4)])
def test_unbiased_where_the_update_exceeds_the_new_value(param, update):
  """Sign changes and cancellations (the new value far below the update):
  the float32 update lands on the neighbours of the sum, the mean is the
  float32 sum; rounding to nearest (from a bfloat16 update, as optax's)
  is off by more than 10 standard errors."""
  params = jnp.full((2**14,), param, jnp.bfloat16)
  updates = jnp.full(params.shape, update, jnp.float32)
  new, _, expected = _one_step(params, updates)
  _assert_same(new, expected, jnp.bfloat16)
  total = np.float64(np.float32(np.float32(params[0]) + np.float32(update)))
  values = np.asarray(new, np.float64)
  standard_error = max(np.std(values), 1e-12) / np.sqrt(values.size)
  assert abs(values.mean() - total) < 4 * standard_error + 1e-9, (values.mean(), total)
  nearest = float(optax.apply_updates(params[:1], updates[:1].astype(jnp.bfloat16))[0])
  assert abs(nearest - total) > 10 * standard_error


def test_unbiased_over_steps():
  """Many steps of updates far below one ulp (both signs): the bfloat16
  params follow the float32 sums, where rounding to nearest stands still."""
  params = jnp.asarray(np.linspace(-4, 4, 2048), jnp.bfloat16)
  tx = optax4bit.round_params_stochastically()
  state = tx.init(params)
  exact = np.asarray(params, np.float64)
  step_size = np.where(np.arange(2048) % 2 == 0, 1e-4, -3e-5)

  @jax.jit
  def step(p, s):
    u, s = tx.update(jnp.asarray(step_size, jnp.float32), s, p)
    return optax.apply_updates(p, u), s

  for _ in range(400):
    params, state = step(params, state)
    exact = exact + np.float32(step_size).astype(np.float64)
  drift = np.asarray(params, np.float64) - exact
  ulp = np.spacing(np.abs(exact).astype(np.float32).astype(ml_dtypes.bfloat16)).astype(np.float64)
  # Each step adds an independent error of at most one ulp: after 400 steps
  # the mean error is within a few sigma of 0, far from the 400 * 1e-4 that
  # rounding to nearest would lose.
  assert abs(drift.mean()) < 0.05 * ulp.mean()
  assert np.abs(drift).max() < 40 * ulp.max()


def _fit_loss(param_dtype, param_rounding, steps=1500):
  """Issue 36's plain fit: W of 256x512 (from 0) fitted to a N(0, 1) target,
  mean squared error, ``adamw_4bit(1e-3, min_quantize_size=0)``; the final
  loss (float32)."""
  target = jax.random.normal(jax.random.key(0), (256, 512))
  tx = optax4bit.adamw_4bit(1e-3, min_quantize_size=0, param_rounding=param_rounding)

  def loss(w):
    return jnp.mean((w.astype(jnp.float32) - target) ** 2)

  def step(_, carry):
    w, state = carry
    updates, state = tx.update(jax.grad(loss)(w), state, w)
    return optax.apply_updates(w, updates), state

  w = jnp.zeros(target.shape, param_dtype)
  w, _ = jax.jit(lambda w, s: jax.lax.fori_loop(0, steps, step, (w, s)))(w, tx.init(w))
  return float(loss(w))


def test_fit_bfloat16_params_reach_float32_loss_only_with_stochastic_rounding():
  """Updates of about lr = 1e-3 fall below half a bfloat16 ulp once |w| >=
  0.5: rounding to nearest stalls there (measured 4.8x float32's loss),
  stochastic rounding tracks float32 (1.005x)."""
  float32 = _fit_loss(jnp.float32, "stochastic")  # no effect on float32 params
  stochastic = _fit_loss(jnp.bfloat16, "stochastic")
  nearest = _fit_loss(jnp.bfloat16, "nearest")
  assert stochastic < 1.2 * float32, (stochastic, float32)
  assert nearest > 3 * float32, (nearest, float32)


@pytest.mark.slow  # two nnx trainings compiled: ~20 s of CPU
def test_in_chain_with_nnx_optimizer_offload_and_checkpoint():
  """A bfloat16 Flax model trained by nnx.Optimizer with the transform in an
  offloaded adamw_4bit chain; the state checkpoints and restores bitwise."""
  nnx = pytest.importorskip("flax.nnx")
  ocp = pytest.importorskip("orbax.checkpoint")

  class MLP(nnx.Module):

    def __init__(self, rngs):
      self.l1 = nnx.Linear(64, 256, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16, rngs=rngs)
      self.l2 = nnx.Linear(256, 10, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16, rngs=rngs)

    def __call__(self, x):
      return self.l2(nnx.relu(self.l1(x)))

  x = jax.random.normal(jax.random.key(1), (16, 64), jnp.bfloat16)
  y = jax.random.randint(jax.random.key(2), (16,), 0, 10)

  def make_tx():
    return optax4bit.adamw_4bit(1e-3, min_quantize_size=0)  # rounds stochastically by default

  @nnx.jit
  def train_step(model, optimizer):
    grads = nnx.grad(lambda m: optax.softmax_cross_entropy_with_integer_labels(
        m(x).astype(jnp.float32), y).mean())(model)
    optimizer.update(model, grads)

  runs = []
  for tx in (optax4bit.offload_state(make_tx()), make_tx()):
    model = MLP(nnx.Rngs(0))
    start = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    for _ in range(3):
      train_step(model, optimizer)
    runs.append((model, optimizer, start))
  (model, optimizer, start), (ref_model, ref_optimizer, _) = runs
  params, ref_params = nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param)
  for p, q, p0 in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), jax.tree.leaves(start)):
    assert p.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(p), np.asarray(q))  # offloaded == on device
    assert not np.array_equal(np.asarray(p), np.asarray(p0))
  opt_state = nnx.state(ref_optimizer.opt_state)
  with ocp.CheckpointManager(tempfile.mkdtemp()) as manager:
    checkpoint.save(manager, 0, opt_state)
    manager.wait_until_finished()
    restored = checkpoint.restore(manager, checkpoint.abstract(opt_state))
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(opt_state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), strict=True)
  counts = [c for c in jax.tree.leaves(opt_state) if c.shape == () and c.dtype == jnp.int32]
  assert counts and all(int(c) == 3 for c in counts)


def _bfloat16_params():
  k1, k2 = jax.random.split(jax.random.key(0))
  return {"w": jax.random.normal(k1, (64, 128), jnp.bfloat16),
          "b": jax.random.normal(k2, (128,), jnp.bfloat16)}


def _bfloat16_grads(step):
  keys = jax.random.split(jax.random.fold_in(jax.random.key(1), step))
  return {"w": jax.random.normal(keys[0], (64, 128), jnp.bfloat16),
          "b": jax.random.normal(keys[1], (128,), jnp.bfloat16)}


def _rounding_count(state) -> int:
  counts = [s.count for s in jax.tree.leaves(
      state, is_leaf=lambda x: isinstance(x, optax4bit.RoundParamsStochasticallyState))
            if isinstance(s, optax4bit.RoundParamsStochasticallyState)]
  assert len(counts) == 1, state
  return int(counts[0])


def test_multisteps_rounds_once_per_step_on_the_mean_gradients():
  """optax.MultiSteps over adamw_4bit with bfloat16 params: the mini-steps
  leave the params bit for bit as they are, and every k-th step equals one
  step of the inner optimizer on the mean of the k gradients (in bfloat16),
  except where MultiSteps' running float32 mean rounds to another bfloat16
  gradient and so, rarely, to the neighbouring parameter."""
  k, cycles = 4, 3
  inner = optax4bit.adamw_4bit(1e-3, min_quantize_size=0)
  tx = optax.MultiSteps(inner, every_k_schedule=k)
  step, inner_step = jax.jit(tx.update), jax.jit(inner.update)
  params = ref_params = start = _bfloat16_params()
  state, ref_state = tx.init(params), inner.init(params)
  for cycle in range(cycles):
    grads = [_bfloat16_grads(k * cycle + i) for i in range(k)]
    for i, g in enumerate(grads):
      updates, state = step(g, state, params)
      new_params = optax.apply_updates(params, updates)
      if i < k - 1:
        for u, p, q in zip(*map(jax.tree.leaves, (updates, params, new_params))):
          assert not np.any(np.asarray(u)), "a mini-step moved the params"
          np.testing.assert_array_equal(np.asarray(q), np.asarray(p), strict=True)
      params = new_params
    mean = jax.tree.map(lambda *gs: jnp.asarray(
        sum(np.asarray(g, np.float64) for g in gs) / k, jnp.bfloat16), *grads)
    ref_updates, ref_state = inner_step(mean, ref_state, ref_params)
    ref_params = optax.apply_updates(ref_params, ref_updates)
  assert _rounding_count(state.inner_opt_state) == _rounding_count(ref_state) == cycles
  for p, q, p0 in zip(*map(jax.tree.leaves, (params, ref_params, start))):
    assert p.dtype == jnp.bfloat16 and np.all(np.isfinite(np.asarray(p, np.float32)))
    p, q, p0 = (np.asarray(x, np.float64) for x in (p, q, p0))
    ulp = np.spacing(np.abs(q).astype(np.float32).astype(ml_dtypes.bfloat16)).astype(np.float64)
    differ = p != q
    # Measured: 2 of 8192 after the 2nd and 3rd step (2026-11-27, CPU).
    assert differ.mean() <= 0.002, f"{differ.sum()} of {differ.size} differ"
    assert np.all(np.abs(p - q) <= cycles * ulp), np.abs(p - q).max()
    # The params moved: 3 steps of about lr, under an ulp for many (measured with the
    # default recipe, 2026-11-27: 50% of "b" and 51% of "w" moved; 45% and 35% rounded
    # to nearest).
    assert np.mean(p != p0) > 0.3


def test_offloaded_and_checkpointed_bitwise():
  """Donated jitted steps of adamw_4bit (stochastic rounding by default) on
  bfloat16 params: offload_state gives the same bits, its moments in host
  memory; a checkpoint restores params and state (the rounding's step count
  included) bit for bit, and the step after it is the one without."""
  ocp = pytest.importorskip("orbax.checkpoint")

  def train(tx, steps):
    step = jax.jit(training_step(tx), donate_argnums=(0, 1))
    params = _bfloat16_params()
    state = tx.init(params)
    for i in range(steps):
      params, state = step(params, state, _bfloat16_grads(i))
    return params, state, step

  offloaded_params, offloaded_state, _ = train(
      optax4bit.offload_state(optax4bit.adamw_4bit(1e-3, min_quantize_size=0)), 2)
  params, state, step = train(optax4bit.adamw_4bit(1e-3, min_quantize_size=0), 2)
  assert offloaded_state[0].mu["w"].codes.sharding.memory_kind == "pinned_host"
  assert_trees_bitwise((offloaded_params, offloaded_state), (params, state))
  assert _rounding_count(state) == 2
  with ocp.CheckpointManager(tempfile.mkdtemp()) as manager:
    checkpoint.save(manager, 2, {"params": params, "opt_state": state})
    manager.wait_until_finished()
    restored = checkpoint.restore(manager, checkpoint.abstract(
        {"params": params, "opt_state": state}))
  assert_trees_bitwise((restored["params"], restored["opt_state"]), (params, state))
  resumed = step(restored["params"], restored["opt_state"], _bfloat16_grads(2))
  assert_trees_bitwise(resumed, step(params, state, _bfloat16_grads(2)))


@pytest.mark.slow  # CI's time (16 s); nnx: test_in_chain_with_nnx_optimizer_offload_and_checkpoint
def test_nnx_optimizer_bfloat16_model():
  """flax.nnx.Optimizer with adamw_4bit's default rounding on a bfloat16
  model: the same bits as the plain optax loop fed the same gradients."""
  pytest.importorskip("flax.nnx")
  tx = optax4bit.adamw_4bit(1e-2, min_quantize_size=0)
  losses, optimizer, params, state, model_params = train_nnx_beside_functional(
      tx, 3, param_dtype=jnp.bfloat16)
  assert losses[-1] < losses[0]
  assert {p.dtype for p in jax.tree.leaves(model_params)} == {jnp.dtype(jnp.bfloat16)}
  assert_trees_bitwise(model_params, params)
  import flax.nnx as nnx  # pylint: disable=import-outside-toplevel
  assert _rounding_count(nnx.as_pure(optimizer.opt_state)) == _rounding_count(state) == 3


# -m slow: CI's time (25 s, a subprocess of 8 devices).
@pytest.mark.slow
def test_sharded_matches_one_device_bitwise():
  """bfloat16 params trained by adamw_4bit (stochastic rounding by default)
  on 8 devices, with explicit and with auto mesh axes, equal the
  single-device run bit for bit. (One child process runs both modes: they
  share its start and the single-device reference.)"""
  results = run_json(os.path.join(TESTS, "param_rounding_checks.py"), "explicit", "auto")
  for mode in ("explicit", "auto"):
    result = results[mode]
    assert result["ok"], (mode, result)
    value = result["value"]
    assert value["params_diff"] == [] and value["state_diff"] == [], (mode, value)
    assert value["placed_like_state_shardings"] and value["shardings_kept"], (mode, value)
    # Only the rank-1 statistics cross devices, never a parameter-sized array.
    assert value["largest_collective"] <= 1024, (mode, value)
    assert value["param_dtypes"] == ["bfloat16"], (mode, value)
