"""Where a leaf and its state live on a mesh: the ``PartitionSpec`` of each
state array, the alignment of quantization blocks with shards, and the
placement of a new state like its parameter. The rules are documented in the
public `optax4bit.sharding`, which re-exports `state_partition_spec`."""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from optax4bit.quant import array as qarray
from optax4bit.quant.array import QuantizedArray

# ----------------------------------------------------------------------------
# Specs of state arrays.


def mesh_axes(entry) -> tuple:
  """Mesh axis names of one PartitionSpec entry."""
  if entry is None:
    return ()
  if isinstance(entry, str):
    return (entry,)
  return tuple(entry)


def padded_spec(spec: PartitionSpec, ndim: int) -> tuple:
  entries = tuple(spec)
  if len(entries) > ndim:
    raise ValueError(f"PartitionSpec {spec} has more entries than the array has axes ({ndim}).")
  return entries + (None,) * (ndim - len(entries))


def state_partition_spec(param_spec: PartitionSpec, param_shape: tuple,
                         state_shape: tuple) -> PartitionSpec:
  """The spec of a state array of a parameter sharded ``param_spec``.

  A state array of the parameter's rank takes the parameter's spec axis by
  axis, except on axes of length 1 (statistics of other axes), which are
  replicated; any other state array (a step count) is replicated.

  Example:
    >>> from jax.sharding import PartitionSpec as P
    >>> import optax4bit
    >>> optax4bit.state_partition_spec(P("data", "model"), (1024, 512), (1024, 1))
    P('data', None)
  """
  if len(state_shape) != len(param_shape) or not param_shape:
    return PartitionSpec()
  entries = padded_spec(param_spec, len(param_shape))
  return PartitionSpec(*(e if n != 1 else None for e, n in zip(entries, state_shape)))


def shard_counts(mesh, entries: tuple) -> tuple:
  return tuple(math.prod(mesh.shape[a] for a in mesh_axes(e)) for e in entries)


def check_alignment(moment: QuantizedArray, mesh, spec: PartitionSpec, where: str = "") -> None:
  """Raises ValueError if ``moment`` cannot be split like its parameter
  (see `optax4bit.sharding` on alignment)."""
  shape = moment.shape
  entries = padded_spec(spec, len(shape))
  counts = shard_counts(mesh, entries)
  leaf = f"{where + ' ' if where else ''}of shape {tuple(shape)} sharded {spec}"
  remedies = ("Shard another axis, choose a block size that divides the per-shard length, or "
              "keep this leaf's moments in float32 with quantize_mask.")
  for axis, (n, k) in enumerate(zip(shape, counts)):
    if k > 1 and n % k:
      raise ValueError(
          f"optax4bit: the parameter {leaf} does not split evenly: axis {axis} has {n} elements "
          f"over {k} shards. Quantized states need evenly divided axes. {remedies}")
  layout = moment.layout
  local_last = shape[-1] // counts[-1]
  if counts[-1] > 1 and moment.spec.bits == 4 and local_last % 2:
    raise ValueError(
        f"optax4bit: the parameter {leaf} has {local_last} elements per shard on its last axis; "
        f"4-bit codes pack pairs of elements, so that must be even. {remedies}")
  if layout.normalization != "block":
    return
  if layout.rows_per_block > 1:
    g = layout.rows_per_block
    if counts[-1] > 1:
      raise ValueError(
          f"optax4bit: the parameter {leaf} has a last axis of {shape[-1]} elements, at most half "
          f"a block of {moment.spec.name}, so one block spans {g} whole rows; its last axis "
          f"cannot be sharded. {remedies}")
    local_rows = shape[-2] // counts[-2]
    if counts[-2] > 1 and local_rows % g:
      raise ValueError(
          f"optax4bit: the parameter {leaf} has {local_rows} rows per shard on axis -2, not a "
          f"multiple of the {g} rows one block of {moment.spec.name} spans. {remedies}")
  elif counts[-1] > 1 and local_last % layout.block_size:
    raise ValueError(
        f"optax4bit: the parameter {leaf} has {local_last} elements per shard on its last axis, "
        f"not a multiple of the block size {layout.block_size} of {moment.spec.name}: blocks "
        f"would straddle shards. {remedies}")


# ----------------------------------------------------------------------------
# Where a parameter lives.


def is_tracer(x) -> bool:
  return isinstance(x, jax.core.Tracer)


def leaf_sharding(x, *, replicated: bool = False) -> Optional[NamedSharding]:
  """The ``NamedSharding`` of ``x`` if it is known and splits ``x``.

  Known means: a concrete ``jax.Array`` with a ``NamedSharding``, or a traced
  value whose type carries an explicit sharding. Unknown (``Auto`` axes
  inside ``jit``) gives None, and so does a replicated sharding unless
  ``replicated``.
  """
  sharding = None
  if is_tracer(x) or isinstance(x, jax.ShapeDtypeStruct):
    try:
      sharding = jax.typeof(x).sharding if is_tracer(x) else x.sharding
    except (AttributeError, TypeError):
      return None
  elif isinstance(x, jax.Array):
    try:
      sharding = x.sharding
    except Exception:  # pylint: disable=broad-except  (deleted or donated arrays)
      return None
  if not isinstance(sharding, NamedSharding):
    return None
  if not replicated and not any(mesh_axes(e) for e in sharding.spec):
    return None
  return sharding


def is_explicit(sharding: NamedSharding) -> bool:
  return any(t == AxisType.Explicit for t in getattr(sharding.mesh, "axis_types", ()))


def shardings_like_param(sharding: NamedSharding, param_shape: tuple, tree):
  """The ``NamedSharding`` of every array of ``tree``, a state subtree of a
  parameter of shape ``param_shape`` placed by ``sharding`` (see
  `state_partition_spec`). Raises if a quantized array cannot be split so."""
  for q in jax.tree.leaves(tree, is_leaf=qarray.is_quantized):
    if isinstance(q, QuantizedArray):
      check_alignment(q, sharding.mesh, sharding.spec)
  return jax.tree.map(lambda x: NamedSharding(
      sharding.mesh, state_partition_spec(sharding.spec, param_shape, tuple(x.shape))), tree)


def on_auto_mesh(x) -> bool:
  """Whether ``x`` is traced on a mesh of several devices whose axes are all
  ``Auto`` (classic GSPMD) and its spec is unknown: its type names the mesh
  but not how ``x`` is split."""
  if not is_tracer(x) or leaf_sharding(x) is not None:
    return False
  try:
    mesh = jax.typeof(x).sharding.mesh
  except AttributeError:
    return False
  return (not mesh.empty and mesh.size > 1
          and all(t == AxisType.Auto for t in mesh.axis_types))


def may_be_split(x) -> bool:
  """Whether ``x`` is split across devices, or may be (on an ``Auto`` mesh,
  where only XLA's partitioner knows): then picking one element of it, or
  flattening it, would gather it."""
  return leaf_sharding(x) is not None or on_auto_mesh(x)


def tie_to_param(param, x):
  """``x`` unchanged, made data-dependent on ``param`` so that XLA's sharding
  propagation places it like ``param`` (see `state_partition_spec`).

  Under ``jit`` on an ``Auto`` mesh a traced parameter does not say how it
  is sharded, and a state created from constants would come out of ``jit``
  on one device. Each axis of ``x`` is linked to the same axis of ``param``:
  taken whole if the lengths agree, strided (packed codes, block scales:
  every 2nd or every k-th element, which keeps the shards' tiling) if
  shorter, reduced if of length 1 (a statistic of the axis: replicated
  along it). ``param * 0 == 1`` is False for every value, NaN and inf
  included, and XLA does not fold it for floats; ``where`` keeps ``x``'s
  bits. Arrays of another rank (a step count) are returned as they are."""
  if (not hasattr(x, "shape") or len(x.shape) != len(param.shape) or not param.shape
      or not jnp.issubdtype(param.dtype, jnp.inexact)):
    return x
  dep = param
  for axis, (n, s) in enumerate(zip(param.shape, x.shape)):
    if s == n:
      continue
    if s == 1:
      dep = jnp.any(dep * 0 == 1, axis=axis, keepdims=True) if dep.dtype != jnp.bool_ else \
          jnp.any(dep, axis=axis, keepdims=True)
      continue
    stride = -(-n // s)
    if -(-n // stride) != s:
      return x
    dep = jax.lax.slice_in_dim(dep, 0, n, stride, axis)
  if dep.dtype != jnp.bool_:
    dep = dep * 0 == 1
  return jnp.where(dep, jnp.zeros_like(x), x)


def follow_param(param, make: Callable[[], Any]):
  """``make()`` (a state subtree of one parameter), placed like ``param``.

  Under ``jit`` with explicit sharding each array is resharded to its state
  spec (a constant, so XLA creates it sharded); for a concrete sharded
  parameter the subtree is created directly sharded; otherwise ``make()``.
  """
  sharding = leaf_sharding(param, replicated=not is_tracer(param))
  if sharding is None:
    if on_auto_mesh(param):
      return jax.tree.map(functools.partial(tie_to_param, param), make())
    return make()
  out = shardings_like_param(sharding, tuple(param.shape), jax.eval_shape(make))
  if is_tracer(param):
    if not is_explicit(sharding):
      return make()
    return jax.tree.map(jax.sharding.reshard, make(), out)
  return jax.jit(make, out_shardings=out)()
