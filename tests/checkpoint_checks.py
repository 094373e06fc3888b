"""Checkpoint checks with orbax; run by tests/test_checkpoint.py.

``python tests/checkpoint_checks.py roundtrip DIR`` (8 virtual CPU devices):
save a sharded train state, restore it bit for bit, onto another mesh and
PartitionSpec, resume training exactly, and refuse a mismatching optimizer.
Prints one JSON object.

``python tests/checkpoint_checks.py crash DIR`` (1 device): saves step 1, then
starts saving step 2 and announces ``FINALIZING`` just before orbax's atomic
rename; the test kills the process there with SIGKILL.
"""

from __future__ import annotations

import os
import sys

MODE = sys.argv[1] if len(sys.argv) > 1 else "roundtrip"
if MODE == "roundtrip":
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")

import json  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import optax4bit  # noqa: E402
from optax4bit import checkpoint  # noqa: E402

SHAPES = {"w1": (256, 1024), "w2": (1024, 256), "b": (8192,)}
SPECS = {"w1": P("data", "model"), "w2": P("model", "data"), "b": P("model")}
# Another mesh (4 devices, one axis) and other PartitionSpecs.
SPECS_4 = {"w1": P(None, "x"), "w2": P("x", None), "b": P()}


def make_tx():
  return optax.chain(optax.clip_by_global_norm(1.0), optax4bit.adamw_4bit(1e-2, chunk_size=2**14))


def make_params():
  keys = jax.random.split(jax.random.key(1), len(SHAPES))
  return {n: jax.random.normal(k, s) * 0.1 for k, (n, s) in zip(keys, sorted(SHAPES.items()))}


def make_step(tx):
  def step(train):
    params, opt_state, i = train["params"], train["opt_state"], train["step"]
    grads = jax.tree.map(lambda p: jnp.sin(5.0 * p + 0.1 * i.astype(jnp.float32)), params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return {"params": optax.apply_updates(params, updates), "opt_state": opt_state,
            "step": i + 1}
  return step


def diff(a, b) -> list:
  la = jax.tree_util.tree_flatten_with_path(a)[0]
  lb = jax.tree.leaves(b)
  if len(la) != len(lb):
    return ["<structure>"]
  return [jax.tree_util.keystr(p) for (p, x), y in zip(la, lb)
          if not np.array_equal(np.asarray(x), np.asarray(y))]


def specs(tree):
  return [str(x.sharding.spec) for x in jax.tree.leaves(tree)]


def train_state(tx, params, shardings):
  """Sharded train state and its restore target."""
  opt_shardings = optax4bit.state_shardings(tx, params, shardings)
  params = jax.device_put(params, shardings)
  opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
  step_sharding = NamedSharding(next(iter(shardings.values())).mesh, P())
  train = {"params": params, "opt_state": opt_state,
           "step": jax.device_put(jnp.zeros((), jnp.int32), step_sharding)}
  return train


def target_for(tx, params, shardings):
  mesh = next(iter(shardings.values())).mesh
  abstract_state = jax.eval_shape(tx.init, params)
  return {"params": checkpoint.abstract(params, shardings),
          "opt_state": checkpoint.abstract(abstract_state,
                                           optax4bit.state_shardings(tx, params, shardings)),
          "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))}


def roundtrip(directory):
  out = {}
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  shardings = {k: NamedSharding(mesh, s) for k, s in SPECS.items()}
  tx = make_tx()
  params = make_params()
  with jax.set_mesh(mesh):
    step = jax.jit(make_step(tx))
    train = train_state(tx, params, shardings)
    for _ in range(2):
      train = step(train)
    saved = jax.tree.map(np.asarray, train)
    saved_specs = specs(train)
    with ocp.CheckpointManager(directory) as manager:
      t0 = time.time()
      checkpoint.save(manager, 2, train)
      manager.wait_until_finished()
      out["save_seconds"] = time.time() - t0
      uninterrupted = train
      for _ in range(2):
        uninterrupted = step(uninterrupted)
      uninterrupted = jax.tree.map(np.asarray, uninterrupted)

      restored = checkpoint.restore(manager, target_for(tx, params, shardings))
      out["restored_diff"] = diff(restored, saved)
      out["restored_specs_same"] = specs(restored) == saved_specs
      resumed = restored
      for _ in range(2):
        resumed = step(resumed)
      out["resumed_diff"] = diff(resumed, uninterrupted)

      # Mismatching optimizers: a clear error, never garbage.
      out["mismatch"] = {}
      others = {
          "second_moment_DE-0": optax.chain(
              optax.clip_by_global_norm(1.0),
              optax4bit.adamw_4bit(1e-2, second_moment="Rank-1/DE-0")),
          "min_quantize_size": optax.chain(
              optax.clip_by_global_norm(1.0),
              optax4bit.adamw_4bit(1e-2, min_quantize_size=10**6)),
          "sgdm_4bit": optax.chain(optax.clip_by_global_norm(1.0), optax4bit.sgdm_4bit(1e-2)),
      }
      for name, other in others.items():
        try:
          checkpoint.restore(manager, target_for(other, params, shardings))
          out["mismatch"][name] = None
        except checkpoint.CheckpointMismatchError as e:
          out["mismatch"][name] = str(e)

  # Another mesh (4 of the 8 devices) and other PartitionSpecs.
  mesh4 = jax.make_mesh((4,), ("x",), devices=jax.devices()[4:])
  shardings4 = {k: NamedSharding(mesh4, s) for k, s in SPECS_4.items()}
  with jax.set_mesh(mesh4):
    with ocp.CheckpointManager(directory) as manager:
      restored4 = checkpoint.restore(manager, target_for(tx, params, shardings4))
    out["mesh4_diff"] = diff(restored4, saved)
    out["mesh4_specs"] = sorted(set(specs(restored4)))
    out["mesh4_devices"] = sorted({d.id for x in jax.tree.leaves(restored4)
                                   for d in x.sharding.device_set})
    step4 = jax.jit(make_step(tx))
    resumed4 = restored4
    for _ in range(2):
      resumed4 = step4(resumed4)
    out["mesh4_resumed_diff"] = diff(resumed4, uninterrupted)
    out["mesh4_resumed_params_max_rel"] = max(
        float(np.max(np.abs(np.asarray(a) - b)) / np.max(np.abs(b)))
        for a, b in zip(jax.tree.leaves(resumed4["params"]),
                        jax.tree.leaves(uninterrupted["params"])))
  return out


def crash(directory):
  """Saves step 1, then hangs inside the save of step 2 until killed."""
  tx = make_tx()
  params = make_params()
  train = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}
  step = jax.jit(make_step(tx))
  train = step(train)
  manager = ocp.CheckpointManager(directory)
  checkpoint.save(manager, 1, train)
  manager.wait_until_finished()
  save_expected(os.path.join(directory, "..", "expected_step1.npz"), train)
  save_until_killed(manager, 2, step(train))


def save_expected(path, tree):
  """``tree``'s leaves as an ``.npz`` keyed by their paths."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  np.savez(path, **{jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves})


def save_until_killed(manager, step, state):
  """Saves ``state`` at ``step`` and hangs after its data is written, before
  orbax's commit (atomic rename), announcing ``FINALIZING``."""
  from orbax.checkpoint._src.path import atomicity  # pylint: disable=import-outside-toplevel

  async def hang(self, *args, **kwargs):
    del self, args, kwargs
    print("FINALIZING", flush=True)
    time.sleep(600)

  for cls in (atomicity.AtomicRenameTemporaryPath, atomicity.CommitFileTemporaryPath):
    cls.finalize = hang
  checkpoint.save(manager, step, state)
  manager.wait_until_finished()
  print("NOT KILLED", flush=True)


if __name__ == "__main__":
  if MODE == "crash":
    crash(sys.argv[2])
  else:
    try:
      result = {"ok": True, "value": roundtrip(sys.argv[2])}
    except Exception:  # pylint: disable=broad-except
      result = {"ok": False, "error": traceback.format_exc()}
    print("RESULTS " + json.dumps(result))
