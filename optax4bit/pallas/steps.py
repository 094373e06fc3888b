"""The Pallas backend's fused steps and its options.

`PallasSteps` runs one leaf's fused optimizer step as Pallas kernels (Triton
lowering, or interpret mode), or declines a leaf the kernels do not cover:
leaves kept in float32, 8-bit quantizers, blocks of one element, and a
block-wise moment whose blocks are smaller than another block-wise moment's
of the same leaf. The kernels cover every 4-bit quantizer (maps ``DE``,
``DE-0``, ``Linear``, ``NF``, ``SqrtDE-0``, ``SqrtLinear``; nearest and stochastic rounding,
and the stall rule of ``stall_only`` specs).
Stochastic rounding draws the jnp reference's numbers: each moment's PRNG key
becomes a uint32 seed (`optax4bit.quant.maps.rounding_seed`) and the kernel
hashes each element's flat index in the global leaf
(`optax4bit.quant.maps.hashed_uniform`).

Sharded leaves (see `optax4bit.sharding`) run the kernels per shard
(`optax4bit._fused_leaf`) exactly like the jnp reference does: block-wise
scales are local, rank-1 and tensor statistics are reduced with a
cross-shard ``pmax``, so results equal the unsharded run.

Which backend runs is chosen by `optax4bit.dispatch.resolve`. ``"auto"`` uses these
kernels on a CUDA GPU only where they compile: once per process and compute
capability the fused AdamW steps of both recipes are compiled for the default
device, and if that fails ``auto`` runs the XLA engine and logs one line
saying why.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from optax4bit import _recipes
from optax4bit._fused_leaf import run_fused
from optax4bit._leaf_context import LeafContext, shard_position
from optax4bit._platform import default_platform
from optax4bit._steps import FusedStep
from optax4bit.pallas import _engine, _geometry
from optax4bit.pallas.optim import STEPS
from optax4bit.quant import array as qarray
from optax4bit.quant import maps
from optax4bit.quant.array import QuantizedArray

__all__ = ["PallasConfig", "PallasSteps", "kernels_run_here"]

_LOG = logging.getLogger(__name__)


def _check_power_of_two(name: str, value) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
    raise ValueError(f"{name} must be a positive power of two, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class PallasConfig:
  """Options of the Pallas implementation (``implementation=PallasConfig(...)``).

  Attributes:
    interpret: run the kernels in Pallas interpret mode (any backend).
    tile_bytes: packed code bytes per kernel program (a power of two; two
      elements per byte). By default 2048 for every fused step (16 elements
      per thread), and 512 on a ragged leaf with a ``stall_only`` moment
      (fewer registers; `_step_tile_bytes`).
    num_warps: Triton warps per program (a power of two).
    update_in_place: write each leaf's update over its gradient (when their
      dtypes match). In a train step, where ``jax.grad`` makes the gradients
      in the same ``jax.jit``, this saves a leaf-sized temporary where the
      update sets the memory peak. Where the
      update is jitted on its own with the gradients as arguments, XLA may
      not overwrite them (an argument is writable only where it aliases an
      output, and donated gradients alias none), so it copies every gradient
      first: 8 bytes per float32 parameter of extra traffic. Pass False there.

  Example:
    >>> import jax.numpy as jnp, optax4bit
    >>> from optax4bit.pallas import PallasConfig
    >>> tx = optax4bit.adamw_4bit(1e-3, implementation=PallasConfig(interpret=True))
    >>> state = tx.init({"w": jnp.zeros((64, 128))})
  """
  interpret: bool = False
  tile_bytes: Optional[int] = None
  num_warps: int = _geometry.DEFAULT_NUM_WARPS
  update_in_place: bool = True

  def __post_init__(self):
    for name in ("interpret", "update_in_place"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}.")
    if self.tile_bytes is not None:
      _check_power_of_two("tile_bytes", self.tile_bytes)
    _check_power_of_two("num_warps", self.num_warps)

  @property
  def options(self) -> _engine.Options:
    return _engine.Options(self.interpret, self.tile_bytes, self.num_warps,
                           self.update_in_place)


# Code bytes per program of every fused step where `PallasConfig.tile_bytes`
# is None: twice the quantizers' tile (16 elements per thread), so that fewer programs
# share the index arithmetic. The momentum steps carry one moment and stay at
# 64 registers on sm_90a (benchmarks/gpu_compile.py: 71 -> 64 SASS
# instructions per parameter); the Adam steps, with the update's approximate
# division and square root, fit in 128 registers without a spill (default
# recipe 142 -> 125 per parameter).
_STEP_TILE_BYTES = 2 * _geometry.DEFAULT_TILE_BYTES


def _step_tile_bytes(shape: tuple, moments: Sequence[QuantizedArray]) -> int:
  """Code bytes per program where `PallasConfig.tile_bytes` is None:
  `_STEP_TILE_BYTES`, except on a leaf whose tiles need masks (ragged) with a
  ``stall_only`` moment. There the masks, the stored codes and the rule's
  comparisons take more than 128 registers at 16 elements per thread (up to
  164 on sm_90a, benchmarks/gpu_compile.py); at 8 (the quantizers' tile)
  ptxas spills on sm_89 (bfloat16, 64 registers); at 4, a quarter of
  `_STEP_TILE_BYTES`, they take 40 to 61 registers and no spill."""
  if any(m.spec.stall_only for m in moments):
    geo = _geometry.geometry(shape, [m.spec for m in moments], _STEP_TILE_BYTES)
    if not geo.exact:
      return _STEP_TILE_BYTES // 4
  return _STEP_TILE_BYTES


def _on_cuda() -> bool:
  if default_platform() != "gpu":
    return False
  try:
    version = str(jax.devices()[0].client.platform_version).lower()
  except Exception:  # pylint: disable=broad-except
    return True
  return "rocm" not in version and "hip" not in version


def _compute_capability() -> str:
  """The default device's compute capability, e.g. ``"8.0"``."""
  return str(getattr(jax.devices()[0], "compute_capability", "unknown"))


def _compile_probe() -> None:
  """Compiles the fused AdamW step of both recipes on a small ragged leaf for
  the default device (their kernels include every kind of pass: local and
  rank-1 encodes, nearest and stochastic rounding); raises what XLA's Triton
  or ptxas raise."""
  shape = (3, 301)
  for recipe in _recipes.RECIPES.values():
    moments = (qarray.zeros(shape, jnp.float32, recipe.first_moment),
               qarray.zeros(shape, jnp.float32, recipe.second_moment))

    def step(grad, moments):
      keys = (jax.random.key(0), jax.random.key(1))
      return PallasSteps(PallasConfig().options).run(
          FusedStep.adam(0.9, 0.999, 1e-8, 0.0, jnp.int32(1), False), grad, moments, keys=keys)

    jax.jit(step).lower(jax.ShapeDtypeStruct(shape, jnp.float32), moments).compile()


@functools.cache
def _kernels_compile(capability: str) -> bool:
  """Whether the Pallas kernels compile on this GPU (once per process and
  compute capability: compiling costs seconds)."""
  try:
    _compile_probe()
  except Exception as e:  # pylint: disable=broad-except  (any compiler failure)
    reason = (str(e).strip().splitlines() or [""])[0][:300]
    _LOG.warning("optax4bit: implementation='auto' runs the XLA engine on this GPU (compute "
                 "capability %s): the Pallas kernels do not compile (%s: %s)", capability,
                 type(e).__name__, reason)
    return False
  return True


def kernels_run_here() -> bool:
  """Whether ``implementation="auto"`` runs these kernels: the default device
  is a CUDA GPU (not ROCm) on which the kernels compile (probed once per
  process and compute capability, see `_kernels_compile`)."""
  return _on_cuda() and _kernels_compile(_compute_capability())


def _covers(shape: tuple, moments: Sequence[QuantizedArray], options: _engine.Options) -> bool:
  try:
    geo = _geometry.geometry(shape, [m.spec for m in moments], options.tile_bytes)
    for m in moments:
      _geometry.moment_format(m.spec, geo)
  except _geometry.Unsupported:
    return False
  return True


def _side_inputs(kind: str, shape: tuple, side: Sequence[jax.Array]) -> list:
  if kind != "factored":
    return []
  row, col, row_mean = side
  rows = math.prod(shape[:-1])
  inverse = np.float32(1) / jnp.where(row_mean > 0, row_mean, np.float32(1))
  per_row = lambda x: jnp.broadcast_to(x, shape[:-1] + (1,)).reshape(rows)
  return [(row.reshape(rows), _engine.SideInput("row")),
          (col.reshape(math.prod(shape[:-2]), shape[-1]), _engine.SideInput("lead_col")),
          (per_row(row_mean), _engine.SideInput("row")),
          (per_row(inverse), _engine.SideInput("row"))]


@dataclasses.dataclass(frozen=True)
class PallasSteps:
  """The fused per-leaf steps of one update as Pallas kernels. Each method
  returns ``(update, new_moments)``, or None when the kernels do not cover
  the leaf (the caller then runs the jnp reference)."""
  options: _engine.Options

  def run(self, step: FusedStep, grad: jax.Array, moments: Sequence,
          side: Sequence[jax.Array] = (), keys: Optional[Sequence] = None, *,
          context: LeafContext = LeafContext()):
    """``step`` (its kind a key of `optax4bit.pallas.optim.STEPS`) on one
    leaf. ``side``: for ``"factored"``, the ``(row, col, row_mean)`` of the
    (already updated) factored second moment, as `optax4bit.transform`
    computes them; ``keys``: one PRNG key (or None) per moment, for
    stochastic rounding; ``context``: the leaf's
    `optax4bit._leaf_context.LeafContext`."""
    kind, coef = step.kind, step.coefficients()
    moments = tuple(moments)
    if not moments or not all(isinstance(m, QuantizedArray) for m in moments):
      return None
    shape = tuple(grad.shape)
    options = self.options
    if options.tile_bytes is None:
      options = dataclasses.replace(options, tile_bytes=_STEP_TILE_BYTES)
      if _covers(shape, moments, options):
        options = dataclasses.replace(options, tile_bytes=_step_tile_bytes(shape, moments))
    if not _covers(shape, moments, options):
      return None
    return run_fused(
        lambda *args: self._local(kind, options, *args), grad, moments, tuple(side), (coef,),
        lambda local_shape: _covers(local_shape, moments, options), context, keys,
        hashes_global_index=True)

  def _local(self, kind, options, grad, moments, side, keys, shard, consts):
    (coef,) = consts
    shape = tuple(grad.shape)
    # The seeds the jnp reference derives from the same keys (`_codecs.encode`).
    seeds = [maps.rounding_seed(k) if m.spec.stochastic and k is not None else None
             for m, k in zip(moments, keys)]
    position = shard_position(shard)
    row_bases = None if position is None else maps.row_hash_bases(shape, position[1], position[0])
    (update,), new = _engine.run(
        STEPS[kind], shape=shape, coef=coef, dense_in=[grad], old=moments,
        side=_side_inputs(kind, shape, side), dense_out=[grad.dtype],
        new=[(m.spec, m.dtype) for m in moments], alias=range(len(moments)),
        seeds=seeds, row_bases=row_bases, options=options,
        reduce_scales=None if shard is None else shard.reduce_scales)
    return update, new
