"""quantize_state on 8 virtual CPU devices; run by tests/test_quantize_state.py.

Uses the harness of tests/sharding_checks.py (``run_sharded``): the same
parameters, shardings and steps as the hand-written optimizers' checks, a
comparison with a single-device run, and the collectives of the compiled HLO.
Prints one ``RESULTS <json>`` line.
"""

from __future__ import annotations

import sys

# sharding_checks sets the 8-device XLA flag before JAX starts.
from sharding_checks import main as run_checks, run_sharded

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


if __name__ == "__main__":
  run_checks(sys.argv[1:], CHECKS)
