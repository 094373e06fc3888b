"""`quantize_state`: store the state of any optax transformation in 4 bits.

The paper treats its method as a wrapper around a black-box stateful optimizer
(Algorithm 1): decompress the state, run the optimizer's exact update, compress
the new state. `quantize_state` is that wrapper as an optax combinator; `optax4bit.lion_4bit`
and `optax4bit.ademamix_4bit` are presets built on it.

How it works (``per_leaf`` mode, the default):

* The positions of the inner state that mirror the params tree are found by
  structure: a subtree of the state whose pytree structure equals the params'
  (``ScaleByAdamState.mu``, ``TraceState.trace``, ``FactoredState.v_row``, ...)
  holds one entry per parameter leaf. Every other state leaf (``count``,
  schedule states, ...) is *shared*.
* ``init`` and ``update`` call the inner transformation once per parameter
  leaf, on that leaf as a bare array, with the inner state sliced to that leaf
  (mirroring positions give the leaf's entry, shared leaves are passed whole).
  The shared leaves of the new state are taken from the first call. Leaves run
  one after another: the float inputs of leaf ``i + 1`` are made data-dependent
  on the codes of leaf ``i`` (``x - 0.0``, bit-exact), so that the decompressed
  state of one leaf exists at a time (`optax4bit._leafwise.sequential_map`).
* A leaf whose update is elementwise (checked on its jaxpr: adam, lion,
  sgd/trace, ademamix, rmsprop, ...) runs through the hand-written optimizers'
  engine (`optax4bit._leafwise.update_leaf`): in chunks of rows when it is
  large, per shard under ``jax.shard_map`` when it is sharded. Other leaves
  (adafactor's factored statistics) run whole, decoded and encoded per shard.
* This is exact for leaf-separable transformations, which most optax
  optimizers are (adam, lion, sgd/trace, ademamix, adafactor, rmsprop, ...).
  ``init`` checks it: it traces ``inner.init`` and ``inner.update`` (abstractly,
  no memory) and follows the data dependencies of the resulting jaxprs; if the
  update of one leaf, or a shared state leaf, depends on another parameter
  leaf (e.g. ``optax.clip_by_global_norm`` inside ``inner``), it raises. Use
  ``per_leaf=False`` for such transformations, or better keep the
  non-separable part outside the wrapper:
  ``optax.chain(optax.clip_by_global_norm(1.0), quantize_state(optax.adam(lr)))``.

Leaves that stay in full precision: integer leaves, scalars, shared leaves,
leaves whose shape differs from their parameter's (Adafactor's factored
``v_row`` / ``v_col``), leaves of parameters with at most ``min_quantize_size``
elements or masked out by ``quantize_mask``, and leaves for which ``spec_for``
returns ``None``.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Union

import jax
import optax

from optax4bit import _quantize_state as _impl
from optax4bit import _state_fields
from optax4bit import _validation
from optax4bit import dispatch
from optax4bit import recipes
from optax4bit._quantize_state import QuantizedState
from optax4bit._state_fields import KNOWN_STATE_FIELDS
from optax4bit._validation import DEFAULT_MIN_QUANTIZE_SIZE, MaskOrFn

__all__ = ["KNOWN_STATE_FIELDS", "QuantizedState", "quantize_state"]


def quantize_state(
    inner: optax.GradientTransformation,
    *,
    spec_for: Optional[Union[Callable[[tuple, Any], Any], Mapping[str, Any]]] = None,
    min_quantize_size: int = DEFAULT_MIN_QUANTIZE_SIZE,
    quantize_mask: MaskOrFn = None,
    implementation: str = "auto",
    per_leaf: Optional[bool] = None,
    seed: int = 0,
    chunk_size: Optional[int] = None,
    recipe: str = "default",
) -> optax.GradientTransformationExtraArgs:
  """Stores the state of any optax transformation quantized (4-bit by default).

  Each step decodes the stored state, runs ``inner.update`` exactly, and
  encodes the new state: the update uses the precise new state, only what is
  stored is quantized (the paper's Algorithm 1).

  Which state leaves are quantized: those at a position of the inner state
  that mirrors the params tree (e.g. ``ScaleByAdamState.mu``), with their
  parameter's shape and a floating dtype, whose parameter has more than
  ``min_quantize_size`` elements and is not masked out by ``quantize_mask``.
  Integer leaves, counts, scalars and leaves shaped otherwise (Adafactor's
  factored ``v_row`` / ``v_col``) stay as they are.

  Which quantizer: read from the optax state class and field name
  (`KNOWN_STATE_FIELDS`), with the quantizers of ``recipe``. With the
  default recipe (that of `adamw_4bit`), signed fields
  (``ScaleByAdamState.mu``, ``TraceState.trace``, ``EmaState.ema``, ...) get
  ``B128/NF``, rounded stochastically where nearest rounding would keep the
  stored code (the stall rule), non-negative, second-moment-like
  fields (``ScaleByAdamState.nu``, ``ScaleByAmsgradState.nu_max``,
  ``ScaleByRmsState.nu``, ``FactoredState.v``, ...) ``Rank-1/SqrtLinear``, also
  stochastic;
  copies of the parameters (``init_params``, ``params0``, schedule-free's
  ``z``) stay in full precision. Stochastic rounding matters most for slow
  EMAs (``ScaleByLionState.mu`` with decay 0.99, ``ScaleByAdemamixState.m2``
  with 0.9999): an EMA that moves by 1% or less per step is frozen by
  round-to-nearest at 4 bits (measured: 4-bit Lion on a least-squares problem
  stalls at loss 18 with nearest rounding and reaches 4e-9, like float32,
  with stochastic rounding; see benchmarks/RESULTS.md); ``recipe="paper"``
  therefore gives those ``B128/DE`` with stochastic rounding and other
  signed fields ``B128/DE``, non-negative ones ``Rank-1/Linear``. An eligible
  leaf of any other field raises a ``ValueError`` naming its path unless
  ``spec_for`` covers it.

  Memory: with ``per_leaf`` (the default) the inner
  transformation runs once per parameter leaf, one leaf after another, so the
  decompressed state of one leaf exists at a time. A leaf larger than
  ``chunk_size`` elements whose update is elementwise (checked on the jaxpr:
  adam, lion, sgd/trace, ademamix, rmsprop, ... but not adafactor) is
  further updated in chunks of rows, as the hand-written optimizers do; other
  leaves run whole, so their transient memory is a few float32 copies of the
  largest such leaf. ``init`` also runs leaf by leaf. State leaves keep the
  parameter's rank (`QuantizedArray`), so a parameter's ``PartitionSpec``
  applies to them as for the hand-written optimizers.

  Leaf-separability: ``per_leaf`` gives each call of ``inner`` one parameter
  as a bare array and the state sliced to it (the positions mirroring the
  params give that parameter's entry; other leaves, like ``count``, are
  passed whole), and keeps the shared leaves of the first call's new state.
  That is exact when ``inner`` treats leaves independently -- true of optax's
  optimizers, not of anything computing a global norm
  (``clip_by_global_norm``, ``apply_if_finite``, line searches, L-BFGS) or
  using a pytree-valued mask inside ``inner`` (a callable mask gets the bare
  array). With ``per_leaf=None``, ``init`` and ``update`` verify it by
  tracing ``inner.init`` and ``inner.update`` (with the extra arguments it
  is called with) abstractly and following the data dependencies of their
  jaxprs; if one leaf's outputs depend on another leaf, that function runs
  on the whole tree instead, with a warning. The check cannot see
  dependencies that are not data dependencies (e.g. a random key split by the
  number of leaves, as in ``optax.add_noise``). Keep non-separable
  transformations outside the wrapper to run leaf by leaf:
  ``optax.chain(optax.clip_by_global_norm(1.0), quantize_state(optax.adam(lr)))``.

  Args:
    inner: the transformation whose state is stored quantized.
    spec_for: overrides the default choice of quantizer: a mapping from a
      field name (``"nu"``) or ``"Class.field"`` (``"ScaleByAdamState.nu"``)
      to a quantizer, or a callable ``spec_for(path, leaf)`` of the leaf's key
      path in the inner state and the leaf (a ``jax.ShapeDtypeStruct``). A
      quantizer is a name (``"B128/DE"``, ``"Rank-1/Linear"``, ...) or a
      `QuantSpec` (8 bits, stochastic rounding); ``None`` keeps the leaf in
      full precision; ``"auto"`` means the default. A mapping key that names
      no per-parameter field of the inner state raises at ``init``.
    min_quantize_size: state leaves of parameters with at most this many
      elements stay in full precision (the paper's rule, 4096).
    quantize_mask: a pytree of bools like the params (or a prefix), or a
      callable of the params returning one; ``False`` leaves stay in full
      precision.
    implementation: ``"auto"`` (on the CPU backend, the C++ kernel's 4-bit
      codecs decode and encode the state around ``inner.update`` where they
      apply, `optax4bit.cpu.codec`, bit for bit as the jnp ones) or ``"jnp"``
      (the jnp codecs). ``"pallas"`` raises ``NotImplementedError``: the
      update is a black box and cannot be fused into a kernel.
    per_leaf: ``None`` (default): leaf by leaf where the check shows that
      ``inner`` is leaf-separable, otherwise on the whole tree with a
      ``UserWarning`` naming the dependency. ``True``: leaf by leaf without
      the check. ``False``: ``inner.update`` on the whole tree (for
      non-separable transformations; every leaf's decompressed state then
      exists at once).
    seed: seeds stochastic rounding (specs with ``stochastic=True``); the key
      of a step is derived from it, the step and the leaf, so runs are
      reproducible.
    chunk_size: elements per chunk for leaves updated in chunks (default
      2**18).
    recipe: the quantizers of the known fields: ``"default"`` (the library
      recipe of `optax4bit.recipes`, as described above) or ``"paper"``
      (signed fields ``B128/DE``, slow EMAs ``B128/DE`` with stochastic
      rounding, non-negative fields ``Rank-1/Linear``).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with `QuantizedState`.

  Example:
    >>> import jax.numpy as jnp, optax, optax4bit
    >>> tx = optax4bit.quantize_state(optax.adam(1e-3))
    >>> state = tx.init({"w": jnp.zeros((1024, 1024)), "b": jnp.zeros(1024)})
    >>> adam_state = state.inner_state[0]
    >>> adam_state.mu["w"]
    QuantizedArray(B128/NF (4-bit, signed, stochastic where stalled), shape=(1024, 1024), dtype=float32)
    >>> adam_state.nu["w"]
    QuantizedArray(Rank-1/SqrtLinear (4-bit, unsigned, stochastic), shape=(1024, 1024), dtype=float32)
    >>> adam_state.nu["b"].dtype  # 1024 elements <= min_quantize_size: float32
    dtype('float32')
    >>> round(optax4bit.state_nbytes(state) / (1024 * 1024 + 1024), 2)
    1.05
  """
  if not isinstance(inner, optax.GradientTransformation):
    raise ValueError(f"inner must be an optax.GradientTransformation, got {inner!r}.")
  dispatch.check_implementation(implementation, fused=False)
  min_quantize_size = _validation.check_static_int("min_quantize_size", min_quantize_size)
  chunk = _validation.check_chunk_size(chunk_size)
  if per_leaf not in (None, True, False):
    raise ValueError(f"per_leaf must be None, True or False, got {per_leaf!r}.")
  if spec_for is not None and not (callable(spec_for) or isinstance(spec_for, Mapping)):
    raise ValueError("spec_for must be a mapping from field names to quantizers or a callable "
                     f"(path, leaf) -> quantizer, got {spec_for!r}.")
  if isinstance(spec_for, Mapping):
    for key, value in spec_for.items():
      if not isinstance(key, str):
        raise ValueError(f"spec_for keys must be field names (str), got {key!r}.")
      _state_fields.check_spec_value(value, f"spec_for[{key!r}]")
  if recipe not in recipes.RECIPES:
    raise ValueError(f"recipe must be one of {tuple(recipes.RECIPES)}, got {recipe!r}.")
  config = _impl.Config(optax.with_extra_args_support(inner), spec_for, min_quantize_size,
                        quantize_mask, per_leaf, seed, chunk, recipe, implementation)

  def init_fn(params):
    return _impl.init(config, _impl.plain_arrays(params))

  def update_fn(updates, state, params=None, **extra_args):
    plain_params = None if params is None else _impl.plain_arrays(params)
    new_updates, state = _impl.update(config, _impl.plain_arrays(updates), state, plain_params,
                                      **extra_args)
    # The updates keep the gradients' structure (e.g. flax.nnx Variables).
    return jax.tree.unflatten(jax.tree.structure(updates), jax.tree.leaves(new_updates)), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
