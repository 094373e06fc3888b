"""optax.contrib optimizers wrapped by `optax4bit.quantize_state`, paired
against the same optimizer in float32 on the least-squares problem of issue 14
(``mean((W @ T - T)**2)``, W, T 256x256, ``W ~ 0.02 N(0, 1)``, full batch,
200 steps): loss ratio to float32 for both recipes, mean and range over seeds,
the state bytes per parameter (float32 and wrapped, default recipe) and
whether the wrapper ran per leaf or fell back to the whole tree.

    python benchmarks/quantize_state_contrib.py
"""

from __future__ import annotations

import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax4bit

contrib = optax.contrib
# name -> (optimizer factory, extra update arguments from (loss_fn, loss value))
OPTIMIZERS = {
    "adopt": (lambda: contrib.adopt(1e-3), None),
    "schedule_free_adamw": (lambda: contrib.schedule_free_adamw(1e-3), None),
    "prodigy": (lambda: contrib.prodigy(1.0), None),
    "dadapt_adamw": (lambda: contrib.dadapt_adamw(1.0), None),
    "mechanize(adam)": (lambda: contrib.mechanize(optax.adam(1e-3)), None),
    "momo_adam": (lambda: contrib.momo_adam(1e-2), lambda loss_fn, value: {"value": value}),
    "sophia": (lambda: contrib.sophia(1e-3), lambda loss_fn, value: {"obj_fn": loss_fn}),
    "muon": (lambda: contrib.muon(3e-2), None),
    # GaLore's Adam moments live in the projected (rank, 256) space.
    "galore (rank 32)": (lambda: contrib.galore(1e-2, rank=32, update_proj_gap=50), None),
    "galore (rank 128)": (lambda: contrib.galore(1e-2, rank=128, update_proj_gap=50), None),
}


def least_squares(tx, seed: int, extra=None, steps: int = 200) -> float:
  k1, k2 = jax.random.split(jax.random.key(seed))
  params = {"w": 0.02 * jax.random.normal(k1, (256, 256))}
  target = jax.random.normal(k2, (256, 256))

  def loss(p):
    return jnp.mean((p["w"] @ target - target) ** 2)

  def step(carry, _):
    p, state = carry
    value, grads = jax.value_and_grad(loss)(p)
    kwargs = extra(loss, value) if extra else {}
    updates, state = tx.update(grads, state, p, **kwargs)
    return (optax.apply_updates(p, updates), state), None

  (params, _), _ = jax.jit(lambda c: jax.lax.scan(step, c, None, length=steps))(
      (params, tx.init(params)))
  return float(loss(params))


def main():
  seeds = [0, 1, 2]
  print(f"jax {jax.__version__}, optax {optax.__version__}, {os.cpu_count()} CPUs; "
        f"seeds {seeds}")
  print("| optimizer | fp32 loss | 4-bit, recipe='default' | 4-bit, recipe='paper' "
        "| state B/param, fp32 -> 4-bit | runs |")
  print("|---|---|---|---|---|---|")
  for name, (make, extra) in OPTIMIZERS.items():
    fp32 = np.array([least_squares(make(), s, extra) for s in seeds])
    cells, mode = [], "per leaf"
    for recipe in ("default", "paper"):
      with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = np.array([least_squares(optax4bit.quantize_state(make(), recipe=recipe), s, extra)
                        for s in seeds])
      if any("not leaf-separable" in str(w.message) for w in caught):
        mode = "whole tree (not leaf-separable)"
      ratio = got / fp32
      cells.append(f"{ratio.mean():.2f} [{ratio.min():.2f}, {ratio.max():.2f}]")
    params = {"w": jnp.zeros((256, 256))}
    nbytes = [optax4bit.state_nbytes(jax.eval_shape(tx.init, params)) / 256**2
              for tx in (make(), optax4bit.quantize_state(make()))]
    print(f"| {name} | {fp32.mean():.3g} | {cells[0]} | {cells[1]} "
          f"| {nbytes[0]:.2f} -> {nbytes[1]:.2f} | {mode} |", flush=True)


if __name__ == "__main__":
  main()
