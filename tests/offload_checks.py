"""offload_state on 8 virtual CPU devices; run by tests/test_offload.py.

Run as a script (a separate process, so that the rest of the suite keeps one
device): prints ``RESULTS <json>`` with the outcome of every check. Params are
sharded over a 2 x 4 mesh; the offloaded state must keep the plain state's
shardings (only the memory kind differs), stay in pinned host memory across
donated jitted steps and be bitwise equal to the plain optimizer's.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8")

import functools  # noqa: E402
import json  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402

warnings.filterwarnings("error", category=DeprecationWarning)  # JAX deprecations fail the check

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import optax4bit  # noqa: E402

SHAPES = {"w1": (512, 1024), "w2": (1024, 256), "b": (1024,), "small": (64,)}
SPECS = {"w1": P("data", "model"), "w2": P("model", None), "b": P("model"), "small": P()}
TXS = {
    "adamw_4bit": lambda: optax4bit.adamw_4bit(1e-3, weight_decay=0.1),
    "adamw_4bit_factor": lambda: optax4bit.adamw_4bit_factor(1e-3, weight_decay=0.1),
    "optax.adamw": lambda: optax.adamw(1e-3, weight_decay=0.1),
}


def params(mesh):
  return {k: jax.device_put(
      jax.random.normal(jax.random.fold_in(jax.random.key(0), i), shape),
      NamedSharding(mesh, SPECS[k])) for i, (k, shape) in enumerate(sorted(SHAPES.items()))}


def train(tx, mesh, steps=3):
  p = params(mesh)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state = tx.init(p)
  init_kinds = {x.sharding.memory_kind for x in jax.tree.leaves(state)}
  for i in range(steps):
    grads = jax.tree.map(lambda x: 0.1 * x * (i + 1), p)
    p, state = step(p, state, grads)
  return p, state, init_kinds


def check(name, mesh):
  p, state, init_kinds = train(optax4bit.offload_state(TXS[name]()), mesh)
  ref_p, ref_state, _ = train(TXS[name](), mesh)
  # Scalars and param-shaped arrays stay on the device (offload.py, "Donation").
  param_shapes = {x.shape for x in jax.tree.leaves(p)}
  def kind_of(x):
    return "device" if x.ndim == 0 or x.shape in param_shapes else "pinned_host"

  assert init_kinds == {kind_of(x) for x in jax.tree.leaves(state)}, init_kinds
  for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state)):
    kind = kind_of(x)
    assert x.sharding.memory_kind == kind, (x.shape, x.sharding)
    assert x.sharding.is_equivalent_to(y.sharding.with_memory_kind(kind), x.ndim), (
        x.sharding, y.sharding)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), strict=True)
  for x, y in zip(jax.tree.leaves(p), jax.tree.leaves(ref_p)):
    assert x.sharding == y.sharding, (x.sharding, y.sharding)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), strict=True)
  # The quantized state is really sharded: some leaf holds less than the whole array.
  assert any(len(x.sharding.device_set) == 8 and not x.sharding.is_fully_replicated
             for x in jax.tree.leaves(state))


def main():
  assert jax.device_count() == 8, jax.devices()
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  results = {}
  for name in TXS:
    try:
      check(name, mesh)
      results[name] = True
    except Exception:  # noqa: BLE001 - reported to the test
      results[name] = traceback.format_exc()[-3000:]
  print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
  main()
