"""Step time of the jitted, donated optimizer update on CPU, as a ratio to
``optax.adamw`` measured in the same run.

Steps of all optimizers are interleaved round by round so that machine noise
hits them alike, and the median per optimizer is reported. ``--step`` picks
what is jitted:

* ``update`` (default): ``jax.jit(tx.update, donate_argnums=(0, 1))``, the
  update with its gradients and state donated; params are a read-only input.
  This is the issue's "jitted, donated update".
* ``apply``: ``updates, state = tx.update(grads, state, params); params =
  optax.apply_updates(params, updates)`` with params and state donated and the
  gradients a read-only input. The 4-bit optimizers write each leaf's update
  over its gradient (to keep transient memory flat), so XLA first copies every
  read-only gradient into fresh memory; the row "in-place floor" measures that
  cost alone: an update that writes one element of each gradient in place and
  does no optimizer math.
* ``train``: as ``apply``, but the gradients are computed inside the step, by
  a backward pass through a thin linear layer per leaf (two small matmuls),
  which leaves them in fresh buffers as a training step does. The gradient
  cost is shared by every optimizer; the ``optax.sgd`` row shows it with the
  cheapest update, and the last columns subtract it.

    python benchmarks/optimizer_speed.py                 # SPEC tree: 4 x 2048x2048
    python benchmarks/optimizer_speed.py --tree gpt124m  # GPT-like, 124M params
    python benchmarks/optimizer_speed.py --tree spec-stacked  # the same as one (4, 2048, 2048) leaf
    python benchmarks/optimizer_speed.py --step train    # gradients made in the step
    python benchmarks/optimizer_speed.py --optimizers optax.adamw "adamw_4bit (cpu)" \
        --cpu-isas avx512 avx2 baseline     # the C++ kernel's ISA paths side by side
    python benchmarks/optimizer_speed.py --tree one-4096 --param-dtype bfloat16 --step apply \
        --optimizers optax.adamw adamw_4bit "adamw_4bit (nearest)"
        # what round_params_stochastically (the default for bfloat16 params) adds to a step
    python benchmarks/optimizer_speed.py --optimizers optax.adamw "adamw_4bit (cpu)" \
        "adamw_4bit (m stall, cpu)" --cpu-isas avx2 baseline --paired-to "adamw_4bit (cpu)"
        # what the stall rule costs, paired with the default on each ISA path

On CPU the first line printed names the ISA path the C++ kernel runs
(``OPTAX4BIT_CPU_ISA`` forces another); ``--cpu-isas`` adds a row per path for
each optimizer forced onto the kernel (``... cpu)``), switched between steps.
"""

from __future__ import annotations

import argparse
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax4bit
from optimizer_memory import CONFIGS, gpt_params
from optax4bit.cpu import ffi as cpu_ffi

_STALL_M = optax4bit.QuantSpec.parse("B128/NF", stochastic=True, stall_only=True)
_STALL_V = optax4bit.QuantSpec.parse("Rank-1/SqrtLinear", stochastic=True, stall_only=True)


def in_place_floor() -> optax.GradientTransformation:
  """Writes one element of each gradient in place and returns it as the
  update: the cost an in-place update pays before doing any math."""

  def write_one_element(g):
    # A loop XLA cannot remove: its carry is updated in place.
    trips = jax.lax.optimization_barrier(jnp.int32(1))
    corner = lambda i: (i,) + (0,) * (g.ndim - 1)
    return jax.lax.fori_loop(0, trips, lambda i, x: x.at[corner(i)].set(x[corner(i)] * 1.0), g)

  def update_fn(updates, state, params=None):
    del params
    return jax.tree.map(write_one_element, updates), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


OPTIMIZERS = {
    "optax.adamw": lambda: optax.adamw(1e-3),
    "adamw_4bit": lambda: optax4bit.adamw_4bit(1e-3),
    # The jnp engine; "adamw_4bit" runs the C++ kernel on CPU where it is built.
    "adamw_4bit (jnp)": lambda: optax4bit.adamw_4bit(1e-3, implementation="jnp"),
    "adamw_4bit (paper)": lambda: optax4bit.adamw_4bit(1e-3, recipe="paper"),
    # Without round_params_stochastically (only bfloat16/float16 params differ).
    "adamw_4bit (nearest)": lambda: optax4bit.adamw_4bit(1e-3, param_rounding="nearest"),
    "adamw_4bit (paper, jnp)": lambda: optax4bit.adamw_4bit(1e-3, recipe="paper",
                                                            implementation="jnp"),
    # The C++ kernel even where "auto" would not run it (see optax4bit.cpu.faster_than_jnp).
    "adamw_4bit (cpu)": lambda: optax4bit.adamw_4bit(1e-3, implementation="cpu"),
    "adamw_4bit (paper, cpu)": lambda: optax4bit.adamw_4bit(1e-3, recipe="paper",
                                                            implementation="cpu"),
    # The default's second moment rounded to nearest (the default before issue 40's
    # stochastic v): what stochastic rounding of v costs.
    "adamw_4bit (v nearest, cpu)": lambda: optax4bit.adamw_4bit(
        1e-3, second_moment="Rank-1/SqrtLinear", implementation="cpu"),
    # The default's moments rounded by issue 50's stall rule (stochastically only
    # where the nearest code is the stored one): m, v, both.
    "adamw_4bit (m stall, cpu)": lambda: optax4bit.adamw_4bit(
        1e-3, first_moment=_STALL_M, implementation="cpu"),
    "adamw_4bit (v stall, cpu)": lambda: optax4bit.adamw_4bit(
        1e-3, second_moment=_STALL_V, implementation="cpu"),
    "adamw_4bit (m+v stall, cpu)": lambda: optax4bit.adamw_4bit(
        1e-3, first_moment=_STALL_M, second_moment=_STALL_V, implementation="cpu"),
    "adamw_4bit_factor": lambda: optax4bit.adamw_4bit_factor(1e-3),
    "adamw_4bit_factor (paper)": lambda: optax4bit.adamw_4bit_factor(1e-3, recipe="paper"),
    "adamw_4bit_factor (jnp)": lambda: optax4bit.adamw_4bit_factor(1e-3, implementation="jnp"),
    "adamw_4bit_factor (cpu)": lambda: optax4bit.adamw_4bit_factor(1e-3, implementation="cpu"),
    "adamw_8bit": lambda: optax4bit.adamw_8bit(1e-3),
    "adamw_8bit (jnp)": lambda: optax4bit.adamw_8bit(1e-3, implementation="jnp"),
    "adamw_8bit (cpu)": lambda: optax4bit.adamw_8bit(1e-3, implementation="cpu"),
    "optax.sgd": lambda: optax.sgd(1e-3),
    "optax.sgd(momentum)": lambda: optax.sgd(1e-3, 0.9),
    "optax.sgd + round_params_stochastically": lambda: optax.chain(
        optax.sgd(1e-3), optax4bit.round_params_stochastically()),
    "sgdm_4bit": lambda: optax4bit.sgdm_4bit(1e-3),
    "sgdm_4bit (paper)": lambda: optax4bit.sgdm_4bit(1e-3, recipe="paper"),
    "sgdm_4bit (jnp)": lambda: optax4bit.sgdm_4bit(1e-3, implementation="jnp"),
    "sgdm_4bit (cpu)": lambda: optax4bit.sgdm_4bit(1e-3, implementation="cpu"),
    # quantize_state's optimizers (the jnp engine, every leaf).
    "optax.lion": lambda: optax.lion(1e-4),
    "lion_4bit": lambda: optax4bit.lion_4bit(1e-4),
    "lion_4bit (jnp)": lambda: optax4bit.lion_4bit(1e-4, implementation="jnp"),
    "optax.contrib.ademamix": lambda: optax.contrib.ademamix(1e-3),
    "ademamix_4bit": lambda: optax4bit.ademamix_4bit(1e-3),
    "ademamix_4bit (jnp)": lambda: optax4bit.ademamix_4bit(1e-3, implementation="jnp"),
    "quantize_state(optax.adamw)": lambda: optax4bit.quantize_state(optax.adamw(1e-3)),
    "quantize_state(optax.adamw) (jnp)": lambda: optax4bit.quantize_state(
        optax.adamw(1e-3), implementation="jnp"),
    "in-place floor": in_place_floor,
}


def make_tree(name: str, dtype=jnp.float32) -> dict:
  if name == "one-4096":
    shapes = {"w": (4096, 4096)}
  elif name == "spec":
    shapes = {f"w{i}": (2048, 2048) for i in range(4)}
  elif name == "spec-stacked":  # the same, stacked into one leaf as for jax.lax.scan
    shapes = {"w": (4, 2048, 2048)}
  else:
    shapes = {"/".join(map(str, path)): leaf.shape for path, leaf in
              jax.tree_util.tree_flatten_with_path(gpt_params(**CONFIGS["124M"]))[0]}
  keys = jax.random.split(jax.random.PRNGKey(0), len(shapes))
  return {k: 0.02 * jax.random.normal(key, s, dtype) for key, (k, s) in zip(keys, shapes.items())}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tree", default="spec",
                      choices=["spec", "spec-stacked", "gpt124m", "one-4096"])
  parser.add_argument("--param-dtype", default="float32", choices=["float32", "bfloat16"],
                      help="dtype of the params and gradients")
  parser.add_argument("--rounds", type=int, default=9)
  parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=list(OPTIMIZERS))
  parser.add_argument("--cpu-isas", nargs="*", default=[], choices=["avx512", "avx2", "baseline"],
                      help="also time the optimizers forced onto the C++ kernel on these ISA "
                      "paths, in the same rounds")
  parser.add_argument("--paired-to", default=None, choices=list(OPTIMIZERS),
                      help="add a column: the paired ratio to this optimizer (a row forced onto "
                      "an ISA path pairs with its row on the same path)")
  parser.add_argument("--step", default="update", choices=["update", "apply", "train"],
                      help="the donated update alone (default), update + apply with read-only "
                      "gradients, or update + apply with gradients computed in the step")
  args = parser.parse_args(argv)
  params = make_tree(args.tree, jnp.dtype(args.param_dtype))
  grads = jax.tree.map(lambda p: 0.1 * p + 0.01, params)
  # Gradients for --step train: those of a thin linear layer's squared output,
  # which a backward pass leaves in fresh buffers (rows of 8 inputs keep the
  # two matmuls per leaf cheap next to the optimizer).
  inputs = jax.tree.map(lambda p: (jax.random.normal(jax.random.PRNGKey(1), (8, p.shape[0])) / 30
                                   ).astype(p.dtype), params)
  gradient_of = jax.grad(lambda p: sum(jnp.sum(jnp.square(x @ w))
                                       for x, w in zip(jax.tree.leaves(inputs), jax.tree.leaves(p))))

  def fresh_grads():
    # Donated gradients are consumed by each call: copy them outside the timing.
    if args.step != "update":
      return grads
    return jax.block_until_ready(jax.tree.map(jnp.copy, grads))

  num_params = sum(math.prod(p.shape) for p in jax.tree.leaves(params))
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, tree {args.tree}: "
        f"{num_params / 1e6:.1f}M {args.param_dtype} params, step: {args.step}")
  if jax.default_backend() == "cpu":
    # OPTAX4BIT_CPU_ISA (read when the kernel loads) forces another ISA path.
    print(f"optax4bit CPU kernel: ISA path {optax4bit.cpu.isa()} of {optax4bit.cpu.isas()}, "
          f"auto runs it: {optax4bit.cpu.faster_than_jnp()}")
  runs = {}
  # (row label, optimizer, ISA path to switch to before each step or None).
  entries = [(name, name, None) for name in args.optimizers]
  entries += [(f"{name} [{isa}]", name, isa) for name in args.optimizers
              if name.endswith("cpu)") for isa in args.cpu_isas]
  default_isa = optax4bit.cpu.isa()

  def use_isa(isa):
    # Every step blocks on its results: a switch holds for the next step alone.
    if default_isa is not None:
      cpu_ffi._use_isa(isa or default_isa)  # pylint: disable=protected-access

  for label, name, isa in entries:
    use_isa(isa)
    tx = OPTIMIZERS[name]()
    p = jax.tree.map(jnp.copy, params)
    s = tx.init(p)
    if args.step == "update":
      compiled = jax.jit(tx.update, donate_argnums=(0, 1)).lower(grads, s, p).compile()

      def call(p, s, g, compiled=compiled):
        updates, s = compiled(g, s, p)
        jax.block_until_ready(updates)  # then dropped; params stay as they are
        return p, s
    else:
      def step(p, s, g, tx=tx):
        if args.step == "train":
          g = gradient_of(p)
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

      compiled = jax.jit(step, donate_argnums=(0, 1)).lower(p, s, grads).compile()
      call = compiled
    p, s = call(p, s, fresh_grads())  # warm-up
    jax.block_until_ready(s)
    runs[label] = [call, p, s, [], isa]
  for _ in range(args.rounds):
    for name, run in runs.items():
      call, p, s, times, isa = run
      use_isa(isa)
      g = fresh_grads()
      start = time.perf_counter()
      p, s = call(p, s, g)
      jax.block_until_ready((p, s))
      times.append(time.perf_counter() - start)
      run[1], run[2] = p, s
  medians = {name: float(np.median(run[3])) for name, run in runs.items()}
  base = medians.get("optax.adamw")
  # The median over rounds of each round's time over optax.adamw's in the same
  # round: drift of the machine's speed (a shared VM) cancels in the pair.
  paired = ({name: np.quantile(np.array(run[3]) / np.array(runs["optax.adamw"][3]),
                               [0.25, 0.5, 0.75]) for name, run in runs.items()}
            if base else {})
  # With in-step gradients every step pays for them: the time over the
  # cheapest update (optax.sgd) isolates what the optimizer adds.
  sgd = medians.get("optax.sgd")
  over = args.step == "train" and sgd is not None and base is not None and base > sgd

  def partner(label, isa):
    # --paired-to's row on the same ISA path as ``label``'s, else its default row.
    forced = f"{args.paired_to} [{isa}]"
    return forced if isa is not None and forced in runs else args.paired_to

  to = ({name: np.quantile(np.array(run[3]) / np.array(runs[partner(name, run[4])][3]),
                           [0.25, 0.5, 0.75]) for name, run in runs.items()}
        if args.paired_to in runs else {})
  print("| optimizer | median ms/step | ratio to optax.adamw | paired ratio (quartiles) |"
        + (" ms over optax.sgd | ratio of ms over optax.sgd |" if over else "")
        + (f" paired ratio to {args.paired_to} (quartiles) |" if to else ""))
  print("|---|---|---|---|" + ("---|---|" if over else "") + ("---|" if to else ""))
  for name, median in medians.items():
    if base:
      low, mid, high = paired[name]
      row = f"| {name} | {median * 1e3:.1f} | {median / base:.2f} | {mid:.2f} ({low:.2f}-{high:.2f}) |"
    else:
      row = f"| {name} | {median * 1e3:.1f} | - | - |"
    if over:
      row += f" {(median - sgd) * 1e3:.1f} | {(median - sgd) / (base - sgd):.2f} |"
    if to:
      low, mid, high = to[name]
      row += f" {mid:.3f} ({low:.3f}-{high:.3f}) |"
    print(row)


if __name__ == "__main__":
  main()
