"""`scale_by_*` gradient transformations whose moments are stored quantized."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax4bit import _leafwise
from optax4bit import _steps
from optax4bit import _validation
from optax4bit._validation import DEFAULT_MIN_QUANTIZE_SIZE, MaskOrFn
from optax4bit import recipes as _recipes
from optax4bit import _state_sharding
from optax4bit import dispatch as _dispatch
from optax4bit.quant import array as qarray
from optax4bit.quant import maps
from optax4bit.quant.spec import QuantSpec, SpecLike

__all__ = [
    "FactoredMoment",
    "ScaleByAdam4bitState",
    "ScaleByFactoredAdam4bitState",
    "ScaleByMomentum4bitState",
    "scale_by_adam_4bit",
    "scale_by_factored_adam_4bit",
    "scale_by_momentum_4bit",
    "state_nbytes",
]

class ScaleByAdam4bitState(NamedTuple):
  """State of `scale_by_adam_4bit`: like ``optax.ScaleByAdamState``, with each
  moment leaf a `QuantizedArray` or, for leaves kept in full precision, a
  float32 array."""
  count: jax.Array
  mu: optax.Updates
  nu: optax.Updates


class FactoredMoment(NamedTuple):
  """Adafactor-style second moment of a tensor with ndim >= 2: EMAs of the
  mean of ``g**2`` over the last axis (``row``, shape ``(..., r, 1)``) and over
  the second-to-last axis (``col``, shape ``(..., 1, c)``)."""
  row: jax.Array
  col: jax.Array


class ScaleByFactoredAdam4bitState(NamedTuple):
  """State of `scale_by_factored_adam_4bit`: ``nu`` leaves are
  `FactoredMoment` for quantized leaves with ndim >= 2."""
  count: jax.Array
  mu: optax.Updates
  nu: optax.Updates


class ScaleByMomentum4bitState(NamedTuple):
  """State of `scale_by_momentum_4bit`: the momentum ``trace`` (quantized
  per leaf) and a step ``count`` that keys stochastic rounding."""
  count: jax.Array
  trace: optax.Updates


def _state_treedef(tree, num_leaves: int):
  """Structure of the per-leaf state of ``tree``: pytree nodes that wrap one
  array and expose ``shape``/``dtype`` (e.g. ``flax.nnx.Variable``) are
  dropped, so a moment is a plain `QuantizedArray` or array. (Flax's
  ``nnx.Optimizer`` rebuilds a Variable's value from its array leaves, which
  would turn a `QuantizedArray` inside a Variable into a dict.)"""
  treedef = jax.tree.structure(tree, is_leaf=_validation.is_array_like)
  return treedef if treedef.num_leaves == num_leaves else jax.tree.structure(tree)


def _flatten_params(params) -> tuple:
  """Array leaves of ``params`` and the structure of their per-leaf state."""
  leaves = jax.tree.leaves(params)
  return leaves, _state_treedef(params, len(leaves))


def _flatten_like(updates, trees: dict) -> tuple:
  """Flattens ``updates`` and each state tree up to its structure, with clear
  errors when they do not match. Returns the leaves, the structure of the
  updates and that of the state (see `_state_treedef`), and the flat states."""
  paths_and_leaves, treedef = jax.tree_util.tree_flatten_with_path(updates)
  state_treedef = _state_treedef(updates, len(paths_and_leaves))
  flat = {}
  for name, tree in trees.items():
    try:
      flat[name] = state_treedef.flatten_up_to(tree)
    except (ValueError, TypeError) as e:
      raise ValueError(
          f"the updates do not have the structure of the optimizer state's {name!r} (the params "
          f"given to init): {e}") from None
  for i, (path, g) in enumerate(paths_and_leaves):
    for name, leaves in flat.items():
      shape = getattr(leaves[i], "shape", None)
      if isinstance(leaves[i], FactoredMoment):
        shape = leaves[i].row.shape[:-1] + leaves[i].col.shape[-1:]
      if shape is not None and tuple(shape) != tuple(g.shape):
        raise ValueError(
            f"update at {jax.tree_util.keystr(path)} has shape {tuple(g.shape)} but the optimizer "
            f"state's {name!r} there has shape {tuple(shape)}.")
  return [g for _, g in paths_and_leaves], treedef, state_treedef, flat


def _leaf_keys(seed, count, num_leaves: int, num_moments: int, stochastic: bool):
  if not stochastic:
    return [(None,) * num_moments] * num_leaves
  base = jax.random.fold_in(jax.random.key(seed), count)
  return [tuple(maps.stream_key(base, leaf * num_moments + m) for m in range(num_moments))
          for leaf in range(num_leaves)]


def _zeros_moment(leaf, spec: Optional[QuantSpec], dtype=None, real: bool = False):
  """Zero moment of ``leaf``, sharded like it when its sharding is known
  (see `optax4bit.sharding`).

  ``dtype``: the dtype asked for (``mu_dtype``, ``accumulator_dtype``; None:
  none). A moment kept unquantized is stored in it (default float32: the
  step's math is float32); a complex leaf's moment is complex (its precision
  at least ``dtype``'s) unless ``real`` (second moments: real, of the leaf's
  precision, as ``|g|**2`` is). A quantized moment reports (and `dequantize`s
  to) the real ``dtype`` asked for, else float32; a complex ``dtype`` asks for
  a complex moment, which is not quantized.
  """
  if dtype is not None and jnp.issubdtype(dtype, jnp.complexfloating):
    spec = None
  if spec is None:
    store = jnp.float32 if dtype is None else dtype
    if jnp.iscomplexobj(leaf):
      store = jnp.promote_types(
          jnp.real(jnp.zeros((), leaf.dtype)).dtype if real else leaf.dtype, store)
    return _state_sharding.follow_param(leaf, lambda: jnp.zeros(leaf.shape, store))
  label = jnp.float32 if dtype is None else dtype
  return _state_sharding.follow_param(leaf, lambda: qarray.zeros(tuple(leaf.shape), label, spec))


def _zeros_factored(shape: tuple) -> FactoredMoment:
  return FactoredMoment(jnp.zeros(shape[:-1] + (1,), jnp.float32),
                        jnp.zeros(shape[:-2] + (1,) + shape[-1:], jnp.float32))





# ----------------------------------------------------------------------------
# Adam.


def _check_adam_args(b1, b2, eps, eps_root, recipe, first_moment, second_moment) -> tuple:
  """Validates Adam's hyperparameters; returns the moments' `QuantSpec`s."""
  _validation.check_hyperparam("b1", b1, low=0, high=1, high_open=True)
  _validation.check_hyperparam("b2", b2, low=0, high=1, high_open=True)
  _validation.check_hyperparam("eps", eps, low=0)
  _validation.check_hyperparam("eps_root", eps_root, low=0)
  return tuple(_recipes.resolve(recipe, first_moment, second_moment))


def scale_by_adam_4bit(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Optional[Any] = None,
    *,
    nesterov: bool = False,
    recipe: str = "default",
    first_moment: Optional[SpecLike] = None,
    second_moment: Optional[SpecLike] = None,
    min_quantize_size: int = DEFAULT_MIN_QUANTIZE_SIZE,
    quantize_mask: MaskOrFn = None,
    seed: int = 0,
    chunk_size: Optional[int] = None,
    implementation: _dispatch.Implementation = "auto",
) -> optax.GradientTransformation:
  """Rescales updates by the Adam rule with both moments stored quantized.

  The same computation as ``optax.scale_by_adam``: each step decodes the
  moments, runs the exact float32 update, and encodes the new moments; the
  update itself uses the precise new moments. Math is float32 whatever the
  parameter dtype; updates come back in the gradient's dtype.

  Args:
    b1: decay rate of the first moment.
    b2: decay rate of the second moment.
    eps: term added to the denominator outside the square root.
    eps_root: term added to the second moment inside the square root.
    mu_dtype: dtype of first moments kept unquantized (default float32;
      optax's default is the parameters' dtype, but the step's math is
      float32 and such leaves are small). A quantized moment reports
      ``mu_dtype`` (what its `dequantize` returns; the step decodes to
      float32), float32 by default. A complex ``mu_dtype`` keeps every first
      moment complex and unquantized. A complex parameter's moment stays
      complex whatever ``mu_dtype`` says: a real one would drop its
      imaginary part.
    nesterov: use Nesterov momentum, as in ``optax.scale_by_adam``.
    second_moment: quantizer of the second moment (unsigned), overriding the
      recipe's; a map with a zero code (``"B128/DE"``) shows the paper's
      zero-point problem.
    recipe: ``"default"`` (first moment ``B128/NF``, second moment
      ``Rank-1/SqrtLinear``, the first rounded stochastically where nearest
      rounding would keep its stored code, the second stochastically) or
      ``"paper"`` (``B128/DE`` and ``Rank-1/Linear``, nearest rounding); see
      `optax4bit.recipes`.
    first_moment: quantizer of the first moment, overriding the recipe's: a
      name such as ``"B128/DE"`` (signed) or a `QuantSpec`.
    min_quantize_size: leaves with at most this many elements keep float32
      moments (the paper's rule, 4096).
    quantize_mask: a pytree of bools like the params (or a prefix of it), or a
      callable of the params returning one; ``False`` leaves keep float32
      moments (e.g. embeddings or norms).
    seed: seeds stochastic rounding (only used if a spec has
      ``stochastic=True``); the key of a step is derived from it and the step
      count, so runs are reproducible.
    chunk_size: leaves larger than this many elements are updated in chunks
      of rows, bounding the transient memory of the update (default 2**18).
    implementation: ``"auto"`` (the engine of the platform the update is
      compiled for: on a CUDA GPU the Pallas kernels, and the XLA engine on
      the leaves they decline; on a TPU the Pallas TPU kernels; on CPU the
      C++ kernel of `optax4bit.cpu` where it is installed and beats the jnp
      path), ``"jnp"``, ``"xla"``, ``"tpu"``, ``"cpu"``, ``"pallas"``, the
      interpret modes ``"pallas_interpret"`` and ``"tpu_interpret"``, or an
      ``optax4bit.pallas.PallasConfig``; see `optax4bit.dispatch`. Leaves an
      engine does not cover run the jnp reference.

  Returns:
    An ``optax.GradientTransformation`` with `ScaleByAdam4bitState`.

  Example:
    >>> import jax, jax.numpy as jnp, optax, optax4bit
    >>> tx = optax.chain(optax4bit.scale_by_adam_4bit(min_quantize_size=0),
    ...                  optax.scale(-1e-3))
    >>> params = {"w": jnp.ones((256, 256))}
    >>> state = tx.init(params)
    >>> updates, state = jax.jit(tx.update)({"w": jnp.full((256, 256), 0.5)}, state)
    >>> round(float(updates["w"][0, 0]), 6)
    -0.001
  """
  m_spec, v_spec = _check_adam_args(b1, b2, eps, eps_root, recipe, first_moment,
                                    second_moment)
  min_quantize_size = _validation.check_static_int("min_quantize_size", min_quantize_size)
  chunk = _validation.check_chunk_size(chunk_size)
  implementation = _dispatch.check_implementation(implementation)
  mu_dtype = None if mu_dtype is None else jnp.dtype(mu_dtype)
  stochastic = m_spec.stochastic or v_spec.stochastic

  def init_fn(params):
    flags = _validation.resolve_mask(quantize_mask, params, "quantize_mask")
    leaves, treedef = _flatten_params(params)
    quantized = [_validation.quantizable(p, f, min_quantize_size) for p, f in zip(leaves, flags)]
    mu = [_zeros_moment(p, m_spec if q else None, mu_dtype) for p, q in zip(leaves, quantized)]
    nu = [_zeros_moment(p, v_spec if q else None, real=True) for p, q in zip(leaves, quantized)]
    return ScaleByAdam4bitState(jnp.zeros([], jnp.int32), treedef.unflatten(mu),
                                treedef.unflatten(nu))

  def update_fn(updates, state, params=None):
    del params
    grads, treedef, state_def, flat = _flatten_like(updates, {"mu": state.mu, "nu": state.nu})
    count_inc = optax.safe_increment(state.count)
    step = _steps.adam_step(b1, b2, eps, eps_root, count_inc, nesterov)
    keys = _leaf_keys(seed, count_inc, len(grads), 2, stochastic)

    fused_step = _steps.FusedStep.adam(b1, b2, eps, eps_root, count_inc, nesterov)

    def update_with(backend):
      def leaf_fn(context, g, m, v, k):
        out = backend.steps and backend.steps.run(fused_step, g, (m, v), (), k, context=context)
        if out:
          return out
        return _leafwise.update_leaf(step, g, (m, v), keys=k, chunk_size=chunk, context=context)

      # Leaves no fused step covers run the jnp engine, with the backend's codecs.
      return _leafwise.sequential_map(leaf_fn, grads, flat["mu"], flat["nu"], keys,
                                      codecs=backend.codecs)

    results = _dispatch.per_platform(implementation, update_with)
    new_updates = treedef.unflatten([u for u, _ in results])
    mu = state_def.unflatten([m for _, (m, _) in results])
    nu = state_def.unflatten([v for _, (_, v) in results])
    return new_updates, ScaleByAdam4bitState(count_inc, mu, nu)

  return optax.GradientTransformation(init_fn, update_fn)


# ----------------------------------------------------------------------------
# Adam with a factored second moment ("4-bit Factor").


def _factored_second_moment(grad, old: FactoredMoment, b2, chunk_size, context, row_sums=None):
  """New row/column EMAs of the means of ``g**2`` over the last two axes;
  ``row_sums`` sums the rows (None: ``jnp.sum``; see `optax4bit.dispatch.Backend`).

  Returns the gradient as threaded through the chunked reduction (see
  `_leafwise.grad_sums`) and the new `FactoredMoment`.
  """
  def sums(g):
    g2 = g * g
    # A non-finite gradient element counts as 0 in the row/column means:
    # otherwise one NaN would poison its whole row and column factor for good.
    g2 = jnp.where(jnp.isfinite(g2), g2, 0)
    row = jnp.sum(g2, axis=-1, keepdims=True) if row_sums is None else row_sums(g2)
    col = jnp.sum(g2, axis=-2, keepdims=True)
    # For 2-D leaves the chunks split axis -2: column sums add up over chunks.
    return ((row,), (col,)) if g.ndim == 2 else ((row, col), ())

  grad, row_stats, totals = _leafwise.grad_sums(grad, sums, chunk_size, context=context)
  row_sum = row_stats[0]
  col_sum = totals[0] if grad.ndim == 2 else row_stats[1]
  # Without the barrier XLA:TPU moves the EMA's scaling before the sums'
  # reshape, into the reduction's layout, and splits each EMA in two fusions.
  row_sum, col_sum = jax.lax.optimization_barrier((row_sum, col_sum))
  row = b2 * old.row + (1 - b2) * (row_sum / grad.shape[-1])
  col = b2 * old.col + (1 - b2) * (col_sum / grad.shape[-2])
  return grad, FactoredMoment(row, col)


def scale_by_factored_adam_4bit(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    *,
    recipe: str = "default",
    first_moment: Optional[SpecLike] = None,
    second_moment: Optional[SpecLike] = None,
    min_quantize_size: int = DEFAULT_MIN_QUANTIZE_SIZE,
    quantize_mask: MaskOrFn = None,
    factor_mask: MaskOrFn = None,
    seed: int = 0,
    chunk_size: Optional[int] = None,
    implementation: _dispatch.Implementation = "auto",
) -> optax.GradientTransformation:
  """Adam with a quantized first moment and a factored second moment.

  The paper's "4-bit Factor". For quantized leaves with ndim >= 2 the second
  moment is Adafactor-style: EMAs of the row means and column means of
  ``g**2`` over the last two axes (a `FactoredMoment`, float32, a few bytes
  per row and column), rebuilt as ``outer(row, col) / mean(row)`` (0 where
  the row factors are all 0). Quantized 1-D leaves, and those ``factor_mask``
  leaves unfactored, store the second moment with ``second_moment``; leaves
  kept in full precision have float32 ``mu`` and ``nu`` and follow Adam
  exactly.

  Args:
    b1: decay rate of the first moment.
    b2: decay rate of the second moment (and of its factors).
    eps: term added to the denominator outside the square root.
    eps_root: term added to the second moment inside the square root.
    second_moment: quantizer of the second moment of 1-D leaves (and of the
      leaves ``factor_mask`` leaves unfactored), overriding the recipe's.
    recipe: ``"default"`` (first moment ``B128/NF``, second moment
      ``Rank-1/SqrtLinear``, the first rounded stochastically where nearest
      rounding would keep its stored code, the second stochastically) or
      ``"paper"`` (``B128/DE`` and ``Rank-1/Linear``, nearest rounding); see
      `optax4bit.recipes`.
    first_moment: quantizer of the first moment, overriding the recipe's: a
      name such as ``"B128/DE"`` (signed) or a `QuantSpec`.
    min_quantize_size: leaves with at most this many elements keep float32
      moments (the paper's rule, 4096).
    quantize_mask: a pytree of bools like the params (or a prefix of it), or a
      callable of the params returning one; ``False`` leaves keep float32
      moments (e.g. embeddings or norms).
    factor_mask: like ``quantize_mask``: ``False`` quantized leaves of two
      or more axes keep their second moment quantized with ``second_moment``
      (rank-1 4-bit, as `scale_by_adam_4bit`'s) instead of factored. Factoring
      attention's matrices cost a byte LM 1.6% of validation loss, the MLP's
      nothing (benchmarks/RESULTS.md); None factors every such leaf.
    seed: seeds stochastic rounding (only used if a spec has
      ``stochastic=True``); the key of a step is derived from it and the step
      count, so runs are reproducible.
    chunk_size: leaves larger than this many elements are updated in chunks
      of rows, bounding the transient memory of the update (default 2**18).
    implementation: ``"auto"`` (the engine of the platform the update is
      compiled for: on a CUDA GPU the Pallas kernels, and the XLA engine on
      the leaves they decline; on a TPU the Pallas TPU kernels; on CPU the
      C++ kernel of `optax4bit.cpu` where it is installed and beats the jnp
      path), ``"jnp"``, ``"xla"``, ``"tpu"``, ``"cpu"``, ``"pallas"``, the
      interpret modes ``"pallas_interpret"`` and ``"tpu_interpret"``, or an
      ``optax4bit.pallas.PallasConfig``; see `optax4bit.dispatch`. Leaves an
      engine does not cover run the jnp reference.

  Returns:
    An ``optax.GradientTransformation`` with `ScaleByFactoredAdam4bitState`.

  Example:
    >>> import jax.numpy as jnp, optax4bit
    >>> tx = optax4bit.scale_by_factored_adam_4bit(min_quantize_size=0)
    >>> state = tx.init({"w": jnp.ones((64, 32))})
    >>> state.nu["w"].row.shape, state.nu["w"].col.shape
    ((64, 1), (1, 32))
  """
  m_spec, v_spec = _check_adam_args(b1, b2, eps, eps_root, recipe, first_moment,
                                    second_moment)
  min_quantize_size = _validation.check_static_int("min_quantize_size", min_quantize_size)
  chunk = _validation.check_chunk_size(chunk_size)
  implementation = _dispatch.check_implementation(implementation)
  stochastic = m_spec.stochastic or v_spec.stochastic

  def init_fn(params):
    flags = _validation.resolve_mask(quantize_mask, params, "quantize_mask")
    factored = _validation.resolve_mask(factor_mask, params, "factor_mask")
    leaves, treedef = _flatten_params(params)
    mu, nu = [], []
    for p, flag, factor in zip(leaves, flags, factored):
      quantized = _validation.quantizable(p, flag, min_quantize_size)
      mu.append(_zeros_moment(p, m_spec if quantized else None))
      if quantized and factor and len(p.shape) >= 2:
        nu.append(_state_sharding.follow_param(p, functools.partial(_zeros_factored, p.shape)))
      else:
        nu.append(_zeros_moment(p, v_spec if quantized else None, real=True))
    return ScaleByFactoredAdam4bitState(jnp.zeros([], jnp.int32), treedef.unflatten(mu),
                                        treedef.unflatten(nu))

  def update_fn(updates, state, params=None):
    del params
    grads, treedef, state_def, flat = _flatten_like(updates, {"mu": state.mu, "nu": state.nu})
    count_inc = optax.safe_increment(state.count)
    adam = _steps.adam_step(b1, b2, eps, eps_root, count_inc, False)
    factored_step = _steps.factored_step(b1, b2, eps, eps_root, count_inc)
    keys = _leaf_keys(seed, count_inc, len(grads), 2, stochastic)

    fused_adam = _steps.FusedStep.adam(b1, b2, eps, eps_root, count_inc, False)
    fused_factored = _steps.FusedStep.factored(b1, b2, eps, eps_root, count_inc)

    def update_with(backend):
      fused = backend.steps

      def leaf_fn(context, g, m, v, k):
        if not isinstance(v, FactoredMoment):
          out = fused and fused.run(fused_adam, g, (m, v), (), k, context=context)
          return out or _leafwise.update_leaf(adam, g, (m, v), keys=k, chunk_size=chunk,
                                              context=context)
        g, v = _factored_second_moment(g, v, b2, None if backend.whole_leaves else chunk,
                                       context, backend.row_sums)
        side = (v.row, v.col, jnp.mean(v.row, axis=-2, keepdims=True))
        out = fused and fused.run(fused_factored, g, (m,), side, k[:1], context=context)
        update, (m,) = out or _leafwise.update_leaf(factored_step, g, (m,), side, keys=k[:1],
                                                    chunk_size=chunk, context=context)
        return update, (m, v)

      # Leaves no fused step covers run the jnp engine, with the backend's codecs.
      return _leafwise.sequential_map(leaf_fn, grads, flat["mu"], flat["nu"], keys,
                                      codecs=backend.codecs)

    results = _dispatch.per_platform(implementation, update_with)
    new_updates = treedef.unflatten([u for u, _ in results])
    mu = state_def.unflatten([m for _, (m, _) in results])
    nu = state_def.unflatten([v for _, (_, v) in results])
    return new_updates, ScaleByFactoredAdam4bitState(count_inc, mu, nu)

  return optax.GradientTransformation(init_fn, update_fn)


# ----------------------------------------------------------------------------
# Momentum.


def scale_by_momentum_4bit(
    momentum: float = 0.9,
    nesterov: bool = False,
    accumulator_dtype: Optional[Any] = None,
    *,
    recipe: str = "default",
    first_moment: Optional[SpecLike] = None,
    min_quantize_size: int = DEFAULT_MIN_QUANTIZE_SIZE,
    quantize_mask: MaskOrFn = None,
    seed: int = 0,
    chunk_size: Optional[int] = None,
    implementation: _dispatch.Implementation = "auto",
) -> optax.GradientTransformation:
  """Heavy-ball momentum (``optax.trace``) with a quantized buffer.

  ``trace = g + momentum * trace``; the update is ``trace`` (or
  ``g + momentum * trace`` with ``nesterov``), as in ``optax.trace``.

  Args:
    momentum: the decay of the trace.
    nesterov: Nesterov momentum.
    accumulator_dtype: dtype of a trace kept unquantized (default float32,
      whatever the parameter dtype: the step's math is float32). A quantized
      trace reports ``accumulator_dtype``, float32 by default; a complex one
      keeps the trace complex and unquantized; a complex parameter's trace
      stays complex.
    recipe: ``"default"`` (the trace in ``B128/NF``, rounded stochastically
      where nearest rounding would keep its stored code) or ``"paper"``
      (``B128/DE``, nearest rounding); see `optax4bit.recipes`.
    first_moment: quantizer of the trace, overriding the recipe's: a name
      such as ``"B128/DE"`` (signed) or a `QuantSpec`.
    min_quantize_size: leaves with at most this many elements keep float32
      moments (the paper's rule, 4096).
    quantize_mask: a pytree of bools like the params (or a prefix of it), or a
      callable of the params returning one; ``False`` leaves keep float32
      moments (e.g. embeddings or norms).
    seed: seeds stochastic rounding (only used if a spec has
      ``stochastic=True``); the key of a step is derived from it and the step
      count, so runs are reproducible.
    chunk_size: leaves larger than this many elements are updated in chunks
      of rows, bounding the transient memory of the update (default 2**18).
    implementation: ``"auto"`` (the engine of the platform the update is
      compiled for: on a CUDA GPU the Pallas kernels, and the XLA engine on
      the leaves they decline; on a TPU the Pallas TPU kernels; on CPU the
      C++ kernel of `optax4bit.cpu` where it is installed and beats the jnp
      path), ``"jnp"``, ``"xla"``, ``"tpu"``, ``"cpu"``, ``"pallas"``, the
      interpret modes ``"pallas_interpret"`` and ``"tpu_interpret"``, or an
      ``optax4bit.pallas.PallasConfig``; see `optax4bit.dispatch`. Leaves an
      engine does not cover run the jnp reference.

  Returns:
    An ``optax.GradientTransformation`` with `ScaleByMomentum4bitState`.

  Example:
    >>> import jax, jax.numpy as jnp, optax4bit
    >>> tx = optax4bit.scale_by_momentum_4bit(0.9, min_quantize_size=0)
    >>> state = tx.init({"w": jnp.zeros((8, 128))})
    >>> updates, state = jax.jit(tx.update)({"w": jnp.ones((8, 128))}, state)
    >>> float(updates["w"][0, 0])
    1.0
  """
  _validation.check_hyperparam("momentum", momentum, low=0, high=1, high_open=True)
  spec = _recipes.resolve(recipe, first_moment).first_moment
  min_quantize_size = _validation.check_static_int("min_quantize_size", min_quantize_size)
  chunk = _validation.check_chunk_size(chunk_size)
  implementation = _dispatch.check_implementation(implementation)
  accumulator_dtype = None if accumulator_dtype is None else jnp.dtype(accumulator_dtype)

  def init_fn(params):
    flags = _validation.resolve_mask(quantize_mask, params, "quantize_mask")
    leaves, treedef = _flatten_params(params)
    trace = [_zeros_moment(p, spec if _validation.quantizable(p, f, min_quantize_size) else None,
                           accumulator_dtype)
             for p, f in zip(leaves, flags)]
    return ScaleByMomentum4bitState(jnp.zeros([], jnp.int32), treedef.unflatten(trace))

  def update_fn(updates, state, params=None):
    del params
    grads, treedef, state_def, flat = _flatten_like(updates, {"trace": state.trace})
    count_inc = optax.safe_increment(state.count)
    keys = _leaf_keys(seed, count_inc, len(grads), 1, spec.stochastic)

    step = _steps.momentum_step(momentum, nesterov)

    fused_step = _steps.FusedStep.heavy_ball(momentum, nesterov)

    def update_with(backend):
      def leaf_fn(context, g, t, k):
        out = backend.steps and backend.steps.run(fused_step, g, (t,), (), k, context=context)
        return out or _leafwise.update_leaf(step, g, (t,), keys=k, chunk_size=chunk,
                                            context=context)

      # Leaves no fused step covers run the jnp engine, with the backend's codecs.
      return _leafwise.sequential_map(leaf_fn, grads, flat["trace"], keys,
                                      codecs=backend.codecs)

    results = _dispatch.per_platform(implementation, update_with)
    new_updates = treedef.unflatten([u for u, _ in results])
    trace = state_def.unflatten([t for _, (t,) in results])
    return new_updates, ScaleByMomentum4bitState(count_inc, trace)

  return optax.GradientTransformation(init_fn, update_fn)


# ----------------------------------------------------------------------------


def state_nbytes(state) -> int:
  """Bytes an optimizer state really stores (codes, scales, full-precision
  moments, counters), for arrays or ``jax.ShapeDtypeStruct`` leaves.

  Example:
    >>> import jax.numpy as jnp, optax4bit
    >>> tx = optax4bit.adamw_4bit(1e-3)
    >>> optax4bit.state_nbytes(tx.init({"w": jnp.zeros((1024, 1024))})) / 1024**2
    1.0...
  """
  return int(sum(np.dtype(x.dtype).itemsize * int(np.prod(x.shape))
                 for x in jax.tree.leaves(state) if hasattr(x, "dtype")))
