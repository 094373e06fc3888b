"""Short training comparison on CPU: fp32 AdamW vs 4-bit AdamW vs 4-bit Factor.

Trains three copies of the same byte-level transformer LM (same initialization,
same batches, see ``train_lm.py``) side by side: every step runs once for each
optimizer in turn, so machine load hits all three alike. Prints a table of the
final validation loss, the optimizer state bytes per parameter (as stored:
4-bit codes, scales, and the fp32 moments of leaves too small to quantize), and
the train-step time (forward + backward + update) relative to fp32 AdamW,
the median over steps of the per-step ratio.

  python examples/compare.py                 # 3-6 minutes on 2 shared CPU cores
  python examples/compare.py --steps 1000    # longer
  python examples/compare.py --optimizers adamw adamw_4bit adamw_8bit adafactor

Writes ``runs/compare/compare.json`` and ``runs/compare/compare.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import jax
import numpy as np
from tqdm.auto import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # pylint: disable=wrong-import-position
import train_lm  # pylint: disable=wrong-import-position

DEFAULT_OPTIMIZERS = ("adamw", "adamw_4bit", "adamw_4bit_factor")
# The benchmark configuration of benchmarks/quality.py (seed 0 reproduces its first seed).
DEFAULTS = train_lm.LMSettings(steps=300, batch_size=16, seq_len=64, d_model=128,
                               num_layers=2, num_heads=4, warmup_steps=30, eval_every=50,
                               eval_windows=128, seed=0)
LR, WEIGHT_DECAY = 2e-3, 0.01


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog="\n".join(__doc__.splitlines()[1:]))
  d = DEFAULTS
  parser.add_argument("--optimizers", nargs="+", default=list(DEFAULT_OPTIMIZERS),
                      help=f"the first is the reference (default: {' '.join(DEFAULT_OPTIMIZERS)})")
  train_lm.add_model_args(parser, d)
  parser.add_argument("--lr", type=float, default=LR)
  parser.add_argument("--weight-decay", type=float, default=WEIGHT_DECAY)
  parser.add_argument("--min-quantize-size", type=int, default=4096,
                      help="leaves with at most this many elements keep fp32 moments")
  parser.add_argument("--seed", type=int, default=d.seed)
  parser.add_argument("--max-corpus-bytes", type=int, default=None,
                      help="read at most about this many bytes per split (quick tests)")
  parser.add_argument("--out-dir", default=os.path.join("runs", "compare"))
  parser.add_argument("--no-progress", action="store_true")
  return parser


def quantized_fraction(params, min_quantize_size: int) -> float:
  """Share of parameters in leaves large enough to get quantized moments."""
  sizes = [int(np.prod(p.shape)) for p in jax.tree.leaves(params)]
  return sum(n for n in sizes if n > min_quantize_size) / sum(sizes)


def format_table(rows: list) -> str:
  header = ("| optimizer | final val loss (nats/byte) | vs fp32 AdamW | state bytes/param "
            "| state KB | train-step time vs fp32 AdamW |")
  lines = [header, "|---|---|---|---|---|---|"]
  ref = rows[0]["final_val_loss"]
  for r in rows:
    rel = 100 * (r["final_val_loss"] - ref) / ref
    lines.append(f"| {r['optimizer']} | {r['final_val_loss']:.4f} | {rel:+.2f}% "
                 f"| {r['state_bytes_per_param']:.3f} | {r['state_bytes'] / 1e3:.0f} "
                 f"| {r['step_time_ratio']:.2f}x |")
  return "\n".join(lines)


def main(argv=None) -> dict:
  args = build_parser().parse_args(argv)
  t_start = time.perf_counter()
  s = dataclasses.replace(DEFAULTS, steps=args.steps, batch_size=args.batch_size,
                          seq_len=args.seq_len, d_model=args.d_model, num_layers=args.layers,
                          num_heads=args.heads, eval_every=args.eval_every,
                          eval_windows=args.eval_windows, seed=args.seed,
                          warmup_steps=min(DEFAULTS.warmup_steps, args.steps // 10))
  train, val, info = C.load_stdlib_corpus(max_bytes=args.max_corpus_bytes)
  print(f"corpus: Python {info['python']} standard library, {info['train_files']} train / "
        f"{info['val_files']} validation files ({info['train_bytes'] / 1e6:.1f} / "
        f"{info['val_bytes'] / 1e6:.1f} MB), byte level")
  trainers, configs = [], []
  for name in args.optimizers:
    cfg = C.OptimizerConfig(name=name, learning_rate=args.lr, weight_decay=args.weight_decay,
                            min_quantize_size=args.min_quantize_size, total_steps=s.steps,
                            warmup_steps=s.warmup_steps, seed=s.seed)
    configs.append(cfg)
    trainers.append(C.Trainer(train_lm.make_model(s), C.make_optimizer(cfg)))
  params = trainers[0].params
  frac = quantized_fraction(params, args.min_quantize_size)
  print(f"model: {s.num_layers}-layer transformer, d_model {s.d_model}, "
        f"{sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params)):,} parameters; "
        f"{100 * frac:.1f}% of them in leaves with > {args.min_quantize_size} elements "
        f"(quantized moments), the rest keep fp32 moments")
  print(f"training {len(trainers)} optimizers side by side for {s.steps} steps "
        f"(batch {s.batch_size} x {s.seq_len} bytes, lr {args.lr}, cosine schedule)")

  x_val, y_val = C.lm_eval_windows(val, s.eval_windows, s.seq_len)
  val_curves = [[(0, t.evaluate(x_val, y_val, 32)[0])] for t in trainers]
  train_curves = [[] for _ in trainers]
  times = [[] for _ in trainers]
  batches = C.lm_batches(train, s.batch_size, s.seq_len, s.seed)
  points = train_lm.eval_points(s)
  bar = tqdm(range(1, s.steps + 1), disable=args.no_progress, dynamic_ncols=True)
  for step in bar:
    x, y = next(batches)
    for i, trainer in enumerate(trainers):
      start = time.perf_counter()
      loss = trainer.step(x, y)
      times[i].append(time.perf_counter() - start)
      train_curves[i].append((step, loss))
    if step in points:
      for i, trainer in enumerate(trainers):
        val_curves[i].append((step, trainer.evaluate(x_val, y_val, 32)[0]))
      bar.set_postfix({cfg.name: f"{v[-1][1]:.3f}" for cfg, v in zip(configs, val_curves)})
  bar.close()

  rows = []
  for i, (cfg, trainer) in enumerate(zip(configs, trainers)):
    # Step 1 compiles; ratios are taken step by step (same batch, adjacent in time).
    ratios = [a / b for a, b in zip(times[i][1:], times[0][1:])] or [1.0]
    losses = [v for _, v in train_curves[i]]
    rows.append({
        "optimizer": cfg.name,
        **trainer.state_stats(),
        "final_val_loss": val_curves[i][-1][1],
        "initial_val_loss": val_curves[i][0][1],
        "step_time_median_s": statistics.median(times[i][1:] or times[i]),
        "step_time_ratio": statistics.median(ratios),
        "spikes": C.count_spikes(losses),
        "diverged": C.diverged(losses, val_curves[i][-1][1], val_curves[i][0][1]),
        "val_loss": val_curves[i],
        "train_loss": train_curves[i],
    })
  table = format_table(rows)
  elapsed = time.perf_counter() - t_start
  print()
  print(table)
  print()
  print(f"step time: fp32 AdamW {1e3 * rows[0]['step_time_median_s']:.1f} ms median "
        f"(forward + backward + update, batch {s.batch_size}x{s.seq_len}); "
        f"total run {elapsed:.0f} s")
  print("state bytes/param counts every leaf: leaves with <= "
        f"{args.min_quantize_size} elements (norms, biases) keep 8 bytes/param of fp32 moments.")

  result = {"settings": dataclasses.asdict(s), "lr": args.lr, "weight_decay": args.weight_decay,
            "min_quantize_size": args.min_quantize_size, "quantized_fraction": frac,
            "corpus": info, "rows": rows, "table": table, "elapsed_s": elapsed}
  os.makedirs(args.out_dir, exist_ok=True)
  C.save_json(os.path.join(args.out_dir, "compare.json"), result)
  C.plot_curves(os.path.join(args.out_dir, "compare.png"),
                {r["optimizer"]: {"train": r["train_loss"], "val": r["val_loss"]} for r in rows},
                title="byte-level LM on the Python stdlib", ylabel="cross-entropy (nats/byte)")
  print(f"wrote {os.path.join(args.out_dir, 'compare.json')} and compare.png")
  return result


if __name__ == "__main__":
  main()
