"""Stochastic rounding of bfloat16 and float16 parameters (issue 36).

Rounding ``params + updates`` to the nearest bfloat16 loses every update
below half an ulp of the parameter: a parameter of 1.0 ignores any step
smaller than 2**-9. `round_params_stochastically` rounds the float32 sum
up or down at random, with the probability that makes the expected new
parameter equal the float32 sum, and returns the update that lands
``optax.apply_updates`` exactly there.

Its random numbers are those of the states' stochastic rounding
(`optax4bit.quant.maps.hashed_uniform`): a hash of the step, the leaf and the
element's flat index in the global leaf, so that single-device, chunked and
sharded runs draw the same number for the same element.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax4bit._validation import check_static_int
from optax4bit.quant import maps

__all__ = ["RoundParamsStochasticallyState", "round_params_stochastically"]

# The dtypes whose sums are rounded; any other leaf (float32, float64,
# complex, integer) passes through.
ROUNDED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

# Folded into each leaf's key after the leaf index, so that the parameters'
# draws are independent of the moments' (which fold in 0, 1, ... there).
_PARAM_STREAM = 0x70617261


class RoundParamsStochasticallyState(NamedTuple):
  """State of `round_params_stochastically`: the step count that keys the
  draws."""
  count: jax.Array


def _bits(x: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(x, jnp.uint16)


def _from_bits(bits: jax.Array, dtype) -> jax.Array:
  return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), dtype)


def round_stochastically(x: jax.Array, dtype, uniform: jax.Array) -> jax.Array:
  """float32 ``x`` rounded to ``dtype`` (bfloat16 or float16) up or down in
  magnitude, up when ``uniform`` (U[0, 1) draws shaped like ``x``) is below
  the distance to the lower neighbour in units of the gap.

  Unbiased: ``E[result] = x``. Values of the dtype (infinities included) are
  kept; NaN stays NaN; a result of zero is ``+0``. Past the largest finite
  value the gap is that of the last binade, so the sum becomes ``inf`` with
  probability ``(|x| - max) / ulp(max)`` (1 from ``max + ulp(max)`` on, where
  rounding to nearest gives ``inf`` too).
  """
  magnitude = jnp.abs(x)
  nearest = magnitude.astype(dtype)
  nearest_bits = _bits(nearest)
  # Bit patterns of non-negative floats are ordered like their values, so
  # +-1 on them steps to the neighbouring magnitude (into inf past the max).
  lower_bits = jnp.where(nearest.astype(jnp.float32) > magnitude, nearest_bits - 1, nearest_bits)
  # Near float32's smallest normal the differences below are subnormal, which
  # XLA on CPU flushes to zero: a power of two scales them up, exactly.
  scale = jnp.where(magnitude < 2.0**-80, np.float32(2.0**40), np.float32(1))

  def scaled(bits):
    return _from_bits(bits, dtype).astype(jnp.float32) * scale

  lower, upper = scaled(lower_bits), scaled(lower_bits + 1)
  gap = jnp.where(jnp.isinf(upper), lower - scaled(jnp.maximum(lower_bits, 1) - 1), upper - lower)
  # (magnitude - lower) is exact (Sterbenz, or lower == 0) and gap a power
  # of two: the probability is exact in float32.
  round_up = uniform < (magnitude * scale - lower) / gap
  bits = jnp.where(nearest.astype(jnp.float32) == magnitude, nearest_bits,
                   jnp.where(round_up, lower_bits + 1, lower_bits))
  rounded = _from_bits(bits, dtype)
  rounded = jnp.where((x < 0) & (bits != 0), -rounded, rounded)
  return jnp.where(jnp.isnan(x), x.astype(dtype), rounded)


def landing_update(params: jax.Array, rounded: jax.Array) -> jax.Array:
  """float32 update with ``optax.apply_updates`` (``params + update`` in
  float32, then cast to the params' dtype) giving exactly ``rounded``.

  ``rounded - params`` is exact in float32 unless one of them is more than
  2**16 times the other; if ``rounded`` is the larger, the float32 error is
  far below half its ulp and the cast still lands on it; ``params`` cannot be
  the larger then, since a float32 sum that small cancels exactly (Sterbenz)
  into a value with at most 8 significant bits, which is kept as it is.
  Where they are equal (infinities included) the update is 0.
  """
  old = _as_float32(params)
  new = rounded.astype(jnp.float32)
  return jnp.where(new == old, jnp.zeros_like(new), new - old)


def _as_float32(x: jax.Array) -> jax.Array:
  """``x`` in float32, rounded to its own dtype first: XLA may keep a
  bfloat16 intermediate in float32 ("excess precision") in one program and
  not another (a sharded one fuses differently); the sum must not depend on
  that."""
  if x.dtype in ROUNDED_DTYPES:
    info = jnp.finfo(x.dtype)
    return jax.lax.reduce_precision(x.astype(jnp.float32), info.nexp, info.nmant)
  return x.astype(jnp.float32)


def leaf_uniform(seed: int, count: jax.Array, leaf: int, shape: tuple) -> jax.Array:
  """The U[0, 1) draws of leaf ``leaf`` at step ``count``: the states' hash
  (`maps.hashed_uniform` of the flat index in the global leaf) under a key
  derived like their keys, on a stream of its own."""
  key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), count), leaf)
  key = jax.random.fold_in(key, _PARAM_STREAM)
  return maps.hashed_uniform(maps.rounding_seed(key), tuple(shape))


def round_params_stochastically(seed: int = 0) -> optax.GradientTransformation:
  """Rounds ``params + updates`` stochastically to bfloat16/float16 params.

  Goes last in a chain (it needs ``params`` in ``update``). For each leaf
  whose parameter is bfloat16 or float16 it computes ``s = float32(params)
  + float32(updates)``, rounds ``s`` to the parameter's dtype up or down
  with probabilities that make the expected result ``s`` (so updates far
  below one ulp still move the parameter on average), and returns the
  float32 update ``u'`` with which ``optax.apply_updates(params, u')`` is
  exactly that rounded value. Other leaves (float32 ...) pass through
  unchanged. Rounding to nearest instead stalls: a bfloat16 parameter of 1.0
  ignores any update below 2**-9.

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
  seed = check_static_int("seed", seed)

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
