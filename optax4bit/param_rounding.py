"""Stochastic rounding of bfloat16 and float16 parameters (issue 36).

Rounding ``params + updates`` to the nearest bfloat16 loses every update
below half an ulp of the parameter: a parameter of 1.0 ignores any step
smaller than 2**-9. `round_params_stochastically` rounds the float32 sum
up or down at random, with the probability that makes the expected new
parameter equal the float32 sum, and returns the float32 update that lands
``optax.apply_updates`` exactly there.

Its random numbers are those of the states' stochastic rounding
(`optax4bit.quant.maps.hashed_uniform`): a hash of the step, the leaf and the
element's flat index in the global leaf, so that single-device, chunked and
sharded runs draw the same number for the same element.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax4bit.quant import maps

__all__ = ["RoundParamsStochasticallyState", "round_params_stochastically"]

# The dtypes whose sums are rounded; any other leaf (float32, float64,
# complex, integer) passes through.
ROUNDED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

# The parameters' stream of the step's key (`maps.stream_key`), whose stream
# ``leaf`` keys a leaf: their draws are independent of the moments' (the
# step key's streams 0, 1, ...).
_PARAM_STREAM = 0x70617261


class RoundParamsStochasticallyState(NamedTuple):
  """State of `round_params_stochastically`: the step count that keys the
  draws."""
  count: jax.Array


def _bits(x: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(x, jnp.uint16)


def _from_bits(bits: jax.Array, dtype) -> jax.Array:
  return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), dtype)


def _neighbours(x: jax.Array, dtype):
  """``(down, up, p)``: the values of ``dtype`` either side of float32 ``x``
  (towards and away from zero; both ``x`` where it is one of them, infinities
  included) and the probability ``p`` of ``up`` that makes the expectation
  ``x``. Past the largest finite value the gap is that of the last binade,
  so ``up`` is ``inf``, with probability ``(|x| - max) / ulp(max)``. A zero
  is ``+0``; NaN gives NaN."""
  magnitude = jnp.abs(x)
  nearest = magnitude.astype(dtype)
  nearest_bits = _bits(nearest)
  exact = nearest.astype(jnp.float32) == magnitude
  # Bit patterns of non-negative floats are ordered like their values, so
  # +-1 on them steps to the neighbouring magnitude (into inf past the max).
  lower_bits = jnp.where(nearest.astype(jnp.float32) > magnitude, nearest_bits - 1, nearest_bits)
  upper_bits = jnp.where(exact, nearest_bits, lower_bits + 1)
  # Near float32's smallest normal the differences below are subnormal, which
  # XLA on CPU flushes to zero: a power of two scales them up, exactly.
  scale = jnp.where(magnitude < 2.0**-80, np.float32(2.0**40), np.float32(1))

  def scaled(bits):
    return _from_bits(bits, dtype).astype(jnp.float32) * scale

  lower, upper = scaled(lower_bits), scaled(lower_bits + 1)
  gap = jnp.where(jnp.isinf(upper), lower - scaled(jnp.maximum(lower_bits, 1) - 1), upper - lower)
  # (magnitude - lower) is exact (Sterbenz, or lower == 0) and gap a power
  # of two: the probability is exact in float32.
  probability = jnp.where(exact, 0, (magnitude * scale - lower) / gap)

  def signed(bits):
    value = _from_bits(bits, dtype)
    value = jnp.where((x < 0) & (bits != 0), -value, value)
    return jnp.where(jnp.isnan(x), x.astype(dtype), value)

  return signed(lower_bits), signed(upper_bits), probability


def round_stochastically(x: jax.Array, dtype, uniform: jax.Array) -> jax.Array:
  """float32 ``x`` rounded to ``dtype`` (bfloat16 or float16): to the
  neighbour away from zero when ``uniform`` (U[0, 1) draws shaped like ``x``)
  is below the distance to the one towards zero, in units of the gap.
  Unbiased: ``E[result] = x`` (see `_neighbours` for the edge cases)."""
  if jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16):
    return _round_to_bfloat16_stochastically(x, uniform)
  down, up, probability = _neighbours(x, dtype)
  return jnp.where(uniform < probability, up, down)


def _round_to_bfloat16_stochastically(x: jax.Array, uniform: jax.Array) -> jax.Array:
  """`round_stochastically` to bfloat16 on the bits, the same decisions as
  `_neighbours` in fewer operations (an elementwise pass that every step of
  a bfloat16 model pays). bfloat16 is float32's upper 16 bits: cutting the
  lower 16 rounds ``|x|`` towards zero, adding one to the upper half steps
  to the neighbour away from zero (into ``inf`` past the largest finite
  value), and the lower 16 bits over 2**16 are the distance to the lower
  neighbour in units of the gap (subnormals included)."""
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  probability = (bits & np.uint32(0xFFFF)).astype(jnp.float32) * np.float32(2.0**-16)
  upper = (bits >> np.uint32(16)) + (uniform < probability).astype(jnp.uint32)
  upper = jnp.where((upper & np.uint32(0x7FFF)) != 0, upper, np.uint32(0))  # a zero is +0
  rounded = _from_bits(upper, jnp.bfloat16)
  return jnp.where(jnp.isnan(x), x.astype(jnp.bfloat16), rounded)


def _rounded_float32(x: jax.Array, dtype) -> jax.Array:
  """float32 ``x`` rounded to nearest in ``dtype``, kept in float32: XLA may
  keep a bfloat16 intermediate in float32 ("excess precision") in one
  program and not another (a sharded one fuses differently); results must
  not depend on that. ``reduce_precision`` flushes the dtype's subnormals,
  so float16's are rounded on their own grid."""
  info = jnp.finfo(dtype)
  rounded = jax.lax.reduce_precision(x, info.nexp, info.nmant)
  tiny = float(info.smallest_subnormal)
  if tiny > float(jnp.finfo(jnp.float32).tiny):  # float16: subnormals are float32 normals
    subnormal = jnp.round(x * np.float32(1 / tiny)) * np.float32(tiny)
    rounded = jnp.where(jnp.abs(x) < float(info.smallest_normal), subnormal, rounded)
  return rounded


def landing_update(params: jax.Array, rounded: jax.Array) -> jax.Array:
  """float32 update with which ``optax.apply_updates`` (``params + update``
  in float32, then cast to the params' dtype) gives exactly ``rounded``.

  ``rounded - params`` is exact in float32 unless one of them is more than
  2**16 times the other; if ``rounded`` is the larger, the float32 error is
  far below half its ulp and the cast still lands on it; ``params`` cannot be
  the larger then, since a float32 sum that small cancels exactly (Sterbenz)
  into a value with at most 8 significant bits, which is kept as it is. Where
  they are equal (infinities included) the update is 0. (An update in the
  params' dtype could not land exactly on a sign change or a cancellation.)
  """
  old = _as_float32(params)
  new = rounded.astype(jnp.float32)
  return jnp.where(new == old, jnp.zeros_like(new), new - old)


def _as_float32(x: jax.Array) -> jax.Array:
  """``x`` in float32, rounded to its own dtype first (see `_rounded_float32`)."""
  if x.dtype in ROUNDED_DTYPES:
    return _rounded_float32(x.astype(jnp.float32), x.dtype)
  return x.astype(jnp.float32)


def leaf_uniform(seed: int, count: jax.Array, leaf: int, shape: tuple) -> jax.Array:
  """The U[0, 1) draws of leaf ``leaf`` at step ``count``: the states' hash
  (`maps.hashed_uniform` of the flat index in the global leaf) under a key
  derived like their keys, on a stream of its own."""
  key = maps.stream_key(jax.random.fold_in(jax.random.key(seed), count), _PARAM_STREAM)
  key = maps.stream_key(key, leaf)
  return maps.hashed_uniform(maps.rounding_seed(key), tuple(shape))


def _check_seed(seed) -> None:
  # An integer array is accepted too: optax.inject_hyperparams passes every
  # number as one, and the seed only feeds jax.random.key.
  integer = isinstance(seed, numbers.Integral) and not isinstance(seed, bool)
  array = (hasattr(seed, "dtype") and jnp.issubdtype(seed.dtype, jnp.integer)
           and jnp.ndim(seed) == 0)
  if not (integer or array):
    raise ValueError(f"seed must be an int (or a scalar integer array), got {seed!r}.")


def round_params_stochastically(seed: int = 0) -> optax.GradientTransformation:
  """Rounds ``params + updates`` stochastically to bfloat16/float16 params.

  Goes last in a chain (it needs ``params`` in ``update``). For each leaf
  whose parameter is bfloat16 or float16 it computes ``s = float32(params)
  + float32(updates)``, rounds ``s`` to the parameter's dtype up or down
  with probabilities that make the expected result ``s`` (so updates far
  below one ulp still move the parameter on average), and returns the
  float32 update ``u'`` with which ``optax.apply_updates(params, u')`` is
  exactly that rounded value (an update in the parameter's dtype could not
  land exactly on a sign change or a cancellation; in a jitted step XLA fuses
  it into the addition). Other leaves (float32 ...) pass through unchanged.
  Rounding to nearest instead stalls: a bfloat16 parameter of 1.0 ignores
  any update below 2**-9.

  The draws hash the step, the leaf and the element's index in the global
  leaf, as the states' stochastic rounding does: jit, sharded (explicit or
  auto axes) and single-device runs give the same bits.

  Args:
    seed: seed of the draws (an int).

  Returns:
    An ``optax.GradientTransformation`` whose state is a step count.

  Example:
    >>> import jax, jax.numpy as jnp, optax, optax4bit
    >>> params = {"w": jnp.ones((1024,), jnp.bfloat16)}
    >>> tx = optax.chain(optax.sgd(1e-3), optax4bit.round_params_stochastically())
    >>> state = tx.init(params)
    >>> grads = {"w": jnp.ones((1024,), jnp.bfloat16)}
    >>> updates, state = jax.jit(tx.update)(grads, state, params)
    >>> new = optax.apply_updates(params, updates)["w"]
    >>> new.dtype, sorted({float(x) for x in new})  # 1 - 2**-8 or 1, never stuck
    (dtype(bfloat16), [0.99609375, 1.0])
    >>> abs(float(jnp.mean(new.astype(jnp.float32))) - (1 - 1e-3)) < 3e-4
    True
  """
  _check_seed(seed)

  def init_fn(params):
    del params
    return RoundParamsStochasticallyState(jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None):
    count_inc = optax.safe_increment(state.count)
    leaves, treedef = jax.tree.flatten(updates)
    if params is None:
      low = [u.dtype for u in leaves if jnp.dtype(u.dtype) in ROUNDED_DTYPES]
      if low:
        raise ValueError(
            f"round_params_stochastically needs `params` in update() to round {low[0]} "
            "parameters: call tx.update(updates, state, params).")
      return updates, RoundParamsStochasticallyState(count_inc)
    param_leaves = jax.tree.leaves(params)
    if len(param_leaves) != len(leaves):
      raise ValueError(
          f"params has {len(param_leaves)} array leaves but the updates have {len(leaves)}: "
          "round_params_stochastically needs params with the structure of the updates.")
    out = []
    for leaf, (u, p) in enumerate(zip(leaves, param_leaves)):
      p = jnp.asarray(p)
      if p.dtype not in ROUNDED_DTYPES:
        out.append(u)
        continue
      total = _as_float32(p) + _as_float32(jnp.asarray(u))
      uniform = leaf_uniform(seed, count_inc, leaf, p.shape)
      out.append(landing_update(p, round_stochastically(total, p.dtype, uniform)))
    return treedef.unflatten(out), RoundParamsStochasticallyState(count_inc)

  return optax.GradientTransformation(init_fn, update_fn)


PARAM_ROUNDINGS = ("stochastic", "nearest")


def rounding_transforms(param_rounding: str, seed: int) -> tuple:
  """The transforms an alias appends for ``param_rounding``: `round_params_stochastically`
  for ``"stochastic"``, none for ``"nearest"`` (``optax.apply_updates``
  rounds to nearest)."""
  if param_rounding not in PARAM_ROUNDINGS:
    raise ValueError(f"param_rounding must be one of {PARAM_ROUNDINGS}, got {param_rounding!r}.")
  return (round_params_stochastically(seed),) if param_rounding == "stochastic" else ()
