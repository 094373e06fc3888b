"""Training quality of every optimizer: mean +- std over seeds, on CPU.

* LM: the byte-level transformer of ``examples/train_lm.py`` on the Python
  standard library's source (split by file), in the configuration of
  ``examples/compare.py`` (2 layers, d_model 128, batch 16 x 64 bytes, 300
  steps, lr 2e-3 with 30 warmup steps and cosine decay, weight decay 0.01 on
  matrices, global-norm clipping 1.0): final validation loss in nats/byte on
  128 fixed validation windows. Optimizers: adamw (optax, fp32), adamw_4bit,
  adamw_4bit_factor, adamw_8bit, adafactor (optax, momentum 0.9).
* Digits: the MLP of ``examples/train_digits.py`` (64-256-256-10) on
  scikit-learn's digits, 1000 steps of batch 64, lr 1e-3 for the Adam family
  and Adafactor, 0.05 for SGD with momentum 0.9: final accuracy on the 450
  validation images. Optimizers: the five above plus sgdm (optax) and
  sgdm_4bit.

Every optimizer keeps the paper's rule: leaves with at most 4096 elements keep
fp32 moments. Seeds change the initialization and the batch order (the data
split is fixed).

Goal (issue 6): 4-bit AdamW and 4-bit Factor within 1% relative validation loss
of fp32 AdamW on the LM (|mean - mean_adamw| / mean_adamw <= 1%), and within
0.5 accuracy points on digits (|mean - mean_adamw| <= 0.5); sgdm_4bit is
compared with sgdm the same way. The script prints whether each is met.

Each run is saved under ``runs/bench/`` and reused by a later call with the
same configuration (``--fresh`` retrains); ``benchmarks/zero_point_ablation.py``
reuses the adamw, adamw_4bit and adamw_4bit_factor LM runs.

Usage:
  python benchmarks/quality.py                     # both tasks, seeds 0 1 2
  python benchmarks/quality.py --task lm --seeds 0
  python benchmarks/quality.py --task digits --fresh
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import sys
import time

import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import _common as C  # pylint: disable=wrong-import-position
import compare  # pylint: disable=wrong-import-position
import train_digits  # pylint: disable=wrong-import-position
import train_lm  # pylint: disable=wrong-import-position

LM_OPTIMIZERS = ("adamw", "adamw_4bit", "adamw_4bit_factor", "adamw_8bit", "adafactor")
DIGITS_OPTIMIZERS = LM_OPTIMIZERS + ("sgdm", "sgdm_4bit")
LM_SETTINGS = compare.DEFAULTS
DIGITS_SETTINGS = train_digits.DigitsSettings()
LM_GOAL_REL = 0.01      # 1% relative validation loss
DIGITS_GOAL_POINTS = 0.5  # accuracy points
PLOTS = os.path.join(ROOT, "benchmarks", "plots")
RESULTS = os.path.join(ROOT, "benchmarks", "results")
CACHE = os.path.join("runs", "bench")


def lm_optimizer(name: str, seed: int, *, first_moment=None, second_moment=None):
  s = LM_SETTINGS
  return C.OptimizerConfig(name=name, learning_rate=compare.LR, weight_decay=compare.WEIGHT_DECAY,
                           first_moment=first_moment, second_moment=second_moment,
                           total_steps=s.steps, warmup_steps=s.warmup_steps, seed=seed)


def lm_result(opt: C.OptimizerConfig, data, *, fresh=False, progress=True) -> dict:
  """One LM run of the benchmark configuration (cached under runs/bench/lm)."""
  s = dataclasses.replace(LM_SETTINGS, seed=opt.seed)
  key = {"settings": dataclasses.asdict(s), "optimizer": dataclasses.asdict(opt),
         "corpus": data[2]}
  path = os.path.join(CACHE, "lm", f"{C.slug(opt.label())}_seed{opt.seed}.json")
  return C.run_cached(path, key, lambda: train_lm.run_lm(s, opt, data[0], data[1],
                                                         progress=progress), fresh=fresh)


def digits_result(name: str, seed: int, data, *, fresh=False, progress=True) -> dict:
  s = dataclasses.replace(DIGITS_SETTINGS, seed=seed)
  lr = C.default_lr(name, train_digits.ADAM_LR, train_digits.SGD_LR)
  opt = C.OptimizerConfig(name=name, learning_rate=lr, weight_decay=0.0, total_steps=s.steps,
                          warmup_steps=s.warmup_steps, seed=seed)
  key = {"settings": dataclasses.asdict(s), "optimizer": dataclasses.asdict(opt)}
  path = os.path.join(CACHE, "digits", f"{C.slug(opt.label())}_{s.model}_seed{seed}.json")
  return C.run_cached(path, key, lambda: train_digits.run_digits(s, opt, data,
                                                                 progress=progress),
                      fresh=fresh)


def mean_curve(runs: list, key: str) -> list:
  """Point-wise mean of the runs' ``key`` curves (same steps in every run)."""
  steps = [s for s, _ in runs[0][key]]
  values = np.mean([[v for _, v in r[key]] for r in runs], axis=0)
  return list(zip(steps, values.tolist()))


def environment() -> str:
  return (f"{datetime.date.today()}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, Python {platform.python_version()}, jax {jax.__version__}")


def lm_table(runs: dict, seeds) -> tuple[str, dict]:
  ref_mean, _ = C.mean_std([r["final_val_loss"] for r in runs["adamw"]])
  lines = [f"| optimizer | state bytes/param | final val loss, nats/byte (mean ± std, "
           f"{len(seeds)} seeds) | vs adamw | per seed | step time (ms) |",
           "|---|---|---|---|---|---|"]
  summary = {}
  for name, rs in runs.items():
    mean, std = C.mean_std([r["final_val_loss"] for r in rs])
    rel = (mean - ref_mean) / ref_mean
    per_seed = ", ".join(f"{r['final_val_loss']:.4f}" for r in rs)
    step_ms = 1e3 * float(np.median([r["step_time_median_s"] for r in rs]))
    lines.append(f"| {name} | {rs[0]['state_bytes_per_param']:.3f} | {mean:.4f} ± {std:.4f} "
                 f"| {100 * rel:+.2f}% | {per_seed} | {step_ms:.0f} |")
    summary[name] = {"mean": mean, "std": std, "rel_vs_adamw": rel, "per_seed":
                     [r["final_val_loss"] for r in rs],
                     "state_bytes_per_param": rs[0]["state_bytes_per_param"],
                     "params": rs[0]["params"], "step_time_ms": step_ms,
                     "diverged": sum(bool(r["diverged"]) for r in rs)}
  return "\n".join(lines), summary


def digits_table(runs: dict, seeds) -> tuple[str, dict]:
  lines = [f"| optimizer | state bytes/param | val accuracy % (mean ± std, {len(seeds)} seeds) "
           f"| vs fp32 reference | per seed | val loss |", "|---|---|---|---|---|---|"]
  summary = {}
  means = {n: C.mean_std([100 * r["final_val_accuracy"] for r in rs])[0]
           for n, rs in runs.items()}
  for name, rs in runs.items():
    mean, std = C.mean_std([100 * r["final_val_accuracy"] for r in rs])
    ref = "sgdm" if name.startswith("sgdm") else "adamw"
    delta = mean - means[ref]
    loss_mean, loss_std = C.mean_std([r["final_val_loss"] for r in rs])
    per_seed = ", ".join(f"{100 * r['final_val_accuracy']:.2f}" for r in rs)
    lines.append(f"| {name} | {rs[0]['state_bytes_per_param']:.3f} | {mean:.2f} ± {std:.2f} "
                 f"| {delta:+.2f} pts vs {ref} | {per_seed} | {loss_mean:.4f} ± {loss_std:.4f} |")
    summary[name] = {"mean": mean, "std": std, "reference": ref, "delta_points": delta,
                     "per_seed": [100 * r["final_val_accuracy"] for r in rs],
                     "val_loss_mean": loss_mean, "val_loss_std": loss_std,
                     "state_bytes_per_param": rs[0]["state_bytes_per_param"],
                     "params": rs[0]["params"]}
  return "\n".join(lines), summary


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--task", choices=("lm", "digits", "all"), default="all")
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--optimizers", nargs="+", default=None,
                      help="subset of the optimizers (default: all of the task)")
  parser.add_argument("--fresh", action="store_true", help="retrain cached runs")
  parser.add_argument("--no-progress", action="store_true")
  parser.add_argument("--no-write", action="store_true",
                      help="do not write benchmarks/plots and benchmarks/results")
  args = parser.parse_args(argv)
  C.enable_compile_cache()
  start = time.perf_counter()
  out = {"environment": environment(), "seeds": args.seeds}
  print(f"# Training quality ({out['environment']})")
  progress = not args.no_progress

  if args.task in ("lm", "all"):
    train, val, info = C.load_stdlib_corpus()
    data = (train, val, info)
    names = [n for n in LM_OPTIMIZERS if args.optimizers is None or n in args.optimizers]
    if "adamw" not in names:
      names.insert(0, "adamw")
    runs = {}
    for name in names:
      runs[name] = [lm_result(lm_optimizer(name, seed), data, fresh=args.fresh,
                              progress=progress) for seed in args.seeds]
      print(f"  lm {name}: " + ", ".join(f"{r['final_val_loss']:.4f}"
                                         + (" (cached)" if r["cached"] else "")
                                         for r in runs[name]), flush=True)
    table, summary = lm_table(runs, args.seeds)
    print(f"\n## LM: byte-level transformer, {runs['adamw'][0]['params']:,} params, "
          f"{LM_SETTINGS.steps} steps; corpus Python {info['python']} stdlib "
          f"({info['train_files']} train / {info['val_files']} val files)\n")
    print(table)
    goal = {}
    for name in ("adamw_4bit", "adamw_4bit_factor"):
      if name in summary:
        rel = summary[name]["rel_vs_adamw"]
        goal[name] = abs(rel) <= LM_GOAL_REL
        print(f"goal |{name} - adamw| / adamw <= 1%: {100 * rel:+.2f}% -> "
              f"{'met' if goal[name] else 'NOT met'}")
    out["lm"] = {"settings": dataclasses.asdict(LM_SETTINGS), "corpus": info,
                 "summary": summary, "goal_met": goal, "table": table}
    if not args.no_write:
      C.plot_curves(os.path.join(PLOTS, "quality_lm.png"),
                    {n: {"train": mean_curve(rs, "train_loss"), "val": mean_curve(rs, "val_loss")}
                     for n, rs in runs.items()},
                    title=f"byte-level LM, mean of {len(args.seeds)} seeds",
                    ylabel="cross-entropy (nats/byte)")

  if args.task in ("digits", "all"):
    data = C.load_digits_split()
    names = [n for n in DIGITS_OPTIMIZERS if args.optimizers is None or n in args.optimizers]
    if "adamw" not in names:
      names.insert(0, "adamw")
    if "sgdm_4bit" in names and "sgdm" not in names:
      names.insert(names.index("sgdm_4bit"), "sgdm")
    runs = {}
    for name in names:
      runs[name] = [digits_result(name, seed, data, fresh=args.fresh, progress=progress)
                    for seed in args.seeds]
      print(f"  digits {name}: " + ", ".join(f"{100 * r['final_val_accuracy']:.2f}%"
                                             for r in runs[name]), flush=True)
    table, summary = digits_table(runs, args.seeds)
    print(f"\n## Digits: MLP 64-{DIGITS_SETTINGS.hidden}-{DIGITS_SETTINGS.hidden}-10, "
          f"{runs[names[0]][0]['params']:,} params, {DIGITS_SETTINGS.steps} steps of batch "
          f"{DIGITS_SETTINGS.batch_size}, 450 validation images\n")
    print(table)
    goal = {}
    for name in ("adamw_4bit", "adamw_4bit_factor", "sgdm_4bit"):
      if name in summary:
        d = summary[name]["delta_points"]
        goal[name] = abs(d) <= DIGITS_GOAL_POINTS
        print(f"goal |{name} - {summary[name]['reference']}| <= 0.5 points: {d:+.2f} -> "
              f"{'met' if goal[name] else 'NOT met'}")
    out["digits"] = {"settings": dataclasses.asdict(DIGITS_SETTINGS), "summary": summary,
                     "goal_met": goal, "table": table}
    if not args.no_write:
      C.plot_curves(os.path.join(PLOTS, "quality_digits.png"),
                    {n: {"val": mean_curve(rs, "val_loss")} for n, rs in runs.items()},
                    title=f"digits MLP, validation loss, mean of {len(args.seeds)} seeds",
                    ylabel="cross-entropy", logy=True)

  out["elapsed_s"] = time.perf_counter() - start
  print(f"\ntotal {out['elapsed_s']:.0f} s")
  if not args.no_write:
    C.save_json(os.path.join(RESULTS, f"quality_{args.task}.json"), out)
  return out


if __name__ == "__main__":
  main()
