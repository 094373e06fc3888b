"""What each optimizer's step compiles to on a TPU, compiled on a machine without one.

Compile-only, with the real TPU compiler (``libtpu``, the ``tpu-check`` extra:
``pip install -e .[tpu-check]``): ``jax.experimental.topologies`` describes a
TPU slice (``TOPOLOGIES``: v5e ``"v5e:2x2"``, v5p ``"v5p:2x2x1"``, v6e
``"v6e:2x2"``, ...; no TPU and no metadata server needed with
``TPU_SKIP_MDS_QUERY=1``), and each step is
``jax.jit(step, donate_argnums=...).lower(<ShapeDtypeStructs on one of its
devices>).compile()``. Nothing the size of the model is allocated.

Settings (``--settings``):

* ``update``: ``tx.update(grads, state, params)`` then
  ``optax.apply_updates``; params, state and gradients donated. The tree
  (`update_tree`) is GPT-like, 76.7M float32 parameters: a 50304 x 1024
  embedding and 2 blocks of width 1024 (qkv, out, mlp_in, mlp_out matrices, two
  norm vectors, a bias of 4096). ``--scale s`` divides the width and the
  vocabulary by ``s`` (the tests use ``--scale 4``: 4.8M parameters).
* ``train``: the GPT-2 124M training step of ``benchmarks/training_memory.py``
  (batch 4 x 1024, layers under ``jax.lax.scan`` and ``jax.checkpoint``; its
  ``param_shapes`` and ``loss_fn``); params and state donated. ``--scale``
  divides its width, heads, vocabulary and sequence.

Params and gradients are in the row's dtype (``--dtypes``: float32, bfloat16).
``implementation="auto"`` follows the platform the update is compiled for
(`optax4bit.dispatch.per_platform`): traced here, with this machine's CPU as
the default device, it runs the TPU's engine, as a user's ahead-of-time
compile from a CPU host does.

Columns (from the compiled executable):

* ``fusions``, ``while``, ``copies``: instructions of the entry computation
  (loop bodies not counted); ``gathers``: ``" gather("`` anywhere in the
  optimized HLO.
* ``B/param``: ``cost_analysis()["bytes accessed"]``, plus the operands and
  results of the Pallas TPU kernels (``tpu_custom_call``, which the cost
  model leaves out: a module holding only one has no ``"bytes accessed"``,
  and in a module with other instructions it counts only theirs; a kernel
  whose blocks each load and store once moves exactly these bytes), over the
  parameters; ``kern``: the kernels' part. XLA:TPU's memory-space assignment
  prefetches operands into on-chip memory (``copy-start``/``slice-start``),
  and the cost model counts those copies too: ``optax.adamw``'s 46.1 B/param
  on the v5e is 28 B/param of the update plus such copies; ``x base``: its ratio to the optax baseline of the same generation, setting
  and dtype (``optax.adamw`` for the Adam-like rows, ``optax.sgd`` with
  momentum for ``sgdm_4bit``).
* ``temp``: ``memory_analysis().temp_size_in_bytes``; ``total``: arguments +
  outputs - aliased (the donated buffers counted once) + temp, as in
  ``benchmarks/training_memory.py``. MiB.
* ``compile s``: seconds to trace, lower and compile the step, after every
  optimizer compiled a small update once (`warm_up`: one-time costs of the
  process are not counted against the first optimizer measured).
* ``fus/leaf``: (fusions - the baseline's fusions) / the leaves with more than
  4096 elements (those the optimizers quantize by default).
* ``opt s raw``, ``unest.``, ``est. s``, ``x base``: XLA:TPU's
  ``optimal_seconds``, the instructions it could not estimate, the estimate of
  the rest and its ratio to the baseline's (see below).

Negative ``optimal_seconds``: each instruction the TPU cost model cannot
estimate adds a sentinel of -1 to the module's ``optimal_seconds`` (and to
``flops``) instead of a time. Verified with libtpu 0.0.42.1 (jax 0.10.2, v5e):

* jitted functions that transpose k float32 (2048 + 128 i, 4096) arrays: for
  k = 1 and 2 ``optimal_seconds`` is positive (9.1e-05, 3.8e-04) and the HLO
  holds copies but no custom call; for k = 3..8 the compiler splits large
  operands into ``slice-start``s joined by a
  ``custom-call(custom_call_target="ConcatBitcast")``, k - 2 of them, and
  ``optimal_seconds`` = e - (k - 2) with e small and positive (-1.99909 for
  k = 4), ``flops`` = -(k - 2) exactly;
* the update steps of this script (scale 4, float32, implementation "jnp"):
  the integer part is minus the number of ConcatBitcast custom calls in every
  row (optax.adamw -2.9995 with 3, optax.sgd -0.9996 with 1, adamw_4bit
  -11.9992 with 12, adamw_4bit_factor and sgdm_4bit -10.9994 with 11,
  adamw_8bit -8.905 with 6 in the entry computation and 3 in while-loop
  bodies); on the full tree likewise (18 to 56 per row, raw + count between
  0.0038 and 0.23 s); and on v6e and tpu7x (bfloat16 sgd and sgdm_4bit: -0.9999
  with 1, -1.9998 with 2; v5p's steps had none and positive seconds), while
  its ``AllocateBuffer`` (9 in adamw_4bit) and ``AssumeGatherIndicesInBound``
  (144 in adamw_8bit, inside fusions) custom calls add nothing;
* the train step of optax.adamw (scale 4, float32): -17.998 with 18
  ConcatBitcasts beside one ``GatherScatterIndicesBitpacked`` (the embedding's
  gather), which adds nothing either.

Copies, transposes, sorts, gathers, dots, reductions, while loops, dynamic
slices, bitcasts and plain fusions, each jitted alone, gave positive seconds. So the script counts the ConcatBitcast
custom calls of the optimized HLO (``unest.``, `SENTINEL_TARGETS`) and reports
``raw + unest.`` as the estimate; a row where that is not in [0, 1) s, or
whose HLO holds a custom call of a target not seen here
(`ESTIMATED_TARGETS`), is marked ``?`` and gets no ratio. The module's
``"bytes accessed"`` stayed a multiple of 4 in these cases (no -1 in it),
while its per-operand entries (``"bytes accessed1{}"``...) can be -1.

While loops: ``bytes accessed``, ``flops`` and ``optimal_seconds`` count a
loop body once, whatever its trip count: for a ``fori_loop`` of 3 and of 30
iterations of ``sin(v) * 2 + 1`` on a (2048, 4096) float32 array all three
are identical, ``flops`` (2 x 2048 x 4096) and ``transcendentals``
(2048 x 4096) those of one iteration. The jnp
implementation updates large leaves in loops over chunks and the train
setting scans its layers, so in rows with while loops (``while`` > 0) these
figures leave out all but one iteration of each loop: compare them only
between rows with the same loops. Temp and total bytes are unaffected (buffer
assignment). The estimate is the cost model's sum over instructions, not a
measured time.

Usage:
  python benchmarks/tpu_compile.py --implementation jnp          # update, float32, v5e
  python benchmarks/tpu_compile.py --generations v5e v5p v6e --dtypes float32 bfloat16 \\
      --settings update train --json /tmp/tpu_compile.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import importlib.metadata
import json
import math
import os
import re
import sys
import time
import warnings

# Before libtpu initializes: no metadata server to ask (no TPU VM), and no
# /tmp/libtpu_lockfile (it lets one process at a time load libtpu, for the
# chips; compiling needs none, and pytest-xdist workers load it side by side).
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import optax4bit  # noqa: E402
import hlo_text  # noqa: E402
import training_memory  # noqa: E402  (GPTConfig, param_shapes, loss_fn)

# Topology names the installed libtpu (0.0.42.1) accepts ("<gen>:<chips>"; the
# chips must cover a host's 2x2x1): each gives a slice of 4 (v4: 8) devices.
# Refused: "v5e:1x1" (not divisible by the host's 2x2x1), "v5litepod-4",
# "v5p-8" (not "<gen>:<layout>"), "v7x:2x2x1" (the name is "tpu7x").
TOPOLOGIES = {
    "v4": "v4:2x2x1",
    "v5e": "v5e:2x2",
    "v5p": "v5p:2x2x1",
    "v6e": "v6e:2x2",
    "tpu7x": "tpu7x:2x2x1",
}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
SETTINGS = ("update", "train")
# Leaves with more elements than this are quantized by the optimizers' default
# min_quantize_size (4096).
QUANTIZED_ABOVE = 4096

# Custom calls whose cost the TPU cost model gives as -1 (see the docstring), and
# those seen to add nothing: a row with any other custom call gets no estimate.
SENTINEL_TARGETS = frozenset({"ConcatBitcast"})
ESTIMATED_TARGETS = frozenset({"AllocateBuffer", "AssumeGatherIndicesInBound",
                               "GatherScatterIndicesBitpacked"})

# The custom call of a Pallas TPU kernel: the cost model leaves it out of its
# "bytes accessed" (a module of one kernel has no such key); `kernel_bytes` adds
# its operands and results (`hlo_text.custom_call_bytes`).
PALLAS_TPU_TARGET = "tpu_custom_call"

# name -> (factory(implementation), baseline name)
OPTIMIZERS = {
    "optax.adamw": (lambda impl: optax.adamw(1e-3), None),
    "adamw_4bit": (lambda impl: optax4bit.adamw_4bit(1e-3, implementation=impl),
                   "optax.adamw"),
    "adamw_4bit paper": (lambda impl: optax4bit.adamw_4bit(1e-3, recipe="paper",
                                                           implementation=impl),
                         "optax.adamw"),
    "adamw_4bit_factor": (lambda impl: optax4bit.adamw_4bit_factor(1e-3, implementation=impl),
                          "optax.adamw"),
    "adamw_8bit": (lambda impl: optax4bit.adamw_8bit(1e-3, implementation=impl),
                   "optax.adamw"),
    "optax.sgd momentum": (lambda impl: optax.sgd(1e-3, momentum=0.9), None),
    "sgdm_4bit": (lambda impl: optax4bit.sgdm_4bit(1e-3, momentum=0.9, implementation=impl),
                  "optax.sgd momentum"),
}


@dataclasses.dataclass
class Row:
  generation: str
  setting: str
  dtype: str
  optimizer: str
  implementation: str
  params: int
  quantized_leaves: int
  fusions: int
  while_loops: int
  gathers: int
  copies: int
  custom_calls: dict
  bytes_accessed: float
  kernel_bytes: int
  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  state_bytes: int
  compile_s: float
  optimal_seconds: float
  flops: float
  baseline: str = None
  bytes_ratio: float = None
  optimal_ratio: float = None
  fusions_per_quantized_leaf: float = None

  @property
  def total_bytes(self) -> int:
    """Arguments + outputs - aliased (donated buffers counted once) + temp."""
    return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

  @property
  def bytes_per_param(self) -> float:
    """The cost model's bytes plus the Pallas TPU kernels' (`kernel_bytes`)."""
    return (self.bytes_accessed + self.kernel_bytes) / self.params

  @property
  def unestimated(self) -> int:
    """Instructions the cost model gave its -1 sentinel (`SENTINEL_TARGETS`)."""
    return sum(n for target, n in self.custom_calls.items() if target in SENTINEL_TARGETS)

  @property
  def estimated_seconds(self) -> float:
    """``optimal_seconds`` without the sentinels."""
    return self.optimal_seconds + self.unestimated

  @property
  def estimate_trusted(self) -> bool:
    """No custom call of an unknown target, and no sentinel left over."""
    known = SENTINEL_TARGETS | ESTIMATED_TARGETS
    return set(self.custom_calls) <= known and 0 <= self.estimated_seconds < 1

  def to_json(self) -> dict:
    out = dataclasses.asdict(self)
    out.update(total_bytes=self.total_bytes, bytes_per_param=self.bytes_per_param,
               unestimated=self.unestimated, estimated_seconds=self.estimated_seconds,
               estimate_trusted=self.estimate_trusted)
    return out


def tpu_device(generation: str = "v5e"):
  """The first device of the generation's `TOPOLOGIES` slice (raises where the
  installed libtpu cannot make it, or none is installed)."""
  return _topology(TOPOLOGIES.get(generation, generation)).devices[0]


def kernels_compile_error(device) -> str | None:
  """None where the installed libtpu compiles this jax's Pallas TPU kernels
  for ``device``, else why not. A libtpu of another jax release describes
  the topology and compiles XLA, but may not read the kernels' Mosaic
  config (jax 0.12 with libtpu 0.0.42: "no such field: 'debug_locations'")."""
  from jax.experimental import pallas as pl  # pylint: disable=import-outside-toplevel

  def double(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2

  x = jax.ShapeDtypeStruct((8, 128), jnp.float32, sharding=SingleDeviceSharding(device))
  kernel = pl.pallas_call(double, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32))
  try:
    jax.jit(kernel).lower(x).compile()
  except Exception as e:  # pylint: disable=broad-except  (JaxRuntimeError, ValueError...)
    return (f"libtpu {importlib.metadata.version('libtpu')} does not compile jax "
            f"{jax.__version__}'s Pallas TPU kernels (install the libtpu that "
            f"jax[tpu]=={jax.__version__} asks for): {str(e)[:300]}")
  return None


_TOPOLOGY_CACHE = {}


def _topology(name: str):
  if name not in _TOPOLOGY_CACHE:
    from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
    _TOPOLOGY_CACHE[name] = topologies.get_topology_desc(platform="tpu", topology_name=name)
  return _TOPOLOGY_CACHE[name]


def update_tree(scale: int = 1, dtype=jnp.float32) -> dict:
  """The GPT-like tree of the update setting: 76.7M parameters at scale 1."""
  d, vocab = 1024 // scale, 50304 // scale
  s = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
  tree = {"embed": s(vocab, d)}
  for b in range(2):
    tree[f"block{b}"] = {"qkv": s(d, 3 * d), "out": s(d, d), "mlp_in": s(d, 4 * d),
                         "mlp_out": s(4 * d, d), "norm1": s(d), "norm2": s(d),
                         "bias": s(4 * d)}
  return tree


def train_config(scale: int = 1) -> training_memory.GPTConfig:
  """GPT-2 124M (12 layers of 768, 12 heads, vocabulary 50304, batch 4 x
  1024), its width, heads, vocabulary and sequence divided by ``scale``."""
  if scale == 1:
    return training_memory.TABLE_CONFIGS[0]
  return training_memory.GPTConfig(f"GPT-2 124M / {scale}", 12, 768 // scale,
                                   max(1, 12 // scale), vocab=50304 // scale,
                                   seq_len=1024 // scale)


def hlo_counts(hlo: str) -> dict:
  """Entry fusions, while loops and copies, gathers and custom calls (by target)
  anywhere, of an optimized HLO module's text."""
  entry = collections.Counter(i.opcode for i in hlo_text.instructions(hlo) if i.in_entry)
  targets = collections.Counter(re.findall(r'custom_call_target="([^"]+)"', hlo))
  return {"fusions": entry["fusion"], "while_loops": entry["while"], "copies": entry["copy"],
          "gathers": hlo.count(" gather("), "custom_calls": dict(targets)}


def cost(compiled) -> dict:
  """``cost_analysis()``: a dict, or on some versions a list of one."""
  analysis = compiled.cost_analysis()
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0] if analysis else {}
  return dict(analysis or {})


def _on(device, tree):
  sharding = SingleDeviceSharding(device)
  return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), tree)


def compile_step(tx, setting: str, dtype, device, scale: int = 1):
  """(compiled step, params tree, state tree, seconds to lower and compile)."""
  if setting == "update":
    params = update_tree(scale, dtype)
  else:
    cfg = train_config(scale)
    params = training_memory.param_shapes(cfg, dtype)
  state = jax.eval_shape(tx.init, params)
  start = time.perf_counter()
  # The gradients are donated in the update setting whether or not an output
  # can reuse them (optax's adamw returns params and 2 moments: one buffer spare).
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", "Some donated buffers were not usable")
    if setting == "update":
      def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state
      lowered = jax.jit(step, donate_argnums=(0, 1, 2)).lower(
          _on(device, params), _on(device, state), _on(device, params))
    else:
      tokens = jax.ShapeDtypeStruct((cfg.batch, cfg.seq_len + 1), jnp.int32)

      def step(params, state, tokens):
        loss, grads = jax.value_and_grad(training_memory.loss_fn)(params, tokens, cfg)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss
      lowered = jax.jit(step, donate_argnums=(0, 1)).lower(
          _on(device, params), _on(device, state), _on(device, tokens))
  compiled = lowered.compile()
  return compiled, params, state, time.perf_counter() - start


def measure(name: str, setting: str = "update", dtype: str = "float32",
            generation: str = "v5e", implementation: str = "auto", scale: int = 1) -> Row:
  """Compiles one (optimizer, setting, dtype) step for the generation's device."""
  factory, baseline = OPTIMIZERS[name]
  tx = factory(implementation)
  compiled, params, state, seconds = compile_step(tx, setting, DTYPES[dtype],
                                                  tpu_device(generation), scale)
  analysis, memory = cost(compiled), compiled.memory_analysis()
  hlo = compiled.as_text()
  leaves = jax.tree.leaves(params)
  return Row(
      generation=generation, setting=setting, dtype=dtype, optimizer=name,
      implementation=implementation if baseline else "optax",
      params=sum(math.prod(p.shape) for p in leaves),
      quantized_leaves=sum(math.prod(p.shape) > QUANTIZED_ABOVE for p in leaves),
      **hlo_counts(hlo),
      bytes_accessed=analysis.get("bytes accessed", float("nan")),
      kernel_bytes=hlo_text.custom_call_bytes(hlo, PALLAS_TPU_TARGET),
      argument_bytes=memory.argument_size_in_bytes, output_bytes=memory.output_size_in_bytes,
      alias_bytes=memory.alias_size_in_bytes, temp_bytes=memory.temp_size_in_bytes,
      state_bytes=optax4bit.state_nbytes(state), compile_s=seconds,
      optimal_seconds=analysis.get("optimal_seconds", float("nan")),
      flops=analysis.get("flops", 0.0), baseline=baseline)


def compare(row: Row, base: Row) -> Row:
  """Fills the row's ratios to its baseline's."""
  row.bytes_ratio = row.bytes_per_param / base.bytes_per_param
  if row.estimate_trusted and base.estimate_trusted and base.estimated_seconds > 0:
    row.optimal_ratio = row.estimated_seconds / base.estimated_seconds
  row.fusions_per_quantized_leaf = (row.fusions - base.fusions) / max(row.quantized_leaves, 1)
  return row


HEADER = ("| gen | setting | dtype | optimizer | fusions | while | gathers | copies | B/param "
          "| kern | x base | temp MiB | total MiB | compile s | opt s raw | unest. | est. s "
          "| x base | fus/leaf |\n" + "|---" * 19 + "|")


def format_row(r: Row) -> str:
  ratio = lambda x, f="{:.2f}": "" if x is None else f.format(x)  # noqa: E731
  est = f"{r.estimated_seconds:.3g}" + ("" if r.estimate_trusted else " ?")
  return (f"| {r.generation} | {r.setting} | {r.dtype} | {r.optimizer} | {r.fusions} "
          f"| {r.while_loops} | {r.gathers} | {r.copies} | {r.bytes_per_param:.1f} "
          f"| {r.kernel_bytes / r.params:.1f} | {ratio(r.bytes_ratio)} | {r.temp_bytes / 2**20:.1f} | {r.total_bytes / 2**20:.1f} "
          f"| {r.compile_s:.1f} | {r.optimal_seconds:.6g} | {r.unestimated} | {est} "
          f"| {ratio(r.optimal_ratio)} | {ratio(r.fusions_per_quantized_leaf, '{:.1f}')} |")


def warm_up(names, generation: str, implementation: str) -> None:
  """Compiles each optimizer's update of a small tree once, so that one-time
  costs (the first Pallas TPU lowering, the quantizers' constant tables) are
  not counted in the first measured optimizer's compile time."""
  device = tpu_device(generation)
  params = {"w": jax.ShapeDtypeStruct((64, 512), jnp.float32),
            "b": jax.ShapeDtypeStruct((64,), jnp.float32)}
  for name in names:
    tx = OPTIMIZERS[name][0](implementation)
    state = jax.eval_shape(tx.init, params)
    jax.jit(tx.update).lower(_on(device, params), _on(device, state),
                             _on(device, params)).compile()


def run(optimizers=None, settings=("update",), dtypes=("float32",), generations=("v5e",),
        implementation: str = "auto", scale: int = 1, progress=None) -> list:
  """Rows for every (generation, setting, dtype, optimizer); the baselines
  the optimizers are compared with are compiled (and listed) too."""
  optimizers = list(optimizers or OPTIMIZERS)
  wanted = set(optimizers) | {OPTIMIZERS[n][1] for n in optimizers if OPTIMIZERS[n][1]}
  ordered = [n for n in OPTIMIZERS if n in wanted]
  rows = []
  for generation in generations:
    warm_up(ordered, generation, implementation)
    for setting in settings:
      for dtype in dtypes:
        done = {}
        for name in ordered:
          row = measure(name, setting, dtype, generation, implementation, scale)
          if row.baseline:
            compare(row, done[row.baseline])
          done[name] = row
          rows.append(row)
          if progress:
            progress(row)
  return rows


def libtpu_version() -> str:
  for dist in ("libtpu", "libtpu-nightly"):
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
      return importlib.metadata.version(dist)
  return "not installed"


def main(argv=None) -> list:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS),
                      choices=list(OPTIMIZERS))
  parser.add_argument("--settings", nargs="+", default=["update"], choices=SETTINGS)
  parser.add_argument("--dtypes", nargs="+", default=["float32"], choices=list(DTYPES))
  parser.add_argument("--generations", nargs="+", default=["v5e"], choices=list(TOPOLOGIES))
  parser.add_argument("--implementation", default="auto",
                      help="optax4bit's implementation= ('auto', 'jnp', ...)")
  parser.add_argument("--scale", type=int, default=1,
                      help="divide the widths (and vocabulary, sequence) by this")
  parser.add_argument("--json", metavar="PATH", help="also write the rows to this file")
  args = parser.parse_args(argv)
  update = update_tree(args.scale)
  print(f"jax {jax.__version__}, libtpu {libtpu_version()}; update: "
        f"{sum(math.prod(p.shape) for p in jax.tree.leaves(update)) / 1e6:.1f}M params, "
        f"train: {train_config(args.scale).name}; implementation={args.implementation!r}; "
        f"topologies {', '.join(TOPOLOGIES[g] for g in args.generations)}", flush=True)
  print(HEADER, flush=True)
  rows = run(args.optimizers, args.settings, args.dtypes, args.generations,
             args.implementation, args.scale, progress=lambda r: print(format_row(r), flush=True))
  print("\nB/param and the seconds count each while loop's body once (module docstring); "
        "est. s: opt s raw + unest. (the ConcatBitcast custom calls' -1 sentinels), '?' where "
        "that is not in [0, 1) or an unknown custom call is present; total: arguments + "
        "outputs - aliased + temp.", flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"jax": jax.__version__, "libtpu": libtpu_version(),
                 "topologies": {g: TOPOLOGIES[g] for g in args.generations},
                 "scale": args.scale, "rows": [r.to_json() for r in rows]}, f, indent=1)
  return rows


if __name__ == "__main__":
  main()
