"""Golden states of the paper's and torchao's recipes.

tests/data/paper_recipe_golden.json holds SHA-256 digests of every array, written by
this script against optax4bit at commit 3d27fa7 (jnp implementation), before the
default recipe changed. tests/data/paper_recipe_golden_floats.npz holds the float
arrays themselves, written at 7a37a45 with JAX 0.10.2, where every array still hashed
to those digests (`test_recipes.py` checks that). The float arrays are compared with a
tolerance: XLA releases may sum in another order (JAX 0.12's XLA:CPU moves the
factored means of a 3-D leaf by 1-2 ulp).

  python tests/paper_recipe_golden.py digests OUT.json   # write (used once)
  python tests/paper_recipe_golden.py floats OUT.npz     # write (used once)
"""

import hashlib
import json
import sys

import jax
import numpy as np
import optax4bit

SHAPES = {"mat": (64, 256), "vec": (5000,), "cube": (3, 40, 130)}
# The params are float32, which param_rounding leaves as they are; "nearest"
# keeps the golden state's structure (no rounding step count, issue 36).
CONFIGS = {
    # The paper's recipe: first moment B128/DE, second moment Rank-1/Linear.
    "paper": lambda implementation: optax4bit.adamw_4bit(1e-2, min_quantize_size=0,
                                          first_moment="B128/DE", second_moment="Rank-1/Linear",
                                          implementation=implementation, param_rounding="nearest"),
    # torchao's AdamW4bit: no rank-1 normalization, B128 for both moments.
    "torchao": lambda implementation: optax4bit.adamw_4bit(1e-2, min_quantize_size=0,
                                            first_moment="B128/DE", second_moment="B128/DE-0",
                                            implementation=implementation,
                                            param_rounding="nearest"),
    "factor_paper": lambda implementation: optax4bit.adamw_4bit_factor(
        1e-2, min_quantize_size=0, first_moment="B128/DE", second_moment="Rank-1/Linear",
        implementation=implementation, param_rounding="nearest"),
    "sgdm_paper": lambda implementation: optax4bit.sgdm_4bit(1e-2, min_quantize_size=0,
                                              first_moment="B128/DE", implementation=implementation,
                                              param_rounding="nearest"),
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


def digest(a: np.ndarray) -> str:
  """sha256 of ``a``'s dtype, shape and bytes."""
  return hashlib.sha256(f"{a.dtype}{a.shape}".encode() + a.tobytes()).hexdigest()


def digests(name: str, implementation: str = "jnp") -> dict:
  """``{array name: digest}`` of `run`'s arrays."""
  return {k: digest(a) for k, a in run(name, implementation).items()}


def floats(name: str, implementation: str = "jnp") -> dict:
  """`run`'s float arrays."""
  return {k: a for k, a in run(name, implementation).items()
          if np.issubdtype(a.dtype, np.floating)}


def main(what: str, path: str) -> None:
  if what == "digests":
    table = {k: v for name in CONFIGS for k, v in digests(name).items()}
    with open(path, "w") as f:
      json.dump(table, f, indent=1, sort_keys=True)
  elif what == "floats":
    table = {k: v for name in CONFIGS for k, v in floats(name).items()}
    np.savez_compressed(path, **table)
  else:
    raise SystemExit(f"what to write must be 'digests' or 'floats', got {what!r}")
  print(f"wrote {len(table)} {what} to {path}")


if __name__ == "__main__":
  main(*sys.argv[1:])
