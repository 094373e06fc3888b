"""What the GPU session's jitted steps compile to on a GPU: kernels, copies, loops, temp bytes.

Compile-only. Counts, in the compiled step's entry computation, the Triton
(Pallas) kernels, XLA fusions, copies and while loops, with the copies grouped
by shape, the bytes its instructions read and write per parameter
(`hlo_text.entry_bytes`: XLA:GPU's deviceless ``cost_analysis()`` gives none;
a while loop's body is counted once, not per trip), and XLA's temp bytes, in the two settings of
``benchmarks/gpu_session.py`` (``--steps``): ``update``, the update alone with
params, state and gradients donated (``gpu_step.py``'s), and ``train``, the
gradients from ``jax.grad`` of the session's transformer loss, params and
state donated. Run it on a GPU, or on a machine without one with
``--gpu-target`` (XLA's deviceless compile; see ``benchmarks/offload_memory.py``
for the plugin it needs):

    JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python benchmarks/gpu_step_kernels.py \\
        --gpu-target benchmarks/gpu_target_h100.txtpb --steps update train
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import re
import sys

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_session  # noqa: E402  (gpt_loss)
import gpu_step  # noqa: E402  (SIZES, gpt_shapes, _is_shape)
import hlo_text  # noqa: E402
import offload_memory  # noqa: E402  (gpu_target_device, _abstract)

import optax4bit  # noqa: E402

OPTIMIZERS = {
    "optax.adamw": lambda: optax.adamw(1e-3),
    "adamw_4bit": lambda: optax4bit.adamw_4bit(1e-3, implementation="pallas"),
    "adamw_4bit paper recipe": lambda: optax4bit.adamw_4bit(1e-3, recipe="paper",
                                                            implementation="pallas"),
    "adamw_4bit_factor": lambda: optax4bit.adamw_4bit_factor(1e-3, implementation="pallas"),
    "adamw_4bit update not in place": lambda: optax4bit.adamw_4bit(
        1e-3, implementation=optax4bit.pallas.PallasConfig(update_in_place=False)),
    # The XLA engine: what `auto` runs on a GPU where the Pallas kernels do not compile.
    "adamw_4bit xla": lambda: optax4bit.adamw_4bit(1e-3, implementation="xla"),
    "adamw_4bit paper recipe xla": lambda: optax4bit.adamw_4bit(1e-3, recipe="paper",
                                                                implementation="xla"),
    "adamw_4bit_factor xla": lambda: optax4bit.adamw_4bit_factor(1e-3, implementation="xla"),
    "adamw_8bit xla": lambda: optax4bit.adamw_8bit(1e-3, implementation="xla"),
    "adamw_8bit jnp": lambda: optax4bit.adamw_8bit(1e-3, implementation="jnp"),
    "optax.sgd momentum": lambda: optax.sgd(1e-3, momentum=0.9),
    "sgdm_4bit xla": lambda: optax4bit.sgdm_4bit(1e-3, momentum=0.9, implementation="xla"),
    "adamw_4bit jnp": lambda: optax4bit.adamw_4bit(1e-3, implementation="jnp"),
}


def entry_counts(hlo: str) -> dict:
  """Kernels, copies and loops of an optimized HLO module's entry computation."""
  entry = hlo[hlo.index("\nENTRY"):]
  entry = entry[:entry.index("\n}\n")]
  instructions = [i for i in hlo_text.instructions(hlo) if i.in_entry]
  ops = collections.Counter(i.opcode for i in instructions)
  triton = len(re.findall(r'custom_call_target="__gpu\$xla\.gpu\.triton"', entry))
  copies = collections.Counter(i.shape for i in instructions if i.opcode == "copy")
  return {"triton kernels": triton, "fusions": ops["fusion"], "copies": ops["copy"],
          "while loops": ops["while"], "copied shapes": dict(copies.most_common(6))}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", default="100M", choices=list(gpu_step.SIZES))
  parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS),
                      choices=list(OPTIMIZERS))
  parser.add_argument("--gpu-target", metavar="TXTPB",
                      help="compile for this GpuTargetConfigProto text, without a GPU")
  parser.add_argument("--steps", nargs="+", default=["update"], choices=["update", "train"])
  parser.add_argument("--batch", type=int, default=4, help="train: sequences per step")
  parser.add_argument("--seq", type=int, default=256, help="train: tokens per sequence")
  args = parser.parse_args(argv)
  device = (offload_memory.gpu_target_device(args.gpu_target) if args.gpu_target
            else jax.devices()[0])
  shapes, treedef = jax.tree.flatten(gpu_step.gpt_shapes(**gpu_step.SIZES[args.size]),
                                     is_leaf=gpu_step._is_shape)  # pylint: disable=protected-access
  params = offload_memory._abstract(  # pylint: disable=protected-access
      treedef.unflatten([jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]), "device",
      device)
  num_params = sum(math.prod(s) for s in shapes)
  print(f"jax {jax.__version__}, compiled for {device.device_kind}, {args.size} float32 "
        f"params; update: params, state and gradients donated as in gpu_step.py; train: "
        f"{args.batch} x {args.seq} tokens, params and state donated")
  tokens = offload_memory._abstract(  # pylint: disable=protected-access
      jax.ShapeDtypeStruct((args.batch, args.seq + 1), jnp.int32), "device", device)
  for step_kind in args.steps:
    for name in args.optimizers:
      tx = OPTIMIZERS[name]()
      state = offload_memory._abstract(  # pylint: disable=protected-access
          jax.eval_shape(tx.init, params), "device", device)
      if step_kind == "update":
        def step(params, state, grads, tx=tx):
          updates, state = tx.update(grads, state, params)
          return optax.apply_updates(params, updates), state
        lowered = jax.jit(step, donate_argnums=(0, 1, 2)).lower(params, state, params)
      else:
        def step(params, state, tokens, tx=tx):
          grads = jax.grad(gpu_session.gpt_loss)(params, tokens)
          updates, state = tx.update(grads, state, params)
          return optax.apply_updates(params, updates), state
        lowered = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, tokens)
      compiled = lowered.compile()
      hlo = compiled.as_text()
      counts = entry_counts(hlo)
      counts["bytes/param"] = round(hlo_text.entry_bytes(hlo) / num_params, 2)
      counts["temp MiB"] = round(compiled.memory_analysis().temp_size_in_bytes / 2**20, 1)
      print(f"{step_kind} {name}: {counts}", flush=True)


if __name__ == "__main__":
  main()
