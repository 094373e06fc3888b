"""Optimizer state bytes/param and transient memory of the jitted update.

Builds GPT-like parameter trees from shapes only (nothing is allocated) and
compiles, for each optimizer, a train step whose gradients come from matmuls
(as in a backward pass):

    grads = jax.grad(loss)(params, batch)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)

jitted with params and state donated. ``memory_analysis().temp_size_in_bytes``
of that step minus the same step with ``optax.sgd`` (whose temporaries are
just the gradients) is the transient memory the optimizer adds (SPEC.md 4).
The raw ``temp_size_in_bytes`` of ``jax.jit(tx.update)`` alone is printed too,
twice: with the gradients and state donated (the jitted, donated update), and
with only the state donated, where the gradients are a read-only input that an
update working in place of the gradient must copy first. State bytes come from
``jax.eval_shape(tx.init, params)``.

    python benchmarks/optimizer_memory.py
"""

from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp
import optax

import optax4bit

MiB = 2**20


def gpt_params(vocab: int, width: int, depth: int, dtype=jnp.float32) -> dict:
  """Shapes of a GPT-2-like decoder (tied embedding, no biases on matmuls)."""
  s = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)
  params = {"embed": s(vocab, width), "pos_embed": s(1024, width), "final_norm": s(width)}
  for i in range(depth):
    params[f"layer{i:02d}"] = {
        "attn_norm": s(width), "qkv": s(width, 3 * width), "attn_out": s(width, width),
        "mlp_norm": s(width), "mlp_in": s(width, 4 * width), "mlp_out": s(4 * width, width),
    }
  return params


CONFIGS = {
    "25M": dict(vocab=16384, width=512, depth=6),
    "124M": dict(vocab=50304, width=768, depth=12),
}

OPTIMIZERS = {
    "optax.adamw": lambda: optax.adamw(1e-3),
    "adamw_8bit": lambda: optax4bit.adamw_8bit(1e-3),
    "adamw_4bit": lambda: optax4bit.adamw_4bit(1e-3),
    "adamw_4bit_factor": lambda: optax4bit.adamw_4bit_factor(1e-3),
    "sgdm_4bit": lambda: optax4bit.sgdm_4bit(1e-3),
}


BATCH = jax.ShapeDtypeStruct((8, 4096), jnp.float32)


def loss(params, batch):
  """Every 2-D leaf gets a dense gradient from a matmul, as in a backward pass."""
  total = 0.0
  for p in jax.tree.leaves(params):
    if p.ndim == 2:
      reps = -(-p.shape[0] // batch.shape[1])
      x = jnp.tile(batch, (1, reps))[:, :p.shape[0]]
      total = total + jnp.sum(jnp.tanh(x @ p))
    else:
      total = total + jnp.sum(p * p)
  return total


def train_step_temp(tx, params) -> float:
  state = jax.eval_shape(tx.init, params)

  def step(params, state, batch):
    grads = jax.grad(loss)(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, BATCH).compile()
  return compiled.memory_analysis().temp_size_in_bytes / MiB


def update_only_temp(tx, params, donate_grads: bool) -> float:
  state = jax.eval_shape(tx.init, params)
  donate = (0, 1) if donate_grads else 1
  compiled = jax.jit(tx.update, donate_argnums=donate).lower(params, state, params).compile()
  return compiled.memory_analysis().temp_size_in_bytes / MiB


def measure(tx, params, sgd_temp: float) -> tuple[float, float, float, float]:
  """(state bytes/param, train-step temp over SGD, update-only temp with donated
  gradients, update-only temp with read-only gradients), temps in MiB."""
  num_params = sum(math.prod(p.shape) for p in jax.tree.leaves(params))
  state = jax.eval_shape(tx.init, params)
  return (optax4bit.state_nbytes(state) / num_params, train_step_temp(tx, params) - sgd_temp,
          update_only_temp(tx, params, True), update_only_temp(tx, params, False))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
  parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=list(OPTIMIZERS))
  args = parser.parse_args(argv)
  print(f"jax {jax.__version__}, backend {jax.default_backend()}")
  header = "| optimizer | " + " | ".join(
      f"{c} state bytes/param | {c} step temp over SGD (MiB) | {c} donated update temp (MiB)"
      f" | {c} update temp, read-only grads (MiB)" for c in args.configs) + " |"
  print(header)
  print("|" + "---|" * (1 + 4 * len(args.configs)))
  sizes = {c: sum(math.prod(p.shape) for p in jax.tree.leaves(gpt_params(**CONFIGS[c])))
           for c in args.configs}
  sgd_temps = {c: train_step_temp(optax.sgd(1e-3), gpt_params(**CONFIGS[c])) for c in args.configs}
  for name in args.optimizers:
    cells = []
    for config in args.configs:
      per_param, *temps = measure(OPTIMIZERS[name](), gpt_params(**CONFIGS[config]),
                                  sgd_temps[config])
      cells += [f"{per_param:.3f}"] + [f"{t:.1f}" for t in temps]
    print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
  print("SGD train-step temp (the gradients): " + ", ".join(
      f"{c} = {t:.1f} MiB" for c, t in sgd_temps.items()))
  print("params: " + ", ".join(f"{c} = {n / 1e6:.1f}M" for c, n in sizes.items()))


if __name__ == "__main__":
  main()
