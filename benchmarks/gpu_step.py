"""GPU optimizer step: fused Pallas kernels against the jnp path and optax.adamw.

0. Runs the compile check of ``benchmarks/gpu_compile.py``: every Pallas
   kernel through PyPI Triton's ptxas for sm_75/80/89/90a, failing on a
   compile error, a spill or more than 128 registers per thread (skipped,
   with a message, without the ``gpu-check`` extra; ``--skip-compile-check``).
1. Checks that ``implementation="pallas"`` matches ``implementation="jnp"`` on
   the GPU (small GPT-like tree plus ragged leaves, float32 and bfloat16):
   teacher-forced steps from the same state (fraction of differing 4-bit
   codes, scales and updates in ulps of each leaf's largest value) and 50
   free-running steps (params in ulps of each leaf's largest |param|).
2. Times the jitted optimizer step ``params, state = step(params, state,
   grads)`` (``tx.update`` then ``optax.apply_updates``; params, state and a
   fresh copy of the gradients donated, as in a training step) as the median of ``--steps`` (>= 50) device-synchronized calls,
   for optax.adamw, jnp 4-bit AdamW, Pallas 4-bit AdamW (``Rank-1/Linear`` v
   and ``B128/Linear`` v, and with the state offloaded to ``pinned_host`` by
   ``optax4bit.offload_state``), jnp and Pallas 4-bit Factor, at ~100M and ~1B
   parameters, float32 and bfloat16 params.
3. Prints the bytes a step must move at least (read grads, params and state;
   write params and state) divided by its time, against a measured
   device-to-device copy bandwidth (``x + 1`` on 1 GiB: read + write), and
   the time ratios to optax.adamw and to the jnp 4-bit path.

Without a GPU it prints a message and exits with status 0. ``--cpu-dry-run``
runs the whole script on the CPU with the kernels in interpret mode and tiny
shapes, to exercise it (its figures mean nothing).

    python benchmarks/gpu_step.py                     # everything
    python benchmarks/gpu_step.py --sizes 100M --dtypes float32 --steps 50
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gpu_compile  # benchmarks/, next to this script
import optax4bit
from optax4bit.pallas import PallasConfig
from optax4bit.quant import packing
from optax4bit.quant.array import QuantizedArray

GiB = 2**30

SIZES = {  # GPT-like decoders (no biases), ~100M and ~1B parameters.
    "100M": dict(vocab=32000, width=768, depth=12),
    "1B": dict(vocab=32000, width=2048, depth=20),
}
DRY_RUN_SIZE = dict(vocab=300, width=64, depth=1)
SWEEP_SIZE = dict(vocab=32000, width=1024, depth=2)  # ~58M: compiles faster than 100M
PALLAS = "pallas"  # "pallas_interpret" in --cpu-dry-run


def gpt_shapes(vocab: int, width: int, depth: int) -> dict:
  shapes = {"embed": (vocab, width), "final_norm": (width,)}
  for i in range(depth):
    shapes[f"layer{i:02d}"] = {
        "attn_norm": (width,), "qkv": (width, 3 * width), "attn_out": (width, width),
        "mlp_norm": (width,), "mlp_in": (width, 4 * width), "mlp_out": (4 * width, width)}
  return shapes


def _is_shape(x) -> bool:
  return isinstance(x, tuple) and all(isinstance(n, int) for n in x)


def random_tree(shapes, dtype, seed: int):
  leaves, treedef = jax.tree.flatten(shapes, is_leaf=_is_shape)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return treedef.unflatten([(jax.random.normal(k, s, jnp.float32) * 0.02).astype(dtype)
                            for k, s in zip(keys, leaves)])


def optimizers(lr: float = 1e-3) -> dict:
  return {
      "optax.adamw": lambda: optax.adamw(lr),
      "jnp adamw_4bit": lambda: optax4bit.adamw_4bit(lr, implementation="jnp"),
      "pallas adamw_4bit": lambda: optax4bit.adamw_4bit(lr, implementation=PALLAS),
      # The state stays in pinned_host memory between steps (tx.init puts it
      # there; the donated step returns it there) and crosses to the device
      # and back a leaf at a time in every step.
      "pallas adamw_4bit offloaded": lambda: optax4bit.offload_state(
          optax4bit.adamw_4bit(lr, implementation=PALLAS)),
      "pallas adamw_4bit paper recipe": lambda: optax4bit.adamw_4bit(
          lr, recipe="paper", implementation=PALLAS),
      "pallas adamw_4bit B128/Linear v": lambda: optax4bit.adamw_4bit(
          lr, second_moment="B128/Linear", implementation=PALLAS),
      "jnp adamw_4bit_factor": lambda: optax4bit.adamw_4bit_factor(lr, implementation="jnp"),
      "pallas adamw_4bit_factor": lambda: optax4bit.adamw_4bit_factor(lr,
                                                                       implementation=PALLAS),
  }


# ----------------------------------------------------------------------------
# 1. Equivalence on the GPU.

CHECKED = {  # name: the scale_by_* transformation for an implementation
    "adam default recipe": lambda impl: optax4bit.scale_by_adam_4bit(
        min_quantize_size=0, implementation=impl),
    "adam paper recipe": lambda impl: optax4bit.scale_by_adam_4bit(
        recipe="paper", min_quantize_size=0, implementation=impl),
    "adam B128/Linear v": lambda impl: optax4bit.scale_by_adam_4bit(
        second_moment="B128/Linear", min_quantize_size=0, implementation=impl),
    "adam nesterov": lambda impl: optax4bit.scale_by_adam_4bit(
        nesterov=True, min_quantize_size=0, implementation=impl),
    "factor": lambda impl: optax4bit.scale_by_factored_adam_4bit(
        min_quantize_size=0, implementation=impl),
    "sgdm": lambda impl: optax4bit.scale_by_momentum_4bit(min_quantize_size=0,
                                                          implementation=impl),
}
CHECK_SHAPES = {"w": (512, 1536), "ragged": (300, 301), "heads": (256, 4, 48), "b": (1001,)}


def _ulps_of_max(a, b, dtype) -> float:
  a = np.asarray(a, np.float32)
  b = np.asarray(b, np.float32)
  scale = float(np.max(np.abs(a)))
  diff = float(np.max(np.abs(a - b)))
  return diff / (scale * float(jnp.finfo(dtype).eps)) if scale else diff


def _grads(params, i):
  key = jax.random.fold_in(jax.random.key(7), i)
  return {k: (jax.random.normal(jax.random.fold_in(key, n), p.shape) * (1 + n)).astype(p.dtype)
          for n, (k, p) in enumerate(sorted(params.items()))}


def _check_one(name, make, params, dtype, steps: int) -> dict:
  """Teacher-forced steps of one transformation: jnp against Pallas."""
  tx_ref, tx_pal = make("jnp"), make(PALLAS)

  @jax.jit
  def both(state, i, tx_ref=tx_ref, tx_pal=tx_pal):
    grads = _grads(params, i)
    return tx_ref.update(grads, state), tx_pal.update(grads, state)

  state = tx_ref.init(params)
  codes_total = codes_differ = 0
  worst_scale = worst_update = 0.0
  for i in range(steps):
    (u_ref, s_ref), (u_pal, s_pal) = both(state, i)
    for k in params:
      worst_update = max(worst_update, _ulps_of_max(u_ref[k], u_pal[k], dtype))
    quantized = lambda s: [x for x in jax.tree.leaves(
        s, is_leaf=lambda x: isinstance(x, QuantizedArray)) if isinstance(x, QuantizedArray)]
    for a, b in zip(quantized(s_ref), quantized(s_pal)):
      ca = np.asarray(packing.unpack(a.codes, a.shape[-1], 4))
      cb = np.asarray(packing.unpack(b.codes, b.shape[-1], 4))
      codes_total += ca.size
      codes_differ += int(np.sum(ca != cb))
      for sa, sb in zip(a.scales, b.scales):
        worst_scale = max(worst_scale, _ulps_of_max(sa, sb, jnp.float32))
    state = s_ref
  fraction = codes_differ / max(codes_total, 1)
  ok = fraction <= 1e-4 and worst_scale <= 4 and worst_update <= (
      8 if dtype == jnp.float32 else 1)
  return dict(check=name, dtype=jnp.dtype(dtype).name, steps=steps,
              codes_differ_fraction=fraction, scale_ulps_of_max=worst_scale,
              update_ulps_of_max=worst_update, ok=ok)


def check(dtype, steps: int = 20, shapes=None, free_steps: int = 50) -> list:
  """Teacher-forced comparison, then free-running adamw_4bit steps."""
  rows = []
  params = random_tree(shapes or CHECK_SHAPES, dtype, seed=1)
  for name, make in CHECKED.items():
    try:
      rows.append(_check_one(name, make, params, dtype, steps))
    except Exception as e:  # pylint: disable=broad-except  (report, go on to the timings)
      rows.append(dict(check=name, dtype=jnp.dtype(dtype).name,
                       error=f"{type(e).__name__}: {str(e)[:300]}", ok=False))

  def run(implementation):
    tx = optax4bit.adamw_4bit(1e-2, min_quantize_size=0, implementation=implementation)

    @jax.jit
    def step(p, s, i):
      updates, s = tx.update(_grads(p, i), s, p)
      return optax.apply_updates(p, updates), s

    p, s = params, tx.init(params)
    for i in range(free_steps):
      p, s = step(p, s, i)
    return p

  name = f"adamw_4bit {free_steps} free-running steps"
  try:
    p_ref, p_pal = run("jnp"), run(PALLAS)
  except Exception as e:  # pylint: disable=broad-except
    rows.append(dict(check=name, dtype=jnp.dtype(dtype).name,
                     error=f"{type(e).__name__}: {str(e)[:300]}", ok=False))
    return rows
  # Each step's rounding differs by a few ulps between XLA's fusions and the
  # Triton kernels, which flips a rare 4-bit code (see the teacher-forced rows);
  # a flipped element then follows its own trajectory. Elements do not interact
  # (the gradients do not depend on the params), so count the elements that left
  # the reference by more than 8 ulps of their leaf's largest |param|.
  worst = max(_ulps_of_max(p_ref[k], p_pal[k], dtype) for k in params)
  diverged = sum(int(np.sum(np.abs(np.asarray(p_ref[k], np.float32) - np.asarray(
      p_pal[k], np.float32)) > 8 * float(jnp.finfo(dtype).eps) * float(np.max(np.abs(
          np.asarray(p_ref[k], np.float32)))))) for k in params)
  fraction = diverged / sum(p.size for p in params.values())
  rows.append(dict(check=name, dtype=jnp.dtype(dtype).name, steps=free_steps,
                   params_ulps_of_max=worst, diverged_fraction=fraction,
                   ok=fraction <= 1e-3))
  return rows


# ----------------------------------------------------------------------------
# 2./3. Timing.


def _median_time(fn, args, steps: int, warmup: int = 3):
  for _ in range(warmup):
    args = fn(*args)
    jax.block_until_ready(args)
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    args = fn(*args)
    jax.block_until_ready(args)
    times.append(time.perf_counter() - start)
  return statistics.median(times), args


def copy_bandwidth(steps: int, nbytes: int = GiB) -> float:
  """Bytes per second of ``x + 1`` on ``nbytes`` of float32 (read + write)."""
  x = jnp.zeros((nbytes // 4,), jnp.float32)
  add = jax.jit(lambda x: (x + 1,), donate_argnums=0)
  seconds, _ = _median_time(add, (x,), steps)
  return 2 * nbytes / seconds


def time_step(make_tx, params, grads, steps: int) -> dict:
  tx = make_tx()
  params = jax.tree.map(jnp.copy, params)  # the step donates (consumes) its params
  state = tx.init(params)
  state_bytes = optax4bit.state_nbytes(state)

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  # The gradients are donated too, as in a training step whose gradients die
  # in it (the kernels write the update over the gradient): each call gets a
  # fresh copy, made outside the timer.
  fresh_grads = lambda: jax.block_until_ready(jax.tree.map(jnp.copy, grads))  # noqa: E731
  start = time.perf_counter()
  with warnings.catch_warnings():
    # Every output shaped like the gradients already aliases a donated param
    # or moment, so JAX warns that the gradients alias none; donating still
    # frees them in the step.
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    fn = jax.jit(step, donate_argnums=(0, 1, 2)).lower(params, state, grads).compile()
  compile_seconds = time.perf_counter() - start
  times = []
  for i in range(3 + steps):  # 3 warm-up calls
    g = fresh_grads()
    start = time.perf_counter()
    params, state = jax.block_until_ready(fn(params, state, g))
    if i >= 3:
      times.append(time.perf_counter() - start)
  seconds = statistics.median(times)
  param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  # At least: read grads and params, write params; read and write the state.
  moved = 3 * param_bytes + 2 * state_bytes
  return dict(seconds=seconds, state_bytes=state_bytes, bytes_moved=moved,
              compile_seconds=compile_seconds)


def sweep(steps: int, dry_run: bool) -> list:
  """Times the Pallas steps over kernel geometries (the defaults were chosen from
  ptxas' register counts alone)."""
  shapes = gpt_shapes(**(DRY_RUN_SIZE if dry_run else SWEEP_SIZE))
  num = sum(math.prod(s) for s in jax.tree.leaves(shapes, is_leaf=_is_shape))
  params = random_tree(shapes, jnp.float32, seed=0)
  grads = random_tree(shapes, jnp.float32, seed=1)
  makers = {"adamw_4bit": optax4bit.adamw_4bit, "adamw_4bit_factor": optax4bit.adamw_4bit_factor}
  print(f"\n## Kernel geometry sweep: {num / 1e6:.0f}M params, float32, ms/step (median of "
        f"{steps})")
  print(f"{'tile_bytes':>10s} {'num_warps':>9s} " + " ".join(f"{n:>18s}" for n in makers))
  adamw = time_step(lambda: optax.adamw(1e-3), params, grads, steps)["seconds"]
  print(f"optax.adamw: {adamw * 1e3:.2f} ms/step")
  rows = [dict(optimizer="optax.adamw", seconds=adamw)]
  for tile_bytes in (1024, 2048, 4096, 8192):
    for num_warps in (4, 8):
      config = PallasConfig(interpret=dry_run, tile_bytes=tile_bytes, num_warps=num_warps)
      row = dict(tile_bytes=tile_bytes, num_warps=num_warps)
      for name, make in makers.items():
        try:
          row[name] = time_step(lambda make=make: make(1e-3, implementation=config), params,
                                grads, steps)["seconds"]
        except Exception as e:  # pylint: disable=broad-except  (a geometry that fails)
          row[name] = float("nan")
          print(f"  {name} tile_bytes={tile_bytes} num_warps={num_warps}: "
                f"{type(e).__name__}: {str(e)[:200]}")
      rows.append(row)
      print(f"{tile_bytes:10d} {num_warps:9d} " + " ".join(
          f"{row[n] * 1e3:18.2f}" for n in makers))
  return rows


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
  parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                      choices=["float32", "bfloat16"])
  parser.add_argument("--steps", type=int, default=50, help="timed steps (>= 50)")
  parser.add_argument("--skip-check", action="store_true")
  parser.add_argument("--skip-compile-check", action="store_true")
  parser.add_argument("--sweep", action="store_true",
                      help="first time Pallas AdamW and Factor over tile_bytes x num_warps "
                      "(~58M float32 params)")
  parser.add_argument("--optimizers", nargs="+", help="time only these (default: all)")
  parser.add_argument("--skip-timing", action="store_true")
  parser.add_argument("--json", help="also write all results to this file")
  parser.add_argument("--cpu-dry-run", action="store_true",
                      help="exercise the script on the CPU (interpret mode, tiny shapes)")
  args = parser.parse_args(argv)
  if args.steps < 50:
    parser.error("--steps must be >= 50")

  global PALLAS
  dry_run = args.cpu_dry_run
  PALLAS = "pallas_interpret" if dry_run else "pallas"
  if jax.default_backend() != "gpu" and not dry_run:
    print(f"No GPU: JAX's default backend is {jax.default_backend()!r}. This benchmark times "
          "the Pallas (Triton) kernels and needs a CUDA GPU; nothing was measured.")
    return 0
  device = jax.devices()[0]
  print(f"device: {device.device_kind}, jax {jax.__version__}")
  results = dict(device=device.device_kind, jax=jax.__version__, checks=[], timings=[])

  failed = False
  if not args.skip_compile_check:
    print("\n## Every kernel through ptxas (benchmarks/gpu_compile.py)")
    # The dry run compiles one case for one architecture, to exercise this.
    status = gpu_compile.main(["--cases", "adamw_4bit default", "--archs", "sm_80"]
                              if dry_run else [])
    results["compile_check"] = {0: "ok", 1: "failed", 2: "skipped: no triton"}[status]
    failed |= status == 1
  if not args.skip_check:
    print("\n## Pallas == jnp on this GPU")
    for dtype in args.dtypes:
      rows = (check(jnp.dtype(dtype), steps=2, shapes={"ragged": (30, 301)}, free_steps=2)
              if dry_run else check(jnp.dtype(dtype)))
      for row in rows:
        results["checks"].append(row)
        failed |= not row["ok"]
        detail = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in row.items() if k not in ("check", "ok"))
        print(f"{'ok  ' if row['ok'] else 'FAIL'} {row['check']}: {detail}")

  if args.sweep:
    results["sweep"] = sweep(args.steps, dry_run)
  bandwidth = copy_bandwidth(args.steps, 2**24 if dry_run else GiB)
  results["copy_bandwidth_bytes_per_s"] = bandwidth
  print(f"\ndevice-to-device copy bandwidth (x + 1): {bandwidth / 1e9:.0f} GB/s")
  for size in [] if args.skip_timing else ["dry-run"] if dry_run else args.sizes:
    shapes = gpt_shapes(**(DRY_RUN_SIZE if dry_run else SIZES[size]))
    num = sum(math.prod(s) for s in jax.tree.leaves(shapes, is_leaf=_is_shape))
    for dtype in args.dtypes:
      params = random_tree(shapes, jnp.dtype(dtype), seed=0)
      grads = random_tree(shapes, jnp.dtype(dtype), seed=1)
      print(f"\n## {size} ({num / 1e6:.0f}M params), {dtype} params, median of {args.steps} "
            "steps")
      print(f"{'optimizer':34s} {'ms/step':>9s} {'state B/param':>14s} {'GB/s moved':>11s} "
            f"{'% copy bw':>9s} {'x adamw':>8s} {'x jnp 4bit':>10s}")
      rows = {}
      for name, make in optimizers().items():
        if args.optimizers and name not in args.optimizers:
          continue
        try:
          row = time_step(make, params, grads, args.steps)
        except Exception as e:  # pylint: disable=broad-except  (e.g. out of memory at 1B)
          print(f"{name:34s} failed: {type(e).__name__}: {str(e)[:200]}")
          continue
        rows[name] = row
        results["timings"].append(dict(size=size, params=num, dtype=dtype, optimizer=name, **row))
        print(f"  timed {name}: {row['seconds'] * 1e3:.2f} ms/step (compiled in "
              f"{row['compile_seconds']:.1f} s)", flush=True)
      for name, row in rows.items():
        rate = row["bytes_moved"] / row["seconds"]
        vs_adamw = row["seconds"] / rows["optax.adamw"]["seconds"] if "optax.adamw" in rows else float("nan")
        base = "jnp adamw_4bit_factor" if "factor" in name else "jnp adamw_4bit"
        vs_jnp = row["seconds"] / rows[base]["seconds"] if base in rows else float("nan")
        print(f"{name:34s} {row['seconds'] * 1e3:9.2f} {row['state_bytes'] / num:14.3f} "
              f"{rate / 1e9:11.0f} {100 * rate / bandwidth:8.0f}% {vs_adamw:8.2f} {vs_jnp:10.2f}")
      del params, grads

  if args.json:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1)
  if failed:
    print("\nFAIL: the compile check or the match of the Pallas path with the jnp reference "
          "on this GPU (see above).")
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
