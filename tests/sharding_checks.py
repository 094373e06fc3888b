"""Sharding checks on 8 virtual CPU devices; run by tests/test_sharding.py.

Run as a script (a separate process, so that the rest of the test suite keeps
one device): prints one JSON object with the outcome of every check, which
the test module asserts on. Every check compares against a single-device run
of the same optimizer and inspects the compiled HLO for collectives.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8")

import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import optax4bit  # noqa: E402

COLLECTIVE = re.compile(
    r"=\s*(\([^)]*\)|\S+)\s+(all-gather|all-to-all|collective-permute|reduce-scatter|all-reduce)"
    r"(?:-start)?\(")
SHAPE = re.compile(r"[a-z]+[0-9]*\[([0-9,]*)\]")

# Leaves: sharded on both axes, on axis 0 only, a 1-D leaf, a leaf whose
# blocks span several rows (last axis 32 < 128 / 2), and a small leaf that
# keeps float32 moments. chunk_size 2**13 makes every large leaf run in
# several chunks per shard.
SHAPES = {"w1": (512, 1024), "w2": (1024, 256), "b": (8192,), "narrow": (2048, 32),
          "small": (64,)}
SPECS = {"w1": P("data", "model"), "w2": P("model", None), "b": P("model"),
         "narrow": P(("data", "model"), None), "small": P()}
CHUNK = 2**13


def make_params():
  keys = jax.random.split(jax.random.key(0), len(SHAPES))
  return {name: jax.random.normal(k, shape) * 0.1
          for k, (name, shape) in zip(keys, sorted(SHAPES.items()))}


def grads_at(params, i):
  return jax.tree.map(lambda p: jnp.sin(7.0 * p + 0.3 * i) * (1.0 + 0.5 * jnp.cos(p)), params)


def make_step(tx):
  def step(params, state, i):
    updates, state = tx.update(grads_at(params, i), state, params)
    return optax.apply_updates(params, updates), state
  return step


def collectives(hlo: str) -> list:
  """(kind, largest operand element count) of every collective in the HLO."""
  found = []
  for line in hlo.splitlines():
    m = COLLECTIVE.search(line)
    if not m:
      continue
    sizes = [int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
             for dims in SHAPE.findall(m.group(1))]
    found.append((m.group(2), max(sizes or [0])))
  return found


def tree_equal(a, b) -> list:
  """Paths where two trees differ bitwise."""
  la = jax.tree_util.tree_flatten_with_path(a)[0]
  lb = jax.tree.leaves(b)
  return [jax.tree_util.keystr(p) for (p, x), y in zip(la, lb)
          if not np.array_equal(np.asarray(x), np.asarray(y))]


def max_rel_diff(a, b) -> float:
  worst = 0.0
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    worst = max(worst, float(np.max(np.abs(x - y)) / (np.max(np.abs(y)) + 1e-30)))
  return worst


def specs_of(tree):
  """PartitionSpecs as tuples without trailing Nones (P(None,) == P())."""
  def one(x):
    spec = tuple(x.spec if isinstance(x, NamedSharding) else x.sharding.spec)
    while spec and spec[-1] is None:
      spec = spec[:-1]
    return spec
  return jax.tree.map(one, tree)


_REFERENCES = {}


def reference(name, tx, params, steps):
  """Single-device run (cached per optimizer name)."""
  if (name, steps) in _REFERENCES:
    return _REFERENCES[name, steps]
  _REFERENCES[name, steps] = _reference(tx, params, steps)
  return _REFERENCES[name, steps]


def _reference(tx, params, steps):
  step = jax.jit(make_step(tx))
  state = tx.init(params)
  for i in range(steps):
    params, state = step(params, state, i)
  return params, state


def run_sharded(name, make_tx, mode, steps=3, wrap=True):  # pylint: disable=too-many-locals
  """Trains ``steps`` steps sharded; compares with one device; inspects HLO."""
  types = (AxisType.Explicit if mode == "explicit" else AxisType.Auto,) * 2
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=types)
  shardings = {k: NamedSharding(mesh, s) for k, s in SPECS.items()}
  params = make_params()
  base = make_tx(CHUNK)
  # The reference runs unchunked: chunk boundaries must not change results.
  expected = reference(name, make_tx(None), params, steps)
  tx = optax4bit.shard_optimizer(base, shardings) if (mode == "auto" and wrap) else base
  want = optax4bit.state_shardings(base, params, shardings)
  with jax.set_mesh(mesh) if mode == "explicit" else _null():
    sparams = jax.device_put(params, shardings)
    if mode == "explicit":
      state = jax.jit(tx.init)(sparams)
    elif wrap:
      state = tx.init(sparams)
    else:
      state = jax.jit(tx.init, out_shardings=want)(sparams)
    placed = specs_of(state) == specs_of(want)
    step = jax.jit(make_step(tx), donate_argnums=(0, 1))
    hlo = step.lower(sparams, state, 0).compile().as_text()
    for i in range(steps):
      sparams, state = step(sparams, state, i)
    out_specs_ok = (specs_of(state) == specs_of(want)
                    and specs_of(sparams) == specs_of(shardings))
  colls = collectives(hlo)
  result = {
      "placed_like_state_shardings": placed,
      "shardings_kept": out_specs_ok,
      "collective_kinds": sorted({k for k, _ in colls}),
      "largest_collective": max([n for _, n in colls] or [0]),
      "params_diff": tree_equal(sparams, expected[0]),
      "state_diff": tree_equal(state, expected[1]),
      "params_max_rel": max_rel_diff(sparams, expected[0]),
  }
  return result


class _null:
  def __enter__(self):
    return self

  def __exit__(self, *a):
    return False


def expected_specs():
  """Specs of the 4-bit AdamW state for SPECS (the documented rule)."""
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  shardings = {k: NamedSharding(mesh, s) for k, s in SPECS.items()}
  sh = optax4bit.state_shardings(optax4bit.adamw_4bit(1e-3), make_params(), shardings)[0]
  out = {}
  for name in ("w1", "w2", "b", "narrow"):
    out[name] = {
        "mu_codes": str(sh.mu[name].codes.spec),
        "mu_scales": [str(s.spec) for s in sh.mu[name].scales],
        "nu_codes": str(sh.nu[name].codes.spec),
        "nu_scales": [str(s.spec) for s in sh.nu[name].scales],
    }
  out["count"] = str(sh.count.spec)
  out["small_mu"] = str(sh.mu["small"].spec)
  return out


def misaligned():
  """Parameters that cannot be split like their state: a clear ValueError."""
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  cases = {
      # 384 / 4 = 96 elements per shard: blocks of 128 would straddle shards.
      "ragged_blocks": ((256, 384), P(None, "model")),
      # 255 rows do not split over 2 shards.
      "uneven": ((255, 512), P("data", None)),
      # last axis 32 (blocks span 4 rows) cannot be sharded.
      "narrow_last_axis": ((1024, 32), P(None, "model")),
  }
  out = {}
  for name, (shape, spec) in cases.items():
    params = {"w": jnp.zeros(shape)}
    shardings = {"w": NamedSharding(mesh, spec)}
    tx = optax4bit.adamw_4bit(1e-3)
    errors = []
    try:
      optax4bit.state_shardings(tx, params, shardings)
    except ValueError as e:
      errors.append(str(e))
    with jax.set_mesh(mesh):
      try:
        jax.jit(tx.init)(jax.device_put(params, shardings))
      except ValueError as e:
        errors.append(str(e))
    out[name] = errors
  # The documented way out: keep such a leaf in float32 with quantize_mask.
  params = {"w": jnp.zeros((256, 384))}
  shardings = {"w": NamedSharding(mesh, P(None, "model"))}
  tx = optax4bit.adamw_4bit(1e-3, quantize_mask={"w": False})
  sh = optax4bit.state_shardings(tx, params, shardings)
  out["masked_fp32_spec"] = str(sh[0].mu["w"].spec)
  return out


def eager_init():
  """tx.init outside jit on concrete sharded params (auto mesh) places the state."""
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  shardings = {k: NamedSharding(mesh, s) for k, s in SPECS.items()}
  tx = optax4bit.adamw_4bit(1e-3)
  params = jax.device_put(make_params(), shardings)
  state = tx.init(params)
  want = optax4bit.state_shardings(tx, params, shardings)
  # The step count is created uncommitted (jit places it anywhere).
  return specs_of(state[0]._replace(count=want[0].count)) == specs_of(want[0])


def adamw_chain(chunk):
  # The global norm is all-reduced in another order than one device sums it, so a clip
  # that acts can differ from one device's in its last bit (outside optax4bit: it broke
  # these bitwise checks when a change of the default recipe moved the trajectory).
  # Clipping at a norm the gradients (about 800) never reach keeps the all-reduce in the
  # step and the updates exact.
  return optax.chain(optax.clip_by_global_norm(1e6),
                     optax4bit.adamw_4bit(1e-3, chunk_size=chunk))


CHECKS = {
    "expected_specs": expected_specs,
    "misaligned": misaligned,
    "eager_init": eager_init,
    "adamw_explicit": lambda: run_sharded("adamw", adamw_chain, "explicit"),
    "adamw_auto_wrapped": lambda: run_sharded("adamw", adamw_chain, "auto"),
    "factor_explicit": lambda: run_sharded(
        "factor", lambda c: optax4bit.adamw_4bit_factor(1e-3, chunk_size=c), "explicit"),
    "sgdm_explicit": lambda: run_sharded(
        "sgdm", lambda c: optax4bit.sgdm_4bit(1e-2, chunk_size=c), "explicit"),
    "adamw8_explicit": lambda: run_sharded(
        "adamw8", lambda c: optax4bit.adamw_8bit(1e-3, chunk_size=c), "explicit"),
    "adamw_auto_unwrapped": lambda: run_sharded("adamw", adamw_chain, "auto", wrap=False),
}
FAST = ("expected_specs", "misaligned", "eager_init", "adamw_explicit", "adamw_auto_wrapped")


def main(names, checks=None):
  """Runs the named checks (all of ``checks``, default `CHECKS`, if none)
  and prints one ``RESULTS <json>`` line."""
  checks = CHECKS if checks is None else checks
  results = {}
  for name in names or checks:
    try:
      results[name] = {"ok": True, "value": checks[name]()}
    except Exception:  # pylint: disable=broad-except
      results[name] = {"ok": False, "error": traceback.format_exc()}
  print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
  main(sys.argv[1:])
