"""Device memory of a train step with the optimizer state offloaded to host.

Compiles (shapes only, nothing is allocated) the donated train step of
``benchmarks/optimizer_memory.py`` for GPT-like trees, once with the state in
device memory and once wrapped in `optax4bit.offload_state` with the state in
``pinned_host`` memory, and prints per step:

* ``memory_analysis()`` of the compiled step: argument, output, alias and
  temp bytes, and the ``host_*`` fields;
* device-resident argument bytes: the step's arguments minus those whose
  layout in the compiled ``entry_computation_layout`` is in the host memory
  space ``S(5)``. The CPU backend counts host-space arguments in
  ``argument_size_in_bytes`` (its ``host_*`` fields stay 0, host and device
  memory being the same RAM), so this column is what a GPU keeps off-device;
* bytes moved host <-> device per step: every state array is copied to the
  device and back once, twice the state's bytes.

    python benchmarks/offload_memory.py [--configs 124M 1B]
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys

import jax
import jax.numpy as jnp
import optax
from jax.sharding import SingleDeviceSharding

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import optimizer_memory  # noqa: E402  (gpt_params, loss, BATCH)

import optax4bit  # noqa: E402

MiB = 2**20
CONFIGS = {"124M": optimizer_memory.CONFIGS["124M"],
           "1B": dict(vocab=50304, width=2048, depth=18)}
OPTIMIZERS = {
    "optax.adamw": lambda: optax.adamw(1e-3),
    "adamw_4bit": lambda: optax4bit.adamw_4bit(1e-3),
    "adamw_4bit_factor": lambda: optax4bit.adamw_4bit_factor(1e-3),
}
# An argument in the compiled entry layout, e.g. "u8[256,256]{1,0:S(5)}".
ARG = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]\{([^}]*)\}")


def _nbytes(tree) -> int:
  return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _abstract(tree, memory_kind: str):
  sharding = SingleDeviceSharding(jax.devices()[0], memory_kind=memory_kind)
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def host_argument_bytes(compiled) -> int:
  """Bytes of the compiled step's arguments laid out in host memory space S(5)."""
  layout = re.search(r"entry_computation_layout=\{\((.*?)\)->", compiled.as_text()).group(1)
  # HLO element types name their width in bits (f32, s32, u8, bf16); pred is a byte.
  itemsize = lambda t: 1 if t == "pred" else int(re.sub(r"\D", "", t)) // 8
  return sum(math.prod(int(d) for d in dims.split(",") if d) * itemsize(dtype)
             for dtype, dims, tail in ARG.findall(layout) if "S(5)" in tail)


def compile_step(tx, params, offload: bool):
  if offload:
    tx = optax4bit.offload_state(tx)
  state = _abstract(jax.eval_shape(tx.init, params),
                    "pinned_host" if offload else "device")

  def step(params, state, batch):
    grads = jax.grad(optimizer_memory.loss)(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step, donate_argnums=(0, 1)).lower(
      _abstract(params, "device"), state, optimizer_memory.BATCH).compile(), state


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
  parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS),
                      choices=list(OPTIMIZERS))
  args = parser.parse_args(argv)
  print(f"jax {jax.__version__}, backend {jax.default_backend()}; MiB")
  print("| model | optimizer | offload | state | argument | device-resident argument | "
        "output | alias | temp | host_argument | host_temp | moved host<->device/step |")
  print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  for config in args.configs:
    params = optimizer_memory.gpt_params(**CONFIGS[config])
    for name in args.optimizers:
      for offload in (False, True):
        compiled, state = compile_step(OPTIMIZERS[name](), params, offload)
        m = compiled.memory_analysis()
        host = host_argument_bytes(compiled)
        moved = 2 * _nbytes(state) if offload else 0
        cells = [_nbytes(state), m.argument_size_in_bytes, m.argument_size_in_bytes - host,
                 m.output_size_in_bytes, m.alias_size_in_bytes, m.temp_size_in_bytes,
                 m.host_argument_size_in_bytes, m.host_temp_size_in_bytes, moved]
        print(f"| {config} | {name} | {'yes' if offload else 'no'} | "
              + " | ".join(f"{c / MiB:.0f}" for c in cells) + " |", flush=True)


if __name__ == "__main__":
  main()
