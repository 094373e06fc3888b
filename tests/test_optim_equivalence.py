"""With quantization off the optimizers are optax's; chunking changes nothing.

* Every leaf unquantized (``min_quantize_size`` huge or ``quantize_mask`` all
  False): 100 jitted steps of updates equal ``optax.adamw`` / ``optax.adam`` /
  ``optax.sgd`` to float32 rounding, with Nesterov, ``eps_root``, schedules for
  the learning rate and the weight decay, and the weight-decay ``mask``; both
  in one piece and in chunks (``chunk_size=1000``: several chunks plus a ragged
  tail, ranks 1 to 3, first axes that are no multiple of the chunk rows).
* Quantized: chunked and unchunked updates agree (codes equal except rare
  rounding ties, scales and updates to float32 rounding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax4bit

STEPS = 100
HUGE = 10**12
CHUNK = 1000

# Ranks 1, 2, 3; with CHUNK = 1000:
# "vec" 2500 -> 2 chunks + tail, "mat" 75 rows of 29 -> 34 (or 32) rows per
# chunk + ragged tail, "cube" 11 rows of 217 -> 4 rows per chunk + tail.
SHAPES = {"vec": (2500,), "mat": (75, 29), "cube": (11, 7, 31)}
UNCHUNKED_SHAPES = {"vec": (2500,), "mat": (75, 29)}


def make_params(shapes=SHAPES, dtype=jnp.float32):
  keys = jax.random.split(jax.random.key(42), len(shapes))
  return {name: jax.random.normal(k, shape, dtype) for k, (name, shape)
          in zip(keys, sorted(shapes.items()))}


def random_grads(key, params):
  """Gradients spread over a few orders of magnitude (exercises eps)."""
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(key, 2 * len(leaves))
  out = []
  for i, p in enumerate(leaves):
    g = jax.random.normal(keys[2 * i], p.shape)
    g = g * jnp.exp(1.5 * jax.random.normal(keys[2 * i + 1], p.shape))
    out.append(g.astype(p.dtype))
  return treedef.unflatten(out)


def run_side_by_side(tx_ref, tx, params, steps=STEPS, seed=0):
  """Runs both optimizers on their own params with the same gradients, all
  steps in one jitted scan; returns stacked updates and final states."""

  @jax.jit
  def run(params):
    def body(carry, key):
      p1, p2, s1, s2 = carry
      g = random_grads(key, params)
      u1, s1 = tx_ref.update(g, s1, p1)
      u2, s2 = tx.update(g, s2, p2)
      return (optax.apply_updates(p1, u1), optax.apply_updates(p2, u2), s1, s2), (u1, u2)

    init = (params, params, tx_ref.init(params), tx.init(params))
    (p1, p2, s1, s2), (u1, u2) = jax.lax.scan(
        body, init, jax.random.split(jax.random.key(seed), steps))
    return u1, u2, p1, p2, s1, s2

  return run(params)


def assert_updates_match(u_ref, u, lr_max, rtol=1e-4):
  """float32 rounding: relative 1e-4 (accumulated over 100 steps and a
  different fusion of the same arithmetic), absolute 1e-6 of the step size
  for updates that are nearly zero."""
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(u_ref)[0], jax.tree.leaves(u)):
    assert a.dtype == b.dtype and a.shape == b.shape, jax.tree_util.keystr(path)
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=rtol, atol=1e-6 * lr_max,
                               err_msg=jax.tree_util.keystr(path))


def contains_loop(tx, params) -> bool:
  """Whether the update's jaxpr has a loop (the chunked path is taken)."""
  state = tx.init(params)
  jaxpr = jax.make_jaxpr(lambda g, s: tx.update(g, s, params))(params, state)
  text = str(jaxpr)
  return "while[" in text or "scan[" in text


def all_plain(state) -> bool:
  return not any(isinstance(x, optax4bit.QuantizedArray)
                 for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(
                     x, optax4bit.QuantizedArray)))


# ----------------------------------------------------------------------------
# Unquantized == optax.


WD_MASK = {"vec": False, "mat": True}

ADAM_CASES = {
    "adamw": dict(
        ref=lambda: optax.adamw(3e-3, weight_decay=0.1, mask=WD_MASK),
        tx=lambda kw: optax4bit.adamw_4bit(3e-3, weight_decay=0.1, mask=WD_MASK, **kw),
        lr=3e-3),
    "adamw_nesterov_eps_root_schedules": dict(
        ref=lambda: optax.adamw(
            optax.warmup_cosine_decay_schedule(0.0, 1e-2, 10, STEPS), b1=0.8, b2=0.99, eps=1e-6,
            eps_root=1e-8, weight_decay=optax.linear_schedule(0.2, 0.0, STEPS), nesterov=True,
            mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
        tx=lambda kw: optax4bit.adamw_4bit(
            optax.warmup_cosine_decay_schedule(0.0, 1e-2, 10, STEPS), b1=0.8, b2=0.99, eps=1e-6,
            eps_root=1e-8, weight_decay=optax.linear_schedule(0.2, 0.0, STEPS), nesterov=True,
            mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p), **kw),
        lr=1e-2),
    "adam": dict(
        ref=lambda: optax.adam(1e-2, eps_root=1e-10),
        tx=lambda kw: optax4bit.adam_4bit(1e-2, eps_root=1e-10, **kw),
        lr=1e-2),
    "adam_nesterov_schedule": dict(
        ref=lambda: optax.adam(optax.exponential_decay(1e-2, 10, 0.9), nesterov=True),
        tx=lambda kw: optax4bit.adam_4bit(optax.exponential_decay(1e-2, 10, 0.9), nesterov=True,
                                          **kw),
        lr=1e-2),
    "adamw_factor": dict(
        ref=lambda: optax.adamw(1e-2, b1=0.85, weight_decay=0.05),
        tx=lambda kw: optax4bit.adamw_4bit_factor(1e-2, b1=0.85, weight_decay=0.05, **kw),
        lr=1e-2),
    "adamw_8bit": dict(
        ref=lambda: optax.adamw(1e-2, weight_decay=0.05),
        tx=lambda kw: optax4bit.adamw_8bit(1e-2, weight_decay=0.05, **kw),
        lr=1e-2),
    "sgd_momentum": dict(
        ref=lambda: optax.sgd(1e-2, momentum=0.9),
        tx=lambda kw: optax4bit.sgdm_4bit(1e-2, momentum=0.9, **kw),
        lr=1e-2),
    "sgd_nesterov_schedule": dict(
        ref=lambda: optax.sgd(optax.piecewise_constant_schedule(1e-2, {30: 0.1}), momentum=0.8,
                              nesterov=True),
        tx=lambda kw: optax4bit.sgdm_4bit(optax.piecewise_constant_schedule(1e-2, {30: 0.1}),
                                          momentum=0.8, nesterov=True, **kw),
        lr=1e-2),
}

# How quantization is switched off, and whether leaves are chunked. Each case
# runs in one of them (a full product would cost compile time for no coverage).
OFF_MODES = {
    "adamw": dict(min_quantize_size=HUGE),
    "adamw_nesterov_eps_root_schedules": dict(min_quantize_size=HUGE, chunk_size=CHUNK),
    "adam": dict(quantize_mask=False, chunk_size=CHUNK),
    "adam_nesterov_schedule": dict(quantize_mask=lambda p: jax.tree.map(lambda _: False, p)),
    "adamw_factor": dict(min_quantize_size=HUGE, chunk_size=CHUNK),
    "adamw_8bit": dict(quantize_mask={"vec": False, "mat": False}),
    "sgd_momentum": dict(min_quantize_size=HUGE),
    "sgd_nesterov_schedule": dict(min_quantize_size=HUGE, chunk_size=CHUNK),
}


@pytest.mark.parametrize("case", sorted(ADAM_CASES))
def test_unquantized_equals_optax(case):
  spec = ADAM_CASES[case]
  kwargs = OFF_MODES[case]
  # Ranks 1 to 3 where chunked; in one piece two leaves suffice.
  params = make_params(SHAPES if "chunk_size" in kwargs else UNCHUNKED_SHAPES)
  tx_ref, tx = spec["ref"](), spec["tx"](kwargs)
  assert all_plain(tx.init(params)), "quantization should be off for every leaf"
  if "chunk_size" in kwargs:
    assert contains_loop(tx, params), "the chunked path should be taken"
  u_ref, u, p_ref, p, s_ref, s = run_side_by_side(tx_ref, tx, params)
  assert_updates_match(u_ref, u, spec["lr"])
  for a, b in zip(jax.tree.leaves(p_ref), jax.tree.leaves(p)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
  # The float32 moments themselves match optax's.
  ref_inner, inner = s_ref[0], s[0]
  if isinstance(ref_inner, optax.ScaleByAdamState):
    for name in ("mu", "nu"):
      for a, b in zip(jax.tree.leaves(getattr(ref_inner, name)),
                      jax.tree.leaves(getattr(inner, name))):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-12)
    assert int(inner.count) == int(ref_inner.count) == STEPS
  else:  # optax.trace
    for a, b in zip(jax.tree.leaves(ref_inner.trace), jax.tree.leaves(inner.trace)):
      np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------
# Quantized: the chunked engine against a whole-tensor reference.
#
# The reference decodes the stored moments with `optax4bit.dequantize`, runs the
# float32 step on whole tensors and encodes the new moments with
# `optax4bit.quantize` (Algorithm 1 of the paper). The engine must agree
# whatever the chunking: codes equal except rare rounding ties (one table step
# apart), scales and updates to float32 rounding.

# Ranks 1 to 3, ragged tails; compile time grows with the number of leaves.
CHUNK_SHAPES = {"vec": (2500,), "mat": (75, 29), "cube": (11, 7, 31)}
B1, B2, EPS = 0.9, 0.99, 1e-8


def _decode(moment):
  if isinstance(moment, optax4bit.QuantizedArray):
    return optax4bit.dequantize(moment)
  return moment


def _encode(value, like):
  if isinstance(like, optax4bit.QuantizedArray):
    return optax4bit.quantize(value, like.spec)
  return value


def reference_adam(g, state):
  count = state.count + 1
  leaves_g, treedef = jax.tree.flatten(g)
  mus = treedef.flatten_up_to(state.mu)
  nus = treedef.flatten_up_to(state.nu)
  updates, new_mu, new_nu = [], [], []
  for gl, mu, nu in zip(leaves_g, mus, nus):
    m = (1 - B1) * gl + B1 * _decode(mu)
    v = (1 - B2) * gl * gl + B2 * _decode(nu)
    updates.append((m / (1 - B1**count)) / (jnp.sqrt(v / (1 - B2**count)) + EPS))
    new_mu.append(_encode(m, mu))
    new_nu.append(_encode(v, nu))
  return treedef.unflatten(updates), (treedef.unflatten(new_mu), treedef.unflatten(new_nu))


def reference_momentum(g, state, momentum=0.9, nesterov=True):
  leaves_g, treedef = jax.tree.flatten(g)
  traces = treedef.flatten_up_to(state.trace)
  updates, new = [], []
  for gl, tr in zip(leaves_g, traces):
    t = gl + momentum * _decode(tr)
    updates.append(gl + momentum * t if nesterov else t)
    new.append(_encode(t, tr))
  return treedef.unflatten(updates), (treedef.unflatten(new),)


def adam_case(first, second):
  def make(chunk):
    return optax4bit.scale_by_adam_4bit(B1, B2, EPS, first_moment=first, second_moment=second,
                                        min_quantize_size=0, chunk_size=chunk,
                                        implementation="jnp")
  return make, reference_adam, ("mu", "nu")


REFERENCE_CASES = {
    "adam_4bit_default": adam_case("B128/DE", "Rank-1/Linear"),
    # 8-bit codes, blocks spanning many rows, and tensor-wise scales (the
    # two-pass path: global maxima first).
    "adam_8bit_b2048_tensor": adam_case(optax4bit.QuantSpec.parse("B2048/DE", bits=8),
                                        "Tensor/Linear"),
    "momentum_nesterov": (
        lambda chunk: optax4bit.scale_by_momentum_4bit(0.9, True, recipe="paper",
                                                       min_quantize_size=0, chunk_size=chunk,
                                                       implementation="jnp"),
        reference_momentum, ("trace",)),
}


def assert_codes_close(a, b, bits, max_fraction=1e-3):
  """Codes equal except rare rounding ties, which move one table step."""
  a, b = np.asarray(a), np.asarray(b)
  if bits == 4:
    a = np.stack([a & 15, a >> 4], -1)
    b = np.stack([b & 15, b >> 4], -1)
  differ = a != b
  assert differ.mean() <= max_fraction, f"{differ.sum()} of {differ.size} codes differ"
  assert np.all(np.abs(a.astype(int) - b.astype(int))[differ] == 1)


def assert_states_close(ref, got):
  is_q = lambda x: isinstance(x, optax4bit.QuantizedArray)
  n_quantized = 0
  for q1, q2 in zip(jax.tree.leaves(ref, is_leaf=is_q), jax.tree.leaves(got, is_leaf=is_q)):
    if is_q(q1):
      n_quantized += 1
      assert is_q(q2) and q1.spec == q2.spec and q1.shape == q2.shape
      assert_codes_close(q1.codes, q2.codes, q1.spec.bits)
      assert len(q1.scales) == len(q2.scales)
      for a, b in zip(q1.scales, q2.scales):
        assert a.shape == b.shape
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=0)
    else:
      np.testing.assert_allclose(np.asarray(q2), np.asarray(q1), rtol=1e-5, atol=1e-30)
  return n_quantized


@pytest.mark.parametrize("case", sorted(REFERENCE_CASES))
def test_quantized_step_matches_whole_tensor_reference(case, chunk=CHUNK):
  make, reference, fields = REFERENCE_CASES[case]
  tx = make(chunk)
  params = make_params(CHUNK_SHAPES)
  assert contains_loop(tx, params), "the chunked path should be taken"

  # Several steps; each compares one step from the same state, and the carried
  # state is the engine's (differences cannot compound).
  @jax.jit
  def run(params):
    def body(state, key):
      g = random_grads(key, params)
      u, new = tx.update(g, state)
      u_ref, new_ref = reference(g, state)
      return new, (u, u_ref, tuple(getattr(new, f) for f in fields), new_ref)

    return jax.lax.scan(body, tx.init(params), jax.random.split(jax.random.key(1), 4))[1]

  u, u_ref, new, new_ref = run(params)
  assert_updates_match(u_ref, u, 1.0, rtol=2e-5)
  assert assert_states_close(new_ref, new) >= 3


# The chunked engine is the jnp path's (on a GPU, "auto" runs the kernels).
# SGDM and Factor (the same first-moment chunks) with -m slow: CI's time (29 s).
@pytest.mark.parametrize("make", [
    lambda c: optax4bit.adamw_4bit(1e-2, min_quantize_size=0, chunk_size=c, implementation="jnp"),
    pytest.param(lambda c: optax4bit.sgdm_4bit(1e-2, min_quantize_size=0, chunk_size=c,
                                               implementation="jnp"), marks=pytest.mark.slow),
    pytest.param(lambda c: optax4bit.adamw_4bit_factor(1e-2, min_quantize_size=0, chunk_size=c,
                                                       implementation="jnp"),
                 marks=pytest.mark.slow),
], ids=["adamw_4bit", "sgdm_4bit", "adamw_4bit_factor"])
def test_default_recipe_chunked_matches_whole_leaf(make):
  """chunk_size 1000 against the default chunking, from the same state each
  step. The default recipe rounds the first moment stochastically; its random
  numbers hash each element's index in the leaf, so chunking changes nothing
  beyond the rare float ties of the deterministic recipes. (4-bit Factor also
  slices its row/column side inputs with the chunks.)"""
  tx_a, tx_b = make(None), make(CHUNK)
  params = make_params(CHUNK_SHAPES)
  assert contains_loop(tx_b, params)
  specs = [q.spec for q in jax.tree.leaves(tx_a.init(params), is_leaf=lambda x: isinstance(
      x, optax4bit.QuantizedArray)) if isinstance(q, optax4bit.QuantizedArray)]
  assert any(spec.stochastic for spec in specs)

  @jax.jit
  def run(params):
    def body(state, key):
      g = random_grads(key, params)
      u1, s1 = tx_a.update(g, state, params)
      u2, s2 = tx_b.update(g, state, params)
      return s1, (u1, u2, s1, s2)

    return jax.lax.scan(body, tx_a.init(params), jax.random.split(jax.random.key(2), 4))[1]

  u1, u2, s1, s2 = run(params)
  assert_updates_match(u1, u2, 1e-2, rtol=2e-5)
  assert assert_states_close(s1, s2) >= 3
