"""Train a small byte-level transformer LM on the Python standard library's source.

The corpus is available offline everywhere: the ``.py`` files under
``os.path.dirname(os.__file__)``, split BY FILE into train and validation
(``crc32(relative path) % 1000 < 100`` goes to validation), read as bytes
(vocabulary 256). The model is a pre-norm decoder-only transformer in Flax NNX.

Examples:
  python examples/train_lm.py --optimizer adamw_4bit
  python examples/train_lm.py --optimizer adamw --steps 2000
  python examples/train_lm.py --optimizer adamw_4bit --second-moment B128/DE   # zero-point problem
  python examples/train_lm.py --optimizer v=Rank-1/DE-0                        # a named preset
  python examples/train_lm.py --optimizer adafactor

Outputs (in ``--out-dir``, default ``runs/lm``): ``<optimizer>_seed<k>.json``
(configuration, training and validation loss curves, final validation loss,
state bytes per parameter, step times, spike/divergence counts) and a PNG of
the loss curves.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys

import numpy as np
from flax import nnx
from tqdm.auto import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # pylint: disable=wrong-import-position


@dataclasses.dataclass(frozen=True)
class LMSettings:
  """Model, data and loop settings of one LM run."""
  steps: int = 1000
  batch_size: int = 16
  seq_len: int = 128
  d_model: int = 128
  num_layers: int = 2
  num_heads: int = 4
  warmup_steps: int = 100
  eval_every: int = 100
  eval_windows: int = 128
  seed: int = 0


def add_model_args(parser: argparse.ArgumentParser, d: LMSettings) -> None:
  """Model, batch and evaluation arguments (shared with compare.py)."""
  parser.add_argument("--steps", type=int, default=d.steps)
  parser.add_argument("--batch-size", type=int, default=d.batch_size)
  parser.add_argument("--seq-len", type=int, default=d.seq_len)
  parser.add_argument("--d-model", type=int, default=d.d_model)
  parser.add_argument("--layers", type=int, default=d.num_layers)
  parser.add_argument("--heads", type=int, default=d.num_heads)
  parser.add_argument("--eval-every", type=int, default=d.eval_every)
  parser.add_argument("--eval-windows", type=int, default=d.eval_windows,
                      help="validation windows of --seq-len bytes (fixed, evenly spaced)")


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog="\n".join(__doc__.splitlines()[1:]))
  d = LMSettings()
  add_model_args(parser, d)
  parser.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
  parser.add_argument("--seed", type=int, default=d.seed, help="init, batches and rounding")
  parser.add_argument("--out-dir", default=os.path.join("runs", "lm"))
  parser.add_argument("--corpus-dir", default=None,
                      help="directory of .py files (default: the standard library)")
  parser.add_argument("--max-corpus-bytes", type=int, default=None,
                      help="read at most about this many bytes per split (quick tests)")
  parser.add_argument("--no-progress", action="store_true", help="no tqdm bar")
  parser.add_argument("--no-plot", action="store_true", help="no PNG")
  C.add_optimizer_args(parser, lr=2e-3, weight_decay=0.01)
  return parser


def settings_from_args(args) -> LMSettings:
  return LMSettings(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                    d_model=args.d_model, num_layers=args.layers, num_heads=args.heads,
                    warmup_steps=args.warmup_steps, eval_every=args.eval_every,
                    eval_windows=args.eval_windows, seed=args.seed)


def make_model(s: LMSettings) -> C.TransformerLM:
  return C.TransformerLM(seq_len=s.seq_len, d_model=s.d_model, num_layers=s.num_layers,
                         num_heads=s.num_heads, rngs=nnx.Rngs(s.seed))


def eval_points(s: LMSettings) -> set:
  every = max(1, s.eval_every)
  return set(range(every, s.steps, every)) | {s.steps}


def run_lm(s: LMSettings, opt: C.OptimizerConfig, train: np.ndarray, val: np.ndarray, *,
           progress: bool = True, desc: str = "") -> dict:
  """Trains one model; returns the JSON-ready result (see module docstring)."""
  trainer = C.Trainer(make_model(s), C.make_optimizer(opt))
  x_val, y_val = C.lm_eval_windows(val, s.eval_windows, s.seq_len)
  eval_bs = 32
  initial_val, _ = trainer.evaluate(x_val, y_val, eval_bs)
  val_curve = [(0, initial_val)]
  train_curve, step_times = [], []
  batches = C.lm_batches(train, s.batch_size, s.seq_len, s.seed)
  points = eval_points(s)
  bar = tqdm(range(1, s.steps + 1), desc=desc or opt.label(), disable=not progress,
             dynamic_ncols=True, leave=False)
  for step in bar:
    x, y = next(batches)
    start = C.now()
    loss = trainer.step(x, y)
    step_times.append(C.now() - start)
    train_curve.append((step, loss))
    if step in points:
      val_curve.append((step, trainer.evaluate(x_val, y_val, eval_bs)[0]))
      bar.set_postfix(loss=f"{loss:.3f}", val=f"{val_curve[-1][1]:.3f}")
    elif step % 10 == 0:
      bar.set_postfix(loss=f"{loss:.3f}", val=f"{val_curve[-1][1]:.3f}")
  bar.close()
  losses = [v for _, v in train_curve]
  final_val = val_curve[-1][1]
  # The first step compiles; the median of the others is the step time.
  return {
      "task": "lm",
      "optimizer": opt.label(),
      "settings": dataclasses.asdict(s),
      "optimizer_config": dataclasses.asdict(opt),
      **trainer.state_stats(),
      "initial_val_loss": initial_val,
      "final_val_loss": final_val,
      "final_train_loss": statistics.fmean(losses[-max(1, len(losses) // 20):]),
      "val_loss": val_curve,
      "train_loss": train_curve,
      "compile_and_first_step_s": step_times[0],
      "step_time_median_s": statistics.median(step_times[1:] or step_times),
      "spikes": C.count_spikes(losses),
      "diverged": C.diverged(losses, final_val, initial_val),
      "val_loss_rose": C.val_loss_rose(val_curve),
  }


def main(argv=None) -> dict:
  args = build_parser().parse_args(argv)
  s = settings_from_args(args)
  opt = C.optimizer_config(args, total_steps=s.steps, warmup_steps=s.warmup_steps, seed=s.seed)
  C.make_optimizer(opt)  # fail early on a bad configuration
  train, val, info = C.load_stdlib_corpus(args.corpus_dir, max_bytes=args.max_corpus_bytes)
  if not args.no_progress:
    print(f"corpus: {info['train_files']} train files ({info['train_bytes'] / 1e6:.1f} MB), "
          f"{info['val_files']} validation files ({info['val_bytes'] / 1e6:.1f} MB) "
          f"from {info['root']}")
  result = run_lm(s, opt, train, val, progress=not args.no_progress)
  result["corpus"] = info
  stem = os.path.join(args.out_dir, f"{C.slug(opt.label())}_seed{s.seed}")
  result["json"] = stem + ".json"
  C.save_json(stem + ".json", result)
  if not args.no_plot:
    result["png"] = stem + ".png"
    C.plot_curves(stem + ".png", {opt.label(): {"train": result["train_loss"],
                                                  "val": result["val_loss"]}},
                  title=f"byte-level LM on the Python stdlib: {opt.label()}",
                  ylabel="cross-entropy (nats/byte)")
  print(f"{opt.label()}: final validation loss {result['final_val_loss']:.4f} nats/byte, "
        f"state {result['state_bytes_per_param']:.3f} bytes/param "
        f"({result['params']:,} params), step {1e3 * result['step_time_median_s']:.1f} ms, "
        f"spikes {result['spikes']}, diverged {result['diverged']} -> {stem}.json")
  return result


if __name__ == "__main__":
  main()
