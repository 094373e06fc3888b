"""bfloat16 params on the paired LM of benchmarks/quality.py (issue 36).

Every variant starts from the same initialization and sees the same batches as
the reference of its group; each is reported by its PAIRED gap
``val_loss / val_loss_reference - 1`` per seed, mean +- std over seeds, at the
10 checkpoints of quality.py (so a gap growing with steps shows).

The LM, its data, schedule (warmup 100, cosine to 10%), clipping (1.0),
weight decay (0.01 on matrices) and evaluation are quality.py's ``lm``
problem, imported from it. bfloat16 variants store params and gradients in
bfloat16; the forward and backward run in float32 on the params upcast (so
the gap measures the storage and the rounding of the update only).

Groups:

* ``adamw`` (reference: ``optax.adamw``, float32 params, lr 2e-3):
  ``adamw_4bit_bf16`` (stochastic rounding, the default),
  ``adamw_4bit_bf16_nearest`` (the control), ``adamw_4bit_factor_bf16``.
* ``muon`` (reference: ``optax.contrib.muon``, float32, lr 0.02 on the
  matrices, Adam at 2e-3 on the other leaves): ``muon_4bit`` (4-bit B32/NF
  momentum, the preset's default) and ``muon_8bit`` (``B2048/DE`` momentum,
  `optax4bit.presets.MUON_MOMENTUM_8BIT`), float32 params.

Each run is written as JSON to ``benchmarks/results/bf16_quality/`` as soon as
it ends (and reused by a later call unless ``--fresh``); the summary goes to
``benchmarks/results/bf16_quality.json`` and is printed as Markdown.

Usage:
  nice -n 10 python benchmarks/bf16_quality.py --seeds 0 1 2
  python benchmarks/bf16_quality.py --variants adamw adamw_4bit_bf16 --steps 200  # timing
  python benchmarks/bf16_quality.py --summarize   # tables from the runs written so far
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import quality  # noqa: E402  (the LM problem, its data and paired statistics)

C, optax4bit = quality.C, quality.optax4bit
RUNS = os.path.join(quality.RESULTS, "bf16_quality")
SUMMARY = os.path.join(quality.RESULTS, "bf16_quality.json")
MUON_LR = 0.02

# variant -> (group, param dtype); each group's reference is its first variant.
VARIANTS = {
    "adamw": ("adamw", jnp.float32),
    "adamw_4bit_bf16": ("adamw", jnp.bfloat16),
    "adamw_4bit_bf16_nearest": ("adamw", jnp.bfloat16),
    "adamw_4bit_factor_bf16": ("adamw", jnp.bfloat16),
    "muon": ("muon", jnp.float32),
    "muon_4bit": ("muon", jnp.float32),
    "muon_8bit": ("muon", jnp.float32),
}


def make_optimizer(variant: str, t: quality.Training, seed: int) -> optax.GradientTransformation:
  """The variant with quality.py's LM hyperparameters (schedule, decay mask,
  clipping); stochastic rounding seeded with ``seed``."""
  def schedule(peak):
    return C.schedule(C.OptimizerConfig(learning_rate=peak, total_steps=t.steps,
                                        warmup_steps=t.warmup_steps))

  lr, mask = schedule(t.learning_rate), C._decay_mask  # pylint: disable=protected-access
  common = dict(weight_decay=t.weight_decay, mask=mask, min_quantize_size=t.min_quantize_size,
                seed=seed)
  if variant == "adamw":
    tx = optax.adamw(lr, weight_decay=t.weight_decay, mask=mask)
  elif variant == "adamw_4bit_bf16":
    tx = optax4bit.adamw_4bit(lr, **common)
  elif variant == "adamw_4bit_bf16_nearest":
    tx = optax4bit.adamw_4bit(lr, **common, param_rounding="nearest")
  elif variant == "adamw_4bit_factor_bf16":
    tx = optax4bit.adamw_4bit_factor(lr, **common)
  else:
    muon = dict(weight_decay=t.weight_decay, weight_decay_mask=mask, adam_learning_rate=lr)
    if variant == "muon":
      tx = optax.contrib.muon(schedule(MUON_LR), **muon)
    else:
      spec_for = ({"MuonState.mu": optax4bit.presets.MUON_MOMENTUM_8BIT}
                  if variant == "muon_8bit" else None)
      tx = optax4bit.muon_4bit(schedule(MUON_LR), **muon, spec_for=spec_for,
                               min_quantize_size=t.min_quantize_size, seed=seed)
  return optax.chain(optax.clip_by_global_norm(t.clip_norm), tx)


def make_trainer(model, tx, param_dtype) -> C.Trainer:
  """quality.py's trainer; for bfloat16 its params (and so its gradients)
  are stored in bfloat16 and upcast to float32 for the forward pass."""
  trainer = C.Trainer(model, tx)
  if param_dtype == jnp.float32:
    return trainer
  graphdef = trainer.graphdef

  def cast(tree, dtype):
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating)
                        else x, tree)

  def logits_of(params, x):
    return C.nnx.merge(graphdef, cast(params, jnp.float32))(x)

  def step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(lambda p: C.cross_entropy(logits_of(p, x), y))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  def evaluate(params, x, y):
    logits = logits_of(params, x)
    return C.cross_entropy(logits, y), jnp.mean(jnp.argmax(logits, -1) == y)

  trainer.params = cast(trainer.params, param_dtype)
  trainer.opt_state = tx.init(trainer.params)
  trainer._step = jax.jit(step, donate_argnums=(0, 1))  # pylint: disable=protected-access
  trainer._eval = jax.jit(evaluate)  # pylint: disable=protected-access
  return trainer


def run(variant: str, t: quality.Training, seed: int, data, *, fresh: bool) -> dict:
  """One run, cached as JSON under `RUNS`."""
  train, val, corpus = data
  group, dtype = VARIANTS[variant]
  key = {"variant": variant, "group": group, "param_dtype": jnp.dtype(dtype).name,
         "training": dataclasses.asdict(t), "settings": quality.LM_MODEL, "seed": seed,
         "muon_lr": MUON_LR if group == "muon" else None, "corpus": corpus}
  if variant.startswith("adamw_4bit"):  # a change of the default recipe retrains
    key["quantizers"] = quality.variant_quantizers(
        "adamw_4bit_factor" if "factor" in variant else "adamw_4bit")
  path = os.path.join(RUNS, f"{variant}_steps{t.steps}_seed{seed}.json")

  def fresh_run():
    start = time.perf_counter()
    s = quality.lm_settings(t, seed)
    trainer = make_trainer(quality.train_lm.make_model(s), make_optimizer(variant, t, seed), dtype)
    x_val, y_val = C.lm_eval_windows(val, s.eval_windows, s.seq_len)
    out = quality.train_minibatch(
        trainer, C.lm_batches(train, s.batch_size, s.seq_len, seed), s.steps,
        quality.evaluation_points(s.steps),
        lambda: {"val_loss": trainer.evaluate(x_val, y_val, 32)[0]})
    out["param_dtypes"] = sorted({str(x.dtype) for x in jax.tree.leaves(trainer.params)})
    out["wall_s"] = time.perf_counter() - start
    return out

  result = C.run_cached(path, key, fresh_run, fresh=fresh)
  print(f"  {variant} seed {seed}: final val loss {result['metrics']['val_loss'][-1]:.4f} "
        f"({result.get('wall_s', 0):.0f} s)", flush=True)
  return result


def load_runs(steps: int) -> dict:
  """variant -> seed -> run, from the JSON files written so far."""
  found = {}
  for variant in VARIANTS:
    for name in sorted(os.listdir(RUNS)) if os.path.isdir(RUNS) else []:
      prefix = f"{variant}_steps{steps}_seed"
      if name.startswith(prefix) and name[len(prefix):-5].isdigit():
        with open(os.path.join(RUNS, name)) as f:
          saved = json.load(f)
        found.setdefault(variant, {})[int(name[len(prefix):-5])] = saved.get("result", saved)
  return found


def summarize(steps: int) -> dict:
  """Paired gaps (mean, std over the seeds both a variant and its reference
  have) at quality.py's checkpoints, as JSON and Markdown."""
  found = load_runs(steps)
  tables, summary = [], {}
  for group in dict.fromkeys(g for g, _ in VARIANTS.values()):
    names = [v for v, (g, _) in VARIANTS.items() if g == group and v in found]
    if not names or names[0] != group:
      continue
    ref = found[group]
    for variant in names[1:]:
      seeds = sorted(set(found[variant]) & set(ref))
      if not seeds:
        continue
      runs = {quality.REFERENCE: [ref[s] for s in seeds],
              variant: [found[variant][s] for s in seeds]}
      marks = quality.checkpoints(ref[seeds[0]]["steps"])
      table = quality.paired(runs, "val_loss", marks)[variant]
      gaps = {step: {"mean": cell["ratio"]["mean"] - 1, "std": cell["ratio"]["std"],
                     "per_seed": [r - 1 for r in cell["ratios"]]} for step, cell in table.items()}
      second_half = [g["mean"] for step, g in gaps.items() if step > steps // 2]
      summary[variant] = {"reference": group, "seeds": seeds, "gaps": gaps,
                          "mean_gap_second_half": float(np.mean(second_half)),
                          "final_val_loss": table[marks[-1]]["value"]["mean"]}
    if any(v in summary for v in names[1:]):
      header = "| variant vs " + group + " | seeds | " + " | ".join(
          str(s) for s in quality.checkpoints(ref[min(ref)]["steps"])) + " | mean, 2nd half |"
      lines = [header, "|---" * (header.count("|") - 1) + "|"]
      for variant in names[1:]:
        if variant in summary:
          s = summary[variant]
          cells = [f"{100 * g['mean']:+.2f}% ± {100 * g['std']:.2f}" for g in s["gaps"].values()]
          lines.append(f"| {variant} | {len(s['seeds'])} | " + " | ".join(cells)
                       + f" | {100 * s['mean_gap_second_half']:+.2f}% |")
      tables.append("\n".join(lines))
  markdown = "\n\n".join(tables)
  print(markdown)
  with open(SUMMARY, "w") as f:
    json.dump({"environment": quality.environment(), "steps": steps, "summary": summary,
               "markdown": markdown}, f, indent=1)
  return summary


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--steps", type=int, default=quality.PROBLEMS["lm"].training.steps)
  parser.add_argument("--fresh", action="store_true", help="retrain cached runs")
  parser.add_argument("--summarize", action="store_true", help="only the tables")
  args = parser.parse_args(argv)
  t = dataclasses.replace(quality.PROBLEMS["lm"].training, steps=args.steps)
  if not args.summarize:
    data = quality.load_data("lm")
    print(f"# bf16 quality, {args.steps} steps ({quality.environment()})", flush=True)
    # Seed-major: every group's reference and variants of a seed finish together.
    for seed in args.seeds:
      for variant in args.variants:
        run(variant, t, seed, data, fresh=args.fresh)
  return summarize(args.steps)


if __name__ == "__main__":
  main()
