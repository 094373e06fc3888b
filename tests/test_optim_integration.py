"""The optimizers inside optax's and Flax's machinery.

``optax.chain`` with ``clip_by_global_norm``, ``inject_hyperparams`` (ours and
optax's with ``static_args``), learning-rate schedules, ``optax.masked``,
``optax.multi_transform``, ``optax.MultiSteps``, ``optax.apply_if_finite``,
``flax.nnx.Optimizer`` and ``optax.tree.map_params``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax4bit
from conftest import train_nnx_beside_functional

LR = 1e-2


def is_quantized(x):
  return isinstance(x, optax4bit.QuantizedArray)


def make_params():
  k1, k2 = jax.random.split(jax.random.key(0))
  # "w" (8192 elements) is quantized by default, "b" (128) is not.
  return {"w": jax.random.normal(k1, (64, 128)), "b": jax.random.normal(k2, (128,))}


def grads_at(step, params):
  keys = jax.random.split(jax.random.key(100 + step), 2)
  return {name: (jax.random.normal(k, p.shape) * (1 + step)).astype(p.dtype)
          for k, (name, p) in zip(keys, sorted(params.items()))}


def assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def assert_mostly_close(a, b, rtol=1e-4, atol=1e-7, max_fraction=2e-3):
  """Close except a rare element that a rounding tie moved by one table step
  in an earlier step."""
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    if x.dtype == jnp.uint8:  # packed codes: equal, except rare ties
      bad = np.asarray(x) != np.asarray(y)
      assert bad.mean() <= 1e-3, f"{bad.sum()} of {bad.size} codes differ"
      continue
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    bad = np.abs(x - y) > atol + rtol * np.abs(x)
    assert bad.mean() <= max_fraction, f"{bad.sum()} of {bad.size} differ"


def run_steps(tx, params, steps, state=None, start=0):
  update = jax.jit(tx.update)
  state = tx.init(params) if state is None else state
  all_updates = []
  for i in range(start, start + steps):
    updates, state = update(grads_at(i, params), state, params)
    params = optax.apply_updates(params, updates)
    all_updates.append(updates)
  return params, state, all_updates


# ----------------------------------------------------------------------------


def test_chain_with_clip_by_global_norm():
  params = make_params()
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax4bit.adamw_4bit(LR))
  inner = optax4bit.adamw_4bit(LR)
  state, inner_state = tx.init(params), inner.init(params)
  g = grads_at(0, params)
  assert float(optax.tree.norm(g)) > 1.0  # clipping is active
  clipped = jax.tree.map(lambda x: x / optax.tree.norm(g), g)
  updates, state = jax.jit(tx.update)(g, state, params)
  expected, inner_state = jax.jit(inner.update)(clipped, inner_state, params)
  assert_mostly_close(updates, expected, rtol=1e-5, max_fraction=0)
  assert is_quantized(state[1][0].mu["w"])


def test_learning_rate_schedule_on_quantized_leaves():
  """The schedule is evaluated at the step count: a learning rate that drops
  to 0 after two steps gives zero updates, while the moments keep moving."""
  params = make_params()
  schedule = optax.piecewise_constant_schedule(LR, {2: 0.0})
  tx = optax4bit.adamw_4bit(schedule, min_quantize_size=0)
  _, state, updates = run_steps(tx, params, 3)
  assert float(jnp.max(jnp.abs(updates[1]["w"]))) > 0.5 * LR
  for leaf in jax.tree.leaves(updates[2]):
    assert float(jnp.max(jnp.abs(leaf))) == 0.0
  assert int(state[0].count) == 3


INJECT_START = dict(learning_rate=1e-2, b1=0.9, b2=0.999)
INJECT_CHANGED = dict(learning_rate=1e-3, b1=0.5, b2=0.9)


def run_with_injected_change(tx):
  """Two steps with INJECT_START, then two with INJECT_CHANGED set in the
  state between steps."""
  params = make_params()
  params, state, updates = run_steps(tx, params, 2)
  for name, value in INJECT_CHANGED.items():
    state.hyperparams[name] = jnp.asarray(value, state.hyperparams[name].dtype)
  _, state, more = run_steps(tx, params, 2, state=state, start=2)
  return updates + more, state


@pytest.fixture(scope="module")
def injected_reference():
  """The same with two plain optimizers, the second continuing the first's
  state."""
  params = make_params()
  params, state, updates = run_steps(
      optax4bit.adamw_4bit(min_quantize_size=0, **INJECT_START), params, 2)
  _, state, more = run_steps(optax4bit.adamw_4bit(min_quantize_size=0, **INJECT_CHANGED),
                             params, 2, state=state, start=2)
  return updates + more, state


def test_optax4bit_inject_hyperparams(injected_reference):
  tx = optax4bit.inject_hyperparams(optax4bit.adamw_4bit)(min_quantize_size=0, **INJECT_START)
  updates, state = run_with_injected_change(tx)
  ref_updates, ref_state = injected_reference
  assert set(state.hyperparams) >= {"learning_rate", "b1", "b2", "eps", "weight_decay"}
  assert "min_quantize_size" not in state.hyperparams
  assert jax.tree.structure(state.inner_state) == jax.tree.structure(ref_state)
  assert is_quantized(state.inner_state[0].mu["w"])
  assert_mostly_close(ref_updates, updates)
  # The injected learning rate (1e-2 -> 1e-3) really changed the step size;
  # with b1 0.5 and b2 0.9 a quantized Adam step can reach a few times lr.
  assert float(jnp.max(jnp.abs(updates[3]["w"]))) < 5e-3


def test_optax_inject_hyperparams_with_static_args(injected_reference):
  tx = optax.inject_hyperparams(
      optax4bit.adamw_4bit, static_args=("min_quantize_size", "chunk_size"))(
          min_quantize_size=0, **INJECT_START)
  updates, state = run_with_injected_change(tx)
  assert is_quantized(state.inner_state[0].mu["w"])
  assert_mostly_close(injected_reference[0], updates)


def test_optax_inject_hyperparams_momentum():
  tx = optax.inject_hyperparams(optax4bit.sgdm_4bit, static_args=("min_quantize_size",))(
      learning_rate=LR, momentum=0.9, min_quantize_size=0)
  params = make_params()
  state = tx.init(params)
  state.hyperparams["momentum"] = jnp.asarray(0.0)
  g = grads_at(0, params)
  updates, state = jax.jit(tx.update)(g, state, params)
  updates, state = jax.jit(tx.update)(g, state, params)
  # No momentum: the update is -lr * g.
  np.testing.assert_allclose(np.asarray(updates["w"]), -LR * np.asarray(g["w"]), rtol=1e-6)


@pytest.mark.parametrize("factory", [optax4bit.adamw_4bit, optax4bit.adam_4bit,
                                     optax4bit.adamw_4bit_factor, optax4bit.sgdm_4bit,
                                     optax4bit.adamw_8bit])
def test_optax_inject_hyperparams_without_static_args_is_a_clear_error(factory):
  tx = optax.inject_hyperparams(factory)(learning_rate=LR)
  with pytest.raises(ValueError, match="static_args"):
    state = tx.init(make_params())
    jax.jit(tx.update)(grads_at(0, make_params()), state, make_params())


def test_optax4bit_inject_hyperparams_keeps_masks_static():
  mask = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)
  tx = optax4bit.inject_hyperparams(optax4bit.adamw_4bit)(
      learning_rate=LR, min_quantize_size=0, quantize_mask=mask, mask=mask)
  state = tx.init(make_params())
  assert is_quantized(state.inner_state[0].mu["w"])
  assert not is_quantized(state.inner_state[0].mu["b"])


# ----------------------------------------------------------------------------


def test_masked():
  params = make_params()
  mask = {"w": True, "b": False}
  tx = optax.masked(optax4bit.adamw_4bit(LR, min_quantize_size=0), mask)
  alone = optax4bit.adamw_4bit(LR, min_quantize_size=0)
  state = tx.init(params)
  g = grads_at(0, params)
  updates, state = jax.jit(tx.update)(g, state, params)
  expected, _ = jax.jit(alone.update)({"w": g["w"]}, alone.init({"w": params["w"]}),
                                      {"w": params["w"]})
  np.testing.assert_array_equal(np.asarray(updates["w"]), np.asarray(expected["w"]))
  np.testing.assert_array_equal(np.asarray(updates["b"]), np.asarray(g["b"]))  # passed through
  assert is_quantized(state.inner_state[0].mu["w"])
  assert isinstance(state.inner_state[0].mu["b"], optax.MaskedNode)


def test_multi_transform():
  params = make_params()
  tx = optax.multi_transform(
      {"q": optax4bit.adamw_4bit(LR, min_quantize_size=0), "fp32": optax.adamw(LR)},
      {"w": "q", "b": "fp32"})
  state = tx.init(params)
  g = grads_at(0, params)
  updates, state = jax.jit(tx.update)(g, state, params)
  q = optax4bit.adamw_4bit(LR, min_quantize_size=0)
  expected_w, _ = jax.jit(q.update)({"w": g["w"]}, q.init({"w": params["w"]}),
                                    {"w": params["w"]})
  expected_b, _ = optax.adamw(LR).update({"b": g["b"]}, optax.adamw(LR).init({"b": params["b"]}),
                                         {"b": params["b"]})
  np.testing.assert_array_equal(np.asarray(updates["w"]), np.asarray(expected_w["w"]))
  np.testing.assert_allclose(np.asarray(updates["b"]), np.asarray(expected_b["b"]), rtol=1e-6)
  assert is_quantized(state.inner_states["q"].inner_state[0].mu["w"])


def test_multisteps():
  params = make_params()
  inner = optax4bit.adamw_4bit(LR, min_quantize_size=0)
  tx = optax.MultiSteps(inner, every_k_schedule=2)
  state = tx.init(params)
  update = jax.jit(tx.update)
  g0, g1 = grads_at(0, params), grads_at(1, params)
  u0, state = update(g0, state, params)
  for leaf in jax.tree.leaves(u0):
    assert float(jnp.max(jnp.abs(leaf))) == 0.0
  u1, state = update(g1, state, params)
  mean = jax.tree.map(lambda a, b: (a + b) / 2, g0, g1)
  expected, inner_state = jax.jit(inner.update)(mean, inner.init(params), params)
  assert_mostly_close(u1, expected, rtol=1e-5, max_fraction=0)
  # (MultiSteps averages incrementally: the mean differs in the last bit.)
  assert_mostly_close(state.inner_opt_state, inner_state, rtol=1e-5, max_fraction=0)


def test_apply_if_finite_nan_step_leaves_state_bit_identical():
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), make_params())
  # param_rounding="nearest": apply_if_finite's rejected step returns zeros of the gradients'
  # dtype, which must match the inner updates' (docs/bfloat16.md: put the stochastic
  # rounding after the wrapper; test_apply_if_finite_with_param_rounding_after_it).
  tx = optax.apply_if_finite(optax4bit.adamw_4bit(LR, min_quantize_size=0, param_rounding="nearest"),
                             max_consecutive_errors=3)
  update = jax.jit(tx.update)
  state = tx.init(params)
  _, state = update(grads_at(0, params), state, params)
  for bad_value in (jnp.nan, jnp.inf):
    bad = grads_at(1, params)
    bad["w"] = bad["w"].at[3, 5].set(bad_value)
    updates, new_state = update(bad, state, params)
    assert_trees_equal(new_state.inner_state, state.inner_state)
    assert int(new_state.notfinite_count) == 1
    for leaf in jax.tree.leaves(updates):
      assert float(jnp.max(jnp.abs(leaf))) == 0.0
  # A finite step afterwards proceeds normally.
  updates, newer = update(grads_at(1, params), new_state, params)
  assert int(newer.notfinite_count) == 0
  assert int(newer.inner_state[0].count) == 2


def test_apply_if_finite_with_param_rounding_after_it():
  """bfloat16 params, a NaN step skipped, then a finite one: the chain docs/bfloat16.md shows."""
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), make_params())
  tx = optax.chain(
      optax.apply_if_finite(optax4bit.adamw_4bit(LR, min_quantize_size=0, param_rounding="nearest"),
                            max_consecutive_errors=3),
      optax4bit.round_params_stochastically())
  update = jax.jit(tx.update)
  state = tx.init(params)
  bad = grads_at(1, params)
  bad["w"] = bad["w"].at[3, 5].set(jnp.nan)
  updates, state = update(bad, state, params)
  assert int(state[0].notfinite_count) == 1
  assert all(float(jnp.max(jnp.abs(u))) == 0.0 for u in jax.tree.leaves(updates))
  updates, state = update(grads_at(1, params), state, params)
  new_params = optax.apply_updates(params, updates)
  assert int(state[0].notfinite_count) == 0
  for p, q in zip(jax.tree.leaves(params), jax.tree.leaves(new_params)):
    assert q.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(q)))
  assert any(bool(jnp.any(p != q)) for p, q in zip(jax.tree.leaves(params), jax.tree.leaves(new_params)))


# ----------------------------------------------------------------------------
# Flax NNX.


def test_flax_nnx_optimizer():
  nnx = pytest.importorskip("flax.nnx")
  tx = optax4bit.adamw_4bit(1e-2, min_quantize_size=0)
  losses, optimizer, params, state, model_params = train_nnx_beside_functional(tx, 4)
  assert losses[-1] < losses[0]
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(model_params)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-7)
  # The optimizer state still holds quantized moments (not dicts of arrays).
  opt_state = nnx.as_pure(optimizer.opt_state)
  moments = jax.tree.leaves(opt_state[0].mu, is_leaf=is_quantized)
  assert len(moments) == 4 and all(is_quantized(m) for m in moments)
  assert int(opt_state[0].count) == 4
  assert jax.tree.structure(opt_state) == jax.tree.structure(state)


def test_flax_nnx_state_with_variables():
  """Plain optax calls on ``nnx.State`` trees that still hold Variables: the
  updates keep the Variable wrappers (so ``optax.apply_updates`` works), the
  state holds plain quantized moments."""
  nnx = pytest.importorskip("flax.nnx")
  model = nnx.Linear(64, 80, rngs=nnx.Rngs(0))
  params = nnx.state(model, nnx.Param)
  tx = optax4bit.adamw_4bit_factor(1e-2, min_quantize_size=0)
  state = tx.init(params)
  assert is_quantized(state[0].mu["kernel"])
  assert isinstance(state[0].nu["kernel"], optax4bit.FactoredMoment)
  grads = nnx.state(nnx.grad(lambda m: jnp.mean(m(jnp.ones((4, 64)))**2))(model), nnx.Param)
  assert isinstance(grads["kernel"], nnx.Variable)
  updates, new_state = jax.jit(tx.update)(grads, state, params)
  assert jax.tree.structure(updates) == jax.tree.structure(params)
  assert jax.tree.structure(new_state) == jax.tree.structure(state)
  new_params = optax.apply_updates(params, updates)
  assert isinstance(new_params["kernel"], nnx.Param)


# ----------------------------------------------------------------------------


@pytest.mark.parametrize("factory", [optax4bit.adamw_4bit, optax4bit.adamw_4bit_factor,
                                     optax4bit.sgdm_4bit, optax4bit.adamw_8bit])
def test_tree_map_params(factory):
  params = make_params()
  tx = factory(LR, min_quantize_size=0)
  state = tx.init(params)
  same = optax.tree.map_params(tx, lambda v: v, state)
  assert_trees_equal(same, state)
  # Every params-shaped part (codes, scales, factors, fp32 moments) is mapped;
  # the step counters (the optimizer's, round_params_stochastically's) are not.
  marked = optax.tree.map_params(tx, lambda v: "P", state, transform_non_params=lambda _: None)
  leaves = jax.tree.leaves(marked, is_leaf=lambda x: x is None)
  assert leaves.count(None) == 2  # the counts
  assert set(leaves) == {None, "P"}
  assert leaves.count("P") == len(jax.tree.leaves(state)) - 2
