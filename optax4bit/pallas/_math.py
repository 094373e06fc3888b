"""The elementwise math of the Pallas kernels, once, over jnp values.

Nothing here knows about Triton, refs or tiles: the kernels of
`optax4bit.pallas._engine` call these functions on the values of a tile, with
``gather_row(table, index)`` (read a row of a small lookup table) and a
`KernelMath` (division and square root) of their backend.
A port to another kernel language (Mosaic GPU, which has no gather as of
JAX 0.11) passes its own: a select tree over the table's constants
(`optax4bit.quant.maps`) is one that needs no memory.

Numerics are the jnp reference's (`optax4bit.quant.maps`,
`optax4bit.quant.normalize`) value for value: codes are equal bit for bit,
with tables instead of its select trees (`optax4bit.pallas._codebook`).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from optax4bit.pallas._codebook import BucketTable
from optax4bit.quant import maps, normalize
from optax4bit.quant.spec import QuantSpec

# gather_row(table, index) -> every column of a small table at ``index``.
GatherRow = Callable


class KernelMath:
  """Division and square root of the kernels.

  The update's (`div`, `sqrt`) are approximate on the GPU: a reciprocal
  (``rcp.approx``) times the dividend, at most 2 ulps off for divisors above
  ``2**-126``, and ``sqrt.approx`` (relative error about ``2**-23``), a few
  instructions each where the correctly rounded ones cost about 25 per
  element with their out-of-line slow paths. The update feeds no state, so
  it stays within the 4 ulps (of the leaf's largest update) that the
  kernels' tests allow against the jnp engine, and codes are unaffected.
  What decides a code (`probability`, `inverse_times_4`) reproduces the
  correctly rounded division's results exactly. In interpret mode all of them
  are jnp's exact operations."""

  def __init__(self, triton: bool):
    self.triton = triton

  @staticmethod
  def _asm(asm: str, *args, result_dtype=jnp.float32):
    from jax.experimental.pallas import triton as plgpu  # pylint: disable=import-outside-toplevel
    shape = jnp.broadcast_shapes(*(jnp.shape(a) for a in args))
    args = [jnp.broadcast_to(jnp.asarray(a, jnp.float32), shape) for a in args]
    constraints = "=r," + ",".join("r" for _ in args)
    (out,) = plgpu.elementwise_inline_asm(
        asm, args=args, constraints=constraints, pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(shape, result_dtype)])
    return out

  def div(self, a, b):
    """``a / b`` of the update (approximate on the GPU, see the class)."""
    if not self.triton:
      return a / b
    return self._asm("{ .reg .f32 r; rcp.approx.ftz.f32 r, $2; mul.rn.f32 $0, $1, r; }", a, b)

  def _div_fast_path(self, a, b):
    """The fast path of ``div.rn.f32`` as ptxas emits it (the reciprocal,
    refined once, then the quotient corrected by one fused multiply-add),
    without its range check and out-of-line slow path: ``div.rn.f32``'s
    quotient bit for bit where that check passes (normal operands and a normal
    quotient well inside the exponent range)."""
    return self._asm(
        "{ .reg .f32 r, e, q, nb; rcp.approx.ftz.f32 r, $2; neg.f32 nb, $2; "
        "fma.rn.f32 e, nb, r, 0f3F800000; fma.rn.f32 r, r, e, r; "
        "fma.rn.f32 q, $1, r, 0f00000000; fma.rn.f32 e, nb, q, $1; "
        "fma.rn.f32 $0, r, e, q; }", a, b)

  def probability(self, d, gap, reciprocal):
    """``d / gap`` for stochastic rounding's decision (`encode_stochastic`), given
    ``reciprocal``, the correctly rounded ``1 / gap`` (a table column). On the
    GPU the quotient ``q = d * reciprocal`` is corrected once by its exact
    remainder (``fma(reciprocal, fma(-gap, q, d), q)``, the last steps of
    ``div.rn.f32``'s fast path): the correctly rounded quotient for the
    operands this sees (``gap`` a positive normal at most 1; tested for every
    gap of the 4-bit maps). An infinite ``gap`` (reciprocal 0) or an infinite
    ``d`` gives NaN or a negative number where ``div.rn.f32`` gives 0, NaN or
    a negative number: never a round-up."""
    if not self.triton:
      return d / gap
    return self._asm(
        "{ .reg .f32 q, e, nb; neg.f32 nb, $2; mul.rn.f32 q, $1, $3; "
        "fma.rn.f32 e, nb, q, $1; fma.rn.f32 $0, $3, e, q; }", d, gap, reciprocal)

  def inverse_times_4(self, s):
    """`normalize.inverse_times_4` of finite scales ``s >= 0``. On the GPU the
    divisor is first scaled by ``2**64`` or ``2**-64`` into ``[2**-85,
    2**64]``, where `_div_fast_path` is exact, and the quotient scaled back:
    powers of two commute with rounding while the result stays normal (4 /
    s is normal for every finite s; where it overflows, so does the scaled
    quotient, and both clamp to the float32 maximum)."""
    if not self.triton:
      return normalize.inverse_times_4(s, self.div)
    positive = s > 0
    up, down = np.float32(2.0**64), np.float32(2.0**-64)
    scale = jnp.where(s < down, up, jnp.where(s > up, down, np.float32(1)))
    quotient = self._div_fast_path(np.float32(4), jnp.where(positive, s, np.float32(1)) * scale)
    inverse = jnp.minimum(quotient * scale, np.float32(np.finfo(np.float32).max))
    return jnp.where(positive, inverse, np.float32(0))

  def linear_code(self, n, bits: int):
    """`maps.encode_nearest`'s Linear code (int32) of ``n``, ``clip(ceil(n *
    2**bits - 1.5), 0, 2**bits - 1)``, with NaN as 0 (as `normalized` would
    make it). On the GPU the ceiling and the clip's lower end are one
    ``cvt.rpi.u32.f32``, which rounds up, saturates negatives (and ``-inf``)
    to 0 and converts NaN to 0; ``n * 2**bits`` is exact, so the fused
    ``n * 2**bits - 1.5`` is the reference's."""
    levels = 2**bits
    if not self.triton:
      n = _nan_as_zero(n)
      return maps.encode_nearest(n, "Linear", bits, False).astype(jnp.int32)
    scaled = n * np.float32(levels) - np.float32(1.5)
    # Triton's inline asm returns signless integers: read its bits as uint32.
    code = jax.lax.bitcast_convert_type(
        self._asm("cvt.rpi.u32.f32 $0, $1;", scaled, result_dtype=jnp.int32), jnp.uint32)
    return jnp.minimum(code, np.uint32(levels - 1)).astype(jnp.int32)

  def sqrt(self, x):
    """The square root of the update's denominator (``sqrt.approx.ftz.f32``
    on the GPU, see the class): ``+-0`` and ``inf`` are their own roots, NaN
    and negative ``x`` give NaN, and a subnormal ``x`` (below ``2**-126``)
    gives 0. Its root, below ``2**-63``, is lost in ``sqrt + eps`` anyway
    unless ``eps`` is below about ``1e-12``."""
    return self._asm("sqrt.approx.ftz.f32 $0, $1;", x) if self.triton else jnp.sqrt(x)




def decode_bytes(packed, pairs, gather_row: GatherRow):
  """The entries of the even and the odd code of int32 bytes ``packed``."""
  return gather_row(pairs, packed)


def count_below(x, bucket: BucketTable, table, gather_row: GatherRow):
  """`maps.count_above` of ``bucket``'s thresholds (``>=`` if inclusive) at
  float32 ``x``, by the bucket of ``x``'s bits; a quiet NaN (every NaN that
  arithmetic makes) counts as 0 does."""
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  index = jax.lax.shift_right_logical(bits, np.uint32(bucket.shift)).astype(jnp.int32)
  threshold_bits, base = gather_row(table, index)
  threshold = jax.lax.bitcast_convert_type(threshold_bits, jnp.float32)
  crossed = x >= threshold if bucket.inclusive else x > threshold
  return base + crossed.astype(jnp.int32)


def normalized(x, inverse_times_4):
  """`normalize.normalize`'s value of ``x`` given ``4 / scale``, before its
  NaN-as-0: the encoders code NaN as 0 themselves, each the cheapest way.
  A NaN here is a product's, so quiet (what `count_below` needs)."""
  return (x * inverse_times_4) * np.float32(0.25)


def _nan_as_zero(n):
  return jnp.where(jnp.isnan(n), np.float32(0), n)


def encode_nearest(n, spec: QuantSpec, bucket: BucketTable, table, gather_row: GatherRow,
                   kmath: KernelMath):
  """`maps.encode_nearest` (int32 codes) of `normalize.normalize`'s value,
  a quiet NaN coded as 0's code (by the Linear code's conversion, or by the
  bucket lookup). The Linear code ignores ``signed``, as the reference's
  does."""
  if spec.mapping == "Linear":
    return kmath.linear_code(n, spec.bits)
  return count_below(n, bucket, table, gather_row)


# Stochastic rounding decides ``u < d / gap`` as ``u * 2**24 < (d * 2**24) / gap``:
# the draw is then the integer-valued float that `maps.hashed_uniform` scales
# by 2**-24 (one multiply per draw fewer), and the scale rides on the
# difference for free: `_codebook.entry_gaps` holds the entries times -2**24.
DRAW_SCALE = np.float32(2.0**24)


def encode_stochastic(n, scaled_uniform, bucket: BucketTable, table, gaps,
                      gather_row: GatherRow, probability=lambda d, gap, reciprocal: d / gap,
                      stored=None):
  """`maps.encode_stochastic` (int32 codes) of ``n`` and the draws ``u``
  given as ``scaled_uniform = u * 2**24`` (`maps.scaled_uniform_of_folded_index`),
  a quiet NaN coded as 0's code: its lookup gives 0's ``lower``, and its
  probability is NaN, so it never rounds up, as 0 does not (0 is an entry
  of every map or below its first, `_codebook.bucket_table`).

  ``lower`` is the largest entry ``<= n`` (0 below the first); the gap after
  the last entry is ``inf``, so that there, and below the first entry, the
  probability is 0, NaN or negative without the reference's clip: the same
  codes. ``probability(d, gap, reciprocal)``: ``d / gap``
  (`KernelMath.probability`); ``gaps``: `_codebook.entry_gaps`.

  The decision ``u * 2**24 < (n * 2**24 - entry * 2**24) / gap`` is the
  reference's ``u < (n - entry) / gap``: scaling by a power of two commutes
  with rounding, ``n * 2**24`` is exact, and where ``(n - entry) / gap``
  would be subnormal (``n - entry`` subnormal, every entry being 0 or far
  above 2**-126), only ``u = 0`` can decide, and both sides are positive
  exactly when ``n > entry``.

  ``stored``: the int32 codes that ``n`` replaces, for the stall rule of a
  ``stall_only`` spec (`optax4bit.quant.array.encode`): the stochastic code
  where the nearest code is ``stored``, the nearest code elsewhere. The
  nearest code is ``lower`` plus whether ``n`` is above nearest rounding's
  threshold after ``lower`` (the fourth column of a ``stall_only`` spec's
  ``gaps``); for a map whose first two entries are equal, ``lower - 1`` plus
  whether it is above that threshold and above the one before (the fifth; see
  `_codebook`): `maps.encode_nearest`'s code, NaN included (no comparison
  with NaN holds, and its ``lower`` is 0's, whose nearest code it gives).
  """
  lower = count_below(n, bucket, table, gather_row)
  negated_scaled_low_value, gap, reciprocal, *thresholds = gather_row(gaps, lower)
  scaled_difference = n * DRAW_SCALE + negated_scaled_low_value
  round_up = scaled_uniform < probability(scaled_difference, gap, reciprocal)
  if stored is None:
    return lower + round_up.astype(jnp.int32)
  nearest = lower + (n > thresholds[0]).astype(jnp.int32)
  if len(thresholds) > 1:  # the first two entries are equal (then lower >= 1)
    nearest = nearest + ((n > thresholds[1]).astype(jnp.int32) - 1)
  return jnp.where(nearest == stored, lower + round_up.astype(jnp.int32), nearest)


# The key of |x| = 0 (`finite_abs_key`).
_ZERO_KEY = np.uint32(1 << 24)


def finite_abs_key(x, mask=None):
  """uint32 keys of float32 ``x`` whose unsigned maximum is the key of the
  largest finite ``|x|`` (where ``mask``), or of 0 if there is none: what a
  scale's maximum sees (`abs_of_key` reads it back).

  ``2 * bits(x) + 2**24`` (modulo 2**32) drops the sign bit and keeps the
  order of the magnitudes' bits, which is their order as floats; ``+-inf``
  wraps to 0 and NaN to below the key of 0. One shift-and-add per element
  and an integer maximum, where ``where(|x| < inf, |x|, 0)`` costs an
  absolute value, a compare and a select before its float maximum."""
  key = jax.lax.bitcast_convert_type(x, jnp.uint32) * np.uint32(2) + _ZERO_KEY
  return key if mask is None else jnp.where(mask, key, _ZERO_KEY)


def abs_of_key(key):
  """The float32 ``|x|`` of a maximum of `finite_abs_key` keys (0 where
  no finite ``x`` was seen)."""
  magnitude_bits = jax.lax.shift_right_logical(jnp.maximum(key, _ZERO_KEY) - _ZERO_KEY,
                                               np.uint32(1))
  return jax.lax.bitcast_convert_type(magnitude_bits, jnp.float32)


def pack(code_even, code_odd, valid_odd=None):
  """Bytes of two int32 codes, the even one in the low nibble (a zero
  nibble past an odd last axis)."""
  if valid_odd is not None:
    code_odd = jnp.where(valid_odd, code_odd, 0)
  return (code_even | (code_odd << 4)).astype(jnp.uint8)
