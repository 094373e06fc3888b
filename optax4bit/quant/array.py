"""`QuantizedArray` and the `quantize` / `dequantize` reference (jnp)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from optax4bit.quant import maps, normalize, packing
from optax4bit.quant.spec import QuantSpec, SpecLike, as_spec

__all__ = ["QuantizedArray", "quantize", "dequantize"]


@dataclasses.dataclass(frozen=True)
class QuantizedArray:
  """A tensor stored as packed integer codes plus float32 scales.

  A registered pytree: ``codes`` (uint8) and ``scales`` (a tuple of float32
  arrays) are its leaves; ``spec``, ``shape`` and ``dtype`` are static aux
  data. Codes and scales keep the tensor's rank (see `optax4bit.quant.normalize`
  for the layouts), so a ``PartitionSpec`` of the tensor applies to them.

  Attributes:
    codes: uint8 codes; for 4 bits two per byte along the last axis, shape
      ``shape[:-1] + (ceil(shape[-1] / 2),)``.
    scales: the normalization's float32 scale arrays.
    spec: the `QuantSpec` used.
    shape: the logical shape of the tensor.
    dtype: the dtype that `dequantize` returns by default.
  """

  codes: Any
  scales: tuple
  spec: QuantSpec = dataclasses.field(metadata=dict(static=True))
  shape: tuple = dataclasses.field(metadata=dict(static=True))
  dtype: Any = dataclasses.field(metadata=dict(static=True))

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def nbytes(self) -> int:
    """Bytes actually stored: codes plus scales."""
    return int(sum(np.dtype(leaf.dtype).itemsize * math.prod(leaf.shape)
                   for leaf in jax.tree.leaves(self)))

  @property
  def layout(self) -> normalize.Layout:
    return normalize.layout_for(self.spec, self.shape)

  def to_raw(self) -> tuple:
    """``(codes, scales)``: the arrays alone, without the static description
    (`from_raw` rebuilds the array). Per-shard code takes these, since a
    shard's arrays describe a tensor of another (local) shape.

    Example:
      >>> import jax.numpy as jnp
      >>> import optax4bit
      >>> q = optax4bit.quantize(jnp.ones((4, 256)), "B128/DE")
      >>> codes, scales = q.to_raw()
      >>> codes.shape, [s.shape for s in scales]
      ((4, 128), [(4, 2)])
      >>> back = QuantizedArray.from_raw((codes, scales), q.spec, q.shape, q.dtype)
      >>> bool(jnp.array_equal(back.dequantize(), q.dequantize()))
      True
    """
    return self.codes, tuple(self.scales)

  @classmethod
  def from_raw(cls, raw: tuple, spec: QuantSpec, shape: tuple, dtype) -> "QuantizedArray":
    """The array of ``raw = (codes, scales)`` (`to_raw`) describing a tensor of
    ``shape`` quantized with ``spec``."""
    codes, scales = raw
    return cls(codes, tuple(scales), spec, tuple(shape), dtype)

  def dequantize(self, dtype=None) -> jax.Array:
    """Same as ``optax4bit.dequantize(self, dtype)``."""
    return dequantize(self, self.dtype if dtype is None else dtype)

  def __repr__(self) -> str:
    return (f"QuantizedArray({self.spec}, shape={self.shape}, "
            f"dtype={np.dtype(self.dtype).name})")


def quantizer_key(spec: QuantSpec) -> str:
  """The key under which a `QuantizedArray` files its scales, naming its
  quantizer: ``"B128_NF_4bit_signed_stochastic"`` for ``B128/NF (4-bit,
  signed, stochastic)``. Without ``/`` or ``.``, so orbax can use it in array
  names."""
  norm, mapping = spec.name.split("/")
  parts = [norm, mapping, f"{spec.bits}bit", "signed" if spec.signed else "unsigned"]
  return "_".join(parts + (["stochastic"] if spec.stochastic else []))


def spec_of_key(key) -> Optional[QuantSpec]:
  """The `QuantSpec` that `quantizer_key` names, or None if ``key`` is not
  such a key."""
  parts = key.split("_") if isinstance(key, str) else []
  if len(parts) not in (4, 5) or not parts[2].endswith("bit") or not parts[2][:-3].isdigit():
    return None
  try:
    spec = QuantSpec.parse(f"{parts[0]}/{parts[1]}", bits=int(parts[2][:-3]),
                           signed=parts[3] == "signed", stochastic=len(parts) == 5)
  except ValueError:
    return None
  return spec if quantizer_key(spec) == key else None


# The quantizer is static aux data, which transformations that keep only a
# tree's keys and leaves drop (``flax.nnx.state`` splits a QuantizedArray into
# plain ``codes`` and ``scales`` leaves). The scales are therefore filed under
# a key that names the quantizer (``.scales['B128_NF_4bit_signed'][0]``), so
# every such tree still says how its codes decode (`optax4bit.checkpoint`).
def _children(q: QuantizedArray) -> tuple:
  return q.codes, {quantizer_key(q.spec): q.scales}


def _flatten_with_keys(q: QuantizedArray):
  codes, scales = _children(q)
  return (((jax.tree_util.GetAttrKey("codes"), codes),
           (jax.tree_util.GetAttrKey("scales"), scales)), (q.spec, q.shape, q.dtype))


def _unflatten(aux: tuple, children) -> QuantizedArray:
  codes, scales = children
  (scales,) = scales.values()
  return QuantizedArray(codes, scales, *aux)


jax.tree_util.register_pytree_with_keys(
    QuantizedArray, _flatten_with_keys, _unflatten,
    flatten_func=lambda q: (_children(q), (q.spec, q.shape, q.dtype)))


def is_quantized(x) -> bool:
  """Whether ``x`` is a `QuantizedArray` (an ``is_leaf`` for tree maps that
  treat quantized moments as single leaves)."""
  return isinstance(x, QuantizedArray)


def encode(x: jax.Array, scales: tuple, spec: QuantSpec, layout: normalize.Layout,
           uniform: Optional[jax.Array] = None, stored_codes: Optional[jax.Array] = None,
           fusible: bool = False, inverses: Optional[tuple] = None) -> jax.Array:
  """Packed codes of float32 ``x`` under given scales (``uniform`` draws for
  stochastic rounding). ``stored_codes``: the packed codes ``x`` replaces,
  which a ``stall_only`` spec keeps stochastic rounding to (None: stochastic
  everywhere); ``fusible`` unpacks them as `decode` does; ``inverses``: the
  scales' `normalize.inverse_times_4`, computed beforehand (`normalize.normalize`)."""
  n = normalize.normalize(x, scales, layout, inverses)
  if not spec.stochastic:
    return packing.pack(maps.encode_nearest(n, spec.mapping, spec.bits, spec.signed), spec.bits)
  codes = maps.encode_stochastic(n, uniform, spec.mapping, spec.bits, spec.signed)
  if spec.stall_only and stored_codes is not None:
    unpack = packing.unpack_fusible if fusible else packing.unpack
    nearest = maps.encode_nearest(n, spec.mapping, spec.bits, spec.signed)
    stalled = nearest == unpack(stored_codes, x.shape[-1], spec.bits)
    codes = jnp.where(stalled, codes, nearest)
  return packing.pack(codes, spec.bits)


def decode(codes: jax.Array, scales: tuple, spec: QuantSpec, layout: normalize.Layout,
           shape: tuple, fusible: bool = False) -> jax.Array:
  """float32 values of packed ``codes`` for a tensor of ``shape``.
  ``fusible``: unpacked by ops that XLA fuses on accelerators (no bitcast;
  `optax4bit.quant.packing.unpack_fusible`)."""
  unpack = packing.unpack_fusible if fusible else packing.unpack
  values = maps.decode(unpack(codes, shape[-1], spec.bits), spec.mapping, spec.bits,
                       spec.signed)
  return values * normalize.expand_scales(scales, layout, shape)


def check_input(x: Any, argname: str) -> jax.Array:
  """``x`` as a floating-point array of at least one axis and one element
  (the input `quantize` takes); a `ValueError` naming ``argname`` if not."""
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"{argname} must be a floating-point array, got dtype {x.dtype}.")
  if x.ndim == 0 or x.size == 0:
    raise ValueError(f"{argname} must have at least one axis and one element, got shape "
                     f"{x.shape}.")
  return x


def quantize(x: jax.Array, spec: SpecLike, *, key: Optional[jax.Array] = None) -> QuantizedArray:
  """Quantizes a floating-point array.

  Math is float32 whatever the input dtype. Each element is normalized by its
  scale and encoded to the nearest table entry (ties to the lower index), or
  rounded stochastically if ``spec.stochastic``. Non-finite inputs never crash
  and never spread: scales are maxima over the finite values only, ``NaN``
  encodes as 0 (the table's smallest entry for zero-free maps) and ``+-inf``
  as the table's ends (``+inf`` as ``scale``; ``-inf`` as the lowest entry
  times the scale, ``-0.8875 * scale`` for the signed 4-bit DE table). A
  block, row or column without a finite non-zero value has scale 0 and
  dequantizes to exact zeros. Unsigned maps clamp negative inputs to their
  smallest entry. So an optimizer's second moment that overflowed to ``+inf``
  comes back finite; the Adam steps restart the first moment of such an
  element (`optax4bit._steps.restart_overflowed`) rather than divide a huge
  ``m`` by it.

  Args:
    x: array of ndim >= 1 (float32, bfloat16, float16, ...).
    spec: a `QuantSpec` or a name such as ``"B128/DE"``.
    key: PRNG key, required for stochastic rounding.

  Returns:
    A `QuantizedArray` remembering ``x``'s shape and dtype.

  Example:
    >>> import jax.numpy as jnp, optax4bit
    >>> x = jnp.linspace(-1.0, 1.0, 256).reshape(2, 128)
    >>> q = optax4bit.quantize(x, "B128/DE")
    >>> q.codes.shape, q.scales[0].shape, q.nbytes
    ((2, 64), (2, 1), 136)
    >>> float(jnp.max(jnp.abs(optax4bit.dequantize(q) - x))) < 0.15
    True
  """
  spec = as_spec(spec)
  x = check_input(x, "x")
  if spec.stochastic and key is None:
    raise ValueError(f"spec {spec} rounds stochastically and needs a PRNG `key`.")
  layout = normalize.layout_for(spec, x.shape)
  x32 = x.astype(jnp.float32)
  scales = normalize.compute_scales(normalize.finite_abs(x32), layout)
  uniform = maps.hashed_uniform(maps.rounding_seed(key), x.shape) if spec.stochastic else None
  codes = encode(x32, scales, spec, layout, uniform)
  return QuantizedArray(codes, scales, spec, tuple(x.shape), np.dtype(x.dtype))


def dequantize(q: QuantizedArray, dtype=jnp.float32) -> jax.Array:
  """Returns the array that ``q`` stores, as ``dtype``.

  Args:
    q: a `QuantizedArray`.
    dtype: the result dtype (float32 by default; the math is float32).

  Example:
    >>> import jax.numpy as jnp, optax4bit
    >>> q = optax4bit.quantize(jnp.array([[0.0, 0.5], [1.0, 2.0]]), "Rank-1/Linear")
    >>> optax4bit.dequantize(q)
    Array([[0.03125, 0.5    ],
           [1.     , 2.     ]], dtype=float32)
  """
  if not isinstance(q, QuantizedArray):
    raise ValueError(f"q must be a QuantizedArray, got {type(q).__name__}.")
  return decode(q.codes, q.scales, q.spec, q.layout, q.shape).astype(dtype)


def zeros(shape: tuple, dtype, spec: QuantSpec) -> QuantizedArray:
  """The quantized all-zero tensor, built without encoding anything."""
  layout = normalize.layout_for(spec, shape)
  # Static: the nearest entry to 0, the lowest index on a tie (jnp would trace).
  zero_code = int(np.argmin(np.abs(maps.qmap(spec.mapping, spec.bits, spec.signed))))
  byte = zero_code | (zero_code << 4) if spec.bits == 4 else zero_code
  codes_shape = tuple(shape[:-1]) + (packing.packed_length(shape[-1], spec.bits),)
  codes = jnp.full(codes_shape, byte, jnp.uint8)
  scales = tuple(jnp.zeros(s, jnp.float32) for s in normalize.scale_shapes(layout, shape))
  return QuantizedArray(codes, scales, spec, tuple(shape), np.dtype(dtype))
