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

With ``--gpu-target benchmarks/gpu_target_h100.txtpb`` it compiles for that GPU
on a machine without one (XLA's deviceless compile), with optax4bit's Pallas
kernels; it needs jax's CUDA plugin and CUDA runtime wheels, not a GPU:

    pip install jax-cuda12-plugin==$(python -c "import jax; print(jax.__version__)") \
        nvidia-cuda-runtime-cu12 nvidia-cuda-nvcc-cu12
    JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 \
        python benchmarks/offload_memory.py --gpu-target benchmarks/gpu_target_h100.txtpb
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
OPTIMIZERS = {  # name -> builder taking optax4bit's `implementation`
    "optax.adamw": lambda implementation: optax.adamw(1e-3),
    "adamw_4bit": lambda implementation: optax4bit.adamw_4bit(
        1e-3, implementation=implementation),
    "adamw_4bit_factor": lambda implementation: optax4bit.adamw_4bit_factor(
        1e-3, implementation=implementation),
}
# An argument in the compiled entry layout, e.g. "u8[256,256]{1,0:S(5)}".
ARG = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]\{([^}]*)\}")


def _nbytes(tree) -> int:
  return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _abstract(tree, memory_kind: str, device=None):
  sharding = SingleDeviceSharding(device or jax.devices()[0], memory_kind=memory_kind)
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def host_argument_bytes(compiled) -> int:
  """Bytes of the compiled step's arguments laid out in host memory space S(5)."""
  layout = re.search(r"entry_computation_layout=\{\((.*?)\)->", compiled.as_text()).group(1)
  # HLO element types name their width in bits (f32, s32, u8, bf16); pred is a byte.
  itemsize = lambda t: 1 if t == "pred" else int(re.sub(r"\D", "", t)) // 8
  return sum(math.prod(int(d) for d in dims.split(",") if d) * itemsize(dtype)
             for dtype, dims, tail in ARG.findall(layout) if "S(5)" in tail)


def _option(text: str):
  name, _, value = text.partition("=")
  if not value:
    raise SystemExit(f"--compiler-option: expected NAME=VALUE, got {text!r}")
  for parse in (int, float):
    try:
      return name, parse(value)
    except ValueError:
      pass
  return name, {"true": True, "false": False}.get(value.lower(), value)


def gpu_target_device(path: str):
  """The device of a one-GPU topology described by a GpuTargetConfigProto text file."""
  from jax.experimental import topologies
  with open(path) as f:
    target = f.read()
  return topologies.get_topology_desc(
      "offload_memory", "cuda", target_config=target, topology="1x1x1").devices[0]


def compile_step(tx, params, offload: bool, compiler_options=None, device=None):
  if offload:
    tx = optax4bit.offload_state(tx)
  state = _abstract(jax.eval_shape(tx.init, params),
                    "pinned_host" if offload else "device", device)

  def step(params, state, batch):
    grads = jax.grad(optimizer_memory.loss)(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step, donate_argnums=(0, 1)).lower(
      _abstract(params, "device", device), state, optimizer_memory.BATCH).compile(
          compiler_options), state


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
  parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS),
                      choices=list(OPTIMIZERS))
  parser.add_argument(
      "--compiler-option", action="append", default=[], metavar="NAME=VALUE",
      help="an XLA option for every compile, e.g. xla_gpu_memory_limit_slop_factor=5 (the "
           "share of device memory XLA:GPU's scheduler plans for, default 95: a small one "
           "shows the schedule of a step that only just fits)")
  parser.add_argument(
      "--gpu-target", metavar="TXTPB",
      help="compile for the GPU this GpuTargetConfigProto text describes, without one "
           "(e.g. benchmarks/gpu_target_h100.txtpb; needs jax's CUDA plugin)")
  args = parser.parse_args(argv)
  options = dict(_option(text) for text in args.compiler_option) or None
  device = gpu_target_device(args.gpu_target) if args.gpu_target else jax.devices()[0]
  # optax4bit's `auto` follows the default device, the CPU when compiling for a GPU target.
  implementation = "pallas" if args.gpu_target else "auto"
  print(f"jax {jax.__version__}, compiled for {device.device_kind} ({device.platform}), "
        f"compiler options {options}; MiB")
  print("| model | optimizer | offload | state | argument | device-resident argument | "
        "device-resident argument + temp | output | alias | temp | host_argument | host_temp | "
        "moved host<->device/step |")
  print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  for config in args.configs:
    params = optimizer_memory.gpt_params(**CONFIGS[config])
    for name in args.optimizers:
      for offload in (False, True):
        row = f"| {config} | {name} | {'yes' if offload else 'no'} | "
        try:
          compiled, state = compile_step(OPTIMIZERS[name](implementation), params, offload,
                                         options, device)
        except jax.errors.JaxRuntimeError as error:  # an XLA compiler failure is a finding
          print(row + f"compile failed: {str(error).splitlines()[0][:160]} |", flush=True)
          continue
        m = compiled.memory_analysis()
        host = host_argument_bytes(compiled)
        moved = 2 * _nbytes(state) if offload else 0
        # XLA:GPU counts host-space arguments in host_argument_size_in_bytes only; the CPU
        # backend counts them in argument_size_in_bytes and leaves the host fields at 0.
        device_argument = (m.argument_size_in_bytes if m.host_argument_size_in_bytes
                           else m.argument_size_in_bytes - host)
        cells = [_nbytes(state), m.argument_size_in_bytes, device_argument,
                 device_argument + m.temp_size_in_bytes,
                 m.output_size_in_bytes, m.alias_size_in_bytes, m.temp_size_in_bytes,
                 m.host_argument_size_in_bytes, m.host_temp_size_in_bytes, moved]
        print(row + " | ".join(f"{c / MiB:.0f}" for c in cells) + " |", flush=True)


if __name__ == "__main__":
  main()
