"""Golden states of the paper's and torchao's recipes, as SHA-256 digests.

tests/data/paper_recipe_golden.json was written by this script run against
optax4bit at commit 3d27fa7 (jnp implementation), before the default recipe
changed; `test_recipes.py` checks that today's library reproduces every array
bit for bit.

  python tests/paper_recipe_golden.py OUT.json     # write (used once)
"""

import hashlib
import json
import sys

import jax
import numpy as np
import optax4bit

SHAPES = {"mat": (64, 256), "vec": (5000,), "cube": (3, 40, 130)}
CONFIGS = {
    # The paper's recipe: first moment B128/DE, second moment Rank-1/Linear.
    "paper": lambda implementation: optax4bit.adamw_4bit(1e-2, min_quantize_size=0,
                                          first_moment="B128/DE", second_moment="Rank-1/Linear",
                                          implementation=implementation),
    # torchao's AdamW4bit: no rank-1 normalization, B128 for both moments.
    "torchao": lambda implementation: optax4bit.adamw_4bit(1e-2, min_quantize_size=0,
                                            first_moment="B128/DE", second_moment="B128/DE-0",
                                            implementation=implementation),
    "factor_paper": lambda implementation: optax4bit.adamw_4bit_factor(
        1e-2, min_quantize_size=0, first_moment="B128/DE", second_moment="Rank-1/Linear",
        implementation=implementation),
    "sgdm_paper": lambda implementation: optax4bit.sgdm_4bit(1e-2, min_quantize_size=0,
                                              first_moment="B128/DE", implementation=implementation),
}
STEPS = 3


def run(name: str, implementation: str = "jnp") -> dict:
  """Flat arrays of the state and updates after STEPS steps of CONFIGS[name]."""
  keys = jax.random.split(jax.random.key(0), len(SHAPES))
  params = {k: jax.random.normal(key, s) for key, (k, s) in zip(keys, SHAPES.items())}
  tx = CONFIGS[name](implementation)
  state = tx.init(params)
  update = jax.jit(tx.update)
  out = {}
  for step in range(STEPS):
    gkeys = jax.random.split(jax.random.key(step + 1), len(SHAPES))
    grads = {k: jax.random.normal(key, s) * (1 + 10 * (step == 1))
             for key, (k, s) in zip(gkeys, SHAPES.items())}
    updates, state = update(grads, state, params)
    params = jax.tree.map(lambda p, u: p + u, params, updates)
  for path, leaf in jax.tree_util.tree_leaves_with_path((params, state)):
    out[f"{name}{jax.tree_util.keystr(path)}"] = np.asarray(leaf)
  return out


def digests(name: str, implementation: str = "jnp") -> dict:
  """``{array name: sha256 of dtype, shape and bytes}`` of `run`'s arrays."""
  return {k: hashlib.sha256(f"{a.dtype}{a.shape}".encode() + a.tobytes()).hexdigest()
          for k, a in run(name, implementation).items()}


def main(path: str) -> None:
  table = {}
  for name in CONFIGS:
    table.update(digests(name))
  with open(path, "w") as f:
    json.dump(table, f, indent=1, sort_keys=True)
  print(f"wrote {len(table)} digests to {path}")


if __name__ == "__main__":
  main(sys.argv[1])
