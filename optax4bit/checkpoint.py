"""Checkpoints of train states with 4-bit optimizer states (orbax-checkpoint).

A `QuantizedArray` keeps its quantizer, shape and dtype as static pytree aux
data, so a restore target built from a new optimizer carries the *new*
quantizer: orbax alone would happily decode codes written under another map
(``Rank-1/Linear`` codes read as ``Rank-1/DE-0``) into garbage. `save` writes,
beside the arrays, a small JSON description of every leaf (path, quantizer,
shape, dtype); `restore` compares it with the target first and raises
`CheckpointMismatchError` naming the differing leaves. The description
survives trees that keep only keys and leaves, such as ``nnx.state(optimizer)``
(which splits each `QuantizedArray` into plain ``codes`` and ``scales``
leaves): a `QuantizedArray` files its scales under a key naming its quantizer
(`optax4bit.quant.array.quantizer_key`), which `describe` reads back.
Where stochastic rounding applies (``stall_only``, the stall rule) is not
compared: it decides how later steps round, not how the codes decode, so a
state written by the default recipe before issue 50 made the stall rule its
first moment's restores into today's default, and the other way round.

Saves go through ``orbax.checkpoint.CheckpointManager``, which writes a step
into a temporary directory and renames it when complete (atomic finalize): a
save killed midway leaves only the temporary directory, which
``latest_step()`` and `restore` ignore, so the previous step is restored.

Restoring onto another mesh or another ``PartitionSpec`` only needs a target
with the new shardings (`optax4bit.state_shardings` for the optimizer state).
Orbax reads each shard's slice of the arrays, so nothing is gathered.

Example:
  >>> import tempfile, jax, jax.numpy as jnp, optax4bit
  >>> import orbax.checkpoint as ocp
  >>> from optax4bit import checkpoint
  >>> tx = optax4bit.adamw_4bit(1e-3)
  >>> params = {"w": jnp.ones((128, 128))}
  >>> state = {"params": params, "opt_state": tx.init(params), "step": 0}
  >>> with ocp.CheckpointManager(tempfile.mkdtemp()) as manager:
  ...   _ = checkpoint.save(manager, 0, state)
  ...   manager.wait_until_finished()
  ...   restored = checkpoint.restore(manager, checkpoint.abstract(state))
  >>> bool((restored["opt_state"][0].mu["w"].codes == state["opt_state"][0].mu["w"].codes).all())
  True
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import numpy as np

from optax4bit.quant import array as qarray
from optax4bit.quant.array import QuantizedArray

__all__ = ["CheckpointMismatchError", "abstract", "describe", "restore", "save",
           "check_compatible"]

# /2: scales are keyed by their quantizer (`qarray.quantizer_key`); /1 files
# had ``scales[i]`` array names, which a /2 target does not have.
FORMAT = "optax4bit-state/2"
STATE_ITEM = "state"
META_ITEM = "optax4bit"


class CheckpointMismatchError(ValueError):
  """The checkpoint was written by another optimizer or quantizer config."""


def _describe_leaf(x) -> dict:
  if isinstance(x, QuantizedArray):
    spec = dataclasses.asdict(x.spec)
    return {"kind": "quantized", "spec": spec, "shape": list(x.shape),
            "dtype": np.dtype(x.dtype).name}
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return {"kind": "array", "shape": list(x.shape), "dtype": np.dtype(x.dtype).name}
  return {"kind": type(x).__name__}


def _split_quantizer(path: tuple):
  """``(path, spec)``: for a scale array of a split `QuantizedArray` (a path
  through ``scales`` and its quantizer key, as ``nnx.state`` leaves it), the
  path without that key and the quantizer; else ``(path, None)``."""
  for i in range(1, len(path)):
    key = getattr(path[i], "key", None)
    before = path[i - 1]
    if getattr(before, "name", getattr(before, "key", None)) == "scales":
      spec = qarray.spec_of_key(key)
      if spec is not None:
        return path[:i] + path[i + 1:], spec
  return path, None


def describe(tree) -> dict:
  """A JSON-able description of every leaf of ``tree``: its path and, for a
  `QuantizedArray`, its quantizer, logical shape and dtype (arrays: shape and
  dtype). Works for arrays and ``jax.ShapeDtypeStruct`` alike, and for trees
  in which quantized arrays were split into their codes and scales (Flax
  NNX's ``nnx.state``): a scale array is described with its quantizer."""
  leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=qarray.is_quantized)[0]
  described = {}
  for path, x in leaves:
    path, spec = _split_quantizer(path)
    entry = _describe_leaf(x)
    if spec is not None:
      entry["quantizer"] = dataclasses.asdict(spec)
    described[jax.tree_util.keystr(path)] = entry
  return {"format": FORMAT, "leaves": described}


def _quantizer_name(s: dict) -> str:
  norm = {"tensor": "Tensor", "rank1": "Rank-1"}.get(s["normalization"], f"B{s['block_size']}")
  rounding = (" stochastic where stalled" if s.get("stall_only") else
              " stochastic" if s["stochastic"] else "")
  return f"{norm}/{s['mapping']} ({s['bits']}-bit{rounding})"


def _stored_form(entry: dict) -> dict:
  """A leaf's description without the stall rule (``stall_only``), which
  does not change how its codes decode; descriptions written before the
  rule existed lack the field."""
  return {k: ({f: x for f, x in v.items() if f != "stall_only"}
              if k in ("spec", "quantizer") else v) for k, v in entry.items()}


def _spec_name(d: dict) -> str:
  if d.get("kind") == "quantized":
    return f"{_quantizer_name(d['spec'])} {tuple(d['shape'])} {d['dtype']}"
  name = f"{d.get('kind')} {tuple(d.get('shape', ()))} {d.get('dtype', '')}".strip()
  if "quantizer" in d:
    return f"{name} (scales of {_quantizer_name(d['quantizer'])})"
  return name


def check_compatible(saved: dict, target) -> None:
  """Raises `CheckpointMismatchError` unless ``target`` (a pytree, or its
  `describe`) stores its leaves exactly as the checkpoint described by
  ``saved`` does."""
  want = target if isinstance(target, dict) and target.get("format") == FORMAT else describe(target)
  if isinstance(saved, dict) and saved.get("format") == "optax4bit-state/1":
    raise CheckpointMismatchError(
        "the checkpoint was written by optax4bit 0.1 (format 'optax4bit-state/1'), whose "
        "arrays are named scales[i]; this version files them under their quantizer's name. "
        "Restore it with optax4bit 0.1, or read it with orbax's own restore.")
  if not isinstance(saved, dict) or saved.get("format") != FORMAT:
    raise CheckpointMismatchError(
        f"the checkpoint has no optax4bit description (format {FORMAT!r}); it was not written "
        "by optax4bit.checkpoint.save.")
  have, need = saved["leaves"], want["leaves"]
  only_saved = sorted(set(have) - set(need))
  only_target = sorted(set(need) - set(have))
  problems = []
  if only_saved or only_target:
    problems.append(
        "the state structures differ (another optimizer or model?): "
        f"only in the checkpoint: {only_saved[:6]}{' ...' if len(only_saved) > 6 else ''}; "
        f"only in the target: {only_target[:6]}{' ...' if len(only_target) > 6 else ''}")
  for path in sorted(set(have) & set(need)):
    if _stored_form(have[path]) != _stored_form(need[path]):
      problems.append(f"{path}: checkpoint has {_spec_name(have[path])}, target expects "
                      f"{_spec_name(need[path])}")
  if problems:
    shown = "\n  ".join(problems[:12])
    more = f"\n  ... and {len(problems) - 12} more" if len(problems) > 12 else ""
    raise CheckpointMismatchError(
        "the checkpoint was written with a different optimizer or quantizer configuration "
        f"than the restore target:\n  {shown}{more}\nBuild the target from the optimizer that "
        "wrote the checkpoint (same quantizers, min_quantize_size and masks).")


def abstract(tree, shardings=None):
  """``jax.ShapeDtypeStruct`` restore target of ``tree`` (arrays or structs),
  with ``shardings`` (a pytree of shardings like ``tree``, e.g. from
  `optax4bit.state_shardings`) or, by default, the leaves' own shardings.
  Non-array leaves (Python step counters) are kept as they are."""
  def one(x, s=None):
    if not hasattr(x, "shape"):
      return x
    sharding = s if s is not None else getattr(x, "sharding", None)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

  if shardings is None:
    return jax.tree.map(one, tree)
  return jax.tree.map(one, tree, shardings)


def save(manager, step: int, state, *, force: bool = False) -> bool:
  """Saves ``state`` (any pytree, e.g. params + optimizer state + step) at
  ``step`` with an ``orbax.checkpoint.CheckpointManager``, together with its
  `describe` metadata. Returns what ``manager.save`` returns; the save may be
  asynchronous (``manager.wait_until_finished()``)."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  return manager.save(step, args=ocp.args.Composite(**{
      STATE_ITEM: ocp.args.StandardSave(state),
      META_ITEM: ocp.args.JsonSave(describe(state)),
  }), force=force)


def restore(manager, target, step: Optional[int] = None) -> Any:
  """Restores the state saved by `save` into ``target``'s structure and
  shardings.

  Args:
    manager: an ``orbax.checkpoint.CheckpointManager``.
    target: the restore target, e.g. `abstract` of a freshly initialized
      state; its shardings may differ from the saved ones (another mesh or
      PartitionSpec).
    step: the step to restore; default the latest complete one.

  Raises:
    FileNotFoundError: if there is no complete checkpoint.
    CheckpointMismatchError: if the checkpoint was written with another
      optimizer or quantizer configuration than ``target``'s.
  """
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  if step is None:
    step = manager.latest_step()
    if step is None:
      raise FileNotFoundError(f"no complete checkpoint in {manager.directory}.")
  meta = manager.restore(step, args=ocp.args.Composite(**{META_ITEM: ocp.args.JsonRestore()}))
  check_compatible(meta[META_ITEM], target)
  restored = manager.restore(step, args=ocp.args.Composite(**{
      STATE_ITEM: ocp.args.StandardRestore(abstract(target))}))
  return restored[STATE_ITEM]
