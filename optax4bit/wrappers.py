"""`quantize_state`: store the state of any optax transformation in 4 bits.

The paper treats its method as a wrapper around a black-box stateful optimizer
(Algorithm 1): decompress the state, run the optimizer's exact update, compress
the new state. `quantize_state` is that wrapper as an optax combinator, and
`lion_4bit` / `ademamix_4bit` are presets built on it.

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
  state of one leaf exists at a time (SPEC.md 4); ``optimization_barrier``
  alone does not do it on XLA:CPU, which drops it before scheduling.
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

import functools
from typing import Any, Callable, Mapping, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend import core as jex_core
from jax.sharding import NamedSharding, PartitionSpec

from optax4bit import _leafwise
from optax4bit import sharding as _sharding
from optax4bit.quant import array as qarray
from optax4bit.quant.array import QuantizedArray
from optax4bit.quant.spec import QuantSpec, as_spec
from optax4bit.transform import (
    DEFAULT_MIN_QUANTIZE_SIZE,
    MaskOrFn,
    _is_array_like,
    _quantizable,
    _resolve_mask,
    check_hyperparam,
    check_static_int,
)

__all__ = [
    "KNOWN_STATE_FIELDS",
    "QuantizedState",
    "ademamix_4bit",
    "lion_4bit",
    "quantize_state",
]

SIGNED = "signed"
SIGNED_SLOW = "signed, slow EMA"
NON_NEGATIVE = "non-negative"
DEFAULT_SPECS = {
    SIGNED: QuantSpec.parse("B128/DE"),
    # An EMA whose decay is close to 1 (Lion's b2 = 0.99, AdEMAMix's b3 =
    # 0.9999) moves by 1% or less of its value per step, much less than half a
    # 4-bit quantization step: rounded to nearest it stays frozen. Stochastic
    # rounding is unbiased, so such an EMA still moves on average.
    SIGNED_SLOW: QuantSpec.parse("B128/DE", stochastic=True),
    NON_NEGATIVE: QuantSpec.parse("Rank-1/Linear"),
}
IMPLEMENTATIONS = ("auto", "jnp", "pallas")

# State classes of optax (and optax.contrib) whose per-parameter fields the
# default classification knows: signed fields get B128/DE, slow signed EMAs
# B128/DE with stochastic rounding, non-negative ones (second-moment-like)
# Rank-1/Linear. Fields never shaped like a parameter
# (FactoredState.v_row / v_col of factored leaves, novograd's per-leaf norm,
# SM3's per-axis accumulators) are listed for completeness.
KNOWN_STATE_FIELDS: dict = {
    "ScaleByAdamState": {"mu": SIGNED, "nu": NON_NEGATIVE},
    "ScaleByAmsgradState": {"mu": SIGNED, "nu": NON_NEGATIVE, "nu_max": NON_NEGATIVE},
    "ScaleByLionState": {"mu": SIGNED_SLOW},
    "TraceState": {"trace": SIGNED},
    "EmaState": {"ema": SIGNED},
    "ScaleByRmsState": {"nu": NON_NEGATIVE},
    "ScaleByRStdDevState": {"mu": SIGNED, "nu": NON_NEGATIVE},
    "ScaleByAdaDeltaState": {"e_g": NON_NEGATIVE, "e_x": NON_NEGATIVE},
    "FactoredState": {"v_row": NON_NEGATIVE, "v_col": NON_NEGATIVE, "v": NON_NEGATIVE},
    "ScaleByBeliefState": {"mu": SIGNED, "nu": NON_NEGATIVE},
    "ScaleByNovogradState": {"mu": SIGNED, "nu": NON_NEGATIVE},
    "ScaleByAdanState": {"m": SIGNED, "v": SIGNED, "n": NON_NEGATIVE, "g": SIGNED},
    "ScaleByRssState": {"sum_of_squares": NON_NEGATIVE},
    "ScaleByRpropState": {"step_sizes": NON_NEGATIVE, "prev_updates": SIGNED},
    "ScaleBySM3State": {"mu": NON_NEGATIVE, "nu": SIGNED},
    # optax.contrib
    "ScaleByAdemamixState": {"m1": SIGNED, "m2": SIGNED_SLOW, "nu": NON_NEGATIVE},
    "ScaleBySimplifiedAdEMAMixState": {"m": SIGNED, "n": NON_NEGATIVE},
    "MuonState": {"mu": SIGNED},
    "MomoState": {"exp_avg": SIGNED},
    "MomoAdamState": {"exp_avg": SIGNED, "exp_avg_sq": NON_NEGATIVE},
    "DAdaptAdamWState": {"exp_avg": SIGNED, "exp_avg_sq": NON_NEGATIVE, "grad_sum": SIGNED},
    "ProdigyState": {"exp_avg": SIGNED, "exp_avg_sq": NON_NEGATIVE, "grad_sum": SIGNED},
    "MadgradState": {"grad_sum_sq": NON_NEGATIVE, "s": SIGNED},
}


def _known_classes() -> dict:
  """The optax classes of `KNOWN_STATE_FIELDS` (matched by identity, so that a
  user's class of the same name is not mistaken for optax's)."""
  table = {}
  for name, fields in KNOWN_STATE_FIELDS.items():
    for module in (optax, getattr(optax, "contrib", None)):
      cls = getattr(module, name, None) if module is not None else None
      if isinstance(cls, type):
        table[cls] = fields
  return table


_KNOWN_CLASSES = _known_classes()


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


def _is_qa(x) -> bool:
  return isinstance(x, QuantizedArray)


# ----------------------------------------------------------------------------
# Where the per-parameter state lives.


class _Layout(NamedTuple):
  """The inner state split at the subtrees that mirror the params tree."""
  outer_def: Any        # treedef of the state with each mirror subtree as one leaf
  outer_paths: list     # key path of each outer leaf
  outer_leaves: list    # mirror subtrees or shared leaves
  mirror: list          # bool per outer leaf


def _split_state(state, params_def) -> _Layout:
  def is_mirror(x):
    return jax.tree.structure(x, is_leaf=_is_qa) == params_def

  pairs, outer_def = jax.tree_util.tree_flatten_with_path(
      state, is_leaf=lambda x: _is_qa(x) or is_mirror(x))
  paths = [p for p, _ in pairs]
  leaves = [x for _, x in pairs]
  return _Layout(outer_def, paths, leaves, [is_mirror(x) for x in leaves])


def _child(node, key):
  if isinstance(key, jax.tree_util.GetAttrKey):
    return getattr(node, key.name)
  if isinstance(key, jax.tree_util.SequenceKey):
    return node[key.idx]
  if isinstance(key, jax.tree_util.DictKey):
    return node[key.key]
  children = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)[0]
  for path, child in children:
    if path and path[0] == key:
      return child
  raise KeyError(key)


def _owner_and_field(state, path) -> tuple:
  """(class name, field name, class) of the attribute or dict entry that holds
  the mirror subtree at ``path``; ``(None, None, None)`` if there is none."""
  owner = field = None
  node = state
  for key in path:
    if isinstance(key, (jax.tree_util.GetAttrKey, jax.tree_util.DictKey)):
      owner = type(node)
      field = key.name if isinstance(key, jax.tree_util.GetAttrKey) else str(key.key)
    try:
      node = _child(node, key)
    except (KeyError, IndexError, AttributeError, TypeError):
      break
  if owner is None:
    return None, None, None
  return owner.__name__, field, owner


def _known_kind(owner, field) -> Optional[str]:
  if owner is None:
    return None
  for cls in owner.__mro__:
    if cls in _KNOWN_CLASSES:
      return _KNOWN_CLASSES[cls].get(field)
  return None


# ----------------------------------------------------------------------------
# Which quantizer each state leaf gets.


def _check_spec_value(value, where: str):
  """A spec_for value: ``None`` (keep full precision), ``"auto"`` (default
  classification), a name or a `QuantSpec`."""
  if value is None or (isinstance(value, str) and value == "auto"):
    return value
  return as_spec(value, argname=where)


def _plan_specs(abstract_state, params, params_def, layout: _Layout, spec_for,
                min_quantize_size: int, quantize_mask) -> list:
  """``specs[k][i]``: the `QuantSpec` of mirror ``k``'s leaf for parameter
  ``i`` (None: full precision); ``None`` for shared outer leaves."""
  param_leaves = params_def.flatten_up_to(params)
  param_paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  flags = _resolve_mask(quantize_mask, params, "quantize_mask")
  owners = [_owner_and_field(abstract_state, path) if m else (None, None, None)
            for path, m in zip(layout.outer_paths, layout.mirror)]

  if isinstance(spec_for, Mapping):
    fields = {}
    for (name, field, _), m in zip(owners, layout.mirror):
      if m and field is not None:
        fields.setdefault(field, set()).add(name)
    known_keys = set(fields) | {f"{n}.{f}" for f, names in fields.items() for n in names}
    for key in spec_for:
      if key not in known_keys:
        listed = ", ".join(f"{f} ({'/'.join(sorted(n))})" for f, n in sorted(fields.items()))
        raise ValueError(
            f"spec_for names the field {key!r}, but the inner state has no such field holding "
            f"per-parameter state; its per-parameter fields are: {listed or 'none'}.")

  specs = []
  for k, (path, node) in enumerate(zip(layout.outer_paths, layout.outer_leaves)):
    if not layout.mirror[k]:
      specs.append(None)
      continue
    name, field, owner = owners[k]
    leaves = params_def.flatten_up_to(node)
    row = []
    for i, leaf in enumerate(leaves):
      p = param_leaves[i]
      eligible = (hasattr(leaf, "shape") and hasattr(leaf, "dtype")
                  and tuple(leaf.shape) == tuple(np.shape(p))
                  and _quantizable(leaf, flags[i], min_quantize_size))
      if not eligible:
        row.append(None)
        continue
      full_path = tuple(path) + tuple(param_paths[i])
      where = f"the state leaf at {jax.tree_util.keystr(full_path)}"
      value = "auto"
      if callable(spec_for):
        value = _check_spec_value(spec_for(full_path, leaf), f"spec_for for {where}")
      elif isinstance(spec_for, Mapping):
        key = f"{name}.{field}" if f"{name}.{field}" in spec_for else field
        if key in spec_for:
          value = _check_spec_value(spec_for[key], f"spec_for[{key!r}]")
      kind = _known_kind(owner, field)
      if isinstance(value, str):  # "auto"
        if kind is None:
          desc = f"{name}.{field}" if name is not None else "an unnamed position"
          raise ValueError(
              f"quantize_state cannot tell how to quantize {where} ({desc}, shape "
              f"{tuple(leaf.shape)}, {np.dtype(leaf.dtype).name}): it is shaped like a parameter "
              f"but is not a field this library knows. Pass spec_for, e.g. "
              f"spec_for={{{field!r}: 'B128/DE'}} if it can be negative, 'Rank-1/Linear' if it "
              f"is non-negative (second-moment-like), or None to keep it in full precision.")
        value = DEFAULT_SPECS[kind]
      elif value is not None and kind in (SIGNED, SIGNED_SLOW) and not value.signed:
        raise ValueError(
            f"spec_for gives the unsigned spec {value} to {where} ({name}.{field}), which can "
            f"be negative; use a signed spec such as 'B128/DE'.")
      row.append(value)
    specs.append(row)
  return specs


# ----------------------------------------------------------------------------
# Leaf-separability check: data dependencies through the jaxpr.

_CALL_PRIMITIVES = {
    "pjit": ("jaxpr",), "jit": ("jaxpr",), "closed_call": ("call_jaxpr",),
    "core_call": ("call_jaxpr",), "remat": ("jaxpr",), "checkpoint": ("jaxpr",),
    "custom_jvp_call": ("call_jaxpr",), "custom_vjp_call": ("call_jaxpr", "fun_jaxpr"),
    "custom_vjp_call_jaxpr": ("fun_jaxpr", "call_jaxpr"),
}
_NONE = frozenset()


def _open(jaxpr):
  return jaxpr.jaxpr if isinstance(jaxpr, jex_core.ClosedJaxpr) else jaxpr


def _propagate(jaxpr, in_deps: list) -> list:
  """For each output of ``jaxpr``, the union of the labels of the inputs it
  depends on. Calls are followed; cond is the union over branches; anything
  else (loops included) conservatively depends on all of its inputs."""
  env = {}

  def read(v):
    return _NONE if isinstance(v, jex_core.Literal) else env.get(v, _NONE)

  for v, d in zip(jaxpr.invars, in_deps):
    env[v] = d
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    name = eqn.primitive.name
    outs = None
    if name == "cond":
      branches = [_open(b) for b in eqn.params["branches"]]
      per_branch = [_propagate(b, ins[1:]) for b in branches]
      outs = [ins[0].union(*col) for col in zip(*per_branch)]
    elif name in _CALL_PRIMITIVES:
      for key in _CALL_PRIMITIVES[name]:
        sub = eqn.params.get(key)
        if isinstance(sub, (jex_core.ClosedJaxpr, jex_core.Jaxpr)):
          sub = _open(sub)
          if len(sub.invars) == len(ins) and len(sub.outvars) == len(eqn.outvars):
            outs = _propagate(sub, ins)
          break
    if outs is None:
      everything = _NONE.union(*ins)
      outs = [everything] * len(eqn.outvars)
    for v, d in zip(eqn.outvars, outs):
      env[v] = d
  return [read(v) for v in jaxpr.outvars]


def _labels(params_def, layout: _Layout, n: int) -> list:
  """Label of each leaf of the state: its parameter index or -1 (shared)."""
  outer = [params_def.unflatten(list(range(n))) if m else -1
           for m in layout.mirror]
  return jax.tree.leaves(layout.outer_def.unflatten(outer))


def _leaf_names(tree) -> list:
  return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


_NOT_SEPARABLE_HINT = (
    "quantize_state calls the inner transformation once per parameter leaf (per_leaf mode), "
    "which is only exact for leaf-separable transformations. Keep the non-separable part "
    "outside the wrapper (e.g. optax.chain(optax.clip_by_global_norm(1.0), "
    "quantize_state(optax.adam(lr)))), or pass per_leaf=False to run the inner update on the "
    "whole tree (every leaf's float32 state then exists at once), or per_leaf=True to skip "
    "this check.")


def _check_dependencies(what: str, deps: list, expected: list, out_names: list,
                        param_names: list) -> None:
  for d, e, name in zip(deps, expected, out_names):
    allowed = frozenset() if e < 0 else frozenset((e,))
    extra = sorted(d - allowed)
    if extra:
      others = ", ".join(param_names[j] or "<root>" for j in extra[:3])
      more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
      kind = "the shared state leaf" if e < 0 else "the output"
      raise ValueError(
          f"inner is not leaf-separable: in {what}, {kind} {name} depends on the parameter "
          f"leaves {others}{more}. {_NOT_SEPARABLE_HINT}")


def _check_separable(inner_update, inner_init, abstract_params, abstract_state, params_def,
                     layout: _Layout) -> None:
  n = params_def.num_leaves
  param_names = _leaf_names(abstract_params)
  state_labels = _labels(params_def, layout, n)
  state_names = ["state" + s for s in _leaf_names(abstract_state)]

  closed = jax.make_jaxpr(inner_init)(abstract_params)
  deps = _propagate(closed.jaxpr, [frozenset((i,)) for i in range(n)])
  _check_dependencies("init", deps, state_labels, state_names, param_names)

  try:
    closed, out_shape = jax.make_jaxpr(inner_update, return_shape=True)(
        abstract_params, abstract_state, abstract_params)
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(
        f"quantize_state could not trace inner.update(updates, state, params) to check that "
        f"it is leaf-separable ({type(e).__name__}: {e}). If inner needs extra arguments or "
        f"is known to be leaf-separable pass per_leaf=True; otherwise per_leaf=False.") from e
  new_updates, new_state = out_shape
  if jax.tree.structure(new_state) != jax.tree.structure(abstract_state):
    raise ValueError(
        "inner.update returns a state whose structure differs from inner.init's: "
        f"{jax.tree.structure(new_state)} vs {jax.tree.structure(abstract_state)}.")
  if jax.tree.structure(new_updates) != params_def:
    raise ValueError("inner.update returns updates whose structure differs from the params'.")
  in_labels = list(range(n)) + state_labels + list(range(n))
  deps = _propagate(closed.jaxpr, [_NONE if l < 0 else frozenset((l,)) for l in in_labels])
  expected = list(range(n)) + state_labels
  names = ["updates" + s for s in param_names] + ["new state" + s[5:] for s in state_names]
  _check_dependencies("update", deps, expected, names, param_names)


# ----------------------------------------------------------------------------
# Elementwise check: may a leaf's update run on chunks of rows?

_ELEMENTWISE = frozenset((
    "abs", "acos", "acosh", "add", "and", "asin", "asinh", "atan", "atan2", "atanh", "cbrt",
    "ceil", "clamp", "convert_element_type", "copy", "copy_p", "cos", "cosh", "digamma", "div",
    "eq", "erf", "erf_inv", "erfc", "exp", "exp2", "expm1", "floor", "ge", "gt", "imag",
    "integer_pow", "is_finite", "le", "lgamma", "log", "log1p", "logistic", "lt", "max", "min",
    "mul", "ne", "neg", "nextafter", "not", "or", "population_count", "pow", "real",
    "reduce_precision", "rem", "round", "rsqrt", "select_n", "shift_left",
    "shift_right_arithmetic", "shift_right_logical", "sign", "sin", "sinh", "sqrt", "square",
    "sub", "tan", "tanh", "xor",
))
_SHARED, _ELEM, _OTHER = 0, 1, 2  # ordered: the worst kind wins


def _elementwise_kinds(jaxpr, in_kinds: list) -> list:
  """Per output: ``_SHARED`` (independent of the per-parameter inputs),
  ``_ELEM`` (an elementwise function of them) or ``_OTHER``."""
  env = {}

  def read(v):
    return _SHARED if isinstance(v, jex_core.Literal) else env.get(v, _SHARED)

  for v, k in zip(jaxpr.invars, in_kinds):
    env[v] = k
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    worst = max(ins, default=_SHARED)
    name = eqn.primitive.name
    outs = None
    if worst == _SHARED:
      outs = [_SHARED] * len(eqn.outvars)
    elif name in _CALL_PRIMITIVES:
      for key in _CALL_PRIMITIVES[name]:
        sub = eqn.params.get(key)
        if isinstance(sub, (jex_core.ClosedJaxpr, jex_core.Jaxpr)):
          sub = _open(sub)
          if len(sub.invars) == len(ins) and len(sub.outvars) == len(eqn.outvars):
            outs = _elementwise_kinds(sub, ins)
          break
    elif name == "cond" and ins[0] == _SHARED:
      per_branch = [_elementwise_kinds(_open(b), ins[1:]) for b in eqn.params["branches"]]
      outs = [max(col) for col in zip(*per_branch)]
    elif name == "optimization_barrier":
      outs = ins
    elif name in _ELEMENTWISE or (
        name in ("broadcast_in_dim", "reshape", "squeeze", "expand_dims")
        and all(tuple(v.aval.shape) == tuple(eqn.invars[0].aval.shape) for v in eqn.outvars)):
      outs = [worst] * len(eqn.outvars)
    if outs is None:
      outs = [_OTHER] * len(eqn.outvars)
    for v, k in zip(eqn.outvars, outs):
      env[v] = k
  return [read(v) for v in jaxpr.outvars]


def _is_elementwise(inner_update, g, state, p, layout: _Layout, extra_args) -> bool:
  """Whether, for this one leaf, every per-parameter output of
  ``inner.update`` is an elementwise function of the per-parameter inputs
  (gradient, per-parameter state, parameter), all of the parameter's shape,
  and every shared output is independent of them."""
  shape = tuple(np.shape(g))
  mirror_leaves = [x for x, m in zip(layout.outer_def.flatten_up_to(state), layout.mirror) if m]
  if any(tuple(np.shape(x)) != shape for x in mirror_leaves):
    return False
  abstract = jax.tree.map(_abstract, (g, state, p))
  try:
    closed = jax.make_jaxpr(lambda a, b, c: inner_update(a, b, c, **extra_args))(*abstract)
  except Exception:  # pylint: disable=broad-except
    return False
  state_kinds = jax.tree.leaves(layout.outer_def.unflatten(
      [_ELEM if m else _SHARED for m in layout.mirror]))
  p_kinds = [_ELEM] * len(jax.tree.leaves(p))
  outs = _elementwise_kinds(closed.jaxpr, [_ELEM] + state_kinds + p_kinds)
  if len(outs) != 1 + len(state_kinds):
    return False
  return all(k != _OTHER for k in outs[:1 + len(state_kinds)]) and all(
      k == _SHARED for k, want in zip(outs[1:], state_kinds) if want == _SHARED)


# ----------------------------------------------------------------------------
# Encoding.


def _abstract(x):
  return jax.ShapeDtypeStruct(np.shape(x), x.dtype if hasattr(x, "dtype") else jnp.result_type(x))


def _dtype(x):
  return np.dtype(x.dtype) if hasattr(x, "dtype") else jnp.result_type(x)


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


def _decode(x, like=None, chunk_size: int = _leafwise.DEFAULT_CHUNK_SIZE):
  """The value a stored state leaf holds, in its dtype. A quantized leaf
  whose gradient ``like`` has a known sharding is decoded per shard (a block
  layout cannot be decoded on the global view of a sharded array)."""
  if not _is_qa(x):
    return x
  if like is None or _sharding.leaf_sharding(like) is None:
    return x.dequantize()
  template = jnp.zeros_like(like, dtype=x.dtype)
  value, _ = _leafwise.update_leaf(_decode_step, template, (x,), chunk_size=chunk_size)
  return value


def _encode(value, like, key=None, chunk_size: int = _leafwise.DEFAULT_CHUNK_SIZE):
  """``value`` stored the way ``like`` is (a `QuantizedArray` or a plain
  array); per shard when ``value``'s sharding is known."""
  if not _is_qa(like):
    return value
  if _sharding.leaf_sharding(value) is None:
    return _leafwise.encode_moment(value.astype(jnp.float32), like, key)
  _, (new,) = _leafwise.update_leaf(_encode_step, value, (like,), keys=(key,),
                                    chunk_size=chunk_size)
  return new


def _rounding_key(seed, count, i: int, k: int):
  """Key of stochastic rounding for state position ``k`` of parameter ``i``."""
  return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(
      jax.random.key(seed), count), i), k)


def _encode_new(value, spec: Optional[QuantSpec], key_fn, param=None):
  """A state leaf of ``init`` stored with ``spec`` (None: as it is), placed
  like its parameter when the parameter is sharded."""
  if spec is None:
    return value
  key = key_fn() if spec.stochastic else None
  like = qarray.zeros(tuple(np.shape(value)), _dtype(value), spec)
  if _sharding.leaf_sharding(value) is not None:
    return _encode(value, like, key)
  if param is not None:
    return _sharding.follow_param(param, lambda: _encode(value, like, key))
  return _encode(value, like, key)


def _completion_token(tree) -> Optional[jax.Array]:
  """A float32 ``+0.0`` computed from every code array (uint8) in ``tree``:
  it exists only once those arrays are complete. ``None`` if there are none."""
  codes = [x for x in jax.tree.leaves(tree) if jnp.dtype(x.dtype) == jnp.uint8]
  if not codes:
    return None
  # One code of each array (not a reduction over all of them): a code is a
  # finite uint8, so the product is exactly +0.0; XLA does not fold
  # ``float * 0`` (NaN semantics), so the data dependency survives.
  return sum(_leafwise.stored_value(c).astype(jnp.float32) for c in codes) * 0.0


def _after(token, tree):
  """``tree`` with every floating array ``x`` replaced by ``x - token``:
  bit-identical values (``x - (+0.0) == x``, signed zeros, infs and NaNs
  included) that XLA can only compute once ``token`` exists."""
  if token is None:
    return tree

  def tie(x):
    if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating):
      return x - token.astype(x.dtype)
    return x

  return jax.tree.map(tie, tree)


def _sequential(fn: Callable, inputs: list, shared=None) -> list:
  """``[fn(i, inputs[i], shared) for i]``, one call after another, so that
  the float32 temporaries of two calls never coexist (SPEC.md 4).

  ``fn`` returns ``(free, stored)``: the float inputs of call ``i`` are made
  data-dependent on the code arrays of call ``i - 1``'s ``stored`` outputs
  (its new quantized state) by `_after`. ``optimization_barrier`` is not
  enough: XLA's CPU pipeline drops it before scheduling (JAX 0.10), and then
  interleaves the leaves and keeps all their float32 temporaries alive.
  """
  results = []
  token = None
  for i, args in enumerate(inputs):
    out = fn(i, _after(token, args), shared)
    results.append(out)
    new_token = _completion_token(out[1])
    if new_token is not None:
      # Outside jit (an eager init) there is nothing to schedule.
      token = new_token if isinstance(new_token, jax.core.Tracer) else None
  return results


def _check_implementation(implementation) -> None:
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}.")
  if implementation == "pallas":
    raise NotImplementedError(
        "quantize_state wraps a black-box transformation: its update is whatever inner.update "
        "computes, so it cannot be fused into a Pallas kernel. Use implementation='auto' or "
        "'jnp' (the decode / encode around inner.update run as jnp), or a hand-written "
        "optimizer (adamw_4bit, sgdm_4bit, ...) for fused kernels.")


def _inner_state(outer_def, mirror, mirrored: list, shared: list):
  """The inner state of one leaf from its per-parameter and shared leaves."""
  mirrored_it, shared_it = iter(mirrored), iter(shared)
  return outer_def.unflatten([next(mirrored_it) if m else next(shared_it) for m in mirror])


def _inner_step(inner_update, outer_def, mirror, dtypes, g_dtype, has_param, shared,
                extra_args, g32, old, side):
  """``inner.update`` as a `_leafwise` step on float32 chunks. Traced values
  (``shared``, ``extra_args``) are arguments, so that ``functools.partial``
  of it can run per shard (`optax4bit.sharding.hoist_partial`)."""
  old = [o.astype(d) for o, d in zip(old, dtypes)]
  u, new_state = inner_update(g32.astype(g_dtype), _inner_state(outer_def, mirror, old, shared),
                              side[0] if has_param else None, **extra_args)
  new_outer = outer_def.flatten_up_to(new_state)
  new = tuple(x.astype(jnp.float32) for x, m in zip(new_outer, mirror) if m)
  return u.astype(jnp.float32), new


def _init_leaf(inner_init, outer_def, mirror, leaf_specs, seed, p, i):
  """``inner.init`` of one parameter leaf, its per-parameter state encoded:
  ``(mirrored, shared)``."""
  outer = outer_def.flatten_up_to(inner_init(p))
  specs = iter(leaf_specs)
  mirrored = [_encode_new(x, next(specs), functools.partial(_rounding_key, seed, 0, i, k), p)
              for k, (x, m) in enumerate(zip(outer, mirror)) if m]
  return mirrored, [x for x, m in zip(outer, mirror) if not m]


_init_leaf_jit = jax.jit(_init_leaf, static_argnums=(0, 1, 2, 3, 4))


def _init_leaf_eager(static, leaf_specs, seed, p, i):
  """`_init_leaf` for a concrete parameter: compiled (one executable per
  distinct leaf signature, instead of dispatching every operation of the
  encoding eagerly), and placed like the parameter when it is sharded."""
  mirrored, shared = _init_leaf_jit(*static, leaf_specs, seed, p, i)
  sharding = _sharding.leaf_sharding(p)
  if sharding is None:
    return mirrored, shared
  shape, spec = tuple(p.shape), sharding.spec
  for q in mirrored:
    if _is_qa(q):
      _sharding.check_alignment(q, sharding.mesh, spec)

  def place(x):
    return NamedSharding(sharding.mesh, _sharding.state_partition_spec(spec, shape,
                                                                       tuple(x.shape)))

  mirrored = jax.device_put(mirrored, jax.tree.map(place, mirrored))
  shared = jax.device_put(shared, jax.tree.map(
      lambda _: NamedSharding(sharding.mesh, PartitionSpec()), shared))
  return mirrored, shared


# ----------------------------------------------------------------------------
# The combinator.


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
  (`KNOWN_STATE_FIELDS`). Signed fields (``ScaleByAdamState.mu``,
  ``TraceState.trace``, ``EmaState.ema``, ...) get ``B128/DE``; non-negative,
  second-moment-like fields (``ScaleByAdamState.nu``,
  ``ScaleByAmsgradState.nu_max``, ``ScaleByRmsState.nu``, ``FactoredState.v``,
  ...) get ``Rank-1/Linear``; slow EMAs (``ScaleByLionState.mu`` with decay
  0.99, ``ScaleByAdemamixState.m2`` with 0.9999) get ``B128/DE`` with
  stochastic rounding, because an EMA that moves by 1% or less per step is
  frozen by round-to-nearest at 4 bits (measured: 4-bit Lion on a least-squares
  problem stalls at loss 18 with nearest rounding and reaches 4e-9, like
  float32, with stochastic rounding; see benchmarks/RESULTS.md). An eligible
  leaf of any other field raises a ``ValueError`` naming its path unless
  ``spec_for`` covers it.

  Memory (SPEC.md 4): with ``per_leaf`` (the default) the inner
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
  array). With ``per_leaf=None``, ``init`` verifies it by tracing
  ``inner.init`` and ``inner.update`` abstractly and following the data
  dependencies of their jaxprs, and raises if one leaf's outputs depend on
  another leaf; it cannot see dependencies that are not data dependencies
  (e.g. a random key split by the number of leaves, as in
  ``optax.add_noise``). Keep such transformations outside the wrapper:
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
    implementation: ``"auto"`` or ``"jnp"`` (the same: the decode and encode
      are jnp). ``"pallas"`` raises ``NotImplementedError``: the update is a
      black box and cannot be fused into a kernel.
    per_leaf: ``None`` (default): leaf by leaf, after checking that ``inner``
      is leaf-separable (raises otherwise). ``True``: leaf by leaf without
      the check. ``False``: ``inner.update`` on the whole tree (for
      non-separable transformations; every leaf's decompressed state then
      exists at once).
    seed: seeds stochastic rounding (specs with ``stochastic=True``); the key
      of a step is derived from it, the step and the leaf, so runs are
      reproducible.
    chunk_size: elements per chunk for leaves updated in chunks (default
      2**18).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with `QuantizedState`.

  Example:
    >>> import jax.numpy as jnp, optax, optax4bit
    >>> tx = optax4bit.quantize_state(optax.adam(1e-3))
    >>> state = tx.init({"w": jnp.zeros((1024, 1024)), "b": jnp.zeros(1024)})
    >>> adam_state = state.inner_state[0]
    >>> adam_state.mu["w"]
    QuantizedArray(B128/DE (4-bit, signed), shape=(1024, 1024), dtype=float32)
    >>> adam_state.nu["w"]
    QuantizedArray(Rank-1/Linear (4-bit, unsigned), shape=(1024, 1024), dtype=float32)
    >>> adam_state.nu["b"].dtype  # 1024 elements <= min_quantize_size: float32
    dtype('float32')
    >>> round(optax4bit.state_nbytes(state) / (1024 * 1024 + 1024), 2)
    1.05
  """
  if not isinstance(inner, optax.GradientTransformation):
    raise ValueError(f"inner must be an optax.GradientTransformation, got {inner!r}.")
  _check_implementation(implementation)
  min_quantize_size = check_static_int("min_quantize_size", min_quantize_size)
  chunk = (_leafwise.DEFAULT_CHUNK_SIZE if chunk_size is None
           else check_static_int("chunk_size", chunk_size, minimum=1))
  if per_leaf not in (None, True, False):
    raise ValueError(f"per_leaf must be None, True or False, got {per_leaf!r}.")
  if spec_for is not None and not (callable(spec_for) or isinstance(spec_for, Mapping)):
    raise ValueError("spec_for must be a mapping from field names to quantizers or a callable "
                     f"(path, leaf) -> quantizer, got {spec_for!r}.")
  if isinstance(spec_for, Mapping):
    for key, value in spec_for.items():
      if not isinstance(key, str):
        raise ValueError(f"spec_for keys must be field names (str), got {key!r}.")
      _check_spec_value(value, f"spec_for[{key!r}]")
  inner = optax.with_extra_args_support(inner)

  def plan(abstract_state, params, params_def):
    layout = _split_state(abstract_state, params_def)
    specs = _plan_specs(abstract_state, params, params_def, layout, spec_for,
                        min_quantize_size, quantize_mask)
    return layout, specs

  def init_fn(params):
    params_def = jax.tree.structure(params)
    n = params_def.num_leaves
    count = jnp.zeros([], jnp.int32)
    if n == 0:
      return QuantizedState(inner.init(params), count)
    abstract_params = jax.tree.map(_abstract, params)
    abstract_state = jax.eval_shape(inner.init, abstract_params)
    layout, specs = plan(abstract_state, params, params_def)

    def key_fn(i, k):
      return lambda: _rounding_key(seed, count, i, k)

    if per_leaf is False:
      state = inner.init(params)
      outer = layout.outer_def.flatten_up_to(state)
      new_outer = []
      for k, node in enumerate(outer):
        if not layout.mirror[k]:
          new_outer.append(node)
          continue
        leaves = params_def.flatten_up_to(node)
        new_outer.append(params_def.unflatten(
            [_encode_new(x, specs[k][i], key_fn(i, k), p)
             for i, (x, p) in enumerate(zip(leaves, params_def.flatten_up_to(params)))]))
      return QuantizedState(layout.outer_def.unflatten(new_outer), count)

    if per_leaf is None:
      _check_separable(inner.update, inner.init, abstract_params, abstract_state, params_def,
                       layout)
    mirrors = [k for k, m in enumerate(layout.mirror) if m]
    abstract_mirror = {k: params_def.flatten_up_to(layout.outer_leaves[k]) for k in mirrors}
    param_leaves = params_def.flatten_up_to(params)
    param_paths = _leaf_names(params)
    for i, p in enumerate(param_leaves):
      try:
        got = jax.eval_shape(inner.init, _abstract(p))
      except Exception as e:  # pylint: disable=broad-except
        raise ValueError(
            f"inner.init fails on the parameter leaf {param_paths[i]} alone "
            f"({type(e).__name__}: {str(e)[:300]}). quantize_state calls inner once per "
            "parameter leaf, given as a bare array: a pytree-valued mask inside inner does not "
            "fit it (a callable mask does). Keep the masked transformation outside the "
            "wrapper, or pass per_leaf=False.") from e
      expected = layout.outer_def.unflatten(
          [abstract_mirror[k][i] if m else layout.outer_leaves[k]
           for k, m in enumerate(layout.mirror)])
      if not _same_shapes(got, expected):
        raise ValueError(
            f"inner.init on the parameter leaf {param_paths[i]} alone does not give the slice of "
            f"inner.init(params) for that leaf: {got} vs {expected}. {_NOT_SEPARABLE_HINT}")
    static = (inner.init, layout.outer_def, tuple(layout.mirror))

    def init_leaf(i, p, _):
      leaf_specs = tuple(specs[k][i] for k in mirrors)
      if isinstance(p, jax.core.Tracer):  # inside the caller's jit
        return None, _init_leaf(*static, leaf_specs, seed, p, i)
      return None, _init_leaf_eager(static, leaf_specs, seed, p, i)

    results = _sequential(init_leaf, param_leaves)
    return QuantizedState(_assemble(layout, params_def, mirrors, [r for _, r in results]),
                          count)

  def update_fn(updates, state, params=None, **extra_args):
    if not isinstance(state, QuantizedState):
      raise ValueError(f"state must be the QuantizedState of quantize_state's init, got "
                       f"{type(state).__name__}.")
    params_def = jax.tree.structure(updates)
    n = params_def.num_leaves
    count = optax.safe_increment(state.rounding_count)
    if n == 0:
      new_updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
      return new_updates, QuantizedState(inner_state, count)
    layout = _split_state(state.inner_state, params_def)
    for k, (path, node) in enumerate(zip(layout.outer_paths, layout.outer_leaves)):
      if not layout.mirror[k] and _is_qa(node):
        raise ValueError(
            f"the quantized state leaf at {jax.tree_util.keystr(path)} is not in a subtree with "
            "the structure of the updates: the updates do not have the structure of the params "
            "given to init.")
    grads = jax.tree.leaves(updates)
    if params is None:
      param_leaves = [None] * n
    else:
      try:
        param_leaves = params_def.flatten_up_to(params)
      except (ValueError, TypeError) as e:
        raise ValueError(f"params do not have the structure of the updates: {e}") from None
    mirrors = [k for k, m in enumerate(layout.mirror) if m]
    mirror_leaves = {k: params_def.flatten_up_to(layout.outer_leaves[k]) for k in mirrors}
    update_names = _leaf_names(updates)
    for k in mirrors:
      for i, x in enumerate(mirror_leaves[k]):
        if _is_qa(x) and tuple(x.shape) != tuple(np.shape(grads[i])):
          raise ValueError(
              f"update at {update_names[i]} has shape {tuple(np.shape(grads[i]))} but its "
              f"quantized state at {jax.tree_util.keystr(layout.outer_paths[k])} has shape "
              f"{x.shape}.")

    def encode(new, old, i, k):
      if not _is_qa(old):
        return new
      key = _rounding_key(seed, count, i, k) if old.spec.stochastic else None
      return _encode(new, old, key, chunk)

    if per_leaf is False:
      decoded = layout.outer_def.unflatten([
          params_def.unflatten([_decode(x, grads[i], chunk)
                                for i, x in enumerate(mirror_leaves[k])]) if m else node
          for k, (node, m) in enumerate(zip(layout.outer_leaves, layout.mirror))])
      new_updates, new_state = inner.update(updates, decoded, params, **extra_args)
      try:
        new_outer = layout.outer_def.flatten_up_to(new_state)
      except (ValueError, TypeError) as e:
        raise ValueError(f"inner.update returned a state of another structure: {e}") from None
      out = []
      for k, (new, old) in enumerate(zip(new_outer, layout.outer_leaves)):
        if not layout.mirror[k]:
          out.append(new)
          continue
        news = params_def.flatten_up_to(new)
        olds = mirror_leaves[k]
        out.append(params_def.unflatten(
            [encode(a, b, i, k) for i, (a, b) in enumerate(zip(news, olds))]))
      return new_updates, QuantizedState(layout.outer_def.unflatten(out), count)

    shared = [x for x, m in zip(layout.outer_leaves, layout.mirror) if not m]

    def elementwise_update_leaf(i, g, stored, p, shared_in):
      """The leaf's update through `_leafwise.update_leaf`: in chunks of rows
      for a large leaf, per shard for a sharded one."""
      step = functools.partial(
          _inner_step, inner.update, layout.outer_def, tuple(layout.mirror),
          tuple(np.dtype(x.dtype) for x in stored), np.dtype(g.dtype), p is not None,
          list(shared_in), dict(extra_args))
      keys = tuple(_rounding_key(seed, count, i, k) if _is_qa(x) and x.spec.stochastic else None
                   for k, x in zip(mirrors, stored))
      u, new_mirrored = _leafwise.update_leaf(step, g, tuple(stored), () if p is None else (p,),
                                              keys, chunk)
      # Shared outputs do not depend on the per-parameter inputs (checked by
      # _is_elementwise): take them from a call on one row of zeros, which
      # XLA reduces to the few scalar operations that make them.
      row = lambda x: jnp.zeros((1,) * max(np.ndim(x), 1), x.dtype)  # noqa: E731
      _, new_state = inner.update(row(g), _inner_state(layout.outer_def, layout.mirror,
                                                       [row(x) for x in stored], shared_in),
                                  None if p is None else row(p), **extra_args)
      new_outer = layout.outer_def.flatten_up_to(new_state)
      shared_out = [x for x, m in zip(new_outer, layout.mirror) if not m]
      return u, (list(new_mirrored), shared_out)

    def elementwise(g, stored, p, shared_in) -> bool:
      abstract = _inner_state(layout.outer_def, layout.mirror,
                              [jax.ShapeDtypeStruct(tuple(x.shape), x.dtype) for x in stored],
                              shared_in)
      signature = (jax.tree.structure(abstract), tuple(
          (tuple(np.shape(x)), np.dtype(_dtype(x))) for x in jax.tree.leaves((g, abstract, p))))
      if signature not in elementwise_cache:
        elementwise_cache[signature] = _is_elementwise(inner.update, g, abstract, p, layout,
                                                       extra_args)
      return elementwise_cache[signature]

    elementwise_cache = {}

    def update_leaf(i, args, shared_in):
      g, stored, p = args
      if (np.ndim(g) >= 1 and any(map(_is_qa, stored))
          and elementwise(g, stored, p, shared_in)):
        return elementwise_update_leaf(i, g, stored, p, shared_in)
      stored_it, shared_it = iter(stored), iter(shared_in)
      inner_state = layout.outer_def.unflatten(
          [_decode(next(stored_it), g, chunk) if m else next(shared_it)
           for m in layout.mirror])
      u, new_state = inner.update(g, inner_state, p, **extra_args)
      try:
        new_outer = layout.outer_def.flatten_up_to(new_state)
      except (ValueError, TypeError) as e:
        raise ValueError(
            f"inner.update on the leaf {update_names[i]} returned a state of another structure "
            f"than it was given: {e}. {_NOT_SEPARABLE_HINT}") from None
      mirrored = [encode(new_outer[k], mirror_leaves[k][i], i, k) for k in mirrors]
      shared_out = [x for x, m in zip(new_outer, layout.mirror) if not m]
      return u, (mirrored, shared_out)

    inputs = [(grads[i], [mirror_leaves[k][i] for k in mirrors], param_leaves[i])
              for i in range(n)]
    results = _sequential(update_leaf, inputs, shared)
    new_updates = params_def.unflatten([u for u, _ in results])
    new_state = _assemble(layout, params_def, mirrors, [r for _, r in results])
    return new_updates, QuantizedState(new_state, count)

  def init_arrays(params):
    return init_fn(_plain_arrays(params))

  def update_arrays(updates, state, params=None, **extra_args):
    plain_params = None if params is None else _plain_arrays(params)
    new_updates, state = update_fn(_plain_arrays(updates), state, plain_params, **extra_args)
    # The updates keep the gradients' structure (e.g. flax.nnx Variables).
    return jax.tree.unflatten(jax.tree.structure(updates), jax.tree.leaves(new_updates)), state

  return optax.GradientTransformationExtraArgs(init_arrays, update_arrays)


def _plain_arrays(tree):
  """``tree`` with array-like wrappers (``flax.nnx.Variable``) replaced by
  their array: the state must not hold them, since ``nnx.Optimizer`` rebuilds
  a Variable from its leaves, which would turn a `QuantizedArray` into a dict."""
  return jax.tree.map(lambda x: jax.tree.leaves(x)[0], tree, is_leaf=_is_array_like)


def _assemble(layout: _Layout, params_def, mirrors: list, results: list):
  """The full inner state from per-leaf ``(mirrored, shared)`` results; shared
  leaves come from the first leaf."""
  shared = iter(results[0][1])
  by_mirror = {k: params_def.unflatten([r[0][j] for r in results])
               for j, k in enumerate(mirrors)}
  outer = [by_mirror[k] if m else next(shared) for k, m in enumerate(layout.mirror)]
  return layout.outer_def.unflatten(outer)


# ----------------------------------------------------------------------------
# Presets.


def lion_4bit(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.99,
    mu_dtype: Optional[Any] = None,
    weight_decay: optax.ScalarOrSchedule = 1e-3,
    mask: MaskOrFn = None,
    *,
    spec_for=None,
    min_quantize_size: int = DEFAULT_MIN_QUANTIZE_SIZE,
    quantize_mask: MaskOrFn = None,
    implementation: str = "auto",
    seed: int = 0,
    chunk_size: Optional[int] = None,
) -> optax.GradientTransformationExtraArgs:
  """Lion with a 4-bit momentum: a drop-in for ``optax.lion``.

  The momentum is stored ``B128/DE`` with stochastic rounding (the
  `quantize_state` default for ``ScaleByLionState.mu``): Lion's momentum is an
  EMA with decay ``b2 = 0.99``, which round-to-nearest at 4 bits freezes.

  ``optax.chain(quantize_state(optax.scale_by_lion(b1, b2, mu_dtype)),
  optax.add_decayed_weights(weight_decay, mask),
  optax.scale_by_learning_rate(learning_rate))``, the composition of
  ``optax.lion`` with only the stateful part wrapped. About 0.53 byte of
  state per parameter instead of 4.

  Args:
    learning_rate: a float or an ``optax`` schedule.
    b1: rate to combine the momentum and the current gradient.
    b2: decay rate of the momentum.
    mu_dtype: dtype of the momentum when kept unquantized.
    weight_decay: decoupled weight decay (as in ``optax.lion``).
    mask: which leaves get weight decay.
    spec_for: see `quantize_state` (e.g. ``{"mu": "B2048/DE"}``).
    min_quantize_size: leaves with at most this many elements stay in full
      precision.
    quantize_mask: pytree of bools or callable; ``False`` leaves stay in
      full precision.
    implementation: ``"auto"`` / ``"jnp"`` (see `quantize_state`).
    seed: seed of stochastic rounding.
    chunk_size: elements per chunk of the update (bounds transient memory).

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, optax4bit
    >>> tx = optax4bit.lion_4bit(learning_rate=1e-4)
    >>> params = {"w": jnp.zeros((1024, 1024))}
    >>> state = tx.init(params)
    >>> round(optax4bit.state_nbytes(state) / (1024 * 1024), 3)
    0.531
    >>> grads = {"w": jnp.ones((1024, 1024))}
    >>> updates, state = jax.jit(tx.update)(grads, state, params)
    >>> round(float(updates["w"][0, 0]), 6)
    -0.0001
  """
  check_hyperparam("learning_rate", learning_rate, low=0)
  check_hyperparam("weight_decay", weight_decay, low=0)
  check_hyperparam("b1", b1, low=0, high=1)
  check_hyperparam("b2", b2, low=0, high=1)
  return optax.chain(
      quantize_state(optax.scale_by_lion(b1=b1, b2=b2, mu_dtype=mu_dtype), spec_for=spec_for,
                     min_quantize_size=min_quantize_size, quantize_mask=quantize_mask,
                     implementation=implementation, per_leaf=True, seed=seed,
                     chunk_size=chunk_size),
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(learning_rate),
  )


def ademamix_4bit(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    b3: optax.ScalarOrSchedule = 0.9999,
    alpha: optax.ScalarOrSchedule = 5.0,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Optional[Any] = None,
    weight_decay: float = 0.0,
    mask: MaskOrFn = None,
    *,
    spec_for=None,
    min_quantize_size: int = DEFAULT_MIN_QUANTIZE_SIZE,
    quantize_mask: MaskOrFn = None,
    implementation: str = "auto",
    seed: int = 0,
    chunk_size: Optional[int] = None,
) -> optax.GradientTransformationExtraArgs:
  """AdEMAMix with 4-bit states: a drop-in for ``optax.contrib.ademamix``.

  Both EMAs of the gradient (``m1``, ``m2``) are stored ``B128/DE`` and the
  second moment ``nu`` ``Rank-1/Linear``: about 1.6 bytes of state per
  parameter instead of 12. The composition of ``optax.contrib.ademamix`` with
  the stateful part wrapped:
  ``optax.chain(quantize_state(optax.contrib.scale_by_ademamix(...)),
  optax.add_decayed_weights(weight_decay, mask),
  optax.scale_by_learning_rate(learning_rate))``.

  Only available when the installed optax has
  ``optax.contrib.scale_by_ademamix`` (optax >= 0.2.4); otherwise raises
  ``NotImplementedError``.

  Args:
    learning_rate: a float or an ``optax`` schedule.
    b1: decay rate of the fast EMA.
    b2: decay rate of the second moment.
    b3: decay rate of the slow EMA (a float or a schedule).
    alpha: mixing coefficient of the slow EMA (a float or a schedule).
    eps: term added to the denominator outside the square root.
    eps_root: term added to the second moment inside the square root.
    mu_dtype: dtype of the accumulators when kept unquantized.
    weight_decay: decoupled weight decay (as in ``optax.contrib.ademamix``).
    mask: which leaves get weight decay.
    spec_for: see `quantize_state`.
    min_quantize_size: leaves with at most this many elements stay in full
      precision.
    quantize_mask: pytree of bools or callable; ``False`` leaves stay in
      full precision.
    implementation: ``"auto"`` / ``"jnp"`` (see `quantize_state`).
    seed: seed of stochastic rounding.
    chunk_size: elements per chunk of the update (bounds transient memory).

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Example:
    >>> import jax.numpy as jnp, optax4bit
    >>> tx = optax4bit.ademamix_4bit(learning_rate=1e-3)
    >>> state = tx.init({"w": jnp.zeros((1024, 1024))})
    >>> round(optax4bit.state_nbytes(state) / (1024 * 1024), 2)
    1.57
  """
  contrib = getattr(optax, "contrib", None)
  scale_by_ademamix = getattr(contrib, "scale_by_ademamix", None)
  if scale_by_ademamix is None:
    raise NotImplementedError(
        f"ademamix_4bit needs optax.contrib.scale_by_ademamix, which optax {optax.__version__} "
        "does not have (optax >= 0.2.4 does).")
  check_hyperparam("learning_rate", learning_rate, low=0)
  check_hyperparam("weight_decay", weight_decay, low=0)
  return optax.chain(
      quantize_state(scale_by_ademamix(b1=b1, b2=b2, b3=b3, alpha=alpha, eps=eps,
                                       eps_root=eps_root, mu_dtype=mu_dtype),
                     spec_for=spec_for, min_quantize_size=min_quantize_size,
                     quantize_mask=quantize_mask, implementation=implementation,
                     per_leaf=True, seed=seed, chunk_size=chunk_size),
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(learning_rate),
  )
