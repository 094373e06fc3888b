"""Standalone Pallas quantize / dequantize kernels (block-wise, rank-1, tensor).

They return exactly what `optax4bit.quantize` and `optax4bit.dequantize`
return (same codes, scales and layout), computed by the kernels of
`optax4bit.pallas._engine`: block-wise quantization is one pass; rank-1 and
tensor quantization are two passes (partial maxima, then encode). Every 4-bit
map (``DE``, ``DE-0``, ``Linear``, ``NF``, ``SqrtDE-0``, ``SqrtLinear``) and both roundings
are covered; stochastic rounding draws `optax4bit.quant.maps.hashed_uniform`'s
numbers from the element's flat index, exactly as the jnp reference does.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from optax4bit.pallas import _engine, _geometry
from optax4bit.quant import maps
from optax4bit.quant.array import QuantizedArray, check_input
from optax4bit.quant.spec import SpecLike, as_spec

__all__ = ["quantize", "dequantize"]


def _identity_new(kmath, coef, dense, old, side):
  del kmath, coef, old, side
  return (), (dense[0],)


def _identity_old(kmath, coef, dense, old, side):
  del kmath, coef, dense, side
  return (old[0],), ()


def quantize(x: jax.Array, spec: SpecLike, *, key: Optional[jax.Array] = None,
             interpret: bool = False,
             tile_bytes: int = _geometry.DEFAULT_TILE_BYTES) -> QuantizedArray:
  """`optax4bit.quantize` with Pallas kernels (4-bit).

  Args:
    x: floating-point array with ndim >= 1 (float32, bfloat16, float16).
    spec: a `QuantSpec` or a name such as ``"B128/DE"``, ``"B128/NF"`` or
      ``"Rank-1/SqrtDE-0"``; 4 bits, nearest or stochastic rounding.
    key: PRNG key, required for stochastic rounding: the kernels draw the
      same numbers as `optax4bit.quantize` with this key
      (`optax4bit.quant.maps.hashed_uniform`).
    interpret: run the kernels in Pallas interpret mode (on any backend).
    tile_bytes: code bytes per kernel program (two elements per byte).

  Returns:
    The `QuantizedArray` that ``optax4bit.quantize(x, spec, key=key)``
    returns.

  Raises:
    ValueError: for a non-floating or empty ``x``, a stochastic spec without
      ``key``, or a spec without a kernel (8-bit, blocks of one element).

  Example:
    >>> import jax.numpy as jnp, optax4bit
    >>> from optax4bit import pallas
    >>> x = jnp.linspace(-1.0, 1.0, 300).reshape(2, 150)
    >>> q = pallas.quantize(x, "B128/DE", interpret=True)
    >>> bool((q.codes == optax4bit.quantize(x, "B128/DE").codes).all())
    True
  """
  spec = as_spec(spec)
  x = check_input(x, "x")
  _geometry.check_spec(spec)
  if spec.stochastic and key is None:
    raise ValueError(f"spec {spec} rounds stochastically and needs a PRNG `key`.")
  seed = maps.rounding_seed(key) if spec.stochastic else None
  options = _engine.Options(interpret=interpret, tile_bytes=tile_bytes)
  _, (q,) = _engine.run(_identity_new, shape=x.shape, dense_in=[x],
                        new=[(spec, np.dtype(x.dtype))], seeds=[seed], options=options)
  return q


def dequantize(q: QuantizedArray, dtype=jnp.float32, *, interpret: bool = False,
               tile_bytes: int = _geometry.DEFAULT_TILE_BYTES) -> jax.Array:
  """`optax4bit.dequantize` with a Pallas kernel.

  Args:
    q: a 4-bit `QuantizedArray`.
    dtype: the result dtype (the math is float32).
    interpret: run the kernel in Pallas interpret mode.
    tile_bytes: code bytes per kernel program.

  Example:
    >>> import jax.numpy as jnp, optax4bit
    >>> from optax4bit import pallas
    >>> q = optax4bit.quantize(jnp.array([[0.0, 0.5], [1.0, 2.0]]), "Rank-1/Linear")
    >>> pallas.dequantize(q, interpret=True)
    Array([[0.03125, 0.5    ],
           [1.     , 2.     ]], dtype=float32)
  """
  if not isinstance(q, QuantizedArray):
    raise ValueError(f"q must be a QuantizedArray, got {type(q).__name__}.")
  _geometry.check_spec(q.spec)
  options = _engine.Options(interpret=interpret, tile_bytes=tile_bytes)
  (out,), _ = _engine.run(_identity_old, shape=q.shape, old=[q], dense_out=[jnp.dtype(dtype)],
                          options=options)
  return out
