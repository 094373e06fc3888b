"""Step time of the jitted, donated optimizer update on CPU, as a ratio to
``optax.adamw`` measured in the same run.

For each optimizer the step ``updates, state = tx.update(grads, state, params);
params = optax.apply_updates(params, updates)`` is jitted with params and state
donated; steps of all optimizers are interleaved round by round so that
machine noise hits them alike, and the median per optimizer is reported.

    python benchmarks/optimizer_speed.py                 # SPEC tree: 4 x 2048x2048
    python benchmarks/optimizer_speed.py --tree gpt124m  # GPT-like, 124M params
    python benchmarks/optimizer_speed.py --donate-grads  # gradients consumed too

By default the gradients are a jit input that is not donated. The 4-bit
optimizers write each leaf's update over its gradient (to keep transient
memory flat), so XLA then copies every gradient first; in a training step the
gradients are intermediates and no copy is made. ``--donate-grads`` models
that: every optimizer gets fresh gradient buffers each step (copied outside the
timed region) and may reuse them.
"""

from __future__ import annotations

import argparse
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax4bit
from optimizer_memory import CONFIGS, gpt_params

OPTIMIZERS = {
    "optax.adamw": lambda: optax.adamw(1e-3),
    "adamw_4bit": lambda: optax4bit.adamw_4bit(1e-3),
    # The jnp engine; "adamw_4bit" runs the C++ kernel on CPU where it is built.
    "adamw_4bit (jnp)": lambda: optax4bit.adamw_4bit(1e-3, implementation="jnp"),
    "adamw_4bit_factor": lambda: optax4bit.adamw_4bit_factor(1e-3),
    "adamw_8bit": lambda: optax4bit.adamw_8bit(1e-3),
    "optax.sgd(momentum)": lambda: optax.sgd(1e-3, 0.9),
    "sgdm_4bit": lambda: optax4bit.sgdm_4bit(1e-3),
}


def make_tree(name: str) -> dict:
  if name == "spec":
    shapes = {f"w{i}": (2048, 2048) for i in range(4)}
  else:
    shapes = {"/".join(map(str, path)): leaf.shape for path, leaf in
              jax.tree_util.tree_flatten_with_path(gpt_params(**CONFIGS["124M"]))[0]}
  keys = jax.random.split(jax.random.PRNGKey(0), len(shapes))
  return {k: 0.02 * jax.random.normal(key, s) for key, (k, s) in zip(keys, shapes.items())}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tree", default="spec", choices=["spec", "gpt124m"])
  parser.add_argument("--rounds", type=int, default=9)
  parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=list(OPTIMIZERS))
  parser.add_argument("--donate-grads", action="store_true",
                      help="donate the gradients too, as intermediates of a training step")
  args = parser.parse_args(argv)
  donate = (0, 1, 2) if args.donate_grads else (0, 1)
  params = make_tree(args.tree)
  grads = jax.tree.map(lambda p: 0.1 * p + 0.01, params)

  def fresh_grads():
    if not args.donate_grads:
      return grads
    return jax.block_until_ready(jax.tree.map(jnp.copy, grads))
  num_params = sum(math.prod(p.shape) for p in jax.tree.leaves(params))
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, tree {args.tree}: "
        f"{num_params / 1e6:.1f}M params, gradients "
        f"{'donated' if args.donate_grads else 'not donated'}")
  runs = {}
  for name in args.optimizers:
    tx = OPTIMIZERS[name]()

    def step(p, s, g, tx=tx):
      updates, s = tx.update(g, s, p)
      return optax.apply_updates(p, updates), s

    p = jax.tree.map(jnp.copy, params)
    s = tx.init(p)
    compiled = jax.jit(step, donate_argnums=donate).lower(p, s, grads).compile()
    p, s = compiled(p, s, fresh_grads())  # warm-up
    jax.block_until_ready(p)
    runs[name] = [compiled, p, s, []]
  for _ in range(args.rounds):
    for name, run in runs.items():
      compiled, p, s, times = run
      g = fresh_grads()
      start = time.perf_counter()
      p, s = compiled(p, s, g)
      jax.block_until_ready((p, s))
      times.append(time.perf_counter() - start)
      run[1], run[2] = p, s
  base = np.median(runs["optax.adamw"][3]) if "optax.adamw" in runs else None
  print("| optimizer | median ms/step | ratio to optax.adamw |")
  print("|---|---|---|")
  for name, (_, _, _, times) in runs.items():
    ms = np.median(times) * 1e3
    ratio = f"{np.median(times) / base:.2f}" if base else "-"
    print(f"| {name} | {ms:.1f} | {ratio} |")


if __name__ == "__main__":
  main()
