"""4-bit Muon (`optax4bit.muon_4bit`) against fp32 Muon (`optax.contrib.muon`).

Two problems, paired (same init and data order per seed):

* the least-squares problem of issue 14, ``mean((W @ T - T)**2)`` with W, T
  256x256, ``W ~ 0.02 N(0, 1)``, full batch, 200 steps, over a learning-rate
  sweep; ratios of the final loss to fp32 Muon's, per quantizer of the
  momentum (4-bit and 8-bit);
* why: the momentum of fp32 Muon at steps 50 and 199 (lr 1e-2, seed 0),
  quantized by each quantizer: relative error and the error of the
  Newton-Schulz output against fp32's; and how much white noise on its
  momentum fp32 Muon tolerates (an idealized quantizer's error);
* the byte-level transformer LM of benchmarks/quality.py's ablation
  configuration (examples/compare.py defaults): validation loss and state
  bytes, Muon's rate for the matrices, a tenth of it for Adam's part.

    python benchmarks/muon.py            # both
    python benchmarks/muon.py --quick    # fewer seeds and steps
    python benchmarks/muon.py --skip-lm  # least squares only
    python benchmarks/muon.py --noise-only  # the noise-tolerance table alone
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import _common as C  # noqa: E402  pylint: disable=wrong-import-position
import compare  # noqa: E402  pylint: disable=wrong-import-position
import train_lm  # noqa: E402  pylint: disable=wrong-import-position

import optax4bit  # noqa: E402  pylint: disable=wrong-import-position
from quantize_state_contrib import least_squares  # noqa: E402  pylint: disable=wrong-import-position

Q = optax4bit.QuantSpec
# name -> momentum quantizer: "B32/NF sr" is muon_4bit's 4-bit option (MUON_MOMENTUM), the
# last its default since issue 36, the 8-bit MUON_MOMENTUM_8BIT (its LM row: muon_4bit).
MOMENTA = {
    "B128/NF sr": Q("block", "NF", 4, signed=True, block_size=128, stochastic=True),
    "B32/NF sr": optax4bit.presets.MUON_MOMENTUM,
    "B32/NF nearest": Q("block", "NF", 4, signed=True, block_size=32),
    "B32/DE sr": Q("block", "DE", 4, signed=True, block_size=32, stochastic=True),
    "B8/NF sr": Q("block", "NF", 4, signed=True, block_size=8, stochastic=True),
    "8-bit B256/DE sr": Q("block", "DE", 8, signed=True, block_size=256, stochastic=True),
    "8-bit B256/DE nearest": Q("block", "DE", 8, signed=True, block_size=256),
    "8-bit B2048/DE nearest": optax4bit.presets.MUON_MOMENTUM_8BIT,
}


def nbytes_per_param(spec) -> float:
  state = optax4bit.muon_4bit(1e-2, min_quantize_size=0, spec_for={"MuonState.mu": spec}).init(
      {"w": jnp.zeros((256, 256))})
  return optax4bit.state_nbytes(state) / 256**2


def least_squares_table(seeds: list, lrs: list, nesterov: bool = True) -> str:
  rows = ["| lr | fp32 Muon loss | " + " | ".join(
      f"{n} ({nbytes_per_param(s):.3f} B)" for n, s in MOMENTA.items()) + " |",
      "|---" * (2 + len(MOMENTA)) + "|"]
  for lr in lrs:
    fp32 = np.array([least_squares(optax.contrib.muon(lr, nesterov=nesterov), s) for s in seeds])
    cells = []
    for spec in MOMENTA.values():
      tx = lambda: optax4bit.muon_4bit(lr, nesterov=nesterov, min_quantize_size=0,  # noqa: E731
                                       spec_for={"MuonState.mu": spec})
      ratio = np.array([least_squares(tx(), s) for s in seeds]) / fp32
      cells.append(f"{ratio.mean():.2f} [{ratio.min():.2f}, {ratio.max():.2f}]")
    rows.append(f"| {lr:g} | {fp32.mean():.3g} | " + " | ".join(cells) + " |")
    print(rows[-1], flush=True)
  return "\n".join(rows)


def newton_schulz_error_table(lr: float = 1e-2, steps=(50, 199)) -> str:
  """Relative error of each quantizer on fp32 Muon's momentum, and of the
  Newton-Schulz output of the quantized momentum against fp32's."""
  ns_fn = optax.contrib._muon.orthogonalize_via_newton_schulz  # pylint: disable=protected-access
  coeffs = jnp.asarray((3.4445, -4.775, 2.0315))
  k1, k2 = jax.random.split(jax.random.key(0))
  params = {"w": 0.02 * jax.random.normal(k1, (256, 256))}
  target = jax.random.normal(k2, (256, 256))
  tx = optax.contrib.muon(lr)

  @jax.jit
  def step(p, state):
    grads = jax.grad(lambda p: jnp.mean((p["w"] @ target - target) ** 2))(p)
    updates, state = tx.update(grads, state, p)
    return optax.apply_updates(p, updates), state

  state, snaps = tx.init(params), {}
  for t in range(max(steps) + 1):
    params, state = step(params, state)
    if t in steps:
      snaps[t] = next(x for x in jax.tree.leaves(state) if getattr(x, "shape", ()) == (256, 256))
  rows = ["| momentum | " + " | ".join(f"step {t}: rel. error / NS error" for t in steps) + " |",
          "|---" * (1 + len(steps)) + "|"]
  for name, spec in MOMENTA.items():
    cells = []
    for t in steps:
      m = snaps[t]
      mq = optax4bit.quant.dequantize(optax4bit.quant.quantize(m, spec, key=jax.random.key(t)))
      ref = ns_fn(m, coeffs, 5)
      cells.append(f"{float(jnp.linalg.norm(mq - m) / jnp.linalg.norm(m)):.3f} / "
                   f"{float(jnp.linalg.norm(ns_fn(mq, coeffs, 5) - ref) / jnp.linalg.norm(ref)):.2f}")
    rows.append(f"| {name} | " + " | ".join(cells) + " |")
  return "\n".join(rows)


def accumulated_error_table(lr: float = 1e-2, steps=(50, 199)) -> str:
  """Error of the momentum that each quantized Muon stores against the exact
  EMA of the same gradients (an fp32 shadow), and of its Newton-Schulz
  output: rounding errors of earlier steps included (seed 0)."""
  ns_fn = optax.contrib._muon.orthogonalize_via_newton_schulz  # pylint: disable=protected-access
  ns = lambda x: ns_fn(x, jnp.asarray((3.4445, -4.775, 2.0315)), 5)  # noqa: E731
  k1, k2 = jax.random.split(jax.random.key(0))
  w0 = 0.02 * jax.random.normal(k1, (256, 256))
  target = jax.random.normal(k2, (256, 256))
  is_q = lambda x: isinstance(x, optax4bit.QuantizedArray)  # noqa: E731
  rows = ["| momentum | " + " | ".join(f"step {t}: rel. error / NS error" for t in steps) + " |",
          "|---" * (1 + len(steps)) + "|"]
  for name, spec in MOMENTA.items():
    tx = optax4bit.muon_4bit(lr, min_quantize_size=0, spec_for={"MuonState.mu": spec})

    @jax.jit
    def step(p, state, shadow, tx=tx):
      grads = jax.grad(lambda p: jnp.mean((p["w"] @ target - target) ** 2))(p)
      updates, state = tx.update(grads, state, p)
      return optax.apply_updates(p, updates), state, 0.95 * shadow + 0.05 * grads["w"]

    params, shadow = {"w": w0}, jnp.zeros((256, 256))
    state, cells = tx.init(params), []
    for t in range(max(steps) + 1):
      params, state, shadow = step(params, state, shadow)
      if t in steps:
        stored = next(optax4bit.quant.dequantize(x) for x in jax.tree.leaves(state, is_leaf=is_q)
                      if is_q(x) and x.shape == (256, 256))
        cells.append(
            f"{float(jnp.linalg.norm(stored - shadow) / jnp.linalg.norm(shadow)):.3f} / "
            f"{float(jnp.linalg.norm(ns(stored) - ns(shadow)) / jnp.linalg.norm(ns(shadow))):.2f}")
    rows.append(f"| {name} | " + " | ".join(cells) + " |")
  return "\n".join(rows)


def with_momentum_noise(tx: optax.GradientTransformation, relative: float, seed: int = 7):
  """``tx`` (a Muon) whose stored momentum of every 256x256 leaf gets white
  Gaussian noise of ``relative * |m|_F`` after each step: an idealized
  quantizer with that relative error, independent of the momentum."""
  def init_fn(params):
    return tx.init(params), jax.random.key(seed)

  def update_fn(updates, state, params=None):
    inner, key = state
    updates, inner = tx.update(updates, inner, params)
    key, step_key = jax.random.split(key)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(inner)
    noisy = []
    for i, (path, x) in enumerate(leaves):
      if "mu" in jax.tree_util.keystr(path) and getattr(x, "shape", ()) == (256, 256):
        noise = jax.random.normal(jax.random.fold_in(step_key, i), x.shape)
        x = x + relative * jnp.linalg.norm(x) / np.sqrt(x.size) * noise
      noisy.append(x)
    return updates, (treedef.unflatten(noisy), key)

  return optax.GradientTransformation(init_fn, update_fn)


def noise_tolerance_table(seeds: list, lrs: list,
                          levels=(0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.2)) -> str:
  """Loss ratio to fp32 Muon when its momentum carries white noise of each
  relative size every step: the error a momentum quantizer may make."""
  rows = ["| lr | " + " | ".join(f"{100 * r:g}% noise" for r in levels) + " |",
          "|---" * (1 + len(levels)) + "|"]
  for lr in lrs:
    fp32 = np.array([least_squares(optax.contrib.muon(lr), s) for s in seeds])
    cells = []
    for r in levels:
      ratio = np.array([least_squares(with_momentum_noise(optax.contrib.muon(lr), r), s)
                        for s in seeds]) / fp32
      cells.append(f"{ratio.mean():.2f} [{ratio.min():.2f}, {ratio.max():.2f}]")
    rows.append(f"| {lr:g} | " + " | ".join(cells) + " |")
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
  parser.add_argument("--noise-only", action="store_true")
  args = parser.parse_args(argv)
  seeds = [0, 1] if args.quick else [0, 1, 2]
  print(f"jax {jax.__version__}, optax {optax.__version__}, {os.cpu_count()} CPUs")
  if args.noise_only:
    print(noise_tolerance_table(seeds, [1e-2, 3e-2]))
    return
  print(least_squares_table(seeds, [1e-2, 2e-2, 3e-2, 1e-1]))
  print("Nesterov off (fp32 Muon also without):")
  print(least_squares_table(seeds, [1e-2, 2e-2], nesterov=False))
  print(newton_schulz_error_table())
  print(accumulated_error_table())
  print("White noise on fp32 Muon's momentum:")
  print(noise_tolerance_table(seeds, [1e-2, 3e-2]))
  if not args.skip_lm:
    print(lm_table(seeds[:2], 300 if args.quick else 600, lr=2e-2))


if __name__ == "__main__":
  main()
