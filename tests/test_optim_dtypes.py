"""Parameter dtypes and non-finite gradients.

* bf16 / fp16 parameters: the math is float32, updates come back in the
  parameter dtype, the state stays float32 scales + uint8 codes and finite.
* One NaN or inf gradient element affects at most that element's stored
  moments (no spreading to its block, row or column), and the stored state
  stays finite (``optax.apply_if_finite``: see test_optim_integration.py).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax4bit


def is_quantized(x):
  return isinstance(x, optax4bit.QuantizedArray)


def make_params(dtype=None):
  """Mixed bf16 / fp16 leaves (or all ``dtype``): "w" and "v" are quantized
  (> 256 elements), "s" and "t" are kept in float32."""
  keys = jax.random.split(jax.random.key(0), 4)
  dtypes = (jnp.bfloat16, jnp.float16, jnp.bfloat16, jnp.float16) if dtype is None else (dtype,) * 4
  shapes = ((32, 96), (300,), (7,), (2, 3))
  return {name: jax.random.normal(k, shape, dt)
          for name, k, shape, dt in zip("wvst", keys, shapes, dtypes)}


def grads_like(params, seed, scale=1.0):
  keys = jax.random.split(jax.random.key(seed), len(params))
  return {name: (scale * jax.random.normal(k, p.shape)).astype(p.dtype)
          for k, (name, p) in zip(keys, sorted(params.items()))}


def to_float32(tree):
  return jax.tree.map(lambda x: x.astype(jnp.float32), tree)


def float_leaves(tree):
  return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]


def assert_rounded_once(low, exact32):
  """``low`` is float32 ``exact32`` rounded to its dtype: within half an ulp
  (plus float32 noise that can flip a rounding: one ulp at most)."""
  info = jnp.finfo(low.dtype)
  low, exact32 = np.asarray(low, np.float32), np.asarray(exact32)
  ulp = np.maximum(np.abs(exact32), float(info.tiny)) * float(info.eps)
  assert np.all(np.abs(low - exact32) <= ulp + float(info.smallest_subnormal))


# The scale_by_* transformations compute the whole update: it must be the
# float32 run's update, rounded once to the parameter dtype.
TRANSFORMS = {
    "adam_4bit": lambda: optax4bit.scale_by_adam_4bit(nesterov=True, min_quantize_size=256),
    "adam_8bit": lambda: optax4bit.scale_by_adam_4bit(
        first_moment=optax4bit.QuantSpec.parse("B256/DE", bits=8),
        second_moment=optax4bit.QuantSpec.parse("B256/DE", bits=8, signed=False),
        min_quantize_size=256),
    "factored_adam_4bit": lambda: optax4bit.scale_by_factored_adam_4bit(min_quantize_size=256),
    "momentum_4bit": lambda: optax4bit.scale_by_momentum_4bit(0.9, nesterov=True,
                                                              min_quantize_size=256),
}


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_low_precision_params_use_float32_math(name):
  tx = TRANSFORMS[name]()
  params = make_params()

  @jax.jit
  def step(state, state32, g):
    u, state = tx.update(g, state, params)
    u32, state32 = tx.update(to_float32(g), state32, to_float32(params))
    return u, u32, state, state32

  state, state32 = tx.init(params), tx.init(to_float32(params))
  for i in range(3):
    u, u32, state, state32 = step(state, state32, grads_like(params, i))
    for leaf_name, leaf in u.items():
      assert leaf.dtype == params[leaf_name].dtype, leaf_name
      assert_rounded_once(leaf, u32[leaf_name])
  # The state is the float32 run's state: same structure, dtypes and values
  # (up to float32 rounding of a differently fused computation).
  assert jax.tree.structure(state) == jax.tree.structure(state32)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(state32)):
    assert a.dtype == b.dtype and a.dtype in (jnp.float32, jnp.uint8, jnp.int32)
    if a.dtype == jnp.uint8:
      assert np.mean(np.asarray(a) != np.asarray(b)) <= 1e-3
    else:
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5)
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in float_leaves(state))
  assert any(is_quantized(x) for x in jax.tree.leaves(state, is_leaf=is_quantized))


@pytest.mark.parametrize("factory", [optax4bit.adamw_4bit])
def test_low_precision_params_aliases(factory):
  """With ``param_rounding="nearest"`` the aliases return updates in the
  parameter dtype; the learning rate (and weight decay) are applied by optax
  in that dtype, as for optax.adamw: at most a rounding or two away from the
  float32 run. (The default, ``"stochastic"``, returns float32 updates that
  land on stochastically rounded params: tests/test_param_rounding.py.)"""
  tx = factory(1e-3, min_quantize_size=256, param_rounding="nearest")
  params = make_params()

  @jax.jit
  def step(g, state, state32):
    u, state = tx.update(g, state, params)
    u32, state32 = tx.update(to_float32(g), state32, to_float32(params))
    return u, u32, state, state32

  state, state32 = tx.init(params), tx.init(to_float32(params))
  for i in range(2):
    u, u32, state, state32 = step(grads_like(params, i), state, state32)
  for leaf_name, leaf in u.items():
    assert leaf.dtype == params[leaf_name].dtype
    info = jnp.finfo(leaf.dtype)
    np.testing.assert_allclose(np.asarray(leaf, np.float32), np.asarray(u32[leaf_name]),
                               rtol=2 * float(info.eps), atol=2 * float(info.smallest_subnormal))
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in float_leaves(state))


def test_fp16_tiny_gradients_do_not_underflow():
  """g = 1e-4 squares to 1e-8, below float16's smallest subnormal (6e-8):
  fp16 math would give v = 0 and a huge step; float32 math gives Adam's first
  step of about lr."""
  params = {"w": jnp.zeros((32, 96), jnp.float16), "s": jnp.zeros((7,), jnp.float16)}
  grads = jax.tree.map(lambda p: jnp.full(p.shape, 1e-4, jnp.float16), params)
  tx = optax4bit.adam_4bit(1e-3, min_quantize_size=256, param_rounding="nearest")
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  for leaf in jax.tree.leaves(updates):
    assert leaf.dtype == jnp.float16
    np.testing.assert_allclose(np.asarray(leaf, np.float32), -1e-3, rtol=1e-2)
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in float_leaves(state))


# ----------------------------------------------------------------------------
# Non-finite gradients.

BAD_W, BAD_V = (3, 7), (5,)

NONFINITE_OPTIMIZERS = {
    "adamw_4bit": lambda: optax4bit.adamw_4bit(1e-3, min_quantize_size=0),
    "adamw_4bit_factor": lambda: optax4bit.adamw_4bit_factor(1e-3, min_quantize_size=0),
    "sgdm_4bit": lambda: optax4bit.sgdm_4bit(1e-3, min_quantize_size=0),
    "adamw_8bit": lambda: optax4bit.adamw_8bit(1e-3, min_quantize_size=0),
}


@jax.jit
def stored_moments(state):
  """Dequantized stored moments, factored second moments rebuilt densely."""
  out = {}
  for field in state._fields[1:]:
    for name, m in getattr(state, field).items():
      if is_quantized(m):
        out[(field, name)] = optax4bit.dequantize(m)
      elif isinstance(m, optax4bit.FactoredMoment):
        out[(field, name)] = m.row * m.col
      else:
        out[(field, name)] = m
  return out


@pytest.mark.parametrize("name", sorted(NONFINITE_OPTIMIZERS))
def test_nonfinite_gradient_element_does_not_spread(name):
  tx = NONFINITE_OPTIMIZERS[name]()
  params = {"w": jax.random.normal(jax.random.key(0), (32, 96)),
            "v": jax.random.normal(jax.random.key(1), (300,))}
  update = jax.jit(tx.update)
  _, state = update(grads_like(params, 0), tx.init(params), params)  # a non-trivial state
  g = grads_like(params, 1)
  clean = {"w": g["w"].at[BAD_W].set(0.0), "v": g["v"].at[BAD_V].set(0.0)}
  _, s_clean = update(clean, state, params)
  m_clean = stored_moments(s_clean[0])
  for bad_value in (np.nan, np.inf, -np.inf):
    bad = {"w": g["w"].at[BAD_W].set(bad_value), "v": g["v"].at[BAD_V].set(bad_value)}
    u_bad, s_bad = update(bad, state, params)
    m_bad = stored_moments(s_bad[0])
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in float_leaves(s_bad)), bad_value
    for key in m_clean:
      clean_m, bad_m = np.asarray(m_clean[key]), np.asarray(m_bad[key])
      other = np.ones(clean_m.shape, bool)
      if clean_m.shape == params["w"].shape:
        other[BAD_W] = False
      elif clean_m.shape == params["v"].shape:
        other[BAD_V] = False
      # Every other element is stored exactly as if the bad gradient were 0.
      np.testing.assert_array_equal(bad_m[other], clean_m[other], err_msg=f"{key} {bad_value}")
    # optax.adamw would make only that element's update non-finite; so here.
    for leaf_name, bad_index in (("w", BAD_W), ("v", BAD_V)):
      finite = np.isfinite(np.asarray(u_bad[leaf_name]))
      finite[bad_index] = True
      assert finite.all(), (leaf_name, bad_value)


COMPLEX_CASES = {
    "adam_4bit": (lambda: optax4bit.adam_4bit(1e-2, min_quantize_size=0),
                  lambda: optax.adam(1e-2)),
    "adamw_4bit": (lambda: optax4bit.adamw_4bit(1e-2, min_quantize_size=0),
                   lambda: optax.adamw(1e-2)),
    "adamw_4bit_factor": (lambda: optax4bit.adamw_4bit_factor(1e-2, min_quantize_size=0),
                          lambda: optax.adamw(1e-2)),
    "adamw_8bit": (lambda: optax4bit.adamw_8bit(1e-2, min_quantize_size=0),
                   lambda: optax.adamw(1e-2)),
    "sgdm_4bit": (lambda: optax4bit.sgdm_4bit(1e-2, momentum=0.9, min_quantize_size=0),
                  lambda: optax.sgd(1e-2, momentum=0.9)),
}


@pytest.mark.parametrize("name", sorted(COMPLEX_CASES))
def test_complex_params_train_like_optax(name):
  """Complex leaves are never quantized; their moments are complex (the
  second moment real, |g|**2), so they follow optax's step exactly."""
  make, make_reference = COMPLEX_CASES[name]
  target = {"z": jnp.array([1 + 1j, -2 + 0.5j, 3 - 1j], jnp.complex64),
            "w": (jax.random.normal(jax.random.key(0), (64, 128))
                  + 1j * jax.random.normal(jax.random.key(1), (64, 128))).astype(jnp.complex64)}
  loss = lambda p: sum(jnp.sum(jnp.abs(p[k] - target[k]) ** 2) for k in p)

  def fit(tx):
    params = jax.tree.map(jnp.zeros_like, target)
    state = tx.init(params)

    @jax.jit
    def step(params, state):
      grads = jax.tree.map(jnp.conj, jax.grad(loss)(params))  # steepest descent
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    for _ in range(300):
      params, state = step(params, state)
    return params, state

  params, state = fit(make())
  reference, _ = fit(make_reference())
  assert not any(isinstance(x, optax4bit.QuantizedArray) for x in jax.tree.leaves(
      state, is_leaf=lambda x: isinstance(x, optax4bit.QuantizedArray)))
  for k in target:
    assert params[k].dtype == jnp.complex64
    assert float(jnp.max(jnp.abs(jnp.imag(params[k])))) > 0.1, "imaginary part lost"
    np.testing.assert_allclose(np.asarray(params[k]), np.asarray(reference[k]), rtol=1e-5,
                               atol=1e-6)


@pytest.fixture
def x64():
  previous = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  try:
    yield
  finally:
    jax.config.update("jax_enable_x64", previous)


@pytest.mark.parametrize("name", ["adam_4bit", "adamw_4bit_factor"])
def test_complex128_second_moment_is_float64(x64, name):  # pylint: disable=redefined-outer-name
  """Under x64 a complex128 leaf's second moment is float64, the precision of
  |g|**2 (a float32 one broke the chunked loop's carry types)."""
  del x64
  tx = getattr(optax4bit, name)(1e-3, min_quantize_size=0)
  params = jnp.full((300,), 1 + 1j, jnp.complex128)
  state = tx.init(params)
  updates, state = jax.jit(tx.update)(params, state, params)
  updates, state = jax.jit(tx.update)(params, state, params)
  assert updates.dtype == jnp.complex128 and np.all(np.isfinite(np.asarray(updates)))
  moments = state[0]
  assert moments.nu.dtype == jnp.float64 and moments.mu.dtype == jnp.complex128


@pytest.mark.parametrize("make_4bit,make_optax,field", [
    (lambda: optax4bit.adam_4bit(0.1, mu_dtype=jnp.bfloat16, min_quantize_size=10**9,
                                 chunk_size=1024),
     lambda: optax.adam(0.1, mu_dtype=jnp.bfloat16), "mu"),
    (lambda: optax4bit.sgdm_4bit(0.1, 0.9, accumulator_dtype=jnp.bfloat16,
                                 min_quantize_size=10**9, chunk_size=1024),
     lambda: optax.sgd(0.1, 0.9, accumulator_dtype=jnp.bfloat16), "trace"),
], ids=["adam mu_dtype", "sgdm accumulator_dtype"])
def test_explicit_moment_dtype_of_unquantized_chunked_leaves(make_4bit, make_optax, field):
  # optax's signature and meaning: an unquantized moment is stored in the
  # dtype asked for. Chunked leaves once crashed (the loop carried float32).
  params = {"w": jnp.full((300, 70), 0.5, jnp.float32), "b": jnp.zeros((5,), jnp.float32)}
  tx, ref = make_4bit(), make_optax()
  state, ref_state = tx.init(params), ref.init(params)
  update = jax.jit(tx.update)
  for i in range(3):
    grads = jax.tree.map(lambda p, i=i: jnp.sin(jnp.arange(p.size, dtype=jnp.float32)
                                                 .reshape(p.shape) + i), params)
    u, state = update(grads, state)
    u_ref, ref_state = ref.update(grads, ref_state)
    chex.assert_trees_all_close(u, u_ref, rtol=2e-2, atol=1e-3)
  for leaf in jax.tree.leaves(optax.tree.get(state, field)):
    assert leaf.dtype == jnp.bfloat16


_DTYPES = ("bfloat16", "float32", "complex64", None)


# adam_4bit (adamw_4bit's chain without weight decay) and sgdm_4bit with -m
# slow: CI's time (21 s).
@pytest.mark.parametrize("opt_name", [pytest.param("sgdm_4bit", marks=pytest.mark.slow),
                                      pytest.param("adam_4bit", marks=pytest.mark.slow),
                                      "adamw_4bit"])
def test_state_dtype_matches_optax_where_it_can(opt_name):
  """optax's ``AliasTest.test_explicit_dtype`` expectations on quantized
  moments (``min_quantize_size=0``): the dtype asked for is the one a moment
  reports (a complex one keeps it complex and unquantized), except where the
  library departs on purpose: no dtype asked for gives float32, not the
  params' dtype; a complex parameter's moment stays complex (a real one
  would drop its imaginary part). The updates stay real for real params."""
  for params_dtype in _DTYPES:
    for state_dtype in _DTYPES:
      if opt_name == "sgdm_4bit":
        tx = optax4bit.sgdm_4bit(0.1, 0.9, accumulator_dtype=state_dtype, min_quantize_size=0)
        field = "trace"
      else:
        tx = getattr(optax4bit, opt_name)(0.1, mu_dtype=state_dtype, min_quantize_size=0)
        field = "mu"
      params = jnp.array([0.5, -1.0], dtype=jax.dtypes.canonicalize_dtype(params_dtype))
      state = tx.init(params)
      got = optax.tree.get(state, field).dtype
      if jnp.iscomplexobj(params):
        expected = params.dtype if state_dtype != "complex64" else jnp.complex64
      elif state_dtype is None:
        expected = jnp.float32
      else:
        expected = jnp.dtype(state_dtype)
      assert got == expected, (params_dtype, state_dtype, got)
      updates, _ = jax.jit(tx.update)(params, state, params)
      # float16/bfloat16 params: the stochastic param rounding's float32 updates, which land
      # exactly on values of the params' dtype (tests/test_param_rounding.py).
      low_precision = params.dtype in (jnp.bfloat16, jnp.float16)
      expected_update = jnp.float32 if low_precision else params.dtype
      assert updates.dtype == expected_update, (params_dtype, state_dtype, updates.dtype)
