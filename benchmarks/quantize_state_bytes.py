"""quantize_state: state bytes/param, transient memory, and convergence.

Three tables for benchmarks/history/log-to-2026-11.md ("quantize_state: state bytes per
parameter"):

1. State bytes per parameter of optax optimizers wrapped with
   ``optax4bit.quantize_state`` (and the presets), next to the float32 originals
   and the hand-written 4-bit optimizers, on GPT-2-like parameter shapes (the
   shapes of benchmarks/optimizer_memory.py; nothing is allocated: bytes come
   from ``jax.eval_shape(tx.init, params)``).
2. Transient memory of the jitted update (``temp_size_in_bytes`` of
   ``updates, state = tx.update(grads, state, params); params += updates``
   with params, state and grads donated, as in optimizer_memory.py) for
   ``quantize_state(optax.adam)`` vs ``adam_4bit`` vs ``optax.adam`` at two
   model sizes.
3. Convergence of ``quantize_state(optax.lion / optax.sgd(momentum=0.9) /
   optax.adafactor(momentum=0.9))`` on a parabola, 16 Rosenbrock functions and
   a matrix least-squares problem (every state leaf quantized,
   ``min_quantize_size=0``), as final loss / initial loss, float32 vs 4-bit;
   and Lion's momentum with round-to-nearest vs stochastic rounding.

Usage:
  python benchmarks/quantize_state_bytes.py                 # all three tables
  python benchmarks/quantize_state_bytes.py --tables bytes convergence
  python benchmarks/quantize_state_bytes.py --configs 25M  # temp memory, smaller model only
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
import warnings

import jax
import optax

# Run from a checkout without installing: `python benchmarks/quantize_state_bytes.py`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import optax4bit  # pylint: disable=wrong-import-position
from optax4bit import QuantSpec  # pylint: disable=wrong-import-position

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from optimizer_memory import CONFIGS, gpt_params  # pylint: disable=wrong-import-position

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
# pylint: disable-next=wrong-import-position
from test_quantize_state import minimize, problems as _test_problems

_DISPLAY_NAMES = {"parabola": "parabola", "rosenbrock": "Rosenbrock",
                  "least_squares": "least squares"}

MiB = 2**20


qs = optax4bit.quantize_state
# (label, float32 original, 4-bit version(s)).
BYTES_ROWS = [
    ("adam", lambda: optax.adam(1e-3), [
        ("quantize_state(optax.adam)", lambda: qs(optax.adam(1e-3))),
        ("adam_4bit (hand-written)", lambda: optax4bit.adam_4bit(1e-3))]),
    ("lion", lambda: optax.lion(1e-4), [
        ("quantize_state(optax.lion) = lion_4bit", lambda: optax4bit.lion_4bit(1e-4))]),
    ("sgd momentum 0.9", lambda: optax.sgd(1e-2, momentum=0.9), [
        ("quantize_state(optax.sgd(momentum=0.9))", lambda: qs(optax.sgd(1e-2, momentum=0.9))),
        ("sgdm_4bit (hand-written)", lambda: optax4bit.sgdm_4bit(1e-2))]),
    ("adafactor momentum 0.9", lambda: optax.adafactor(1e-3, momentum=0.9), [
        ("quantize_state(optax.adafactor(momentum=0.9))",
         lambda: qs(optax.adafactor(1e-3, momentum=0.9)))]),
    ("AdEMAMix", lambda: optax.contrib.ademamix(1e-3), [
        ("ademamix_4bit", lambda: optax4bit.ademamix_4bit(1e-3))]),
]


def num_params(params) -> int:
  return sum(math.prod(p.shape) for p in jax.tree.leaves(params))


def bytes_per_param(tx, params) -> float:
  return optax4bit.state_nbytes(jax.eval_shape(tx.init, params)) / num_params(params)


def table_bytes(configs):
  print("\n### State bytes per parameter\n")
  print("| optimizer | " + " | ".join(f"{c} ({num_params(gpt_params(**CONFIGS[c])) / 1e6:.1f}M)"
                                       for c in configs) + " |")
  print("|---|" + "---|" * len(configs))
  for label, fp32, quantized in BYTES_ROWS:
    rows = [(f"`{label}` float32", fp32)] + [(f"`{name}`", make) for name, make in quantized]
    for name, make in rows:
      cells = [f"{bytes_per_param(make(), gpt_params(**CONFIGS[c])):.3f}" for c in configs]
      print(f"| {name} | " + " | ".join(cells) + " |")


def update_temp_mib(tx, params) -> float:
  state = jax.eval_shape(tx.init, params)

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Some donated buffers were not usable"
    compiled = jax.jit(step, donate_argnums=(0, 1, 2)).lower(params, state, params).compile()
  return compiled.memory_analysis().temp_size_in_bytes / MiB


TEMP_ROWS = [
    ("`optax.adam`", lambda: optax.adam(1e-3)),
    ("`quantize_state(optax.adam)`", lambda: qs(optax.adam(1e-3))),
    ("`adam_4bit` (hand-written)", lambda: optax4bit.adam_4bit(1e-3)),
]


def table_temp(configs):
  print("\n### Transient memory of the jitted update (temp_size_in_bytes, MiB)\n")
  largest = {c: max(math.prod(p.shape) for p in jax.tree.leaves(gpt_params(**CONFIGS[c])))
             for c in configs}
  print("| optimizer | " + " | ".join(
      f"{c} (largest leaf {largest[c] * 4 / MiB:.0f} MiB fp32)" for c in configs) + " |")
  print("|---|" + "---|" * len(configs))
  for name, make in TEMP_ROWS:
    cells = []
    for c in configs:
      start = time.time()
      temp = update_temp_mib(make(), gpt_params(**CONFIGS[c]))
      cells.append(f"{temp:.1f}")
      print(f"  ({name} {c}: compiled in {time.time() - start:.0f}s)", file=sys.stderr)
    print(f"| {name} | " + " | ".join(cells) + " |")


# ----------------------------------------------------------------------------
# Convergence (the problems of tests/test_quantize_state.py).


def problems():
  """The convergence problems of tests/test_quantize_state.py, with display names."""
  losses, start = _test_problems()
  return {_DISPLAY_NAMES[name]: f for name, f in losses.items()}, start


def final_ratios(tx, steps):
  losses, start = problems()
  final = minimize(tx, losses, start, tx.init(start), steps)
  return {name: float(f(final)) / float(f(start)) for name, f in losses.items()}


def table_convergence(steps):
  sched = lambda lr: optax.cosine_decay_schedule(lr, steps)  # noqa: E731
  rows = [
      ("lion, lr 1e-2", lambda: optax.lion(sched(1e-2), weight_decay=0.0), {}),
      ("sgd, momentum 0.9, lr 1e-3", lambda: optax.sgd(sched(1e-3), momentum=0.9), {}),
      ("adafactor, momentum 0.9, lr 3e-2", lambda: optax.adafactor(
          sched(3e-2), momentum=0.9, multiply_by_parameter_scale=False,
          clipping_threshold=None), {}),
  ]
  names = list(problems()[0])
  print(f"\n### Convergence: final loss / initial loss after {steps} steps "
        "(cosine-decayed learning rate, every state leaf quantized)\n")
  print("| optimizer | state | " + " | ".join(names) + " |")
  print("|---|---|" + "---|" * len(names))

  def row(label, state, tx):
    r = final_ratios(tx, steps)
    print(f"| {label} | {state} | " + " | ".join(f"{r[n]:.1e}" for n in names) + " |")

  for label, make, _ in rows:
    row(label, "float32", make())
    row(label, "4-bit (`quantize_state` default)", qs(make(), min_quantize_size=0))
  lion = rows[0][1]
  row("lion, lr 1e-2", "4-bit, momentum `B128/DE` round-to-nearest",
      qs(lion(), min_quantize_size=0, spec_for={"mu": "B128/DE"}))
  row("lion, lr 1e-2", "8-bit, momentum `B128/DE` round-to-nearest",
      qs(lion(), min_quantize_size=0, spec_for={"mu": QuantSpec.parse("B128/DE", bits=8)}))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tables", nargs="+", default=["bytes", "temp", "convergence"],
                      choices=["bytes", "temp", "convergence"])
  parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
  parser.add_argument("--steps", type=int, default=1000)
  args = parser.parse_args(argv)
  print(f"jax {jax.__version__}, optax {optax.__version__}, backend {jax.default_backend()}, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
  if "bytes" in args.tables:
    table_bytes(args.configs)
  if "temp" in args.tables:
    table_temp(args.configs)
  if "convergence" in args.tables:
    table_convergence(args.steps)


if __name__ == "__main__":
  main()
