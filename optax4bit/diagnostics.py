"""Diagnostics: how far a quantized optimizer state is from float32 Adam.

Two tools:

* `quantization_report` compares, leaf by leaf, the moments stored by a 4-bit
  Adam (a `ScaleByAdam4bitState` or `ScaleByFactoredAdam4bitState`, found
  anywhere inside a chained, injected or Flax-wrapped optimizer state) with the
  float32 moments of an ``optax.scale_by_adam`` run fed the same gradients: the
  relative error of ``m``, of ``v`` and of the update direction
  ``m_hat / (sqrt(v_hat) + eps)``, the fraction of elements whose stored ``v``
  decodes to exactly 0 while the float32 ``v`` is positive (the paper's
  "zero-point problem": the update of such an element is ``m_hat / eps``), and
  how concentrated the moments are in a few rows or columns (outliers).
  `with_fp32_shadow` runs that float32 reference next to any optimizer, and
  `format_report` prints the report as a table.
* `plot_histograms` (original / normalized / dequantized values) and
  `plot_outliers` (a heat map of ``|x|``) draw the paper's pictures for one
  tensor. They import matplotlib lazily; the rest of the package does not need
  it.

The report is computed on the host in float64 numpy, one leaf at a time: it is
a debugging tool, not something to call every step of a large run.

Example:
  >>> import jax, jax.numpy as jnp, optax, optax4bit
  >>> from optax4bit import diagnostics
  >>> tx = diagnostics.with_fp32_shadow(optax4bit.adamw_4bit(1e-3))
  >>> params = {"w": jnp.zeros((128, 256))}
  >>> state, update = tx.init(params), jax.jit(tx.update)
  >>> for i in range(3):
  ...   grads = {"w": jax.random.normal(jax.random.key(i), (128, 256))}
  ...   updates, state = update(grads, state, params)
  >>> (leaf,) = diagnostics.quantization_report(state)
  >>> leaf.path, leaf.m_spec, leaf.v_spec, leaf.v_zero_fraction
  ("['w']", 'B128/NF stochastic', 'Rank-1/SqrtLinear stochastic', 0.0)
  >>> 0 < leaf.rel_err_m < 0.3 and 0 < leaf.rel_err_direction < 0.5
  True
  >>> print(diagnostics.format_report([leaf]))  # doctest: +ELLIPSIS, +NORMALIZE_WHITESPACE
  path shape m v err m err v err dir v=0 m rows/cols v rows/cols bytes
  ['w'] 128x256 B128/NF stochastic Rank-1/SqrtLinear stochastic ...
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax4bit.quant.array import QuantizedArray, dequantize
from optax4bit._diagnostics_plots import plot_histograms, plot_outliers
from optax4bit._diagnostics_plots import unwrap as _unwrap
from optax4bit._validation import check_hyperparam
from optax4bit.transform import FactoredMoment, ScaleByAdam4bitState, ScaleByFactoredAdam4bitState

__all__ = [
    "LeafReport",
    "ShadowState",
    "format_report",
    "plot_histograms",
    "plot_outliers",
    "quantization_report",
    "with_fp32_shadow",
]

QUANTIZED_ADAM_STATES = (ScaleByAdam4bitState, ScaleByFactoredAdam4bitState)


# ----------------------------------------------------------------------------
# The float32 shadow.


class ShadowState(NamedTuple):
  """State of `with_fp32_shadow`: the wrapped optimizer's state and the
  ``optax.ScaleByAdamState`` of a float32 Adam fed the same gradients."""
  inner: optax.OptState
  shadow: optax.ScaleByAdamState


def with_fp32_shadow(inner: optax.GradientTransformation, b1: float = 0.9,
                     b2: float = 0.999) -> optax.GradientTransformationExtraArgs:
  """Runs float32 Adam moments next to ``inner``, for `quantization_report`.

  The returned transformation behaves exactly like ``inner`` (same updates);
  its state is a `ShadowState` that also holds ``optax.scale_by_adam``
  moments of the same incoming gradients, kept in float32 whatever the
  parameter dtype. It costs 8 bytes per parameter: a diagnostic, not for
  production runs.

  The shadow sees what ``inner`` sees, so wrap the transformation whose input
  is what reaches the 4-bit Adam: ``adamw_4bit(...)`` itself (its Adam comes
  first in its chain), and keep gradient clipping outside, e.g.
  ``optax.chain(optax.clip_by_global_norm(1.0), with_fp32_shadow(adamw_4bit(1e-3)))``.

  Args:
    inner: the optimizer to shadow, e.g. ``optax4bit.adamw_4bit(1e-3)``.
    b1: the first-moment decay of ``inner``.
    b2: the second-moment decay of ``inner``.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with `ShadowState`.

  Example:
    >>> import jax.numpy as jnp, optax4bit
    >>> from optax4bit import diagnostics
    >>> tx = diagnostics.with_fp32_shadow(optax4bit.adamw_4bit(1e-3))
    >>> state = tx.init({"w": jnp.zeros((64, 128))})
    >>> type(state.shadow).__name__
    'ScaleByAdamState'
  """
  check_hyperparam("b1", b1, low=0, high=1, high_open=True)
  check_hyperparam("b2", b2, low=0, high=1, high_open=True)
  inner = optax.with_extra_args_support(inner)
  shadow = optax.scale_by_adam(b1, b2, mu_dtype=jnp.float32)

  def to_f32(tree):
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)

  def init_fn(params):
    return ShadowState(inner.init(params), shadow.init(to_f32(params)))

  def update_fn(updates, state, params=None, **extra_args):
    new_updates, inner_state = inner.update(updates, state.inner, params, **extra_args)
    _, shadow_state = shadow.update(to_f32(updates), state.shadow)
    return new_updates, ShadowState(inner_state, shadow_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# ----------------------------------------------------------------------------
# The report.


@dataclasses.dataclass(frozen=True)
class LeafReport:
  """How one parameter leaf's stored moments compare with float32 Adam.

  Relative errors are ``||stored - fp32|| / ||fp32||`` (Frobenius norms,
  float64; 0 when both are 0, ``inf`` when only the float32 value is 0).

  Attributes:
    path: the leaf's key path in the params, e.g. ``"['layer']['kernel']"``.
    shape: the parameter's shape.
    m_spec: how the first moment is stored: a quantizer name such as
      ``"B128/DE"`` (``"... 8-bit"``, ``"... stochastic"`` when so), or the
      dtype of a moment kept in full precision (``"float32"``).
    v_spec: the same for the second moment; ``"factored"`` for Adafactor
      row/column factors (the error is then the factorization's).
    rel_err_m: relative error of the stored first moment.
    rel_err_v: relative error of the stored second moment.
    rel_err_direction: relative error of the update direction that the stored
      moments give, ``m_hat / (sqrt(v_hat + eps_root) + eps)`` with Adam's
      bias corrections.
    v_zero_fraction: fraction of all elements whose stored ``v`` decodes to
      exactly 0 while the float32 ``v`` is > 0 (the zero-point problem).
    m_row_concentration: share of the total ``|m|`` (float32 reference) held
      by the top ``top_fraction`` rows, the tensor viewed as a matrix
      ``(prod(shape[:-1]), shape[-1])``: about ``top_fraction`` when the mass
      is spread evenly, near 1 when a few rows hold outliers. NaN for 1-D
      leaves and all-zero moments.
    m_col_concentration: the same for columns (the last axis).
    v_row_concentration: the same for ``v`` rows.
    v_col_concentration: the same for ``v`` columns.
    nbytes: bytes stored for this leaf's two moments.
    v_step_scale: how the stored ``v`` scales the step against float32
      Adam's: the geometric mean of ``sqrt(fp32 v / stored v)`` over the
      elements where both are > 0 (1: unbiased; below 1: steps smaller, as a
      second moment rounded to nearest that stalls above its float32 value
      gives them). NaN where there is no such element.
  """

  path: str
  shape: tuple
  m_spec: str
  v_spec: str
  rel_err_m: float
  rel_err_v: float
  rel_err_direction: float
  v_zero_fraction: float
  m_row_concentration: float
  m_col_concentration: float
  v_row_concentration: float
  v_col_concentration: float
  nbytes: int
  v_step_scale: float = math.nan

  @property
  def quantized(self) -> bool:
    """Whether either moment of this leaf is stored quantized or factored."""
    return not (_is_dtype_name(self.m_spec) and _is_dtype_name(self.v_spec))


def _is_dtype_name(name: str) -> bool:
  """Whether a storage name is a dtype's (a moment kept in full precision)
  rather than a quantizer's (``"NORM/MAP ..."``) or ``"factored"``."""
  return "/" not in name and name != "factored"


def _find_one(tree, types: tuple, what: str, argname: str):
  found = [x for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, types))
           if isinstance(x, types)]
  if len(found) != 1:
    names = " or ".join(t.__name__ for t in types)
    detail = ("none was found" if not found else
              f"{len(found)} were found; pass the sub-state that holds the one you want")
    raise ValueError(f"{argname} must contain exactly one {names} ({what}), but {detail}.")
  return found[0]


# One compiled program per shape and spec, instead of dozens of eager ops.
_dequantize = jax.jit(dequantize)


def _moment_leaf(x):
  return isinstance(x, (QuantizedArray, FactoredMoment))


def _as_f64(moment) -> np.ndarray:
  """float64 value of a stored moment (quantized, factored or plain)."""
  moment = _unwrap(moment)
  if isinstance(moment, QuantizedArray):
    return np.asarray(_dequantize(moment), np.float64)
  if isinstance(moment, FactoredMoment):
    row = np.asarray(_unwrap(moment.row), np.float64)
    col = np.asarray(_unwrap(moment.col), np.float64)
    row_mean = row.mean(axis=-2, keepdims=True)
    positive = row_mean > 0
    return np.where(positive, row * col / np.where(positive, row_mean, 1.0), 0.0)
  return np.asarray(moment, np.float64)


def _storage_name(moment) -> str:
  moment = _unwrap(moment)
  if isinstance(moment, QuantizedArray):
    spec = moment.spec
    extras = ([] if spec.bits == 4 else [f"{spec.bits}-bit"]) + (
        ["stochastic"] if spec.stochastic else [])
    return " ".join([spec.name] + extras)
  if isinstance(moment, FactoredMoment):
    return "factored"
  return np.dtype(moment.dtype).name


def _nbytes(moment) -> int:
  return int(sum(np.dtype(x.dtype).itemsize * math.prod(x.shape)
                 for x in jax.tree.leaves(moment) if hasattr(x, "dtype")))


def _rel_err(approx: np.ndarray, exact: np.ndarray) -> float:
  num = float(np.linalg.norm((approx - exact).ravel()))
  den = float(np.linalg.norm(exact.ravel()))
  if den == 0.0:
    return 0.0 if num == 0.0 else math.inf
  return num / den


def _concentration(x: np.ndarray, top_fraction: float) -> tuple:
  """(row share, column share) of ``|x|`` held by the top rows / columns."""
  if x.ndim < 2:
    return math.nan, math.nan
  a = np.abs(x).reshape(-1, x.shape[-1])
  total = float(a.sum())
  if not total > 0:
    return math.nan, math.nan

  def share(mass):
    k = max(1, math.ceil(top_fraction * mass.size))
    return float(np.sort(mass)[-k:].sum() / total)

  return share(a.sum(axis=1)), share(a.sum(axis=0))


def _step_scale(v: np.ndarray, v_ref: np.ndarray) -> float:
  both = (v > 0) & (v_ref > 0)
  if not both.any():
    return math.nan
  return float(np.exp(0.5 * np.mean(np.log(v_ref[both] / v[both]))))


def _direction(m, v, count, b1, b2, eps, eps_root):
  if count == 0:
    return np.zeros_like(m)
  m_hat = m / (1.0 - b1**count)
  v_hat = v / (1.0 - b2**count)
  return m_hat / (np.sqrt(v_hat + eps_root) + eps)


def quantization_report(
    state: Any,
    reference: Any = None,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    top_fraction: float = 0.01,
    quantized_only: bool = False,
) -> list:
  """Per-leaf comparison of a quantized Adam state with float32 Adam.

  ``state`` is searched (as a pytree) for the one `ScaleByAdam4bitState` or
  `ScaleByFactoredAdam4bitState` it holds, e.g. inside ``optax.chain``,
  ``optax.inject_hyperparams`` or a Flax ``nnx.State``; ``reference`` (or,
  if ``None``, ``state`` itself, as with `with_fp32_shadow`) for the one
  ``optax.ScaleByAdamState`` of a float32 Adam that saw the same gradients.
  Both must be at the same step.

  Args:
    state: an optimizer state holding a 4-bit Adam state (any bits: the
      8-bit optimizer's state is a `ScaleByAdam4bitState` too).
    reference: an optimizer state holding the float32 reference
      (``optax.adam``/``optax.adamw``/``optax.scale_by_adam`` with the same
      ``b1``, ``b2`` and the same gradients); defaults to ``state``.
    b1: the first-moment decay (for the bias correction of the direction).
    b2: the second-moment decay.
    eps: the ``eps`` of the direction ``m_hat / (sqrt(v_hat + eps_root) + eps)``.
    eps_root: the ``eps_root`` of the direction.
    top_fraction: the share of rows / columns whose mass the concentration
      columns report (default the top 1%, at least one row or column).
    quantized_only: leave out leaves whose moments are both kept in full
      precision (their errors are 0).

  Returns:
    A list of `LeafReport`, in the params' leaf order.

  Raises:
    ValueError: when the states do not hold exactly one of each, are at
      different steps or have different structures.

  Example:
    >>> import jax, jax.numpy as jnp, optax, optax4bit
    >>> from optax4bit import diagnostics
    >>> params = {"w": jnp.zeros((64, 128))}
    >>> tx4 = optax4bit.adam_4bit(1e-3, second_moment="B128/DE", min_quantize_size=0)
    >>> tx32 = optax.adam(1e-3)
    >>> s4, s32 = tx4.init(params), tx32.init(params)
    >>> g = {"w": jnp.ones((64, 128)).at[0, 0].set(1e3)}  # one outlier
    >>> _, s4 = jax.jit(tx4.update)(g, s4)
    >>> _, s32 = jax.jit(tx32.update)(g, s32)
    >>> (r,) = diagnostics.quantization_report(s4, s32)
    >>> r.v_spec, r.v_zero_fraction  # the outlier's block decodes to 0
    ('B128/DE', 0.0155029296875)
  """
  check_hyperparam("b1", b1, low=0, high=1, high_open=True)
  check_hyperparam("b2", b2, low=0, high=1, high_open=True)
  check_hyperparam("eps", eps, low=0)
  check_hyperparam("eps_root", eps_root, low=0)
  check_hyperparam("top_fraction", top_fraction, low=0, high=1, low_open=True)
  q_state = _find_one(state, QUANTIZED_ADAM_STATES, "the quantized optimizer", "state")
  ref_state = _find_one(state if reference is None else reference, (optax.ScaleByAdamState,),
                        "the float32 reference", "state" if reference is None else "reference")
  count = int(np.asarray(_unwrap(q_state.count)))
  ref_count = int(np.asarray(_unwrap(ref_state.count)))
  if count != ref_count:
    raise ValueError(f"the quantized state is at step {count} but the float32 reference at step "
                     f"{ref_count}: they must have seen the same gradients.")

  paths_and_m, treedef = jax.tree_util.tree_flatten_with_path(q_state.mu, is_leaf=_moment_leaf)
  flat_v = treedef.flatten_up_to(q_state.nu)
  try:
    ref_m = treedef.flatten_up_to(ref_state.mu)
    ref_v = treedef.flatten_up_to(ref_state.nu)
  except (ValueError, TypeError) as e:
    raise ValueError(f"the float32 reference's moments do not have the structure of the "
                     f"quantized state's: {e}") from None

  reports = []
  for (path, m_q), v_q, m_32, v_32 in zip(paths_and_m, flat_v, ref_m, ref_v):
    report_m, report_v = _storage_name(m_q), _storage_name(v_q)
    if quantized_only and _is_dtype_name(report_m) and _is_dtype_name(report_v):
      continue
    m, v = _as_f64(m_q), _as_f64(v_q)
    m_ref, v_ref = _as_f64(m_32), _as_f64(v_32)
    if m.shape != m_ref.shape:
      raise ValueError(f"leaf {jax.tree_util.keystr(path)} has shape {m.shape} in the quantized "
                       f"state but {m_ref.shape} in the reference.")
    direction = _direction(m, v, count, b1, b2, eps, eps_root)
    ref_direction = _direction(m_ref, v_ref, count, b1, b2, eps, eps_root)
    m_rows, m_cols = _concentration(m_ref, top_fraction)
    v_rows, v_cols = _concentration(v_ref, top_fraction)
    reports.append(LeafReport(
        path=jax.tree_util.keystr(_strip_variable_keys(path)),
        shape=tuple(m.shape),
        m_spec=report_m,
        v_spec=report_v,
        rel_err_m=_rel_err(m, m_ref),
        rel_err_v=_rel_err(v, v_ref),
        rel_err_direction=_rel_err(direction, ref_direction),
        v_zero_fraction=float(np.mean((v == 0) & (v_ref > 0))) if v.size else 0.0,
        v_step_scale=_step_scale(v, v_ref),
        m_row_concentration=m_rows,
        m_col_concentration=m_cols,
        v_row_concentration=v_rows,
        v_col_concentration=v_cols,
        nbytes=_nbytes(m_q) + _nbytes(v_q),
    ))
  return reports


def _strip_variable_keys(path: tuple) -> tuple:
  """Drops the ``.value`` / ``.raw_value`` attribute keys of Flax variables."""
  return tuple(k for k in path if not (isinstance(k, jax.tree_util.GetAttrKey)
                                       and k.name in ("value", "raw_value")))


def format_report(reports: Sequence[LeafReport], *, max_path: int = 48) -> str:
  """Formats a `quantization_report` as a plain-text table.

  Columns: the leaf, its shape, how ``m`` and ``v`` are stored, the relative
  errors of ``m``, ``v`` and the update direction, the share of elements whose
  ``v`` decodes to 0 (``v=0``), the share of ``|m|`` and ``|v|`` in the top
  rows / columns (``rows/cols``), and the stored bytes. A last line gives
  the largest errors (NaN if any is NaN) and the total bytes.

  Args:
    reports: `LeafReport` objects.
    max_path: paths longer than this are shortened from the left.

  Returns:
    The table as a string (print it).

  Example:
    >>> from optax4bit import diagnostics
    >>> r = diagnostics.LeafReport("['w']", (4, 8), "B128/DE", "Rank-1/Linear", 0.05, 0.1,
    ...                            0.08, 0.0, 0.02, 0.5, 0.01, 0.01, 32)
    >>> print(diagnostics.format_report([r]))  # doctest: +NORMALIZE_WHITESPACE
    path   shape  m        v              err m  err v  err dir  v=0    m rows/cols  v rows/cols  bytes
    ['w']  4x8    B128/DE  Rank-1/Linear  0.05   0.1    0.08     0.00%  0.02/0.50    0.01/0.01    32
    max / sum                             0.05   0.1    0.08     0.00%                             32
  """

  def num(x):  # NaN and inf errors mean a broken state: print them
    return f"{x:.3g}"

  def worst(values):  # NaN wins, unlike max()
    return float(np.max(np.asarray(values, np.float64)))

  def pair(a, b):
    if math.isnan(a) and math.isnan(b):
      return "-"
    return f"{a:.2f}/{b:.2f}"

  def short(path):
    return path if len(path) <= max_path else "..." + path[-(max_path - 3):]

  header = ("path", "shape", "m", "v", "err m", "err v", "err dir", "v=0", "m rows/cols",
            "v rows/cols", "bytes")
  rows = [header]
  for r in reports:
    rows.append((short(r.path), "x".join(map(str, r.shape)) or "()", r.m_spec, r.v_spec,
                 num(r.rel_err_m), num(r.rel_err_v), num(r.rel_err_direction),
                 f"{100 * r.v_zero_fraction:.2f}%",
                 pair(r.m_row_concentration, r.m_col_concentration),
                 pair(r.v_row_concentration, r.v_col_concentration), str(r.nbytes)))
  if reports:
    rows.append(("max / sum", "", "", "", num(worst([r.rel_err_m for r in reports])),
                 num(worst([r.rel_err_v for r in reports])),
                 num(worst([r.rel_err_direction for r in reports])),
                 f"{100 * worst([r.v_zero_fraction for r in reports]):.2f}%", "", "",
                 str(sum(r.nbytes for r in reports))))
  widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
  lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
  return "\n".join(lines)
