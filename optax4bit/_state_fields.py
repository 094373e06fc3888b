"""Which leaves of an optax state are per-parameter, and how each is quantized.

`quantize_state` finds the per-parameter fields of an inner state by
structure (`split_state`) and reads the quantizer of each from the optax state
class and field name (`KNOWN_STATE_FIELDS`), or from the user's ``spec_for``
(`plan_specs`).
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Optional

import jax
import numpy as np

from optax4bit import _validation
from optax4bit import _recipes
from optax4bit.quant import array as qarray
from optax4bit.quant.spec import QuantSpec, as_spec

__all__ = ["KNOWN_STATE_FIELDS"]

SIGNED = "signed"
SIGNED_SLOW = "signed, slow EMA"
NON_NEGATIVE = "non-negative"
# Copies of the parameters (an initial point, schedule-free's z): 4 bits would
# move the point itself, not an estimate of a statistic.
PARAMETER_COPY = "parameter copy"
PAPER_SPECS = {
    SIGNED: QuantSpec.parse("B128/DE"),
    # An EMA whose decay is close to 1 (Lion's b2 = 0.99, AdEMAMix's b3 =
    # 0.9999) moves by 1% or less of its value per step, much less than half a
    # 4-bit quantization step: rounded to nearest it stays frozen. Stochastic
    # rounding is unbiased, so such an EMA still moves on average.
    SIGNED_SLOW: QuantSpec.parse("B128/DE", stochastic=True),
    NON_NEGATIVE: QuantSpec.parse("Rank-1/Linear"),
    PARAMETER_COPY: None,
}

# State classes of optax (and optax.contrib) whose per-parameter fields the
# default classification knows: signed fields, slow signed EMAs, non-negative
# ones (second-moment-like) and copies of the parameters (kept in full
# precision); see `default_spec` for the quantizer of each kind. Fields
# never shaped like a parameter (FactoredState.v_row / v_col of factored
# leaves, novograd's per-leaf norm, SM3's per-axis accumulators) are listed
# for completeness.
KNOWN_STATE_FIELDS: dict = {
    "ScaleByAdamState": {"mu": SIGNED, "nu": NON_NEGATIVE},
    "ScaleByAmsgradState": {"mu": SIGNED, "nu": NON_NEGATIVE, "nu_max": NON_NEGATIVE},
    "ScaleByLionState": {"mu": SIGNED_SLOW},
    "TraceState": {"trace": SIGNED},
    "EmaState": {"ema": SIGNED},
    "ScaleByRmsState": {"nu": NON_NEGATIVE},
    "ScaleByRmsWithCountState": {"nu": NON_NEGATIVE},
    "ScaleByRStdDevState": {"mu": SIGNED, "nu": NON_NEGATIVE},
    "ScaleByRStdDevWithCountState": {"mu": SIGNED, "nu": NON_NEGATIVE},
    "ScaleByAdaDeltaState": {"e_g": NON_NEGATIVE, "e_x": NON_NEGATIVE},
    "FactoredState": {"v_row": NON_NEGATIVE, "v_col": NON_NEGATIVE, "v": NON_NEGATIVE},
    "ScaleByBeliefState": {"mu": SIGNED, "nu": NON_NEGATIVE},
    "ScaleByNovogradState": {"mu": SIGNED, "nu": NON_NEGATIVE},
    "ScaleByAdanState": {"m": SIGNED, "v": SIGNED, "n": NON_NEGATIVE, "g": SIGNED},
    "ScaleByRssState": {"sum_of_squares": NON_NEGATIVE},
    "ScaleByRpropState": {"step_sizes": NON_NEGATIVE, "prev_updates": SIGNED},
    "ScaleBySM3State": {"mu": NON_NEGATIVE, "nu": SIGNED},
    # optimistic_gradient_descent, optimistic_adam(_v2): the last gradient.
    "ScaleByOptimisticGradientState": {"previous_gradient": SIGNED},
    "ScaleByDistanceOverGradientsState": {"init_params": PARAMETER_COPY},
    # optax.contrib
    "ScaleByAdemamixState": {"m1": SIGNED, "m2": SIGNED_SLOW, "nu": NON_NEGATIVE},
    "ScaleBySimplifiedAdEMAMixState": {"m": SIGNED, "n": NON_NEGATIVE},
    "MuonState": {"mu": SIGNED},
    "MomoState": {"exp_avg": SIGNED},
    "MomoAdamState": {"exp_avg": SIGNED, "exp_avg_sq": NON_NEGATIVE},
    "DAdaptAdamWState": {"exp_avg": SIGNED, "exp_avg_sq": NON_NEGATIVE, "grad_sum": SIGNED},
    "ProdigyState": {"exp_avg": SIGNED, "exp_avg_sq": NON_NEGATIVE, "grad_sum": SIGNED,
                     "params0": PARAMETER_COPY},
    "MadgradState": {"grad_sum_sq": NON_NEGATIVE, "s": SIGNED, "x0": PARAMETER_COPY},
    "SophiaState": {"mu": SIGNED, "nu": SIGNED},  # a Hutchinson estimate can be negative
    "ScheduleFreeState": {"z": PARAMETER_COPY},
    "DoGState": {"init_params": PARAMETER_COPY},
    "DoWGState": {"init_params": PARAMETER_COPY},
    "MechanicState": {"x0": PARAMETER_COPY},
}




class StateSplit(NamedTuple):
  """An inner state split at the subtrees that mirror the params tree (the
  per-parameter fields, e.g. ``ScaleByAdamState.mu``); other leaves are
  shared by all parameters (``count``, schedule states)."""
  outer_def: Any        # treedef of the state with each mirror subtree as one leaf
  outer_paths: list     # key path of each outer leaf
  outer_leaves: list    # mirror subtrees or shared leaves
  mirror: list          # bool per outer leaf


def split_state(state, params_def, *, prefix: bool = False) -> StateSplit:
  """``state`` split at its subtrees with the structure ``params_def`` (one
  leaf per parameter), or with ``prefix`` at the outermost subtrees of which
  ``params_def`` is a prefix (a parameter's entry may then be a subtree, as
  SM3's per-axis accumulators are)."""
  def is_mirror(x):
    if not prefix:
      return jax.tree.structure(x, is_leaf=qarray.is_quantized) == params_def
    if qarray.is_quantized(x):
      return False
    try:
      params_def.flatten_up_to(x)
    except (ValueError, TypeError):
      return False
    return True

  pairs, outer_def = jax.tree_util.tree_flatten_with_path(
      state, is_leaf=lambda x: qarray.is_quantized(x) or is_mirror(x))
  paths = [p for p, _ in pairs]
  leaves = [x for _, x in pairs]
  return StateSplit(outer_def, paths, leaves, [is_mirror(x) for x in leaves])


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
  """The `KNOWN_STATE_FIELDS` kind of ``owner.field`` (through base classes).
  Only optax's own classes match (by module), not a user's class of the same
  name."""
  if owner is None:
    return None
  for cls in owner.__mro__:
    if cls.__module__.split(".")[0] == "optax" and cls.__name__ in KNOWN_STATE_FIELDS:
      return KNOWN_STATE_FIELDS[cls.__name__].get(field)
  return None


def check_spec_value(value, where: str):
  """A spec_for value: ``None`` (keep full precision), ``"auto"`` (default
  classification), a name or a `QuantSpec`."""
  if value is None or (isinstance(value, str) and value == "auto"):
    return value
  return as_spec(value, argname=where)


def default_spec(kind: str, recipe: str) -> Optional[QuantSpec]:
  """The quantizer of a `KNOWN_STATE_FIELDS` kind: `PAPER_SPECS` for
  ``recipe="paper"``; for ``"default"``, the library
  recipe's first-moment quantizer (the stall rule) for signed fields and its
  second-moment quantizer for non-negative ones."""
  if recipe == "paper" or kind == PARAMETER_COPY:
    return PAPER_SPECS[kind]
  chosen = _recipes.resolve(recipe)
  return chosen.second_moment if kind == NON_NEGATIVE else chosen.first_moment


def plan_specs(abstract_state, params, params_def, layout: StateSplit, spec_for,
               min_quantize_size: int, quantize_mask, recipe: str) -> list:
  """``specs[k][i]``: the `QuantSpec` of mirror ``k``'s leaf for parameter
  ``i`` (None: full precision); ``None`` for shared outer leaves."""
  param_leaves = params_def.flatten_up_to(params)
  param_paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  flags = _validation.resolve_mask(quantize_mask, params, "quantize_mask")
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
      kind = _known_kind(owner, field)
      # A known field may hold a parameter's state in another shape of the
      # same rank (GaLore's Adam moments live in the projected (rank, n)
      # space); factors of lower rank (Adafactor's v_row / v_col, SM3's
      # accumulators) and unknown fields are quantized only where shaped like
      # the parameter.
      eligible = (hasattr(leaf, "shape") and hasattr(leaf, "dtype")
                  and (tuple(leaf.shape) == tuple(np.shape(p))
                       or (kind is not None and len(leaf.shape) == np.ndim(p)))
                  and _validation.quantizable(leaf, flags[i], min_quantize_size))
      if not eligible:
        row.append(None)
        continue
      full_path = tuple(path) + tuple(param_paths[i])
      where = f"the state leaf at {jax.tree_util.keystr(full_path)}"
      value = "auto"
      if callable(spec_for):
        value = check_spec_value(spec_for(full_path, leaf), f"spec_for for {where}")
      elif isinstance(spec_for, Mapping):
        key = f"{name}.{field}" if f"{name}.{field}" in spec_for else field
        if key in spec_for:
          value = check_spec_value(spec_for[key], f"spec_for[{key!r}]")
      if isinstance(value, str):  # "auto"
        if kind is None:
          desc = f"{name}.{field}" if name is not None else "an unnamed position"
          raise ValueError(
              f"quantize_state cannot tell how to quantize {where} ({desc}, shape "
              f"{tuple(leaf.shape)}, {np.dtype(leaf.dtype).name}): it is shaped like a parameter "
              f"but is not a field this library knows. Pass spec_for, e.g. "
              f"spec_for={{{field!r}: 'B128/DE'}} if it can be negative, 'Rank-1/Linear' if it "
              f"is non-negative (second-moment-like), or None to keep it in full precision.")
        value = default_spec(kind, recipe)
      elif value is not None and kind in (SIGNED, SIGNED_SLOW, PARAMETER_COPY) and not value.signed:
        raise ValueError(
            f"spec_for gives the unsigned spec {value} to {where} ({name}.{field}), which can "
            f"be negative; use a signed spec such as 'B128/DE'.")
      row.append(value)
    specs.append(row)
  return specs
