"""Argument checks shared by the public builders: hyperparameters, static
integers, masks, and which leaves are quantized at all."""

from __future__ import annotations

import numbers
from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

DEFAULT_MIN_QUANTIZE_SIZE = 4096
DEFAULT_CHUNK_SIZE = 1 << 18
MaskOrFn = Optional[Union[Any, Callable[[optax.Params], Any]]]
# The names of ``implementation=`` (see `optax4bit.dispatch`).
IMPLEMENTATIONS = ("auto", "jnp", "xla", "tpu", "tpu_interpret", "cpu", "pallas",
                   "pallas_interpret")


def is_static_number(x) -> bool:
  return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_hyperparam(name: str, value, *, low=None, high=None, low_open=False,
                     high_open=False) -> None:
  """Raises ValueError for a Python number outside its range; arrays,
  tracers and schedules are not checked (they may be injected)."""
  if not is_static_number(value):
    return
  v = float(value)
  bad = not np.isfinite(v)
  if low is not None:
    bad |= v <= low if low_open else v < low
  if high is not None:
    bad |= v >= high if high_open else v > high
  if bad:
    lo = "" if low is None else ("(" if low_open else "[") + f"{low}"
    hi = "" if high is None else f"{high}" + (")" if high_open else "]")
    raise ValueError(f"{name} must be in {lo or '(-inf'}, {hi or 'inf)'}, got {value!r}.")


def check_static_int(name: str, value, *, minimum: int = 0) -> int:
  # numpy scalars are Integral; a jax array is refused even when concrete, so
  # that optax.inject_hyperparams without static_args fails at init already.
  if isinstance(value, np.ndarray) and value.ndim == 0 and np.issubdtype(value.dtype, np.integer):
    value = int(value)
  if not isinstance(value, numbers.Integral) or isinstance(value, bool):
    hint = ""
    if isinstance(value, jax.Array):
      hint = (" It was passed as an array, as optax.inject_hyperparams does with every "
              "number: use optax4bit.inject_hyperparams, or pass "
              f"static_args=({name!r},).")
    raise ValueError(f"{name} must be a Python int, got {value!r}.{hint}")
  if value < minimum:
    raise ValueError(f"{name} must be >= {minimum}, got {value}.")
  return int(value)


def resolve_mask(mask: MaskOrFn, params, argname: str) -> list:
  """Flat list of bools, one per params leaf (prefix masks broadcast)."""
  leaves, treedef = jax.tree.flatten(params)
  if mask is None:
    return [True] * len(leaves)
  tree = mask(params) if callable(mask) else mask
  try:
    full = jax.tree.map(lambda m, sub: jax.tree.map(lambda _: m, sub), tree, params)
    flags = treedef.flatten_up_to(full)
  except (ValueError, TypeError) as e:
    raise ValueError(f"{argname} must be a pytree of bools with the structure of the params "
                     f"(or a prefix of it), or a callable returning one: {e}") from None
  for flag in flags:
    if not isinstance(flag, (bool, np.bool_)):
      raise ValueError(f"{argname} must hold Python bools, got {flag!r} ({type(flag).__name__}).")
  return [bool(f) for f in flags]


def quantizable(leaf, eligible: bool, min_quantize_size: int) -> bool:
  return (eligible and hasattr(leaf, "shape") and len(leaf.shape) >= 1
          and jnp.issubdtype(leaf.dtype, jnp.floating)
          and int(np.prod(leaf.shape)) > min_quantize_size)


def is_array_like(x) -> bool:
  return hasattr(x, "shape") and hasattr(x, "dtype")


def check_chunk_size(chunk_size) -> int:
  """``chunk_size`` or the default (elements per chunk of a chunked update)."""
  if chunk_size is None:
    return DEFAULT_CHUNK_SIZE
  return check_static_int("chunk_size", chunk_size, minimum=1)
