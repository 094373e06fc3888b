"""The implementation of `optax4bit.quantize_state` (see `optax4bit.wrappers`
for what it does and why): per-leaf ``init`` and ``update`` of an inner optax
transformation whose per-parameter state is stored quantized."""

from __future__ import annotations

import functools
import warnings
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from optax4bit import _leafwise
from optax4bit import _state_fields
from optax4bit import _state_sharding
from optax4bit import _validation
from optax4bit import dispatch as _dispatch
from optax4bit._leaf_context import LeafContext
from optax4bit._separability import (
    NOT_SEPARABLE_HINT,
    abstract_leaf,
    init_problem,
    is_elementwise,
    leaf_names,
    update_problem,
)
from optax4bit._state_fields import StateSplit
from optax4bit._validation import DEFAULT_CHUNK_SIZE
from optax4bit.quant import array as qarray
from optax4bit.quant import maps
from optax4bit.quant.spec import QuantSpec


class QuantizedState(NamedTuple):
  """State of `quantize_state`.

  Attributes:
    inner_state: the inner transformation's state, with every quantized leaf
      a `QuantizedArray` in place of its float array.
    rounding_count: steps taken; keys stochastic rounding (if a spec asks for
      it). Not named ``count`` so that ``optax.tree_utils.tree_get(state,
      "count")`` still finds the inner optimizer's count.
  """
  inner_state: Any
  rounding_count: jax.Array


class Config(NamedTuple):
  """The checked arguments of `quantize_state`."""
  inner: optax.GradientTransformationExtraArgs
  spec_for: Any
  min_quantize_size: int
  quantize_mask: Any
  per_leaf: Optional[bool]
  seed: int
  chunk_size: int
  recipe: str
  implementation: str = "auto"


def _dtype(x):
  """The dtype of an array or a Python scalar; JAX's extended dtypes (PRNG
  keys) as they are, since numpy cannot interpret them."""
  return x.dtype if hasattr(x, "dtype") else jnp.result_type(x)


def _same_shapes(a, b) -> bool:
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return (jax.tree.structure(a) == jax.tree.structure(b)
          and all(tuple(np.shape(x)) == tuple(np.shape(y)) and _dtype(x) == _dtype(y)
                  for x, y in zip(la, lb)))


def _decode_step(g32, old, side):
  del g32, side
  return old[0], old


def _encode_step(g32, old, side):
  del old, side
  return g32, (g32,)


def _decode(x, like, chunk_size: int, context: LeafContext):
  """The value a stored state leaf holds, in its dtype. A quantized leaf
  whose gradient ``like`` has a known sharding is decoded per shard (a block
  layout cannot be decoded on the global view of a sharded array)."""
  if not qarray.is_quantized(x):
    return x
  # A field in another shape than its parameter (GaLore's projected moments)
  # is decoded whole.
  if (like is None or _state_sharding.leaf_sharding(like) is None
      or tuple(np.shape(like)) != tuple(x.shape)):
    return x.dequantize()
  template = jnp.zeros_like(like, dtype=x.dtype)
  value, _ = _leafwise.update_leaf(_decode_step, template, (x,), chunk_size=chunk_size,
                                   context=context)
  return value


def _encode(value, like, key, context: LeafContext, chunk_size: int = DEFAULT_CHUNK_SIZE):
  """``value`` stored the way ``like`` is (a `QuantizedArray` or a plain
  array); per shard when ``value``'s sharding is known."""
  if not qarray.is_quantized(like):
    return value
  if _state_sharding.leaf_sharding(value) is None:
    return _leafwise.encode_moment(value.astype(jnp.float32), like, context, key)
  _, (new,) = _leafwise.update_leaf(_encode_step, value, (like,), keys=(key,),
                                    chunk_size=chunk_size, context=context)
  return new


def _rounding_key(seed, count, i: int, k: int):
  """Key of stochastic rounding for state position ``k`` of parameter ``i``."""
  return maps.stream_key(maps.stream_key(jax.random.fold_in(jax.random.key(seed), count), k), i)


def _encode_new(value, spec: Optional[QuantSpec], key_fn, param, context: LeafContext):
  """A state leaf of ``init`` stored with ``spec`` (None: as it is), placed
  like its parameter when the parameter is sharded."""
  if spec is None:
    return value
  key = key_fn() if spec.stochastic else None
  like = qarray.zeros(tuple(np.shape(value)), _dtype(value), spec)
  if _state_sharding.leaf_sharding(value) is not None:
    return _encode(value, like, key, context)
  if param is not None and tuple(np.shape(param)) == tuple(np.shape(value)):
    return _state_sharding.follow_param(param, lambda: _encode(value, like, key, context))
  return _encode(value, like, key, context)


def _inner_state(outer_def, mirror, mirrored: list, shared: list):
  """The inner state of one leaf from its per-parameter and shared leaves."""
  mirrored_it, shared_it = iter(mirrored), iter(shared)
  return outer_def.unflatten([next(mirrored_it) if m else next(shared_it) for m in mirror])


def restart_beside_overflow(new: list, quantized) -> list:
  """The new per-parameter fields of one leaf, with the quantized ones set to
  0 where another quantized field became ``+inf``.

  A quantized field cannot store ``inf`` (its scale counts finite values
  only), so the ``v = inf`` that makes Adam freeze an element after ``g**2``
  overflowed comes back finite; a huge first moment beside it would then make
  a step of ``m / eps``. The other quantized fields restart from 0 there
  instead, as the library's own Adam steps do
  (`optax4bit._steps.restart_overflowed`); fields kept as plain arrays keep
  what the wrapped optimizer made."""
  flags = [q and hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)
           for x, q in zip(new, quantized)]
  shapes = {tuple(np.shape(x)) for x, f in zip(new, flags) if f}
  if sum(flags) < 2 or len(shapes) > 1:  # elements of fields of other shapes do not pair up
    return list(new)
  overflowed = functools.reduce(jnp.logical_or, [jnp.isposinf(x) for x, f in zip(new, flags)
                                                  if f])
  return [jnp.where(overflowed & ~jnp.isposinf(x), jnp.zeros((), x.dtype), x) if f else x
          for x, f in zip(new, flags)]


def _inner_step(inner_update, outer_def, mirror, dtypes, quantized, g_dtype, has_param, shared,
                extra_args, g32, old, side):
  """``inner.update`` as a `_leafwise` step on float32 chunks. Traced values
  (``shared``, ``extra_args``) are arguments, so that ``functools.partial``
  of it can run per shard (`optax4bit._shard_map.hoist_partial`)."""
  old = [o.astype(d) for o, d in zip(old, dtypes)]
  u, new_state = inner_update(g32.astype(g_dtype), _inner_state(outer_def, mirror, old, shared),
                              side[0] if has_param else None, **extra_args)
  new_outer = outer_def.flatten_up_to(new_state)
  new = [x.astype(jnp.float32) for x, m in zip(new_outer, mirror) if m]
  return u.astype(jnp.float32), tuple(restart_beside_overflow(new, quantized))


def _init_leaf(inner_init, outer_def, mirror, leaf_specs, seed, p, i,
               context: LeafContext = LeafContext()):
  """``inner.init`` of one parameter leaf, its per-parameter state encoded:
  ``(mirrored, shared)`` (``context``: the leaf's, where traced in the
  caller's ``jit``; compiled on its own, a fresh one)."""
  # A barrier: inner.init mostly returns constants (zeros), and XLA would
  # otherwise constant-fold their whole encoding at compile time (seconds
  # per large leaf).
  outer = jax.lax.optimization_barrier(outer_def.flatten_up_to(inner_init(p)))
  specs = iter(leaf_specs)
  mirrored = [_encode_new(x, next(specs), functools.partial(_rounding_key, seed, 0, i, k), p,
                          context)
              for k, (x, m) in enumerate(zip(outer, mirror)) if m]
  return mirrored, [x for x, m in zip(outer, mirror) if not m]


_init_leaf_jit = jax.jit(_init_leaf, static_argnums=(0, 1, 2, 3, 4))


def _init_leaf_eager(static, leaf_specs, seed, p, i):
  """`_init_leaf` for a concrete parameter: compiled once per distinct leaf
  signature (`_state_sharding.follow_param` would compile once per leaf), then
  placed like the parameter when it is sharded."""
  mirrored, shared = _init_leaf_jit(*static, leaf_specs, seed, p, i)
  sharding = _state_sharding.leaf_sharding(p)
  if sharding is None:
    return mirrored, shared
  mirrored = jax.device_put(mirrored, _state_sharding.shardings_like_param(
      sharding, tuple(p.shape), mirrored))
  shared = jax.device_put(shared, jax.tree.map(
      lambda _: NamedSharding(sharding.mesh, PartitionSpec()), shared))
  return mirrored, shared




def _entry_shapes(tree):
  """Structure and leaf shapes of ``tree``, a `QuantizedArray` counting as one
  leaf (the array it stores)."""
  return (jax.tree.structure(tree, is_leaf=qarray.is_quantized),
          [tuple(np.shape(x)) for x in jax.tree.leaves(tree, is_leaf=qarray.is_quantized)])


def _split(config: Config, state, params_def, first_leaf) -> StateSplit:
  """Where ``state`` holds per-parameter entries: the subtrees shaped like the
  params, unless that split disagrees with ``inner.init`` of the first
  parameter leaf alone (a state list that happens to match the params' list,
  as SM3's accumulators of a 2-D parameter do for two parameters); then the
  outermost subtrees with the params' structure as a prefix."""
  exact = _state_fields.split_state(state, params_def)
  if params_def.num_nodes == 1:  # a bare array: every subtree has it as a prefix
    return exact
  try:
    alone = _entry_shapes(jax.eval_shape(config.inner.init, abstract_leaf(first_leaf)))
  except Exception:  # pylint: disable=broad-except  (reported by _check_leaf_init)
    return exact

  def first_slice(split: StateSplit):
    return _entry_shapes(split.outer_def.unflatten(
        [params_def.flatten_up_to(node)[0] if m else node
         for node, m in zip(split.outer_leaves, split.mirror)]))

  if first_slice(exact) == alone:
    return exact
  prefix = _state_fields.split_state(state, params_def, prefix=True)
  return prefix if first_slice(prefix) == alone else exact


def _assemble(split: StateSplit, params_def, mirrors: list, results: list):
  """The full inner state from per-leaf ``(mirrored, shared)`` results; shared
  leaves come from the first leaf."""
  shared = iter(results[0][1])
  by_mirror = {k: params_def.unflatten([r[0][j] for r in results])
               for j, k in enumerate(mirrors)}
  outer = [by_mirror[k] if m else next(shared) for k, m in enumerate(split.mirror)]
  return split.outer_def.unflatten(outer)


def _sequential(fn, inputs: list, shared=None, codecs=None) -> list:
  """``[fn(context, i, inputs[i], shared) for i]`` one leaf after another
  (see `_leafwise.sequential_map`, which makes each leaf's ``context``):
  ``fn`` returns ``(update, (mirrored, shared))``, and the inputs of a leaf
  wait for the previous leaf's codes."""
  return _leafwise.sequential_map(
      lambda context, i, args: fn(context, i, _leafwise.after_previous_leaf(args, context),
                                  shared),
      range(len(inputs)), inputs, codecs=codecs)


def _not_separable(problem: Optional[str]) -> bool:
  """Whether ``per_leaf=None`` falls back to the whole tree; warns if so."""
  if problem is None:
    return False
  warnings.warn(
      f"quantize_state: {problem}, so its {'init' if 'in init' in problem else 'update'} runs "
      "on the whole tree (every leaf's float32 state exists at once) instead of leaf by leaf. "
      "Keep the non-separable part outside the wrapper to run leaf by leaf (e.g. "
      "optax.chain(optax.clip_by_global_norm(1.0), quantize_state(optax.adam(lr)))), or pass "
      "per_leaf=False to choose the whole tree and silence this warning.", stacklevel=4)
  return True


# ----------------------------------------------------------------------------
# init


def _check_leaf_init(config: Config, split: StateSplit, params_def, params) -> None:
  """Raises unless ``inner.init`` of each parameter leaf alone gives that
  leaf's slice of ``inner.init(params)``."""
  mirrors = [k for k, m in enumerate(split.mirror) if m]
  abstract_mirror = {k: params_def.flatten_up_to(split.outer_leaves[k]) for k in mirrors}
  param_paths = leaf_names(params)
  for i, p in enumerate(params_def.flatten_up_to(params)):
    try:
      got = jax.eval_shape(config.inner.init, abstract_leaf(p))
    except Exception as e:  # pylint: disable=broad-except
      raise ValueError(
          f"inner.init fails on the parameter leaf {param_paths[i]} alone "
          f"({type(e).__name__}: {str(e)[:300]}). quantize_state calls inner once per "
          "parameter leaf, given as a bare array: a pytree-valued mask inside inner does not "
          "fit it (a callable mask does). Keep the masked transformation outside the "
          "wrapper, or pass per_leaf=False.") from e
    expected = split.outer_def.unflatten(
        [abstract_mirror[k][i] if m else split.outer_leaves[k]
         for k, m in enumerate(split.mirror)])
    if not _same_shapes(got, expected):
      raise ValueError(
          f"inner.init on the parameter leaf {param_paths[i]} alone does not give the slice of "
          f"inner.init(params) for that leaf: {got} vs {expected}. {NOT_SEPARABLE_HINT}")


def _init_whole_tree(config: Config, split: StateSplit, specs: list, params_def, params,
                     count):
  """``per_leaf=False``: ``inner.init`` on the whole tree, then encoded."""
  outer = split.outer_def.flatten_up_to(config.inner.init(params))
  param_leaves = params_def.flatten_up_to(params)
  new_outer = []
  for k, node in enumerate(outer):
    if not split.mirror[k]:
      new_outer.append(node)
      continue
    new_outer.append(params_def.unflatten([
        _encode_new(x, specs[k][i], functools.partial(_rounding_key, config.seed, count, i, k), p,
                    LeafContext())
        for i, (x, p) in enumerate(zip(params_def.flatten_up_to(node), param_leaves))]))
  return split.outer_def.unflatten(new_outer)


def init(config: Config, params) -> QuantizedState:
  """``quantize_state(...).init``."""
  params_def = jax.tree.structure(params)
  count = jnp.zeros([], jnp.int32)
  if params_def.num_leaves == 0:
    return QuantizedState(config.inner.init(params), count)
  abstract_params = jax.tree.map(abstract_leaf, params)
  abstract_state = jax.eval_shape(config.inner.init, abstract_params)
  split = _split(config, abstract_state, params_def, jax.tree.leaves(params)[0])
  specs = _state_fields.plan_specs(abstract_state, params, params_def, split, config.spec_for,
                                   config.min_quantize_size, config.quantize_mask,
                                   config.recipe)
  whole_tree = config.per_leaf is False or (config.per_leaf is None and _not_separable(
      init_problem(config.inner.init, abstract_params, abstract_state, params_def, split)))
  if whole_tree:
    return QuantizedState(_init_whole_tree(config, split, specs, params_def, params, count),
                          count)
  _check_leaf_init(config, split, params_def, params)
  mirrors = [k for k, m in enumerate(split.mirror) if m]
  static = (config.inner.init, split.outer_def, tuple(split.mirror))

  def init_leaf(context, i, p, _):
    leaf_specs = tuple(specs[k][i] for k in mirrors)
    if isinstance(p, jax.core.Tracer):  # inside the caller's jit
      return None, _init_leaf(*static, leaf_specs, config.seed, p, i, context)
    return None, _init_leaf_eager(static, leaf_specs, config.seed, p, i)

  results = _sequential(init_leaf, params_def.flatten_up_to(params))
  return QuantizedState(_assemble(split, params_def, mirrors, [r for _, r in results]), count)


# ----------------------------------------------------------------------------
# update


class _Step(NamedTuple):
  """What every leaf's update needs besides its own inputs."""
  config: Config
  split: StateSplit
  mirrors: list        # outer positions of the per-parameter fields
  count: jax.Array     # the new rounding count
  extra_args: dict
  update_names: list
  codecs: Any          # the backend's codecs (`optax4bit.dispatch.resolve`), or None


def _encode_result(step: _Step, new, old, i: int, k: int, context: LeafContext):
  """New state leaf ``new`` of parameter ``i`` at outer position ``k``,
  stored as the old one ``old`` is."""
  if not qarray.is_quantized(old):
    return new
  key = _rounding_key(step.config.seed, step.count, i, k) if old.spec.stochastic else None
  return _encode(new, old, key, context, step.config.chunk_size)


def _check_update_inputs(split: StateSplit) -> None:
  for k, (path, node) in enumerate(zip(split.outer_paths, split.outer_leaves)):
    if not split.mirror[k] and qarray.is_quantized(node):
      raise ValueError(
          f"the quantized state leaf at {jax.tree_util.keystr(path)} is not in a subtree with "
          "the structure of the updates: the updates do not have the structure of the params "
          "given to init.")


def _update_whole_tree(step: _Step, updates, params, params_def, grads, mirror_leaves):
  """``per_leaf=False``: decode everything, ``inner.update`` on the whole
  tree, encode everything."""
  split, chunk = step.split, step.config.chunk_size
  context = LeafContext(step.codecs)  # the whole tree at once: nothing to order
  decoded = split.outer_def.unflatten([
      params_def.unflatten([_decode(x, grads[i], chunk, context)
                            for i, x in enumerate(mirror_leaves[k])]) if m else node
      for k, (node, m) in enumerate(zip(split.outer_leaves, split.mirror))])
  new_updates, new_state = step.config.inner.update(updates, decoded, params, **step.extra_args)
  try:
    new_outer = split.outer_def.flatten_up_to(new_state)
  except (ValueError, TypeError) as e:
    raise ValueError(f"inner.update returned a state of another structure: {e}") from None
  out = []
  for k, new in enumerate(new_outer):
    if not split.mirror[k]:
      out.append(new)
      continue
    out.append(params_def.unflatten(
        [_encode_result(step, a, b, i, k, context)
         for i, (a, b) in enumerate(zip(params_def.flatten_up_to(new), mirror_leaves[k]))]))
  return new_updates, split.outer_def.unflatten(out)


def _elementwise_update_leaf(step: _Step, i, g, stored, p, shared_in, context: LeafContext):
  """One leaf's update through `_leafwise.update_leaf`: in chunks of rows for
  a large leaf, per shard for a sharded one."""
  split, inner = step.split, step.config.inner
  leaf_step = functools.partial(
      _inner_step, inner.update, split.outer_def, tuple(split.mirror),
      tuple(np.dtype(x.dtype) for x in stored), tuple(qarray.is_quantized(x) for x in stored),
      np.dtype(g.dtype), p is not None,
      list(shared_in), dict(step.extra_args))
  keys = tuple(_rounding_key(step.config.seed, step.count, i, k)
               if qarray.is_quantized(x) and x.spec.stochastic else None
               for k, x in zip(step.mirrors, stored))
  u, new_mirrored = _leafwise.update_leaf(leaf_step, g, tuple(stored),
                                          () if p is None else (p,), keys,
                                          step.config.chunk_size, context=context)
  # Shared outputs do not depend on the per-parameter inputs (checked by
  # is_elementwise): take them from a call on one row of zeros, which XLA
  # reduces to the few scalar operations that make them.
  row = lambda x: jnp.zeros((1,) * max(np.ndim(x), 1), x.dtype)  # noqa: E731
  _, new_state = inner.update(row(g), _inner_state(split.outer_def, split.mirror,
                                                   [row(x) for x in stored], shared_in),
                              None if p is None else row(p), **step.extra_args)
  new_outer = split.outer_def.flatten_up_to(new_state)
  return u, (list(new_mirrored), [x for x, m in zip(new_outer, split.mirror) if not m])


def _whole_update_leaf(step: _Step, i, g, stored, p, shared_in, context: LeafContext):
  """One leaf's update on the whole leaf: decode, ``inner.update``, encode."""
  split, chunk = step.split, step.config.chunk_size
  stored_it, shared_it = iter(stored), iter(shared_in)
  inner_state = split.outer_def.unflatten(
      [_decode(next(stored_it), g, chunk, context) if m else next(shared_it)
       for m in split.mirror])
  u, new_state = step.config.inner.update(g, inner_state, p, **step.extra_args)
  if tuple(np.shape(u)) != tuple(np.shape(g)):
    # A state field may have another shape than its parameter (GaLore), so a
    # gradient of a wrong shape can broadcast against it instead of failing.
    raise ValueError(
        f"inner.update turned the update at {step.update_names[i]} of shape "
        f"{tuple(np.shape(g))} into one of shape {tuple(np.shape(u))}: the updates do not "
        f"have the shapes of the params given to init.")
  try:
    new_outer = split.outer_def.flatten_up_to(new_state)
  except (ValueError, TypeError) as e:
    raise ValueError(
        f"inner.update on the leaf {step.update_names[i]} returned a state of another "
        f"structure than it was given: {e}. {NOT_SEPARABLE_HINT}") from None
  new_mirrored = restart_beside_overflow([new_outer[k] for k in step.mirrors],
                                         [qarray.is_quantized(old) for old in stored])
  mirrored = [_encode_result(step, new, old, i, k, context)
              for new, old, k in zip(new_mirrored, stored, step.mirrors)]
  return u, (mirrored, [x for x, m in zip(new_outer, split.mirror) if not m])


def _update_per_leaf(step: _Step, grads, param_leaves, mirror_leaves):
  """``inner.update`` once per parameter leaf, one leaf after another."""
  split = step.split
  elementwise_cache = {}

  def elementwise(g, stored, p, shared_in) -> bool:
    abstract = _inner_state(split.outer_def, split.mirror,
                            [jax.ShapeDtypeStruct(tuple(x.shape), x.dtype) for x in stored],
                            shared_in)
    signature = (jax.tree.structure(abstract), tuple(
        (tuple(np.shape(x)), _dtype(x)) for x in jax.tree.leaves((g, abstract, p))))
    if signature not in elementwise_cache:
      elementwise_cache[signature] = is_elementwise(step.config.inner.update, g, abstract, p,
                                                    split, step.extra_args)
    return elementwise_cache[signature]

  def update_leaf(context, i, args, shared_in):
    g, stored, p = args
    if (np.ndim(g) >= 1 and any(map(qarray.is_quantized, stored))
        and all(map(_validation.is_array_like, stored))  # not an entry that is a subtree
        and all(tuple(np.shape(x)) == tuple(np.shape(g)) for x in stored)
        and elementwise(g, stored, p, shared_in)):
      return _elementwise_update_leaf(step, i, g, stored, p, shared_in, context)
    return _whole_update_leaf(step, i, g, stored, p, shared_in, context)

  inputs = [(grads[i], [mirror_leaves[k][i] for k in step.mirrors], param_leaves[i])
            for i in range(len(grads))]
  shared = [x for x, m in zip(split.outer_leaves, split.mirror) if not m]
  return _sequential(update_leaf, inputs, shared, step.codecs)


def _function_argument_problem(extra_args: dict) -> Optional[str]:
  """A function among the extra arguments (``optax.contrib.sophia``'s
  ``obj_fn``) takes the whole params tree: a call on one leaf cannot use it."""
  names = sorted(k for k, v in extra_args.items() if callable(v))
  if not names:
    return None
  return (f"inner is not leaf-separable: in update, the extra argument {names[0]!r} is a "
          "function, which expects the whole parameter tree")


def _decoded_abstract(tree):
  """``tree`` with each `QuantizedArray` replaced by the array it decodes to
  (shape and dtype only)."""
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if qarray.is_quantized(x) else x,
      tree, is_leaf=qarray.is_quantized)


def update(config: Config, updates, state, params=None, **extra_args):
  """``quantize_state(...).update``, with the backend's 4-bit codecs where it
  has them (`optax4bit.dispatch.per_platform`)."""
  if not isinstance(state, QuantizedState):
    raise ValueError(f"state must be the QuantizedState of quantize_state's init, got "
                     f"{type(state).__name__}.")
  params_def = jax.tree.structure(updates)
  n = params_def.num_leaves
  count = optax.safe_increment(state.rounding_count)
  if n == 0:
    new_updates, inner_state = config.inner.update(updates, state.inner_state, params,
                                                   **extra_args)
    return new_updates, QuantizedState(inner_state, count)
  split = _split(config, state.inner_state, params_def, jax.tree.leaves(updates)[0])
  grads = jax.tree.leaves(updates)
  if params is None:
    param_leaves = [None] * n
  else:
    try:
      param_leaves = params_def.flatten_up_to(params)
    except (ValueError, TypeError) as e:
      raise ValueError(f"params do not have the structure of the updates: {e}") from None
  mirrors = [k for k, m in enumerate(split.mirror) if m]
  mirror_leaves = {k: params_def.flatten_up_to(split.outer_leaves[k]) for k in mirrors}
  update_names = leaf_names(updates)
  _check_update_inputs(split)
  whole_tree = config.per_leaf is False or (config.per_leaf is None and _not_separable(
      _function_argument_problem(extra_args) or update_problem(
          config.inner.update, jax.tree.map(abstract_leaf, updates),
          jax.tree.map(abstract_leaf, _decoded_abstract(state.inner_state)),
          None if params is None else jax.tree.map(abstract_leaf, params), params_def, split,
          extra_args)))

  def update_with(backend):
    step = _Step(config, split, mirrors, count, extra_args, update_names, backend.codecs)
    if whole_tree:
      return _update_whole_tree(step, updates, params, params_def, grads, mirror_leaves)
    results = _update_per_leaf(step, grads, param_leaves, mirror_leaves)
    return (params_def.unflatten([u for u, _ in results]),
            _assemble(split, params_def, mirrors, [r for _, r in results]))

  new_updates, new_state = _dispatch.per_platform(config.implementation, update_with,
                                                  codecs_only=True)
  return new_updates, QuantizedState(new_state, count)


def plain_arrays(tree):
  """``tree`` with array-like wrappers (``flax.nnx.Variable``) replaced by
  their array: the state must not hold them, since ``nnx.Optimizer`` rebuilds
  a Variable from its leaves, which would turn a `QuantizedArray` into a dict."""
  return jax.tree.map(lambda x: jax.tree.leaves(x)[0], tree, is_leaf=_validation.is_array_like)
