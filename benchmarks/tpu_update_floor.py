"""The fewest bytes a TPU update can move through ``optax.apply_updates``, against writing the
params in the kernel: minimal-traffic Pallas TPU kernels, compiled on a machine without a TPU.

Why: issue 49 asks the 4-bit updates to access at most 0.7x ``optax.adamw``'s bytes
(``benchmarks/tpu_compile.py --settings update``: the update then ``optax.apply_updates``,
params, state and gradients donated). An optax `GradientTransformation` returns the update; the
user's ``optax.apply_updates`` adds it to the params in an XLA fusion of its own, which no Pallas
kernel can fuse with. This script measures how low any engine can go under that contract.

For each optimizer's traffic (``TRAFFIC``), every matrix leaf of ``tpu_compile.update_tree``
gets kernels that read and write exactly the operands the optimizer's passes must (no math: a
kernel's bytes are its operands and results, ``hlo_text.custom_call_bytes``):

* a stats pass where a moment has rank-1 scales (or Factor's factors, a reduction of ``g**2``
  in XLA): it reads the gradient and that moment's codes and writes per-row maxima;
* the step: it reads the gradient and every moment's codes (and block scales), writes the
  codes (over the old ones) and either the update (``returns updates``, then the
  ``adamw``-like weight decay, learning rate and ``optax.apply_updates`` in XLA) or the new
  params (``writes params``: it reads them too).

The vectors (norms, bias) take a float32 step in XLA, as the library does. Columns: the cost
model's ``bytes accessed`` plus the kernels' operands and results, per parameter (as
``tpu_compile``), its ratio to the optax baseline's compiled in the same run, and the library's
update (``implementation="auto"``) measured beside them.

The cost model counts XLA's prefetches into on-chip memory (``copy-start``, ``slice-start``;
about 18 of ``optax.adamw``'s 46.1 B/param on a v5e), whose number the schedule decides, so
these figures move by a few hundredths of the baseline between steps of equal traffic, and on
small trees (``--scale 4``, where much fits on chip) far more. Measured at scale 1 (libtpu
0.0.42.1, 2026-11-30): returning updates, the minimal kernels give 1.01x (``adamw_4bit``),
0.89x (Factor), 0.95x (``adamw_8bit``) and 1.02x (``sgdm_4bit``), the library 1.01x, 0.90x,
0.91x and 1.02x; writing params, 0.45x to 0.50x.

Run: ``TPU_SKIP_MDS_QUERY=1 python benchmarks/tpu_update_floor.py`` (the ``tpu-check`` extra).
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import warnings
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hlo_text  # noqa: E402  pylint: disable=wrong-import-position
import tpu_compile  # noqa: E402  pylint: disable=wrong-import-position

ROWS_PER_PROGRAM = 32  # the uint8 sublane tile


class Traffic(NamedTuple):
  """What one optimizer's passes must move per parameter of a matrix leaf."""
  code_bytes: tuple      # per moment: 0.5 (4-bit) or 1 (8-bit)
  block_scaled: tuple    # per moment: whether it has block scales (one float32 per 128)
  stats_moment: int      # the moment whose codes a stats pass reads (-1: no codes; None: none)
  baseline: str          # the optax optimizer it is compared with


TRAFFIC = {
    # m block-wise, v rank-1: a stats pass over g and v's codes.
    "adamw_4bit": Traffic((0.5, 0.5), (True, False), 1, "optax.adamw"),
    # m block-wise, v factored: the factors' sums of g**2 read g (no codes).
    "adamw_4bit_factor": Traffic((0.5,), (True,), -1, "optax.adamw"),
    "adamw_8bit": Traffic((1, 1), (True, True), None, "optax.adamw"),
    "sgdm_4bit": Traffic((0.5,), (True,), None, "optax.sgd momentum"),
}


def _rows(width: int):
  from jax.experimental import pallas as pl  # pylint: disable=import-outside-toplevel
  return pl.BlockSpec((ROWS_PER_PROGRAM, width), lambda i: (i, 0))


def _stats_kernel(*refs):
  """Reads its inputs' blocks; writes a per-row value."""
  *inputs, out = refs
  total = jnp.max(inputs[0][...], axis=1, keepdims=True)
  for ref in inputs[1:]:
    total = total + jnp.max(ref[...].astype(jnp.int32).astype(jnp.float32), axis=1,
                            keepdims=True)
  out[...] = total


def _step_kernel(num_codes: int, num_scales: int, reads_params: bool, *refs):
  """Reads every input block and writes every output block (uint8 through int32: Mosaic has
  no 8-bit vector arithmetic)."""
  grad, *rest = refs
  codes, rest = rest[:num_codes], rest[num_codes:]
  scales, rest = rest[:num_scales], rest[num_scales:]
  row_stat, rest = rest[0], rest[1:]
  params, rest = (rest[0], rest[1:]) if reads_params else (None, rest)
  first, *outs = rest
  value = grad[...] * row_stat[...]
  first[...] = value + params[...] if params is not None else value
  for code, out in zip(codes, outs[:num_codes]):
    out[...] = (code[...].astype(jnp.int32) + 1).astype(jnp.uint8)
  for scale, out in zip(scales, outs[num_codes:]):
    out[...] = scale[...] * 2


def _matrix_leaf(traffic: Traffic, writes_params: bool, param, grad, codes, scales):
  """(new param, new codes, new scales) of one matrix leaf through the minimal kernels."""
  from jax.experimental import pallas as pl  # pylint: disable=import-outside-toplevel
  rows = grad.shape[0]
  grid = (rows // ROWS_PER_PROGRAM,)
  if traffic.stats_moment is None:
    row_stat = jnp.ones((rows, 1), jnp.float32)
  else:
    stats_in = [grad] + ([] if traffic.stats_moment < 0 else [codes[traffic.stats_moment]])
    row_stat = pl.pallas_call(
        _stats_kernel, grid=grid, in_specs=[_rows(x.shape[1]) for x in stats_in],
        out_specs=_rows(1), out_shape=jax.ShapeDtypeStruct((rows, 1), jnp.float32))(*stats_in)
  inputs = [grad, *codes, *scales, row_stat] + ([param] if writes_params else [])
  out_shapes = [jax.ShapeDtypeStruct(grad.shape, jnp.float32)] + [
      jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (*codes, *scales)]
  # Codes and scales over the old ones (and the params over themselves), as the library's.
  aliases = {1 + k: 1 + k for k in range(len(codes) + len(scales))}
  if writes_params:
    aliases[len(inputs) - 1] = 0
  first, *new = pl.pallas_call(
      functools.partial(_step_kernel, len(codes), len(scales), writes_params), grid=grid,
      in_specs=[_rows(x.shape[1]) for x in inputs],
      out_specs=[_rows(s.shape[1]) for s in out_shapes], out_shape=out_shapes,
      input_output_aliases=aliases)(*inputs)
  if writes_params:
    return first, new[:len(codes)], new[len(codes):]
  update = -1e-3 * (first + 1e-2 * param)  # weight decay and learning rate, in XLA
  return optax.apply_updates(param, update), new[:len(codes)], new[len(codes):]


def _state(traffic: Traffic, tree):
  """Per matrix leaf: the codes and block scales of each moment; per vector: a float32 moment."""
  def leaf(p):
    if len(p.shape) != 2:
      return jax.ShapeDtypeStruct(p.shape, jnp.float32)
    rows, cols = p.shape
    codes = [jax.ShapeDtypeStruct((rows, int(cols * b)), jnp.uint8) for b in traffic.code_bytes]
    scales = [jax.ShapeDtypeStruct((rows, cols // 128), jnp.float32)
              for scaled in traffic.block_scaled if scaled]
    return codes, scales
  return jax.tree.map(leaf, tree)


def floor_bytes(name: str, writes_params: bool, generation: str = "v5e",
                scale: int = 1) -> tuple:
  """``(cost model's bytes, kernels' bytes, parameters)`` of ``name``'s minimal update."""
  traffic = TRAFFIC[name]
  tree = tpu_compile.update_tree(scale, jnp.float32)
  state = _state(traffic, tree)

  def step(params, state, grads):
    def leaf(p, s, g):
      if p.ndim != 2:
        moment = 0.9 * s + g
        return p - 1e-3 * moment, moment
      new_p, codes, scales = _matrix_leaf(traffic, writes_params, p, g, *s)
      return new_p, (codes, scales)
    flat_state = jax.tree.structure(tree).flatten_up_to(state)
    out = [leaf(p, s, g) for p, s, g in zip(jax.tree.leaves(params), flat_state,
                                            jax.tree.leaves(grads))]
    treedef = jax.tree.structure(tree)
    return (jax.tree.unflatten(treedef, [o[0] for o in out]),
            jax.tree.unflatten(treedef, [o[1] for o in out]))

  device = tpu_compile.tpu_device(generation)
  on = functools.partial(tpu_compile._on, device)  # pylint: disable=protected-access
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", "Some donated buffers were not usable")
    compiled = jax.jit(step, donate_argnums=(0, 1, 2)).lower(
        on(tree), on(state), on(tree)).compile()
  hlo = compiled.as_text()
  accessed = tpu_compile.cost(compiled).get("bytes accessed", float("nan"))
  kernels = hlo_text.custom_call_bytes(hlo, tpu_compile.PALLAS_TPU_TARGET)
  return accessed, kernels, sum(math.prod(p.shape) for p in jax.tree.leaves(tree))


def _per_param(accessed, kernels, params) -> float:
  return (accessed + kernels) / params


def run(names=tuple(TRAFFIC), generation: str = "v5e", scale: int = 1) -> list:
  """Rows ``(optimizer, baseline, its B/param, the library's, the minimal update's returning
  updates, and writing params)``: the cost model's bytes plus the kernels', per parameter."""
  baselines, rows = {}, []
  for name in names:
    base = TRAFFIC[name].baseline
    if base not in baselines:
      baselines[base] = tpu_compile.measure(base, generation=generation,
                                            scale=scale).bytes_per_param
    library = tpu_compile.measure(name, generation=generation, scale=scale).bytes_per_param
    rows.append((name, base, baselines[base], library,
                 _per_param(*floor_bytes(name, False, generation, scale)),
                 _per_param(*floor_bytes(name, True, generation, scale))))
  return rows


def main(argv=None) -> list:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--optimizers", nargs="+", default=list(TRAFFIC), choices=list(TRAFFIC))
  parser.add_argument("--generation", default="v5e")
  parser.add_argument("--scale", type=int, default=1)
  args = parser.parse_args(argv)
  rows = run(args.optimizers, args.generation, args.scale)
  print(f"jax {jax.__version__}, libtpu {tpu_compile.libtpu_version()}, {args.generation}, "
        f"update of tpu_compile.update_tree(scale={args.scale}), float32; B/param and x the "
        "baseline's")
  print("| optimizer | baseline | baseline B/param | library (auto) | floor, returns updates "
        "| floor, writes params |\n|---|---|---:|---:|---:|---:|")
  for name, base, base_bytes, library, updates, params in rows:
    ratio = lambda b: f"{b:.1f} ({b / base_bytes:.2f}x)"  # noqa: E731
    print(f"| {name} | {base} | {base_bytes:.1f} | {ratio(library)} | {ratio(updates)} "
          f"| {ratio(params)} |")
  return rows


if __name__ == "__main__":
  main()
