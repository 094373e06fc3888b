"""Pallas kernels per shard: 8 virtual CPU devices, interpret mode.

Under a mesh, ``implementation="pallas"`` runs each sharded leaf's kernels on
its local block under ``jax.shard_map`` (via `optax4bit._shard_map.per_shard`)
and combines rank-1 statistics with a cross-shard ``pmax``; the results must
equal the jnp path's under the same mesh (same criteria as
tests/test_pallas_optim.py: codes equal, scales within 2 ulps of the largest
scale, updates within 4 ulps of the leaf's largest update).

The checks run in a separate process (this file executed as a script, see
tests/subprocess_json.py), which needs the device count set before JAX starts.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")

import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# A mesh of 4 x 2 with explicit axes (jax.make_mesh's default in JAX 0.10).
# Leaves: sharded on both axes; on the last axis only; a 3-D leaf whose
# first-moment blocks span several short rows; a 1-D leaf.
SHAPES = {"w": (8, 512), "c": (6, 256), "g": (4, 6, 32), "b": (1024,)}
SPECS = {"w": ("x", "y"), "c": (None, "y"), "g": ("x", None, None), "b": ("x",)}
STEPS = 4


def _check(name: str) -> dict:
  import optax4bit  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
  from optax4bit.pallas import PallasConfig  # pylint: disable=import-outside-toplevel

  make = {
      "adamw": lambda impl: optax4bit.adamw_4bit(1e-2, min_quantize_size=0, implementation=impl),
      "factor": lambda impl: optax4bit.adamw_4bit_factor(1e-2, min_quantize_size=0,
                                                         implementation=impl),
      "sgdm": lambda impl: optax4bit.sgdm_4bit(1e-2, min_quantize_size=0, implementation=impl),
  }[name]
  mesh = jax.make_mesh((4, 2), ("x", "y"))
  rng = np.random.RandomState(0)
  params = {k: jax.device_put(jnp.asarray(rng.standard_normal(s), jnp.float32),
                              NamedSharding(mesh, P(*SPECS[k]))) for k, s in SHAPES.items()}
  tx_ref = make("jnp")
  tx_pal = make(PallasConfig(interpret=True, tile_bytes=64))

  @jax.jit
  def both(state, i):
    key = jax.random.fold_in(jax.random.key(1), i)
    grads = {k: jax.random.normal(jax.random.fold_in(key, n), p.shape,
                                  out_sharding=jax.typeof(p).sharding)
             for n, (k, p) in enumerate(sorted(params.items()))}
    return tx_ref.update(grads, state, params), tx_pal.update(grads, state, params)

  state = tx_ref.init(params)
  jaxpr = str(jax.make_jaxpr(lambda s: tx_pal.update(params, s, params))(state))
  result = {"pallas_calls": jaxpr.count("pallas_call"), "shard_maps": jaxpr.count("shard_map"),
            "codes_differ": 0, "scale_ulps": 0.0, "update_ulps": 0.0, "specs_kept": True}
  for i in range(STEPS):
    (u_ref, s_ref), (u_pal, s_pal) = both(state, i)
    for a, b in zip(jax.tree.leaves(s_ref), jax.tree.leaves(s_pal)):
      result["specs_kept"] &= a.sharding.spec == b.sharding.spec
      a, b = np.asarray(a), np.asarray(b)
      if a.dtype == np.uint8:
        result["codes_differ"] += int(np.sum(a != b))
      elif a.dtype == np.float32 and a.ndim and np.max(np.abs(a)) > 0:
        ulps = np.max(np.abs(a - b)) / (np.max(np.abs(a)) * np.finfo(np.float32).eps)
        result["scale_ulps"] = max(result["scale_ulps"], float(ulps))
    for k in SHAPES:
      a, b = np.asarray(u_ref[k]), np.asarray(u_pal[k])
      result["specs_kept"] &= u_ref[k].sharding.spec == u_pal[k].sharding.spec
      ulps = np.max(np.abs(a - b)) / (np.max(np.abs(a)) * np.finfo(np.float32).eps)
      result["update_ulps"] = max(result["update_ulps"], float(ulps))
    state = s_ref
  return result


def main(names):
  results = {}
  for name in names:
    try:
      results[name] = {"ok": True, "value": _check(name)}
    except Exception as e:  # pylint: disable=broad-except
      import traceback  # pylint: disable=import-outside-toplevel
      results[name] = {"ok": False, "error": f"{e!r}\n{traceback.format_exc()[-3000:]}"}
  print("RESULTS " + json.dumps(results))


# ----------------------------------------------------------------------------


@pytest.mark.slow
def test_pallas_per_shard_matches_jnp():
  from subprocess_json import run_json  # pylint: disable=import-outside-toplevel
  results = run_json(os.path.abspath(__file__), "adamw", "factor", "sgdm", timeout=1800)
  # Per leaf: adamw two passes on the 2-D leaves (rank-1 v) and on the 3-D
  # leaf (its first moment's blocks span rows), one on the 1-D leaf.
  expected_calls = {"adamw": 7, "factor": 5, "sgdm": 5}
  for name, entry in results.items():
    assert entry["ok"], entry.get("error")
    value = entry["value"]
    assert value["shard_maps"] == len(SHAPES), (name, value)
    assert value["pallas_calls"] == expected_calls[name], (name, value)
    assert value["codes_differ"] == 0, (name, value)
    assert value["scale_ulps"] <= 2, (name, value)
    assert value["update_ulps"] <= 4, (name, value)
    assert value["specs_kept"], (name, value)


if __name__ == "__main__":
  main(sys.argv[1:])
