"""The optimizer state: stable types, configurable quantizers, true sizes.

* Shapes, dtypes and shardings of the state are the same after init and after
  updates (``jax.typeof``, ``jax.eval_shape``), and a second jitted call does
  not recompile.
* Every row of the paper's ablation is a configuration (names or
  `QuantSpec`s), and the state leaves carry those specs.
* The zero-point problem is visible with ``B128/DE`` for the second moment and
  absent with ``Rank-1/Linear``.
* ``state_nbytes`` reports the true storage.
* A jitted update with donated gradients writes every update over its
  gradient: no leaf-sized temporary.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax4bit
from optax4bit import QuantSpec


def is_quantized(x):
  return isinstance(x, optax4bit.QuantizedArray)


def make_params():
  keys = jax.random.split(jax.random.key(0), 3)
  # quantized 2-D and 3-D leaves, a quantized 1-D leaf (300 > 256) and a small one
  return {"w": jax.random.normal(keys[0], (64, 96)), "t": jax.random.normal(keys[1], (4, 6, 40)),
          "v": jax.random.normal(keys[2], (300,)), "s": jnp.ones((3,))}


def grads_like(params, seed):
  keys = jax.random.split(jax.random.key(seed), len(params))
  return {name: jax.random.normal(k, p.shape) for k, (name, p) in zip(keys, sorted(params.items()))}


OPTIMIZERS = {
    "adamw_4bit": lambda: optax4bit.adamw_4bit(1e-3, min_quantize_size=256),
    "adamw_4bit_factor": lambda: optax4bit.adamw_4bit_factor(1e-3, min_quantize_size=256),
    "sgdm_4bit": lambda: optax4bit.sgdm_4bit(1e-3, min_quantize_size=256),
    "adamw_8bit": lambda: optax4bit.adamw_8bit(1e-3, min_quantize_size=256),
    "injected_chain": lambda: optax.chain(
        optax.clip_by_global_norm(1.0),
        optax4bit.inject_hyperparams(optax4bit.adamw_4bit)(
            learning_rate=optax.linear_schedule(1e-3, 0.0, 10), min_quantize_size=256)),
}


def types_of(tree):
  return jax.tree.map(jax.typeof, tree)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_state_types_are_stable_and_no_recompilation(name):
  tx = OPTIMIZERS[name]()
  params = make_params()
  state = tx.init(params)
  assert any(is_quantized(x) for x in jax.tree.leaves(state, is_leaf=is_quantized))
  abstract = jax.eval_shape(tx.init, params)
  assert jax.tree.structure(abstract) == jax.tree.structure(state)
  assert jax.tree.map(lambda s: (s.shape, s.dtype), abstract) == jax.tree.map(
      lambda x: (x.shape, x.dtype), state)

  traces = []

  def step(params, state, grads):
    traces.append(1)  # runs only when jax traces, i.e. on a cache miss
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  jitted = jax.jit(step)
  after_update = jax.eval_shape(lambda *a: step(*a), params, state, grads_like(params, 0))[1]
  traces.clear()
  assert types_of(after_update) == types_of(jax.eval_shape(lambda: state))
  new_params, new_state = jitted(params, state, grads_like(params, 0))
  for i in range(1, 3):
    new_params, new_state = jitted(new_params, new_state, grads_like(params, i))
  assert len(traces) == 1, "the second call retraced"
  if hasattr(jitted, "_cache_size"):
    assert jitted._cache_size() == 1
  # Same structure, shapes, dtypes, weak types and shardings as after init.
  assert jax.tree.structure(new_state) == jax.tree.structure(state)
  assert types_of(new_state) == types_of(state)
  assert jax.tree.map(lambda x: x.sharding, new_state) == jax.tree.map(lambda x: x.sharding,
                                                                        state)
  assert types_of(new_params) == types_of(params)
  # Quantized leaves keep their static metadata.
  old_q = [x for x in jax.tree.leaves(state, is_leaf=is_quantized) if is_quantized(x)]
  new_q = [x for x in jax.tree.leaves(new_state, is_leaf=is_quantized) if is_quantized(x)]
  assert [(q.spec, q.shape, q.dtype) for q in old_q] == [(q.spec, q.shape, q.dtype) for q in new_q]


# ----------------------------------------------------------------------------
# The paper's ablation (Table 1 and the 8-bit / stochastic-rounding variants).

ABLATION = {
    # name: (first_moment, second_moment, factored)
    "B2048/DE + B2048/DE": ("B2048/DE", "B2048/DE", False),
    "B128/DE + B128/DE": ("B128/DE", "B128/DE", False),
    "B128/DE + B128/DE-0": ("B128/DE", "B128/DE-0", False),
    "B128/DE + Rank-1/DE-0": ("B128/DE", "Rank-1/DE-0", False),
    "B128/DE + Rank-1/Linear (4-bit AdamW)": ("B128/DE", "Rank-1/Linear", False),
    "B128/DE + factorized (4-bit Factor)": ("B128/DE", "Rank-1/Linear", True),
    "stochastic rounding": (QuantSpec.parse("B128/DE", stochastic=True),
                            QuantSpec.parse("Rank-1/Linear", stochastic=True), False),
    "8-bit": (QuantSpec.parse("B2048/DE", bits=8),
              QuantSpec.parse("Rank-1/Linear", bits=8), False),
    "QuantSpec fields": (QuantSpec("block", "DE", bits=4, signed=True, block_size=64),
                         QuantSpec("tensor", "DE-0", bits=4, signed=False), False),
}


def expected_spec(spec, signed):
  if isinstance(spec, QuantSpec):
    return spec
  return QuantSpec.parse(spec, signed=signed)


@pytest.mark.parametrize("row", sorted(ABLATION))
def test_ablation_row_is_a_configuration(row):
  first, second, factored = ABLATION[row]
  factory = optax4bit.adamw_4bit_factor if factored else optax4bit.adamw_4bit
  tx = factory(1e-3, first_moment=first, second_moment=second, min_quantize_size=0)
  params = make_params()
  state = tx.init(params)
  m_spec, v_spec = expected_spec(first, True), expected_spec(second, False)
  inner = state[0]
  for name, p in params.items():
    mu, nu = inner.mu[name], inner.nu[name]
    assert is_quantized(mu) and mu.spec == m_spec and mu.shape == p.shape
    if factored and p.ndim >= 2:
      assert isinstance(nu, optax4bit.FactoredMoment)
      assert nu.row.shape == p.shape[:-1] + (1,)
      assert nu.col.shape == p.shape[:-2] + (1, p.shape[-1])
    else:
      assert is_quantized(nu) and nu.spec == v_spec and nu.shape == p.shape
  # Buildable: the update traces, and the new state carries the same specs.
  _, new_state = jax.eval_shape(tx.update, grads_like(params, 0), state, params)
  assert jax.tree.structure(new_state) == jax.tree.structure(state)


@pytest.mark.parametrize("row", ["stochastic rounding"])
def test_ablation_rows_run(row):
  first, second, _ = ABLATION[row]
  tx = optax4bit.adamw_4bit(1e-3, first_moment=first, second_moment=second, min_quantize_size=0)
  params = make_params()
  state = tx.init(params)
  update = jax.jit(tx.update)
  for i in range(2):
    updates, state = update(grads_like(params, i), state, params)
  for leaf in jax.tree.leaves((updates, state)):
    if jnp.issubdtype(leaf.dtype, jnp.floating):
      assert bool(jnp.all(jnp.isfinite(leaf)))
  if row == "stochastic rounding":  # reproducible: same seed, same codes
    again = tx.init(params)
    for i in range(2):
      _, again = update(grads_like(params, i), again, params)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(again)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ----------------------------------------------------------------------------
# The zero-point problem.


def test_zero_point_problem_visible_with_b128_de_and_absent_with_rank1_linear():
  """With a second-moment map that has a zero code, non-zero second moments
  are stored as exact zeros; with the zero-free linear map never."""
  shapes = {"m": (48, 80), "v": (700,)}
  keys = jax.random.split(jax.random.key(1), len(shapes))
  params = {n: jnp.zeros(s) for n, s in shapes.items()}

  def grads(step):
    out = {}
    for k, (n, s) in zip(keys, sorted(shapes.items())):
      k1, k2 = jax.random.split(jax.random.fold_in(k, step))
      # Magnitudes spread over four orders: small ones fall below the first
      # non-zero entry of the DE map relative to their block's maximum.
      out[n] = jax.random.normal(k1, s) * 10.0**jax.random.uniform(k2, s, minval=-4, maxval=0)
    return out

  reference = optax.scale_by_adam()
  zero_point = optax4bit.scale_by_adam_4bit(second_moment="B128/DE", min_quantize_size=0)
  zero_free = optax4bit.scale_by_adam_4bit(second_moment="Rank-1/Linear", min_quantize_size=0)
  txs = (reference, zero_point, zero_free)
  states = tuple(tx.init(params) for tx in txs)
  assert states[1].nu["m"].spec == QuantSpec.parse("B128/DE", signed=False)

  @jax.jit
  def step(states, g):
    states = tuple(tx.update(g, state)[1] for tx, state in zip(txs, states))
    stored = [jax.tree.map(optax4bit.dequantize, s.nu, is_leaf=is_quantized) for s in states[1:]]
    return states, states[0].nu, stored

  zeros_seen = 0
  for i in range(4):
    states, true_nu, (nu_zero_point, nu_zero_free) = step(states, grads(i))
    for name in shapes:
      assert np.all(np.asarray(true_nu[name]) > 0)
      zeros_seen += int(np.sum(np.asarray(nu_zero_point[name]) == 0))
      assert np.all(np.asarray(nu_zero_free[name]) > 0), name
  total = 4 * sum(math.prod(s) for s in shapes.values())
  assert zeros_seen > 0.05 * total, (zeros_seen, total)


# ----------------------------------------------------------------------------
# state_nbytes.


def nbytes_of(tree):
  return sum(np.dtype(x.dtype).itemsize * math.prod(x.shape) for x in jax.tree.leaves(tree))


def test_state_nbytes_4bit_adamw_1024x1024():
  n = 1024
  state = optax4bit.adamw_4bit(1e-3).init({"w": jnp.zeros((n, n))})
  m_codes = n * n // 2  # 512 KiB
  m_scales = n * (n // 128) * 4  # one float32 per block of 128
  v_codes = n * n // 2
  v_rank1 = (n + n) * 4
  counts = 4 + 4  # the optimizer's step and round_params_stochastically's
  expected = m_codes + m_scales + v_codes + v_rank1 + counts
  assert optax4bit.state_nbytes(state) == expected == 1_089_544
  mu, nu = state[0].mu["w"], state[0].nu["w"]
  assert mu.codes.nbytes == m_codes and sum(s.nbytes for s in mu.scales) == m_scales
  assert nu.codes.nbytes == v_codes and sum(s.nbytes for s in nu.scales) == v_rank1
  assert expected / (n * n) <= 1.04  # SPEC.md 4
  # Works on abstract states too.
  abstract = jax.eval_shape(optax4bit.adamw_4bit(1e-3).init, {"w": jnp.zeros((n, n))})
  assert optax4bit.state_nbytes(abstract) == expected


@pytest.mark.parametrize("name,expected_bytes", [
    # m codes + m scales + row + col + the two step counts (the optimizer's and
    # round_params_stochastically's)
    ("adamw_4bit_factor", 1024 * 512 + 1024 * 8 * 4 + 1024 * 4 + 1024 * 4 + 8),
    ("sgdm_4bit", 1024 * 512 + 1024 * 8 * 4 + 8),
    # 8-bit codes and one float32 per block of 256, for both moments
    ("adamw_8bit", 2 * (1024 * 1024 + 1024 * 4 * 4) + 8),
])
def test_state_nbytes_other_optimizers(name, expected_bytes):
  state = getattr(optax4bit, name)(1e-3).init({"w": jnp.zeros((1024, 1024))})
  assert optax4bit.state_nbytes(state) == expected_bytes == nbytes_of(state)


def test_state_nbytes_counts_unquantized_leaves_and_wrappers():
  params = {"w": jnp.zeros((1024, 1024)), "b": jnp.zeros(1024)}
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   optax4bit.inject_hyperparams(optax4bit.adamw_4bit)(learning_rate=1e-3))
  state = tx.init(params)
  assert optax4bit.state_nbytes(state) == nbytes_of(state)
  # "b" (1024 <= 4096 elements) keeps two float32 moments: 8 KiB.
  q_only = optax4bit.state_nbytes(optax4bit.adamw_4bit(1e-3).init({"w": params["w"]}))
  hyper = nbytes_of(state.hyperparams) if hasattr(state, "hyperparams") else nbytes_of(
      state[1].hyperparams) + 4
  assert optax4bit.state_nbytes(state) >= q_only + 2 * 1024 * 4
  del hyper
  fp32 = nbytes_of(optax.adamw(1e-3).init(params))
  assert optax4bit.state_nbytes(state) < 0.14 * fp32


# ----------------------------------------------------------------------------
# In-place updates.

GPT_LIKE = {"embed": (1024, 256), "final_norm": (256,)} | {
    f"layer{i}": {"attn_norm": (256,), "qkv": (256, 768), "mlp_in": (256, 1024),
                  "mlp_out": (1024, 256)} for i in range(2)}


@pytest.mark.parametrize("name,make", [
    ("adamw_4bit", lambda: optax4bit.adamw_4bit(1e-3, chunk_size=2**13)),
    ("adamw_4bit jnp", lambda: optax4bit.adamw_4bit(1e-3, chunk_size=2**13, implementation="jnp")),
    ("adamw_4bit_factor", lambda: optax4bit.adamw_4bit_factor(1e-3, chunk_size=2**13)),
    ("sgdm_4bit", lambda: optax4bit.sgdm_4bit(1e-3, chunk_size=2**13)),
    ("adamw_8bit", lambda: optax4bit.adamw_8bit(1e-3, chunk_size=2**13)),
])
def test_donated_update_copies_no_gradient(name, make):
  # With gradients and state donated, every update is written over its own
  # gradient: no leaf-sized temporary. (Reading a leaf's update to order the
  # next leaf after it once made XLA copy the gradients under it.)
  params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32), GPT_LIKE,
                        is_leaf=lambda x: isinstance(x, tuple))
  tx = make()
  state = jax.eval_shape(tx.init, params)
  compiled = jax.jit(tx.update, donate_argnums=(0, 1)).lower(params, state, params).compile()
  smallest_matrix = 256 * 768 * 4
  assert compiled.memory_analysis().temp_size_in_bytes < smallest_matrix / 2, name


def test_factor_mask_keeps_unfactored_leaves_as_adamw_4bit_does():
  """``factor_mask=False`` leaves of Factor store a rank-1 4-bit second moment
  and take `adamw_4bit`'s step bit for bit (the same recipe, keys and kernel);
  the others keep Adafactor factors."""
  params = {"attn": jax.random.normal(jax.random.key(0), (64, 192)),
            "mlp": jax.random.normal(jax.random.key(1), (192, 64))}
  mask = {"attn": False, "mlp": True}
  factor = optax4bit.adamw_4bit_factor(1e-2, min_quantize_size=0, factor_mask=mask)
  adamw = optax4bit.adamw_4bit(1e-2, min_quantize_size=0)
  state, reference = factor.init(params), adamw.init(params)
  nu = state[0].nu
  assert isinstance(nu["attn"], optax4bit.QuantizedArray)
  assert nu["attn"].spec.normalization == "rank1"
  assert isinstance(nu["mlp"], optax4bit.transform.FactoredMoment)
  # Factoring saves the mlp leaf's 4-bit codes (half a byte per element); its
  # factors are the size of the rank-1 scales they replace.
  saved = optax4bit.state_nbytes(reference) - optax4bit.state_nbytes(state)
  assert abs(saved - params["mlp"].size / 2) <= 0.05 * params["mlp"].size, saved
  update, reference_update = jax.jit(factor.update), jax.jit(adamw.update)
  for t in range(3):
    grads = jax.tree.map(lambda p, t=t: jnp.sin(3.0 * p + t), params)
    updates, state = update(grads, state, params)
    expected, reference = reference_update(grads, reference, params)
    np.testing.assert_array_equal(updates["attn"], expected["attn"])
    np.testing.assert_array_equal(state[0].nu["attn"].codes, reference[0].nu["attn"].codes)
  with pytest.raises(ValueError, match="factor_mask"):
    optax4bit.adamw_4bit_factor(1e-2, factor_mask={"attn": False}).init(params)
