"""Sharded 4-bit states: they follow the parameters' ``PartitionSpec``.

Codes and scales keep the parameter's rank (`QuantizedArray`), so a state array
takes its parameter's spec axis by axis; an axis of length 1 in the state
(a rank-1 statistic of another axis, a tensor scale, a factored row or
column) is replicated along that axis:

=========================  ====================  ===========================
state array                shape                 spec (param ``P(a, b)``)
=========================  ====================  ===========================
packed codes               ``(r, ceil(d/2))``    ``P(a, b)``
block scales ``B<k>``      ``(r, ceil(d/k))``    ``P(a, b)``
rank-1 statistics          ``(r, 1)``, ``(1, d)``  ``P(a, None)``, ``P(None, b)``
tensor scale               ``(1, 1)``            ``P(None, None)``
factored ``row``/``col``   ``(r, 1)``, ``(1, d)``  ``P(a, None)``, ``P(None, b)``
step count                 ``()``                ``P()``
=========================  ====================  ===========================

How the optimizer learns the sharding:

* **Explicit sharding** (``jax.make_mesh`` defaults to ``AxisType.Explicit``
  in JAX 0.10): array types carry their sharding, so ``tx.init`` places the
  state like the parameters and ``tx.update`` runs each sharded leaf under
  ``jax.shard_map``, with no argument to pass.
* **Concrete arrays** (``tx.init`` called outside ``jit``): the state is created
  directly sharded like each parameter's ``NamedSharding``.
* **Auto sharding** (``jax.sharding.Mesh(...)``, ``AxisType.Auto``): types
  inside ``jit`` name the mesh but not the spec. ``jax.jit(tx.init)(params)``
  ties each state array to its parameter by a data dependence
  (`tie_to_param`), so XLA's sharding propagation places it like the
  parameter; each leaf's update is a ``custom_partitioning`` call
  (``optax4bit._gspmd``) whose partition callback receives the gradient's
  sharding from XLA and runs the per-shard update below, the fused kernels'
  included (`run_fused`). `shard_optimizer` states the shardings up front
  instead.

Per shard, each leaf runs the ordinary update on its local block (in chunks of
local rows): block-wise scales are local, rank-1 and tensor scales are
reduced with ``lax.pmax`` over the mesh axes of the other dimensions, so that
they are the maxima of the global tensor. Nothing state-sized crosses devices:
only the rank-1/tensor statistics (one float per row or column) are
all-reduced. Results equal the single-device run bit for bit, stochastic
rounding included: its random numbers hash the element's index in the global
tensor (`shard_origin` tells a shard where its block starts).

Alignment. A parameter can be split like its state only if no quantization
block straddles two shards: every sharded axis must divide evenly, and if the
last axis is sharded its per-shard length must be a multiple of the block
size (and even, for 4-bit packing). Blocks that span whole rows (last axis at
most half a block) need the last axis unsharded and a per-shard row count that
is a multiple of the rows per block. Anything else raises a ``ValueError``
naming the leaf and the remedies (another block size, another axis, or
``quantize_mask`` to keep the leaf in float32): optax4bit never reshuffles
blocks across devices silently.
"""

from __future__ import annotations

import contextvars
import functools
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from optax4bit import _order
from optax4bit.quant import array as qarray
from optax4bit.quant import normalize
from optax4bit.quant.array import QuantizedArray

__all__ = ["shard_optimizer", "state_partition_spec", "state_shardings"]


# ----------------------------------------------------------------------------
# Specs of state arrays.


def _axes(entry) -> tuple:
  """Mesh axis names of one PartitionSpec entry."""
  if entry is None:
    return ()
  if isinstance(entry, str):
    return (entry,)
  return tuple(entry)


def _padded(spec: PartitionSpec, ndim: int) -> tuple:
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
  entries = _padded(param_spec, len(param_shape))
  return PartitionSpec(*(e if n != 1 else None for e, n in zip(entries, state_shape)))


def _shard_counts(mesh, entries: tuple) -> tuple:
  return tuple(math.prod(mesh.shape[a] for a in _axes(e)) for e in entries)


def check_alignment(moment: QuantizedArray, mesh, spec: PartitionSpec, where: str = "") -> None:
  """Raises ValueError if ``moment`` cannot be split like its parameter
  (see the module docstring)."""
  shape = moment.shape
  entries = _padded(spec, len(shape))
  counts = _shard_counts(mesh, entries)
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


def _is_tracer(x) -> bool:
  return isinstance(x, jax.core.Tracer)


def leaf_sharding(x, *, replicated: bool = False) -> Optional[NamedSharding]:
  """The ``NamedSharding`` of ``x`` if it is known and splits ``x``.

  Known means: a concrete ``jax.Array`` with a ``NamedSharding``, or a traced
  value whose type carries an explicit sharding. Unknown (``Auto`` axes
  inside ``jit``) gives None, and so does a replicated sharding unless
  ``replicated``.
  """
  sharding = None
  if _is_tracer(x) or isinstance(x, jax.ShapeDtypeStruct):
    try:
      sharding = jax.typeof(x).sharding if _is_tracer(x) else x.sharding
    except (AttributeError, TypeError):
      return None
  elif isinstance(x, jax.Array):
    try:
      sharding = x.sharding
    except Exception:  # pylint: disable=broad-except  (deleted or donated arrays)
      return None
  if not isinstance(sharding, NamedSharding):
    return None
  if not replicated and not any(_axes(e) for e in sharding.spec):
    return None
  return sharding


def _is_explicit(sharding: NamedSharding) -> bool:
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
  if not _is_tracer(x) or leaf_sharding(x) is not None:
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
  sharding = leaf_sharding(param, replicated=not _is_tracer(param))
  if sharding is None:
    if on_auto_mesh(param):
      return jax.tree.map(functools.partial(tie_to_param, param), make())
    return make()
  out = shardings_like_param(sharding, tuple(param.shape), jax.eval_shape(make))
  if _is_tracer(param):
    if not _is_explicit(sharding):
      return make()
    return jax.tree.map(jax.sharding.reshard, make(), out)
  return jax.jit(make, out_shardings=out)()


# ----------------------------------------------------------------------------
# Running one leaf's update per shard.


def _global_max(dim_axes: tuple, scales: tuple, layout: normalize.Layout) -> tuple:
  """Rank-1 and tensor scales computed on a local block, reduced to the
  maxima of the global tensor (block scales are local: alignment holds)."""
  if layout.normalization == "rank1":
    out = []
    for axis, s in enumerate(scales):
      names = tuple(a for d, axes in enumerate(dim_axes) if d != axis for a in axes)
      out.append(jax.lax.pmax(s, names) if names else s)
    return tuple(out)
  if layout.normalization == "tensor":
    names = tuple(a for axes in dim_axes for a in axes)
    return tuple(jax.lax.pmax(s, names) if names else s for s in scales)
  return scales


def _local_shape(shape: tuple, counts: tuple) -> tuple:
  return tuple(n // k for n, k in zip(shape, counts))


def hoist_partial(fn: Callable):
  """Splits ``fn`` into ``(rebuild, consts)`` with ``rebuild(consts) == fn``.

  ``consts`` are the array arguments of a ``functools.partial`` (e.g. traced
  bias corrections); they must enter ``shard_map`` as arguments, since a
  ``shard_map`` cannot close over arrays with explicit sharding. Python
  numbers stay static, so the arithmetic is exactly that of ``fn``.
  """
  if not isinstance(fn, functools.partial):
    return (lambda consts: fn), ()
  leaves, treedef = jax.tree.flatten((fn.args, fn.keywords))
  dynamic = [isinstance(x, (jax.Array, jax.core.Tracer)) for x in leaves]
  consts = tuple(x for x, d in zip(leaves, dynamic) if d)

  def rebuild(new_consts):
    it = iter(new_consts)
    args, keywords = treedef.unflatten([next(it) if d else x for x, d in zip(leaves, dynamic)])
    return functools.partial(fn.func, *args, **keywords)

  return rebuild, consts


_SHARD_ORIGIN = contextvars.ContextVar("optax4bit_shard_origin", default=None)

def shard_origin() -> Optional[tuple]:
  """``(global_shape, origin)`` while `per_shard` traces a shard's update:
  the global leaf's shape and the global index, per axis, of the shard's
  first element (traced ints); None outside."""
  return _SHARD_ORIGIN.get()


def run_fused(local_update: Callable, grad, moments: tuple, side: tuple, consts: tuple,
              covers_shard: Callable[[tuple], bool], keys: Optional[tuple] = None,
              hashes_global_index: bool = False):
  """Runs a fused kernel's ``local_update`` (see `per_shard`) on one leaf:
  directly if the leaf is not sharded, per shard if it is. Returns None (the
  caller runs the jnp path) when the shards are uneven (the jnp path raises
  optax4bit's alignment error) or ``covers_shard(local_shape)`` is False.
  ``keys``: one PRNG key (or None) per moment, for stochastic rounding;
  ``hashes_global_index``: whether the kernel hashes each element's index in
  the global leaf (from `shard_origin`) as the jnp path does; if not, sharded
  leaves with stochastic rounding run the jnp path."""
  keys = (None,) * len(moments) if keys is None else tuple(keys)
  sharding = leaf_sharding(grad)
  if sharding is None:
    if on_auto_mesh(grad):  # XLA tells the sharding when it partitions (`optax4bit._gspmd`)
      if ((not hashes_global_index and any(k is not None for k in keys))
          or not covers_shard(tuple(grad.shape))):
        return None
      from optax4bit import _gspmd  # pylint: disable=g-import-not-at-top  (it imports this module)
      return _gspmd.run_auto(local_update, grad, moments, side, keys, consts,
                             covers_shard=covers_shard)
    return local_update(grad, moments, side, keys, None, consts)
  if not hashes_global_index and any(k is not None for k in keys):
    return None
  try:
    local_shape = tuple(sharding.shard_shape(tuple(grad.shape)))
  except ValueError:
    return None
  if not covers_shard(local_shape):
    return None
  return per_shard(local_update, sharding, grad, moments, side, keys, consts)


def shard_runner(mesh, param_spec: PartitionSpec, shape: tuple):
  """``(spec, local_shape, as_shard)`` of a leaf of ``shape`` split by
  ``param_spec`` (padded to the leaf's rank). ``as_shard(fn)`` runs
  ``fn(reduce_scales)`` as this device's shard, inside a per-shard context
  (``shard_map``, a ``custom_partitioning`` lowering): `shard_origin` is set
  and ``reduce_scales`` takes rank-1/tensor maxima over the other shards."""
  spec = PartitionSpec(*_padded(param_spec, len(shape)))
  entries = tuple(spec)
  local_shape = _local_shape(shape, _shard_counts(mesh, entries))
  dim_axes = tuple(_axes(e) for e in entries)

  def as_shard(fn):
    origin = tuple(jax.lax.axis_index(axes) * n if axes else 0
                   for axes, n in zip(dim_axes, local_shape))
    token = _SHARD_ORIGIN.set((shape, origin))
    try:
      return fn(functools.partial(_global_max, dim_axes))
    finally:
      _SHARD_ORIGIN.reset(token)

  return spec, local_shape, as_shard


def per_shard(local_update: Callable, sharding: NamedSharding, grad, moments: tuple,
              side: tuple, keys: tuple, consts: tuple = ()):
  """Runs ``local_update`` on each shard of one leaf under ``jax.shard_map``.

  ``local_update(grad, moments, side, keys, reduce_scales, consts)`` is the
  single-device update of a leaf (it sees local blocks; ``reduce_scales``
  turns locally computed rank-1/tensor scales into global maxima; ``consts``
  are replicated arrays it needs, see `hoist_partial`). Returns
  ``(update, new_moments)`` of the global leaf.
  """
  mesh, shape = sharding.mesh, tuple(grad.shape)
  spec, local_shape, as_shard = shard_runner(mesh, sharding.spec, shape)

  def spec_of(x):
    return state_partition_spec(spec, shape, tuple(x.shape))

  # QuantizedArray keeps its (global) shape as static aux data: pass codes and
  # scales as plain leaves and rebuild local arrays inside.
  raw, rebuild = [], []
  for m in moments:
    if isinstance(m, QuantizedArray):
      check_alignment(m, mesh, spec)
      raw.append((m.codes, m.scales))
      rebuild.append((m.spec, m.dtype))
    else:
      raw.append(m)
      rebuild.append(None)
  raw = tuple(raw)
  raw_specs = jax.tree.map(spec_of, raw)
  side_specs = tuple(spec_of(s) for s in side)
  key_specs = jax.tree.map(lambda _: PartitionSpec(), keys)

  def moments_of(raw_moments, leaf_shape):
    return tuple(r if info is None else
                 QuantizedArray(r[0], tuple(r[1]), info[0], leaf_shape, info[1])
                 for r, info in zip(raw_moments, rebuild))

  def to_raw(local_moments):
    return tuple((m.codes, m.scales) if isinstance(m, QuantizedArray) else m
                 for m in local_moments)

  ordering = _order.request()

  def run(g, raw_moments, side_local, keys_local, consts_local):
    update, new = as_shard(lambda reduce: local_update(
        g, moments_of(raw_moments, local_shape), side_local, keys_local, reduce, consts_local))
    return update, to_raw(new), new

  def matched(x, s):
    if _is_tracer(x) and _is_explicit(sharding):
      return jax.sharding.reshard(x, NamedSharding(mesh, s))
    return x

  args = (grad, raw, tuple(side), tuple(keys), tuple(consts))
  arg_specs = (spec, raw_specs, side_specs, key_specs, tuple(PartitionSpec() for _ in consts))
  args = jax.tree.map(matched, args, arg_specs,
                      is_leaf=lambda x: x is None)
  # check_vma=False: the single-device engine carries old and new statistics
  # in one loop carry, which varying-axis typing would reject; the out_specs
  # hold by construction (statistics are reduced with pmax before they leave).
  update, new_raw, *zero = jax.shard_map(
      _order.with_local_zero(run, ordering), mesh=mesh, in_specs=arg_specs,
      out_specs=(spec, raw_specs, *_order.zero_specs(ordering)), check_vma=False)(*args)
  return update, moments_of(_order.collect(ordering, new_raw, zero), shape)


# ----------------------------------------------------------------------------
# Public helpers.


def _flat_shardings(params, param_shardings):
  leaves, treedef = jax.tree.flatten(params)
  if param_shardings is None:
    shardings = [getattr(p, "sharding", None) for p in leaves]
  else:
    try:
      shardings = treedef.flatten_up_to(param_shardings)
    except (ValueError, TypeError):
      shardings = jax.tree.leaves(param_shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
      if len(shardings) != len(leaves):
        raise ValueError(
            "param_shardings must be a pytree of NamedSharding with the structure of the params "
            f"({len(leaves)} leaves), got {len(shardings)} shardings.") from None
  meshes = {s.mesh for s in shardings if isinstance(s, NamedSharding)}
  for s in shardings:
    if not isinstance(s, NamedSharding):
      raise ValueError(f"param_shardings must hold jax.sharding.NamedSharding, got {s!r}.")
  if len(meshes) > 1:
    raise ValueError("all parameters must be sharded over the same mesh.")
  return leaves, treedef, shardings, (meshes.pop() if meshes else None)


def _explicit_mesh(mesh):
  return jax.sharding.Mesh(mesh.devices, mesh.axis_names,
                           axis_types=(AxisType.Explicit,) * len(mesh.axis_names))


def state_shardings(tx: optax.GradientTransformation, params, param_shardings=None):
  """Shardings of ``tx.init(params)`` when the params are sharded.

  Use them as ``jax.jit(..., out_shardings=...)`` for ``tx.init`` or a train
  step, and as the target of a checkpoint restore. Every array of the state
  follows its parameter (see `state_partition_spec`); arrays that belong to
  no parameter (step counts, hyperparameters) are replicated. Works for any
  optax transformation, optax4bit or not, and for chains of them.

  Args:
    tx: the optimizer.
    params: the parameters (arrays or ``jax.ShapeDtypeStruct``); only shapes
      and dtypes are used.
    param_shardings: a pytree of ``NamedSharding`` like ``params``; default:
      the params' own ``.sharding``.

  Returns:
    A pytree of ``NamedSharding`` with the structure of ``tx.init(params)``.

  Raises:
    ValueError: if a quantized state cannot be split like its parameter (see
      the module docstring on alignment).

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax4bit
    >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    >>> mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    >>> params = {"w": jnp.zeros((256, 512))}
    >>> tx = optax4bit.adamw_4bit(1e-3)
    >>> sh = optax4bit.state_shardings(tx, params, {"w": NamedSharding(mesh, P("data", "model"))})
    >>> sh[0].nu["w"].scales[0].spec, sh[0].mu["w"].codes.spec
    (P('data', None), P('data', 'model'))
  """
  leaves, treedef, shardings, mesh = _flat_shardings(params, param_shardings)
  if mesh is None:
    raise ValueError("state_shardings needs at least one parameter.")
  explicit = _explicit_mesh(mesh)
  abstract = treedef.unflatten([
      jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=NamedSharding(explicit, s.spec))
      for p, s in zip(leaves, shardings)])
  with jax.sharding.use_abstract_mesh(explicit.abstract_mesh):
    state = jax.eval_shape(tx.init, abstract)

  def to_sharding(x):
    s = getattr(x, "sharding", None)
    spec = s.spec if isinstance(s, NamedSharding) else PartitionSpec()
    return NamedSharding(mesh, spec)

  return jax.tree.map(to_sharding, state)


def shard_optimizer(tx: optax.GradientTransformation,
                    param_shardings) -> optax.GradientTransformationExtraArgs:
  """Wraps ``tx`` so that its state and update follow ``param_shardings``.

  Optional: with ``Auto`` mesh axes (``jax.sharding.Mesh(devices, names)``)
  an unwrapped ``tx`` learns the shardings from XLA (see the module
  docstring) and with explicit axes from the array types. The wrapper states
  them up front, which keeps the fused kernels on sharded leaves.
  ``init`` returns the state sharded by `state_shardings`; ``update`` runs
  ``tx.update`` with the mesh axes made explicit
  (``jax.sharding.explicit_axes``), so that every sharded leaf is updated per
  shard without all-gathers.

  Args:
    tx: any optax transformation (e.g. a chain with `adamw_4bit`).
    param_shardings: a pytree of ``NamedSharding`` like the params.

  Returns:
    The wrapped transformation.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax4bit
    >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    >>> mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    >>> shardings = {"w": NamedSharding(mesh, P("data", "model"))}
    >>> tx = optax4bit.shard_optimizer(optax4bit.adamw_4bit(1e-3), shardings)
    >>> params = jax.device_put({"w": jnp.ones((256, 512))}, shardings)
    >>> state = tx.init(params)
    >>> updates, state = jax.jit(tx.update)(params, state, params)
  """
  tx = optax.with_extra_args_support(tx)

  def init_fn(params):
    return jax.jit(tx.init, out_shardings=state_shardings(tx, params, param_shardings))(params)

  def update_fn(updates, state, params=None, **extra_args):
    leaves, treedef, shardings, mesh = _flat_shardings(updates, param_shardings)
    if mesh is None or all(t == AxisType.Explicit for t in mesh.axis_types):
      return tx.update(updates, state, params, **extra_args)
    auto = tuple(n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Auto)
    param_specs = treedef.unflatten([s.spec for s in shardings])
    state_specs = jax.tree.map(lambda s: s.spec, state_shardings(tx, updates, param_shardings))
    params_specs = None if params is None else param_specs

    def run(u, s, p, extra):
      return tx.update(u, s, p, **extra)

    extra_specs = jax.tree.map(lambda _: PartitionSpec(), extra_args)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return jax.sharding.explicit_axes(
          run, axes=auto, in_sharding=(param_specs, state_specs, params_specs, extra_specs))(
              updates, state, params, extra_args)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
