"""Static checks on the jaxprs of an inner transformation, for `quantize_state`.

* `init_problem`, `update_problem`: is each parameter leaf's output (and
  every shared state leaf) a function of that leaf alone? Then running the
  inner transformation once per leaf is exact.
* `is_elementwise`: is one leaf's update elementwise? Then it may run on
  chunks of rows, as the hand-written optimizers do.

Both follow data dependencies through the jaxpr of ``inner.init`` /
``inner.update`` traced on abstract values (no memory, no compute).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from optax4bit._state_fields import StateSplit
from optax4bit.quant import array as qarray


def abstract_leaf(x):
  """``jax.ShapeDtypeStruct`` of an array or a Python scalar."""
  return jax.ShapeDtypeStruct(np.shape(x), x.dtype if hasattr(x, "dtype") else jnp.result_type(x))


def leaf_names(tree) -> list:
  """``keystr`` of the path of every leaf of ``tree``."""
  return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


_CALL_PRIMITIVES = {
    "pjit": ("jaxpr",), "jit": ("jaxpr",), "closed_call": ("call_jaxpr",),
    "core_call": ("call_jaxpr",), "remat": ("jaxpr",), "checkpoint": ("jaxpr",),
    "custom_jvp_call": ("call_jaxpr",), "custom_vjp_call": ("call_jaxpr", "fun_jaxpr"),
    "custom_vjp_call_jaxpr": ("fun_jaxpr", "call_jaxpr"),
}
_NONE = frozenset()


def _open(jaxpr):
  return jaxpr.jaxpr if isinstance(jaxpr, jex_core.ClosedJaxpr) else jaxpr


def _called_jaxpr(eqn):
  """The jaxpr a call-like equation runs, if its inputs and outputs map one
  to one onto the equation's; None otherwise (then it is treated as opaque)."""
  for key in _CALL_PRIMITIVES.get(eqn.primitive.name, ()):
    sub = eqn.params.get(key)
    if isinstance(sub, (jex_core.ClosedJaxpr, jex_core.Jaxpr)):
      sub = _open(sub)
      if len(sub.invars) == len(eqn.invars) and len(sub.outvars) == len(eqn.outvars):
        return sub
      return None
  return None


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
    elif (sub := _called_jaxpr(eqn)) is not None:
      outs = _propagate(sub, ins)
    if outs is None:
      everything = _NONE.union(*ins)
      outs = [everything] * len(eqn.outvars)
    for v, d in zip(eqn.outvars, outs):
      env[v] = d
  return [read(v) for v in jaxpr.outvars]


def _labels(params_def, layout: StateSplit, n: int) -> list:
  """Label of each leaf of the state: its parameter index or -1 (shared). An
  entry of a mirror may be a subtree (any number of leaves, e.g. none for a
  masked-out parameter); a `QuantizedArray` counts as the one array it
  stores."""
  del n
  labels = []
  for node, mirror in zip(layout.outer_leaves, layout.mirror):
    if mirror:
      labels.extend(i for i, entry in enumerate(params_def.flatten_up_to(node))
                    for _ in jax.tree.leaves(entry, is_leaf=qarray.is_quantized))
    else:
      labels.extend([-1] * len(jax.tree.leaves(node, is_leaf=qarray.is_quantized)))
  return labels


NOT_SEPARABLE_HINT = (
    "quantize_state calls the inner transformation once per parameter leaf (per_leaf mode), "
    "which is only exact for leaf-separable transformations. Keep the non-separable part "
    "outside the wrapper (e.g. optax.chain(optax.clip_by_global_norm(1.0), "
    "quantize_state(optax.adam(lr)))), or pass per_leaf=False to run the inner update on the "
    "whole tree (every leaf's float32 state then exists at once), or per_leaf=True to skip "
    "this check.")


def _dependency_problem(what: str, deps: list, expected: list, out_names: list,
                        param_names: list) -> Optional[str]:
  for d, e, name in zip(deps, expected, out_names):
    allowed = frozenset() if e < 0 else frozenset((e,))
    extra = sorted(d - allowed)
    if extra:
      others = ", ".join(param_names[j] or "<root>" for j in extra[:3])
      more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
      kind = "the shared state leaf" if e < 0 else "the output"
      return (f"inner is not leaf-separable: in {what}, {kind} {name} depends on the parameter "
              f"leaves {others}{more}")
  return None


def init_problem(inner_init, abstract_params, abstract_state, params_def,
                 split: StateSplit) -> Optional[str]:
  """Why running ``inner.init`` once per parameter leaf would not be exact
  (a state leaf that depends on another parameter leaf), or None."""
  n = params_def.num_leaves
  closed = jax.make_jaxpr(inner_init)(abstract_params)
  deps = _propagate(closed.jaxpr, [frozenset((i,)) for i in range(n)])
  state_names = ["state" + s for s in leaf_names(abstract_state)]
  return _dependency_problem("init", deps, _labels(params_def, split, n), state_names,
                             leaf_names(abstract_params))


def update_problem(inner_update, abstract_updates, abstract_state, abstract_params, params_def,
                   split: StateSplit, extra_args: dict) -> Optional[str]:
  """Why running ``inner.update`` once per parameter leaf would not be exact
  (an update or a state leaf that depends on another parameter leaf), or
  None. ``abstract_params`` may be None."""
  n = params_def.num_leaves
  state_labels = _labels(params_def, split, n)
  # Array-valued extra arguments (traced under jit) enter as inputs labelled
  # shared; Python values stay static.
  extra_leaves, extra_def = jax.tree.flatten(extra_args)
  is_array = [isinstance(x, (jax.Array, np.ndarray)) for x in extra_leaves]

  def update(u, s, p, arrays):
    arrays_it = iter(arrays)
    leaves = [next(arrays_it) if a else x for x, a in zip(extra_leaves, is_array)]
    return inner_update(u, s, p, **jax.tree.unflatten(extra_def, leaves))

  extra_arrays = [abstract_leaf(x) for x, a in zip(extra_leaves, is_array) if a]
  try:
    closed, out_shape = jax.make_jaxpr(update, return_shape=True)(
        abstract_updates, abstract_state, abstract_params, extra_arrays)
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(
        f"quantize_state could not trace inner.update(updates, state, params) to check that "
        f"it is leaf-separable ({type(e).__name__}: {e}). If inner is known to be "
        f"leaf-separable pass per_leaf=True; otherwise per_leaf=False.") from e
  new_updates, new_state = out_shape
  if jax.tree.structure(new_state) != jax.tree.structure(abstract_state):
    raise ValueError(
        "inner.update returns a state whose structure differs from inner.init's: "
        f"{jax.tree.structure(new_state)} vs {jax.tree.structure(abstract_state)}.")
  if jax.tree.structure(new_updates) != params_def:
    raise ValueError("inner.update returns updates whose structure differs from the params'.")
  param_labels = list(range(n)) if abstract_params is not None else []
  in_labels = list(range(n)) + state_labels + param_labels + [-1] * len(extra_arrays)
  deps = _propagate(closed.jaxpr, [_NONE if l < 0 else frozenset((l,)) for l in in_labels])
  param_names = leaf_names(abstract_updates)
  names = (["updates" + s for s in param_names]
           + ["new state" + s for s in leaf_names(abstract_state)])
  return _dependency_problem("update", deps, list(range(n)) + state_labels, names, param_names)


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
      sub = _called_jaxpr(eqn)
      outs = None if sub is None else _elementwise_kinds(sub, ins)
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


def is_elementwise(inner_update, g, state, p, layout: StateSplit, extra_args) -> bool:
  """Whether, for this one leaf, every per-parameter output of
  ``inner.update`` is an elementwise function of the per-parameter inputs
  (gradient, per-parameter state, parameter), all of the parameter's shape,
  and every shared output is independent of them."""
  shape = tuple(np.shape(g))
  mirror_leaves = [x for x, m in zip(layout.outer_def.flatten_up_to(state), layout.mirror) if m]
  if any(tuple(np.shape(x)) != shape for x in mirror_leaves):
    return False
  abstract = jax.tree.map(abstract_leaf, (g, state, p))
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
