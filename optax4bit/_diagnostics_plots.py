"""The plots of `optax4bit.diagnostics`: `plot_histograms` and
`plot_outliers` (matplotlib is imported lazily)."""

from __future__ import annotations

import functools
import math
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from optax4bit.quant import maps, normalize
from optax4bit.quant.array import QuantizedArray, dequantize, quantize
from optax4bit.quant.spec import SpecLike, as_spec

_dequantize = jax.jit(dequantize)


def unwrap(x):
  """The value of a Flax variable (or ``x`` itself)."""
  get_value = getattr(x, "get_value", None)
  return get_value() if callable(get_value) else x


def _pyplot():
  try:
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("optax4bit.diagnostics plots need matplotlib: pip install matplotlib "
                      "(or the package's 'examples' extra).") from e
  return plt


def _host_array(x) -> np.ndarray:
  x = unwrap(x)
  if isinstance(x, QuantizedArray):
    x = _dequantize(x)
  return np.asarray(x, np.float32)


@functools.partial(jax.jit, static_argnums=1)
def _normalized_and_dequantized(x, spec, key):
  layout = normalize.layout_for(spec, x.shape)
  normalized = normalize.normalize(
      x, normalize.compute_scales(normalize.finite_abs(x), layout), layout)
  return normalized, dequantize(quantize(x, spec, key=key))


def plot_histograms(
    x: Any,
    spec: SpecLike,
    ax: Optional[Sequence[Any]] = None,
    *,
    signed: Optional[bool] = None,
    bins: int = 100,
    log_x: bool = False,
    key: Optional[jax.Array] = None,
    title: Optional[str] = None,
):
  """Histograms of a tensor before and after quantization (log-scale counts).

  Three panels, as in the paper's figures: the original values, the
  normalized values ``x / scale`` with the quantization table drawn as thin
  vertical lines, and the dequantized values. The dequantized panel's title
  gives the share of non-zero elements that decode to exactly 0 (the
  zero-point problem: try a second moment with ``"B128/DE"`` against
  ``"Rank-1/Linear"``).

  Args:
    x: the tensor (array, or a `QuantizedArray`, which is dequantized first).
    spec: the quantizer, a name such as ``"B128/DE"`` or a `QuantSpec`.
    ax: three matplotlib axes to draw in; by default a new figure.
    signed: for a name: whether to use the signed table; by default signed
      exactly when ``x`` has negative values (``DE-0`` and ``Linear`` are
      unsigned only).
    bins: histogram bins.
    log_x: histogram ``log10(|x|)`` of the non-zero values instead (for
      second moments, which span many orders of magnitude); zeros are counted
      in the panel titles.
    key: PRNG key for a stochastic spec (default ``jax.random.key(0)``).
    title: a title for the figure.

  Returns:
    The matplotlib ``Figure``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from optax4bit import diagnostics
    >>> v = jax.random.normal(jax.random.key(0), (256, 256)) ** 2
    >>> fig = diagnostics.plot_histograms(v, "B128/DE")
    >>> len(fig.axes)
    3
  """
  plt = _pyplot()
  x32 = _host_array(x)
  if isinstance(spec, str) and signed is None:
    signed = bool(np.any(x32 < 0)) if spec.endswith("/DE") else None
  spec = as_spec(spec, signed=signed if isinstance(spec, str) else None)
  if spec.stochastic and key is None:
    key = jax.random.key(0)
  normalized, dq = jax.device_get(_normalized_and_dequantized(
      jnp.asarray(x32), spec, key if spec.stochastic else None))
  table = maps.qmap(spec.mapping, spec.bits, spec.signed)

  if ax is None:
    fig, ax = plt.subplots(1, 3, figsize=(13, 3.4))
  else:
    fig = ax[0].figure
  if len(ax) != 3:
    raise ValueError(f"ax must be three axes, got {len(ax)}.")

  nonzero = x32 != 0
  decoded_to_zero = float(np.mean((dq == 0) & nonzero)) if x32.size else 0.0

  def draw(axis, values, name, color):
    values = values[np.isfinite(values)].ravel()
    if log_x:
      zeros = int(np.sum(values == 0))
      values = np.log10(np.abs(values[values != 0]))
      name = f"{name}, log10|x| ({zeros} zeros)"
    axis.hist(values, bins=bins, color=color, log=True)
    axis.set_title(name, fontsize=10)
    axis.set_ylabel("count")

  draw(ax[0], x32, "original", "tab:blue")
  draw(ax[1], normalized, f"normalized ({spec.name})", "tab:orange")
  for entry in table:
    if log_x:
      if entry != 0:
        ax[1].axvline(np.log10(abs(entry)), color="k", lw=0.4, alpha=0.4)
    else:
      ax[1].axvline(entry, color="k", lw=0.4, alpha=0.4)
  draw(ax[2], dq, f"dequantized: {100 * decoded_to_zero:.2f}% non-zeros -> 0", "tab:green")
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  return fig


def _max_pool(a: np.ndarray, max_size: int) -> np.ndarray:
  """Block maxima so that neither axis exceeds ``max_size`` (outliers stay)."""
  fr = max(1, math.ceil(a.shape[0] / max_size))
  fc = max(1, math.ceil(a.shape[1] / max_size))
  if fr == 1 and fc == 1:
    return a
  padded = np.zeros((math.ceil(a.shape[0] / fr) * fr, math.ceil(a.shape[1] / fc) * fc), a.dtype)
  padded[:a.shape[0], :a.shape[1]] = a
  return padded.reshape(padded.shape[0] // fr, fr, padded.shape[1] // fc, fc).max(axis=(1, 3))


def plot_outliers(
    x: Any,
    ax: Optional[Any] = None,
    *,
    max_size: int = 256,
    log: bool = True,
    title: Optional[str] = None,
):
  """Heat map of ``|x|``, to see outlier rows and columns.

  The tensor is viewed as a matrix ``(prod(shape[:-1]), shape[-1])`` (1-D:
  one row); larger matrices are shown by block maxima, at most ``max_size``
  cells per axis, so single outliers stay visible. Row outliers show as
  horizontal stripes, column outliers as vertical ones: the structure that
  decides between block-wise and rank-1 normalization.

  Args:
    x: the tensor (array, or a `QuantizedArray`, which is dequantized first).
    ax: a matplotlib axis to draw in; by default a new figure.
    max_size: largest number of cells per axis.
    log: logarithmic colour scale (when ``x`` has non-zero values).
    title: the axis title (default: the shape).

  Returns:
    The matplotlib ``Figure``.

  Example:
    >>> import jax.numpy as jnp
    >>> from optax4bit import diagnostics
    >>> m = jnp.ones((512, 300)).at[:, 7].set(50.0)  # an outlier column
    >>> fig = diagnostics.plot_outliers(m)
    >>> fig.axes[0].images[0].get_array().shape
    (256, 150)
  """
  plt = _pyplot()
  from matplotlib import colors  # pylint: disable=import-outside-toplevel
  if not (isinstance(max_size, int) and max_size >= 1):
    raise ValueError(f"max_size must be a positive int, got {max_size!r}.")
  a = np.abs(_host_array(x))
  a = np.where(np.isfinite(a), a, 0.0)
  matrix = a.reshape(1, -1) if a.ndim < 2 else a.reshape(-1, a.shape[-1])
  shape = matrix.shape
  pooled = _max_pool(matrix, max_size)
  if ax is None:
    fig, ax = plt.subplots(figsize=(6, 4.5))
  else:
    fig = ax.figure
  positive = pooled[pooled > 0]
  norm = None
  if log and positive.size:
    norm = colors.LogNorm(vmin=float(positive.min()), vmax=float(positive.max()))
    pooled = np.where(pooled > 0, pooled, np.nan)
  image = ax.imshow(pooled, aspect="auto", interpolation="nearest", norm=norm, cmap="viridis",
                    extent=(0, shape[1], shape[0], 0))
  fig.colorbar(image, ax=ax, label="|x|" + (" (block max)" if pooled.shape != shape else ""))
  ax.set_xlabel("column (last axis)")
  ax.set_ylabel("row")
  ax.set_title(title if title is not None else f"|x|, shape {tuple(a.shape)}", fontsize=10)
  return fig
