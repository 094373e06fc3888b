"""Multi-host training with 4-bit AdamW: sharded model, checkpoint, restore.

Every process runs this script; together they train a small two-layer MLP whose
weights are sharded over a ("data", "model") mesh spanning all processes'
devices, with `optax4bit.adamw_4bit` states sharded like the weights. After a
few steps the train state is saved with orbax (each process writes its own
shards), training continues, and the saved state is restored and trained
again: the resumed run must equal the uninterrupted one bit for bit.

Two processes on one machine, 4 CPU devices each (gloo CPU collectives)::

  python examples/multihost.py --num-processes 2 --process-id 0 --port 12355 &
  python examples/multihost.py --num-processes 2 --process-id 1 --port 12355

One process with all 8 devices (the same global computation)::

  python examples/multihost.py --num-processes 1

On a real cluster, call ``jax.distributed.initialize()`` without arguments
(SLURM, TPU pods and GKE are detected) and keep the rest of the script.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile

import jax
import numpy as np

DEVICES = 8  # global CPU devices in this example


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--num-processes", type=int, default=1)
  parser.add_argument("--process-id", type=int, default=0)
  parser.add_argument("--port", type=int, default=12355)
  parser.add_argument("--checkpoint-dir", default=None,
                      help="shared directory (default: a fresh temporary one, 1 process only)")
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--json", default=None, help="write a summary here")
  return parser.parse_args()


def main():
  args = parse_args()
  # CPU devices and collectives must be configured before JAX starts a backend.
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", DEVICES // args.num_processes)
  if args.num_processes > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}",
                               num_processes=args.num_processes, process_id=args.process_id)

  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel

  import optax4bit  # pylint: disable=import-outside-toplevel
  from optax4bit import checkpoint  # pylint: disable=import-outside-toplevel

  assert jax.device_count() == DEVICES, jax.devices()
  mesh = jax.make_mesh((2, 4), ("data", "model"))  # explicit axes: states follow params
  specs = {"w1": P("data", "model"), "b1": P("model"), "w2": P("model", "data")}
  shardings = {k: NamedSharding(mesh, s) for k, s in specs.items()}
  batch_sharding = NamedSharding(mesh, P("data", None))

  # Global values from a fixed seed; each process fills only its own shards.
  rng = np.random.default_rng(0)
  host_params = {"w1": rng.normal(0, 0.05, (256, 1024)).astype(np.float32),
                 "b1": np.zeros(1024, np.float32),
                 "w2": rng.normal(0, 0.05, (1024, 256)).astype(np.float32)}
  host_x = rng.normal(0, 1, (64, 256)).astype(np.float32)
  host_y = np.tanh(host_x @ rng.normal(0, 0.1, (256, 256)).astype(np.float32))

  def global_array(value, sharding):
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

  tx = optax4bit.adamw_4bit(learning_rate=1e-2, min_quantize_size=1024, chunk_size=2**16)

  def loss_fn(params, x, y):
    # FSDP: weights are stored sharded over all 8 devices and gathered for
    # the matmuls; the batch is split over "data". Every float sum that
    # crosses devices then has 2 terms, so the result does not depend on the
    # collectives' summation order (gloo or in-process): a 2-process run
    # equals the 1-process run bit for bit.
    full = jax.tree.map(lambda w: jax.sharding.reshard(w, P()), params)
    hidden = jax.nn.gelu(x @ full["w1"] + full["b1"])
    return jnp.mean((hidden @ full["w2"] - y) ** 2)

  @jax.jit
  def train_step(train, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(train["params"], x, y)
    updates, opt_state = tx.update(grads, train["opt_state"], train["params"])
    return {"params": optax.apply_updates(train["params"], updates), "opt_state": opt_state,
            "step": train["step"] + 1}, loss

  def fetch(tree):
    """Global values on every host (process_allgather of each shard)."""
    return jax.tree.map(lambda a: np.asarray(multihost_utils.process_allgather(a, tiled=True)),
                        tree)

  def digest(tree) -> str:
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(fetch(tree)):
      h.update(np.ascontiguousarray(leaf).tobytes())
    return h.hexdigest()

  directory = args.checkpoint_dir or tempfile.mkdtemp(prefix="optax4bit-multihost-")
  with jax.set_mesh(mesh):
    params = {k: global_array(v, shardings[k]) for k, v in host_params.items()}
    x, y = global_array(host_x, batch_sharding), global_array(host_y, batch_sharding)
    opt_state = jax.jit(tx.init)(params)
    train = {"params": params, "opt_state": opt_state,
             "step": jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(mesh, P()))}
    target = checkpoint.abstract(train)  # shapes, dtypes and shardings to restore into

    losses = []
    for _ in range(args.steps):
      train, loss = train_step(train, x, y)
      losses.append(float(loss))
    mu_w1 = train["opt_state"][0].mu["w1"]
    layout = {"mu_codes": str(mu_w1.codes.sharding.spec),
              "nu_scales": [str(s.sharding.spec) for s in train["opt_state"][0].nu["w1"].scales],
              "local_codes_shape": list(mu_w1.codes.addressable_shards[0].data.shape)}

    with ocp.CheckpointManager(directory) as manager:
      checkpoint.save(manager, args.steps, train)
      manager.wait_until_finished()
      uninterrupted = train
      for _ in range(2):
        uninterrupted, loss = train_step(uninterrupted, x, y)
        losses.append(float(loss))
      restored = checkpoint.restore(manager, target)

    restored_digest = digest(restored)
    saved_digest = digest(train)
    resumed = restored
    for _ in range(2):
      resumed, _ = train_step(resumed, x, y)
    summary = {
        "process": jax.process_index(),
        "processes": jax.process_count(),
        "local_devices": jax.local_device_count(),
        "losses": losses,
        "layout": layout,
        "saved_digest": saved_digest,
        "restored_equal": restored_digest == saved_digest,
        "final_digest": digest(uninterrupted),
        "resumed_equal": digest(resumed) == digest(uninterrupted),
        "final_w1_sum": float(np.sum(fetch(uninterrupted["params"]["w1"]), dtype=np.float64)),
    }
  print(json.dumps(summary))
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(summary, f)
  if args.num_processes > 1:
    jax.distributed.shutdown()


if __name__ == "__main__":
  main()
