"""Auto-axis (classic GSPMD) checks on 8 virtual CPU devices; run by
tests/test_gspmd_auto.py (issue 18).

The Flax Linen / MaxText flow: ``jax.sharding.Mesh(devices, names)`` (Auto
axes), params committed with ``NamedSharding`` and ``jax.jit(tx.init)(params)``
with no ``out_shardings``. Prints one ``RESULTS <json>`` line (see
tests/sharding_checks.py, whose helpers this reuses).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sharding_checks as sc  # noqa: E402  (sets the 8-device XLA_FLAGS first)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import optax4bit  # noqa: E402

SHAPE = (512, 1024)  # the issue's parameter `a`


def _mesh():
  return Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))


def _state_bytes(state, per_device: bool) -> int:
  total = 0
  for x in jax.tree.leaves(state):
    if per_device:
      total += max(s.data.nbytes for s in x.addressable_shards)
    else:
      total += x.nbytes
  return total


def _quantized_leaves(state):
  return [x for x in jax.tree.leaves(state, is_leaf=optax4bit.is_quantized)
          if optax4bit.is_quantized(x)]


def jit_init_placement():
  """Specs and bytes per device of ``jax.jit(tx.init)(params)``."""
  mesh = _mesh()
  sh = NamedSharding(mesh, P("data", "model"))
  params = {"a": jax.device_put(jax.random.normal(jax.random.key(0), SHAPE) * 0.1, sh)}
  out = {}
  for name, tx in (("adamw_4bit", optax4bit.adamw_4bit(1e-3)),
                   ("adamw_4bit_factor", optax4bit.adamw_4bit_factor(1e-3)),
                   ("sgdm_4bit", optax4bit.sgdm_4bit(1e-2)),
                   ("optax_adamw", optax.adamw(1e-3))):
    state = jax.jit(tx.init)(params)
    want = optax4bit.state_shardings(tx, params)
    arrays = [x for x in jax.tree.leaves(state) if x.ndim == 2]
    wanted = [w for x, w in zip(jax.tree.leaves(state), jax.tree.leaves(want)) if x.ndim == 2]
    out[name] = {
        "specs": [str(x.sharding.spec) if isinstance(x.sharding, NamedSharding)
                  else type(x.sharding).__name__ for x in arrays],
        "want": [str(w.spec) for w in wanted],
        "shard_shapes": [list(x.addressable_shards[0].data.shape) for x in arrays],
        "bytes_total": _state_bytes(arrays, per_device=False),
        "bytes_per_device": _state_bytes(arrays, per_device=True),
    }
  return out


def _sharded_specs_ok(state, want):
  got = sc.specs_of([x for x in jax.tree.leaves(state) if x.ndim >= 1])
  exp = sc.specs_of([w for x, w in zip(jax.tree.leaves(state), jax.tree.leaves(want))
                     if x.ndim >= 1])
  return got == exp


def auto_flow(wrap: bool, name: str = "adamw", make_tx=sc.adamw_chain, steps: int = 3):
  """``jax.jit(tx.init)(params)`` then a jitted step, with or without
  `shard_optimizer` around the update: placement, HLO collectives, bits."""
  mesh = _mesh()
  shardings = {k: NamedSharding(mesh, s) for k, s in sc.SPECS.items()}
  params = sc.make_params()
  base = make_tx(sc.CHUNK)
  expected = sc.reference(name, make_tx(None), params, steps)
  tx = optax4bit.shard_optimizer(base, shardings) if wrap else base
  want = optax4bit.state_shardings(base, params, shardings)
  sparams = jax.device_put(params, shardings)
  state = jax.jit(base.init)(sparams)          # no out_shardings, no wrapper
  placed = _sharded_specs_ok(state, want)
  step = jax.jit(sc.make_step(tx), donate_argnums=(0, 1))
  hlo = step.lower(sparams, state, 0).compile().as_text()
  for i in range(steps):
    sparams, state = step(sparams, state, i)
  colls = sc.collectives(hlo)
  # A gather is state-sized if its result holds a whole row block of a
  # quantized leaf or more (its rank-1 statistics are at most 8192 floats).
  state_sized = sorted({n for k, n in colls if k != "all-reduce" and n > 8192})
  return {
      "placed": placed,
      "kept": _sharded_specs_ok(state, want),
      "collective_kinds": sorted({k for k, _ in colls}),
      "largest_collective": max([n for _, n in colls] or [0]),
      "state_sized_gathers": state_sized,
      "params_diff": sc.tree_equal(sparams, expected[0]),
      "params_max_rel": sc.max_rel_diff(sparams, expected[0]),
      "state_diff": sc.tree_equal(state, expected[1]),
  }


def issue_default():
  """Issue 18 verbatim: ``a`` 512x1024 on P("data", "model"), default
  `adamw_4bit` (its CPU kernel, where built, runs per shard)."""
  mesh = _mesh()
  params = {"a": jax.device_put(jax.random.normal(jax.random.key(1), SHAPE) * 0.1,
                                NamedSharding(mesh, P("data", "model")))}
  tx = optax4bit.adamw_4bit(1e-3)
  state = jax.jit(tx.init)(params)

  def step(p, s):
    u, s = tx.update(jax.tree.map(jnp.sin, p), s, p)
    return optax.apply_updates(p, u), s

  hlo = jax.jit(step).lower(params, state).compile().as_text()
  new_params, new_state = jax.jit(step)(params, state)
  local = jax.device_put(params, jax.devices()[0])
  want = jax.jit(step)(local, jax.jit(tx.init)(local))
  colls = sc.collectives(hlo)
  return {
      "codes_spec": str(state[0].mu["a"].codes.sharding.spec),
      "codes_shard_shape": list(state[0].mu["a"].codes.addressable_shards[0].data.shape),
      "new_codes_spec": str(new_state[0].mu["a"].codes.sharding.spec),
      "collectives": sorted({f"{k} {n}" for k, n in colls}),
      "params_diff": sc.tree_equal(new_params, want[0]),
      "state_diff": sc.tree_equal(new_state, want[1]),
  }


def auto_kernels():
  """The issue's case with the fused kernels (the CPU kernel, and Pallas in
  interpret mode): per shard, sharded like the param, bitwise equal to one
  device; and data parallelism (P() params) runs them whole on every device."""
  mesh = _mesh()
  out = {}
  for impl in ("cpu", "pallas_interpret"):
    if impl == "cpu" and not optax4bit.cpu.available():
      continue
    tx = optax4bit.adamw_4bit(1e-3, implementation=impl)

    def step(p, s, tx=tx):
      u, s = tx.update(jax.tree.map(jnp.sin, p), s, p)
      return optax.apply_updates(p, u), s

    for name, spec in (("sharded", P("data", "model")), ("replicated", P())):
      params = {"a": jax.device_put(jax.random.normal(jax.random.key(1), SHAPE) * 0.1,
                                    NamedSharding(mesh, spec))}
      state = jax.jit(tx.init)(params)
      hlo = jax.jit(step).lower(params, state).compile().as_text()
      new_params, new_state = jax.jit(step)(params, state)
      local = jax.device_put(params, jax.devices()[0])
      want = jax.jit(step)(local, jax.jit(tx.init)(local))
      out[f"{impl} {name}"] = {
          "codes_spec": str(new_state[0].mu["a"].codes.sharding.spec),
          "collectives": sorted({f"{k} {n}" for k, n in sc.collectives(hlo)}),
          "kernel_calls": hlo.count("optax4bit_adam") if impl == "cpu" else None,
          "params_diff": sc.tree_equal(new_params, want[0]),
          "state_diff": sc.tree_equal(new_state, want[1]),
      }
  return out


def issue_report():
  """Issue 18's figures for RESULTS.md, public API only (so the same check
  runs against an older optax4bit): bytes of ``a``'s 4-bit state per device
  after ``jax.jit(tx.init)``, and the collectives of the compiled update."""
  mesh = _mesh()
  params = {"a": jax.device_put(jax.random.normal(jax.random.key(1), SHAPE) * 0.1,
                                NamedSharding(mesh, P("data", "model")))}
  out = {}
  for impl in ("auto", "jnp"):
    tx = optax4bit.adamw_4bit(1e-3, implementation=impl)
    state = jax.jit(tx.init)(params)
    arrays = [x for x in jax.tree.leaves(state) if x.ndim == 2]
    per_device = {}
    for x in arrays:
      for shard in x.addressable_shards:
        per_device[shard.device.id] = per_device.get(shard.device.id, 0) + shard.data.nbytes

    def step(p, s, tx=tx):
      u, s = tx.update(jax.tree.map(jnp.sin, p), s, p)
      return optax.apply_updates(p, u), s

    hlo = jax.jit(step).lower(params, state).compile().as_text()
    kinds = {}
    for line in hlo.splitlines():
      m = sc.COLLECTIVE.search(line)
      if m:
        name = f"{m.group(2)} {m.group(1).split('{')[0]}"
        kinds[name] = kinds.get(name, 0) + 1
    out[impl] = {"bytes_total": sum(x.nbytes for x in arrays),
                 "bytes_max_per_device": max(per_device.values()),
                 "devices_holding": len(per_device), "collectives": kinds}
  return out


def replicated_and_misaligned():
  """Data parallelism (P() params on an Auto mesh) runs as on one device;
  a leaf whose blocks would straddle shards raises optax4bit's error."""
  mesh = _mesh()
  out = {}
  params = {"a": jax.device_put(jnp.full(SHAPE, 0.1), NamedSharding(mesh, P()))}
  tx = optax4bit.adamw_4bit(1e-3, implementation="jnp")
  state = jax.jit(tx.init)(params)
  step = jax.jit(lambda p, s: tx.update(p, s, p))
  hlo = step.lower(params, state).compile().as_text()
  upd, _ = step(params, state)
  local = jax.device_put(params, jax.devices()[0])
  want, _ = step(local, jax.jit(tx.init)(local))
  out["replicated_collectives"] = sorted({k for k, _ in sc.collectives(hlo)})
  out["replicated_diff"] = sc.tree_equal(upd, want)
  params = {"w": jax.device_put(jnp.zeros((256, 384)), NamedSharding(mesh, P(None, "model")))}
  try:
    state = jax.jit(tx.init)(params)
    jax.jit(lambda p, s: tx.update(p, s, p))(params, state)
    out["misaligned_error"] = None
  except Exception as e:  # pylint: disable=broad-except  (XLA wraps the callback's error)
    # Whole: JAX 0.11 puts the partitioner's traceback before its message.
    out["misaligned_error"] = f"{type(e).__name__}: {e}"
  return out


def temp_bytes():
  """Compiled temp bytes of the update, unwrapped vs `shard_optimizer`."""
  mesh = _mesh()
  shardings = {k: NamedSharding(mesh, s) for k, s in sc.SPECS.items()}
  params = jax.device_put(sc.make_params(), shardings)
  out = {}
  for name, wrap in (("unwrapped", False), ("shard_optimizer", True)):
    base = sc.adamw_chain(sc.CHUNK)
    tx = optax4bit.shard_optimizer(base, shardings) if wrap else base
    state = jax.jit(base.init)(params)
    step = jax.jit(sc.make_step(tx), donate_argnums=(0, 1))
    out[name] = step.lower(params, state, 0).compile().memory_analysis().temp_size_in_bytes
  return out


CHECKS = {
    "jit_init_placement": jit_init_placement,
    "auto_wrapped": lambda: auto_flow(wrap=True),
    "auto_unwrapped": lambda: auto_flow(wrap=False),
    "issue_default": issue_default,
    "replicated_and_misaligned": replicated_and_misaligned,
    "temp_bytes": temp_bytes,
    "issue_report": issue_report,
    "auto_kernels": auto_kernels,
    "factor_unwrapped": lambda: auto_flow(False, "factor", lambda c: optax4bit.adamw_4bit_factor(
        1e-3, chunk_size=c)),
    "sgdm_unwrapped": lambda: auto_flow(False, "sgdm", lambda c: optax4bit.sgdm_4bit(
        1e-2, chunk_size=c)),
    "adamw8_unwrapped": lambda: auto_flow(False, "adamw8", lambda c: optax4bit.adamw_8bit(
        1e-3, chunk_size=c)),
    "lion_unwrapped": lambda: auto_flow(False, "lion", lambda c: optax4bit.lion_4bit(1e-4)),
}


if __name__ == "__main__":
  sc.main(sys.argv[1:], CHECKS)
