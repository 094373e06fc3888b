"""Fingerprints of the compiled CPU update of several optimizers: a hash of
each optimized HLO module, its source-line metadata removed. Run it in two
trees (e.g. before and after a refactoring) and compare the JSON it prints:
equal hashes mean XLA compiles the same program, so step times cannot move
(the C++ kernel's own code aside).

Usage: python benchmarks/hlo_fingerprints.py > fingerprints.json
"""

from __future__ import annotations

import hashlib
import json
import re
import sys

import jax
import jax.numpy as jnp
import optax

import optax4bit

PARAMS = {"a": jnp.ones((256, 512)), "b": jnp.ones((3, 128, 256)), "c": jnp.ones((4096,)),
          "d": jnp.ones((130, 70))}
OPTIMIZERS = {
    "adamw_4bit": lambda i: optax4bit.adamw_4bit(1e-3, implementation=i),
    "adamw_4bit_paper": lambda i: optax4bit.adamw_4bit(1e-3, recipe="paper", implementation=i),
    "adamw_4bit_factor": lambda i: optax4bit.adamw_4bit_factor(1e-3, implementation=i),
    "sgdm_4bit": lambda i: optax4bit.sgdm_4bit(1e-3, implementation=i),
    "adamw_8bit": lambda i: optax4bit.adamw_8bit(1e-3, implementation=i),
    "quantize_state_adam": lambda i: optax4bit.quantize_state(optax.adam(1e-3), implementation=i),
    "lion_4bit": lambda i: optax4bit.lion_4bit(1e-3),
}


def fingerprints() -> dict:
  out = {}
  for name, make in OPTIMIZERS.items():
    for impl in ("auto", "jnp", "cpu"):
      if name.startswith(("quantize_state", "lion")) and impl == "cpu":
        continue  # quantize_state takes auto or jnp; lion_4bit has no implementation=
      tx = make(impl)
      state = tx.init(PARAMS)
      text = jax.jit(tx.update).lower(PARAMS, state, PARAMS).compile().as_text()
      text = re.sub(r", metadata=\{[^}]*\}", "", text)
      out[f"{name}/{impl}"] = hashlib.sha256(text.encode()).hexdigest()[:16]
  return out


if __name__ == "__main__":
  json.dump(fingerprints(), sys.stdout, indent=0, sort_keys=True)
