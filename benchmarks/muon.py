"""4-bit Muon (`optax4bit.muon_4bit`) against fp32 Muon (`optax.contrib.muon`).

Two problems, paired (same init and data order per seed):

* the least-squares problem of issue 14, ``mean((W @ T - T)**2)`` with W, T
  256x256, ``W ~ 0.02 N(0, 1)``, full batch, 200 steps, over a learning-rate
  sweep; ratios of the final loss to fp32 Muon's, per block size of the
  4-bit momentum;
* the byte-level transformer LM of benchmarks/quality.py's ablation
  configuration (examples/compare.py defaults): validation loss and state
  bytes, Muon's rate for the matrices, a tenth of it for Adam's part.

    python benchmarks/muon.py            # both
    python benchmarks/muon.py --quick    # fewer seeds and steps
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import jax
import numpy as np
import optax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import _common as C  # noqa: E402  pylint: disable=wrong-import-position
import compare  # noqa: E402  pylint: disable=wrong-import-position
import train_lm  # noqa: E402  pylint: disable=wrong-import-position

import optax4bit  # noqa: E402  pylint: disable=wrong-import-position
from quantize_state_contrib import least_squares  # noqa: E402  pylint: disable=wrong-import-position

BLOCKS = (128, 32)


def momentum(block: int) -> optax4bit.QuantSpec:
  return optax4bit.QuantSpec("block", "NF", 4, signed=True, block_size=block, stochastic=True)


def least_squares_table(seeds: list, lrs: list) -> str:
  rows = ["| lr | fp32 Muon loss | " + " | ".join(f"4-bit, B{b}/NF momentum" for b in BLOCKS)
          + " |", "|---" * (2 + len(BLOCKS)) + "|"]
  for lr in lrs:
    fp32 = np.array([least_squares(optax.contrib.muon(lr), s) for s in seeds])
    cells = []
    for block in BLOCKS:
      tx = lambda: optax4bit.muon_4bit(lr, min_quantize_size=0,  # noqa: E731
                                       spec_for={"MuonState.mu": momentum(block)})
      ratio = np.array([least_squares(tx(), s) for s in seeds]) / fp32
      cells.append(f"{ratio.mean():.2f} [{ratio.min():.2f}, {ratio.max():.2f}]")
    rows.append(f"| {lr:g} | {fp32.mean():.3g} | " + " | ".join(cells) + " |")
    print(rows[-1], flush=True)
  return "\n".join(rows)


def lm_table(seeds: list, steps: int, lr: float) -> str:
  settings = dataclasses.replace(compare.DEFAULTS, steps=steps)
  train, val, _ = C.load_stdlib_corpus()
  rows = ["| optimizer | state bytes / param | final val loss (mean over seeds) | "
          "paired gap to fp32 Muon |", "|---|---|---|---|"]
  finals = {}
  for name in ("muon", "muon_4bit"):
    finals[name], nbytes = [], None
    for seed in seeds:
      opt = C.OptimizerConfig(name=name, learning_rate=lr, weight_decay=compare.WEIGHT_DECAY,
                              total_steps=steps, warmup_steps=settings.warmup_steps, seed=seed)
      result = train_lm.run_lm(dataclasses.replace(settings, seed=seed), opt, train, val,
                               progress=False)
      finals[name].append(result["final_val_loss"])
      nbytes = result.get("state_bytes_per_param", nbytes)
    gap = np.array(finals[name]) / np.array(finals["muon"]) - 1
    rows.append(f"| {name} | {nbytes if nbytes is None else f'{nbytes:.3f}'} | "
                f"{np.mean(finals[name]):.4f} | {100 * gap.mean():+.2f}% "
                f"[{100 * gap.min():+.2f}%, {100 * gap.max():+.2f}%] |")
    print(rows[-1], flush=True)
  return "\n".join(rows)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--skip-lm", action="store_true")
  args = parser.parse_args(argv)
  seeds = [0, 1] if args.quick else [0, 1, 2]
  print(f"jax {jax.__version__}, optax {optax.__version__}, {os.cpu_count()} CPUs")
  print(least_squares_table(seeds, [1e-2, 2e-2, 3e-2, 1e-1]))
  if not args.skip_lm:
    print(lm_table(seeds[:2], 300 if args.quick else 600, lr=2e-2))


if __name__ == "__main__":
  main()
