"""quantize_state on 8 virtual CPU devices; run by tests/test_quantize_state.py.

Uses the harness of tests/sharding_checks.py (``run_sharded``): the same
parameters, shardings and steps as the hand-written optimizers' checks, a
comparison with a single-device run, and the collectives of the compiled HLO.
Prints one ``RESULTS <json>`` line.
"""

from __future__ import annotations

import json
import sys
import traceback

from sharding_checks import run_sharded  # sets the 8-device XLA flag before JAX starts

import optax  # noqa: E402  (after the flag)

import optax4bit  # noqa: E402


def qs(inner_fn, **kwargs):
  return lambda chunk: optax4bit.quantize_state(inner_fn(), chunk_size=chunk, **kwargs)


CHECKS = {
    "adam_explicit": lambda: run_sharded("qs_adam", qs(lambda: optax.adamw(1e-3)), "explicit"),
    "adam_auto_wrapped": lambda: run_sharded("qs_adam", qs(lambda: optax.adamw(1e-3)), "auto"),
    # Deterministic rounding: stochastic rounding draws per shard.
    "lion_explicit": lambda: run_sharded(
        "qs_lion", qs(lambda: optax.lion(1e-3), spec_for={"mu": "B128/DE"}), "explicit"),
    "sgd_momentum_explicit": lambda: run_sharded(
        "qs_sgdm", qs(lambda: optax.sgd(1e-2, momentum=0.9)), "explicit"),
}


def main(names):
  results = {}
  for name in names or CHECKS:
    try:
      results[name] = {"ok": True, "value": CHECKS[name]()}
    except Exception:  # pylint: disable=broad-except
      results[name] = {"ok": False, "error": traceback.format_exc()}
  print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
  main(sys.argv[1:])
