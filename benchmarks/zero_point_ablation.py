"""Zero-point ablation in the spirit of the paper's Table 1, on CPU.

The first moment is fixed at the paper's ``B128/DE``; the second moment is
stored with each quantizer of the paper's table: ``B2048/DE``, ``B128/DE``,
``B128/DE-0``, ``Rank-1/DE-0``, ``Rank-1/Linear`` (the paper's
``adamw_4bit``) and ``Factor`` (the factored second moment of
``adamw_4bit_factor``), plus this library's default ``Rank-1/SqrtDE-0`` and
fp32 ``adamw`` as the reference. The task and every hyperparameter are those
of ``examples/compare.py`` (byte-level transformer, 300 steps, lr 2e-3, 3
seeds).

Definitions (the same code counts them for every run, see
``examples/_common.py``):

* spike: a step t >= 20 whose training loss exceeds 1.5 x the median of the
  training losses of steps t-20 .. t-1 (a non-finite loss is a spike).
* diverged: some training loss is non-finite, or the final validation loss is
  not below the validation loss at initialization (about ln 256 = 5.55).
* val loss rose: the validation loss (evaluated every 50 steps) rose by more
  than 0.01 nats/byte from one evaluation to the next; under the cosine
  schedule a healthy run improves at every evaluation.
* unstable: diverged, at least one spike, or the validation loss rose.

Usage:
  python benchmarks/zero_point_ablation.py             # seeds 0 1 2
  python benchmarks/zero_point_ablation.py --seeds 0 --fresh
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import quality  # pylint: disable=wrong-import-position
from quality import C  # pylint: disable=wrong-import-position

ROWS = (  # label, optimizer, first moment, second moment
    ("fp32 (optax.adamw)", "adamw", None, None),
    ("B2048/DE", "adamw_4bit", "B128/DE", "B2048/DE"),
    ("B128/DE", "adamw_4bit", "B128/DE", "B128/DE"),
    ("B128/DE-0", "adamw_4bit", "B128/DE", "B128/DE-0"),
    ("Rank-1/DE-0", "adamw_4bit", "B128/DE", "Rank-1/DE-0"),
    ("Rank-1/Linear (paper's adamw_4bit)", "adamw_4bit", "B128/DE", "Rank-1/Linear"),
    ("Rank-1/SqrtDE-0", "adamw_4bit", "B128/DE", "Rank-1/SqrtDE-0"),
    ("Factor (paper's adamw_4bit_factor)", "adamw_4bit_factor", "B128/DE", "Factor"),
)


def is_unstable(run: dict) -> bool:
  return bool(run["diverged"]) or run["spikes"] > 0 or C.val_loss_rose(run["val_loss"])


def table(results: dict, seeds) -> tuple[str, dict]:
  n = len(seeds)
  lines = ["| second moment v (m = B128/DE) | state bytes/param | final val loss, not diverged "
           "(mean ± std) | per seed | diverged | seeds with spikes (spike steps) "
           "| val loss rose | unstable |", "|---|---|---|---|---|---|---|---|"]
  summary = {}
  for label, runs in results.items():
    finals = [r["final_val_loss"] for r in runs]
    stable = [r["final_val_loss"] for r in runs if not r["diverged"]]
    mean, std = C.mean_std(stable)
    div = sum(bool(r["diverged"]) for r in runs)
    spiked = sum(r["spikes"] > 0 for r in runs)
    rose = sum(C.val_loss_rose(r["val_loss"]) for r in runs)
    unstable = sum(is_unstable(r) for r in runs)
    total_spikes = sum(r["spikes"] for r in runs)
    per_seed = ", ".join(f"{v:.4f}" if math.isfinite(v) and v < 100 else f"{v:.3g}"
                         for v in finals)
    loss = f"{mean:.4f} ± {std:.4f}" if stable else "—"
    if stable and len(stable) < n:
      loss += f" ({len(stable)} seeds)"
    lines.append(f"| {label} | {runs[0]['state_bytes_per_param']:.3f} | {loss} | {per_seed} "
                 f"| {div}/{n} | {spiked}/{n} ({total_spikes}) | {rose}/{n} | {unstable}/{n} |")
    summary[label] = {"final_val_loss_per_seed": finals, "stable_mean": mean, "stable_std": std,
                      "diverged": div, "seeds_with_spikes": spiked, "spike_steps": total_spikes,
                      "val_loss_rose": rose, "unstable": unstable,
                      "state_bytes_per_param": runs[0]["state_bytes_per_param"]}
  return "\n".join(lines), summary


def plot(path: str, results: dict) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  cols = 4
  rows = math.ceil(len(results) / cols)
  fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 2.8 * rows), sharex=True,
                           sharey=True, squeeze=False)
  for ax, (label, runs) in zip(axes.flat, results.items()):
    for i, r in enumerate(runs):
      steps, losses = zip(*r["train_loss"])
      losses = np.where(np.isfinite(losses), losses, np.nan)
      ax.plot(steps, np.clip(losses, 1e-3, 1e4), lw=0.8, color=f"C{i}",
              label=f"seed {r['settings']['seed']}")
    ax.set_title(label, fontsize=9)
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
  for ax in axes.flat[len(results):]:
    ax.axis("off")
  axes.flat[0].legend(fontsize=7)
  for ax in axes[:, 0]:
    ax.set_ylabel("train loss")
  for ax in axes[-1]:
    ax.set_xlabel("step")
  fig.suptitle("zero-point ablation: training loss per seed (byte-level LM)", fontsize=10)
  fig.tight_layout()
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--fresh", action="store_true", help="retrain cached runs")
  parser.add_argument("--no-progress", action="store_true")
  parser.add_argument("--no-write", action="store_true",
                      help="do not write benchmarks/plots and benchmarks/results")
  args = parser.parse_args(argv)
  C.enable_compile_cache()
  start = time.perf_counter()
  env = quality.environment()
  print(f"# Zero-point ablation ({env})")
  train, val, info = C.load_stdlib_corpus()
  data = (train, val, info)
  results = {}
  for label, name, first, second in ROWS:
    runs = [quality.lm_result(quality.lm_optimizer(name, seed, first_moment=first,
                                                   second_moment=second), data,
                              fresh=args.fresh, progress=not args.no_progress)
            for seed in args.seeds]
    results[label] = runs
    print(f"  {label}: " + ", ".join(
        f"{r['final_val_loss']:.4g} (spikes {r['spikes']}{', diverged' if r['diverged'] else ''}"
        f"{', cached' if r['cached'] else ''})" for r in runs), flush=True)
  text, summary = table(results, args.seeds)
  print()
  print(text)
  elapsed = time.perf_counter() - start
  print(f"\ntotal {elapsed:.0f} s")
  out = {"environment": env, "seeds": args.seeds, "summary": summary, "table": text,
         "spike_rule": {"window": C.SPIKE_WINDOW, "factor": C.SPIKE_FACTOR},
         "val_loss_rose_tolerance": C.ROSE_TOLERANCE,
         "elapsed_s": elapsed}
  if not args.no_write:
    plot(os.path.join(quality.PLOTS, "zero_point_ablation.png"), results)
    C.save_json(os.path.join(quality.RESULTS, "zero_point_ablation.json"), out)
  return out


if __name__ == "__main__":
  main()
