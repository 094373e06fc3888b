"""Leaf-ordering checks on 8 virtual CPU devices; run by tests/test_leaf_order.py.

`optax4bit._leafwise.sequential_map` orders the leaves of a step by a runtime
zero made from the previous leaf's stored codes (issue 37). On a classic
``Mesh`` (``Auto`` axes) that zero was made outside the per-shard code, and
XLA all-gathered whole leaves' codes to pick one element. Each check compiles
a step and lists its collectives, next to those of the same step on each leaf
alone (a one-leaf tree has nothing to order): ordering must add none. Prints
one ``RESULTS <json>`` line (tests/sharding_checks.py's format).
"""

from __future__ import annotations

import collections
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sharding_checks as sc  # noqa: E402  (sets the 8-device XLA_FLAGS first)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import optax4bit  # noqa: E402

# Issue 37's tree: a on both axes, b on "model" only, c 1-D.
TREE = {"a": ((512, 1024), P("data", "model")), "b": ((256, 2048), P(None, "model")),
        "c": ((8192,), P("model"))}
TXS = {"adamw_4bit": lambda: optax4bit.adamw_4bit(1e-3),
       "adamw_4bit_factor": lambda: optax4bit.adamw_4bit_factor(1e-3)}


def _classic_mesh(shape=(2, 4)):
  return Mesh(np.array(jax.devices()).reshape(shape), ("data", "model"))


def _params(mesh, tree):
  return {k: jax.device_put(jax.random.normal(jax.random.fold_in(jax.random.key(0), i), s) * 0.1,
                            NamedSharding(mesh, p))
          for i, (k, (s, p)) in enumerate(sorted(tree.items()))}


def _step(tx):
  def step(p, s):
    u, s = tx.update(jax.tree.map(jnp.sin, p), s, p)
    return optax.apply_updates(p, u), s
  return step


def _collectives(tx, params):
  state = jax.jit(tx.init)(params)
  return collections.Counter(
      f"{k} {n}" for k, n in sc.collectives(jax.jit(_step(tx)).lower(params, state).compile()
                                            .as_text()))


def _alone(name, tree, mesh):
  """Collectives of each leaf's step alone, summed (nothing to order)."""
  tx, params = TXS[name](), _params(mesh, tree)
  return sum((_collectives(tx, {k: params[k]}) for k in params), collections.Counter())


def compare(name, tree, mesh, alone=None, bits=True):
  """Collectives of the whole tree's step (with ``alone``'s, see `_alone`)
  and, if ``bits``, the step's result against one device's."""
  tx = TXS[name]()
  params = _params(mesh, tree)
  out = {"whole": dict(_collectives(tx, params)), "alone": alone and dict(alone)}
  if bits:
    state = jax.jit(tx.init)(params)
    new_params, new_state = jax.jit(_step(tx))(params, state)
    local = jax.device_put(params, jax.devices()[0])
    want = jax.jit(_step(tx))(local, jax.jit(tx.init)(local))
    out.update(params_max_rel=sc.max_rel_diff(new_params, want[0]),
               state_diff=sc.tree_equal(new_state, want[1]))
  return out


def issue_tree():
  mesh = _classic_mesh()
  return {name: compare(name, TREE, mesh) for name in TXS}


def orders():
  """Every order of the issue's leaves (renamed so that sorting puts them in
  that order) on a 2 x 4 and a 4 x 2 classic mesh, and an explicit mesh; the
  bits against one device for the first order of each classic mesh."""
  out = {}
  for shape in ((2, 4), (4, 2)):
    mesh = _classic_mesh(shape)
    for name in TXS:
      alone = _alone(name, TREE, mesh)  # one-leaf steps do not depend on the order
      for i, perm in enumerate(itertools.permutations(sorted(TREE))):
        tree = {f"{j}{k}": TREE[k] for j, k in enumerate(perm)}
        out[f"{name} {shape} {''.join(perm)}"] = compare(name, tree, mesh, alone, bits=i == 0)
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  with jax.set_mesh(mesh):
    for name in TXS:
      # Bits against one device: tests/test_sharding.py (a one-device jit
      # cannot run inside this mesh's context).
      out[f"{name} explicit"] = compare(name, TREE, mesh, _alone(name, TREE, mesh), bits=False)
  return out


def explicit():
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  with jax.set_mesh(mesh):
    return {name: compare(name, TREE, mesh, _alone(name, TREE, mesh), bits=False)
            for name in TXS}


if __name__ == "__main__":
  sc.main(sys.argv[1:], {"issue_tree": issue_tree, "orders": orders, "explicit": explicit})
