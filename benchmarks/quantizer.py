"""Quantizer throughput on CPU: quantize + dequantize of one large fp32 tensor.

For every preset the jitted ``quantize`` and the jitted ``dequantize`` are timed
separately (in an optimizer the codes are stored between the two, so fusing them
into one jitted round trip would flatter the numbers). The reference is a jitted
plain fp32 pass ``x * 1.0`` over the same tensor (XLA turns it into one copy: one
read and one write of the tensor). Measurements are interleaved: every round
times the reference right before each preset, so machine noise hits all of them
alike; the table reports medians over rounds after a warm-up, and the ratio is
the median over rounds of ``(quantize + dequantize) / reference``.

GB/s counts the bytes the passes must move: quantize reads the fp32 tensor and
writes codes + scales, dequantize reads codes + scales and writes fp32 (the
reference reads and writes fp32), divided by the median time.

Usage:
  python benchmarks/quantizer.py            # 4096 x 4096, 7 rounds
  python benchmarks/quantizer.py --size 1024 --rounds 3
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

# Run from a checkout without installing: `python benchmarks/quantizer.py`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import optax4bit  # pylint: disable=wrong-import-position
from optax4bit import QuantSpec  # pylint: disable=wrong-import-position

# (label, spec): the paper's presets and the 8-bit bitsandbytes recipe.
PRESETS = (
    ("B128/DE", QuantSpec.parse("B128/DE")),
    ("B2048/DE", QuantSpec.parse("B2048/DE")),
    ("B128/DE-0", QuantSpec.parse("B128/DE-0")),
    ("Rank-1/DE-0", QuantSpec.parse("Rank-1/DE-0")),
    ("Rank-1/Linear", QuantSpec.parse("Rank-1/Linear")),
    ("Tensor/Linear", QuantSpec.parse("Tensor/Linear")),
    ("8-bit B256/DE", QuantSpec.parse("B256/DE", bits=8)),
)


def _time(fn, *args) -> float:
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - start


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", type=int, default=4096, help="the tensor is size x size")
  parser.add_argument("--rounds", type=int, default=7, help="timed rounds after warm-up")
  parser.add_argument("--warmup", type=int, default=2, help="untimed rounds")
  args = parser.parse_args()

  shape = (args.size, args.size)
  rng = np.random.default_rng(0)
  x_signed = jnp.asarray(rng.standard_normal(shape, dtype=np.float32))
  # Unsigned presets get a non-negative tensor (as Adam's second moment).
  x_unsigned = jnp.square(x_signed)
  fp32_bytes = 4 * x_signed.size

  reference = jax.jit(lambda x: x * 1.0)
  runs = []
  for label, spec in PRESETS:
    x = x_signed if spec.signed else x_unsigned
    quantize = jax.jit(lambda x, spec=spec: optax4bit.quantize(x, spec))
    dequantize = jax.jit(optax4bit.dequantize)
    q = quantize(x)
    # Sanity: the round trip is close (not a timing assertion).
    err = float(jnp.max(jnp.abs(dequantize(q) - x)) / jnp.max(jnp.abs(x)))
    assert err < 0.2, (label, err)
    runs.append(dict(label=label, x=x, q=q, quantize=quantize, dequantize=dequantize,
                     nbytes=q.nbytes, t_q=[], t_dq=[], t_ref=[], ratio=[]))

  for r in range(args.warmup + args.rounds):
    for run in runs:
      t_ref = _time(reference, run["x"])
      t_q = _time(run["quantize"], run["x"])
      t_dq = _time(run["dequantize"], run["q"])
      if r >= args.warmup:
        run["t_ref"].append(t_ref)
        run["t_q"].append(t_q)
        run["t_dq"].append(t_dq)
        run["ratio"].append((t_q + t_dq) / t_ref)

  all_ref = [t for run in runs for t in run["t_ref"]]
  ref_ms = 1e3 * statistics.median(all_ref)
  print(f"# Quantizer throughput, {shape[0]}x{shape[1]} float32 "
        f"({x_signed.size / 1e6:.1f}M elements, {fp32_bytes / 2**20:.0f} MiB)")
  print(f"# {datetime.date.today().isoformat()}, JAX {jax.__version__}, "
        f"backend {jax.default_backend()}, {os.cpu_count()} CPU cores, "
        f"{platform.machine()}, Python {platform.python_version()}")
  print(f"# medians of {args.rounds} interleaved rounds after {args.warmup} warm-up rounds")
  print()
  print("| preset | stored bytes/elem | quantize ms | dequantize ms | q+dq ms "
        "| q+dq / fp32 pass | q+dq GB/s |")
  print("|---|---|---|---|---|---|---|")
  print(f"| fp32 `x * 1.0` (reference) | 4 | - | - | {ref_ms:.1f} | 1.00 "
        f"| {2 * fp32_bytes / (ref_ms / 1e3) / 1e9:.2f} |")
  for run in runs:
    t_q = statistics.median(run["t_q"])
    t_dq = statistics.median(run["t_dq"])
    traffic = 2 * (fp32_bytes + run["nbytes"])
    print(f"| {run['label']} | {run['nbytes'] / x_signed.size:.3f} | {1e3 * t_q:.1f} "
          f"| {1e3 * t_dq:.1f} | {1e3 * (t_q + t_dq):.1f} "
          f"| {statistics.median(run['ratio']):.2f} | {traffic / (t_q + t_dq) / 1e9:.2f} |")

if __name__ == "__main__":
  main()
