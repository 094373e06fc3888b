"""Train an image classifier on scikit-learn's 8x8 digits (ships with scikit-learn).

1797 images, 10 classes; a fixed stratified split keeps 25% (450 images) for
validation (``random_state=0``: seeds change the initialization and the batch
order, never the split). The model is an MLP (default) or a small CNN in Flax NNX.

Examples:
  python examples/train_digits.py --optimizer adamw_4bit
  python examples/train_digits.py --optimizer sgdm_4bit --lr 0.05
  python examples/train_digits.py --optimizer adamw_4bit_factor --model cnn
  python examples/train_digits.py --optimizer adamw_4bit --second-moment B128/DE

Outputs (in ``--out-dir``, default ``runs/digits``): ``<optimizer>_seed<k>.json``
(configuration, loss and accuracy curves, final validation accuracy, state
bytes per parameter) and a PNG of the curves.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys

from flax import nnx
from tqdm.auto import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # pylint: disable=wrong-import-position

ADAM_LR = 1e-3
SGD_LR = 0.05


@dataclasses.dataclass(frozen=True)
class DigitsSettings:
  """Model, data and loop settings of one digits run."""
  steps: int = 1000
  batch_size: int = 64
  model: str = "mlp"
  hidden: int = 256
  warmup_steps: int = 50
  eval_every: int = 100
  seed: int = 0


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog="\n".join(__doc__.splitlines()[1:]))
  d = DigitsSettings()
  parser.add_argument("--steps", type=int, default=d.steps)
  parser.add_argument("--batch-size", type=int, default=d.batch_size)
  parser.add_argument("--model", choices=("mlp", "cnn"), default=d.model)
  parser.add_argument("--hidden", type=int, default=d.hidden, help="MLP width (%(default)s)")
  parser.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
  parser.add_argument("--eval-every", type=int, default=d.eval_every)
  parser.add_argument("--seed", type=int, default=d.seed, help="init, batches and rounding")
  parser.add_argument("--out-dir", default=os.path.join("runs", "digits"))
  parser.add_argument("--no-progress", action="store_true", help="no tqdm bar")
  parser.add_argument("--no-plot", action="store_true", help="no PNG")
  C.add_optimizer_args(parser, lr=None, weight_decay=0.0,
                       lr_help=f"peak learning rate (default {ADAM_LR} for the Adam family "
                               f"and Adafactor, {SGD_LR} for sgdm and sgdm_4bit)")
  return parser


def settings_from_args(args) -> DigitsSettings:
  return DigitsSettings(steps=args.steps, batch_size=args.batch_size, model=args.model,
                        hidden=args.hidden, warmup_steps=args.warmup_steps,
                        eval_every=args.eval_every, seed=args.seed)


def make_model(s: DigitsSettings) -> nnx.Module:
  rngs = nnx.Rngs(s.seed)
  if s.model == "cnn":
    return C.CNN(rngs=rngs)
  return C.MLP(hidden=s.hidden, rngs=rngs)


def run_digits(s: DigitsSettings, opt: C.OptimizerConfig, data, *, progress: bool = True,
               desc: str = "") -> dict:
  """Trains one classifier; returns the JSON-ready result."""
  (x_train, y_train), (x_val, y_val) = data
  trainer = C.Trainer(make_model(s), C.make_optimizer(opt))
  batches = C.classification_batches(x_train, y_train, s.batch_size, s.seed)
  every = max(1, s.eval_every)
  points = set(range(every, s.steps, every)) | {s.steps}
  loss0, acc0 = trainer.evaluate(x_val, y_val, 512)
  val_loss, val_acc = [(0, loss0)], [(0, acc0)]
  train_curve, step_times = [], []
  bar = tqdm(range(1, s.steps + 1), desc=desc or opt.label(), disable=not progress,
             dynamic_ncols=True, leave=False)
  for step in bar:
    x, y = next(batches)
    start = C.now()
    loss = trainer.step(x, y)
    step_times.append(C.now() - start)
    train_curve.append((step, loss))
    if step in points:
      vl, va = trainer.evaluate(x_val, y_val, 512)
      val_loss.append((step, vl))
      val_acc.append((step, va))
      bar.set_postfix(loss=f"{loss:.3f}", acc=f"{100 * va:.2f}%")
  bar.close()
  losses = [v for _, v in train_curve]
  return {
      "task": "digits",
      "optimizer": opt.label(),
      "settings": dataclasses.asdict(s),
      "optimizer_config": dataclasses.asdict(opt),
      **trainer.state_stats(),
      "final_val_accuracy": val_acc[-1][1],
      "final_val_loss": val_loss[-1][1],
      "val_accuracy": val_acc,
      "val_loss": val_loss,
      "train_loss": train_curve,
      "compile_and_first_step_s": step_times[0],
      "step_time_median_s": statistics.median(step_times[1:] or step_times),
      "spikes": C.count_spikes(losses),
      "diverged": C.diverged(losses, val_loss[-1][1], loss0),
  }


def main(argv=None) -> dict:
  args = build_parser().parse_args(argv)
  if args.lr is None:
    args.lr = C.default_lr(args.optimizer, ADAM_LR, SGD_LR)
  s = settings_from_args(args)
  opt = C.optimizer_config(args, total_steps=s.steps, warmup_steps=s.warmup_steps, seed=s.seed)
  C.make_optimizer(opt)  # fail early on a bad configuration
  result = run_digits(s, opt, C.load_digits_split(), progress=not args.no_progress)
  stem = os.path.join(args.out_dir, f"{C.slug(opt.label())}_{s.model}_seed{s.seed}")
  result["json"] = stem + ".json"
  C.save_json(stem + ".json", result)
  if not args.no_plot:
    result["png"] = stem + ".png"
    C.plot_curves(stem + ".png", {opt.label(): {"train": result["train_loss"],
                                                  "val": result["val_loss"]}},
                  title=f"digits ({s.model}): {opt.label()}", ylabel="cross-entropy",
                  logy=True)
  print(f"{opt.label()}: validation accuracy {100 * result['final_val_accuracy']:.2f}% "
        f"(loss {result['final_val_loss']:.4f}), state "
        f"{result['state_bytes_per_param']:.3f} bytes/param ({result['params']:,} params), "
        f"step {1e3 * result['step_time_median_s']:.2f} ms -> {stem}.json")
  return result


if __name__ == "__main__":
  main()
