"""Training-step memory of GPT-like models and the largest model per budget.

Compile-only: nothing the size of the model is ever allocated. Parameters are
``jax.ShapeDtypeStruct``s, the optimizer state comes from
``jax.eval_shape(tx.init, params)``, and the whole training step (forward,
backward, optimizer update, parameter update; params and optimizer state
donated) is compiled with
``jax.jit(train_step, donate_argnums=(0, 1)).lower(...).compile()``. Its
``memory_analysis()`` gives

* arguments: params + optimizer state + the token batch,
* outputs: new params + new optimizer state + loss (aliased to the donated
  arguments: ``alias``),
* temp: everything else alive during the step: gradients, activations kept for
  the backward pass, and the optimizer's transient buffers,

and the step's total is ``arguments + outputs - alias + temp``.

The model: a GPT-2-style pre-norm decoder (learned positions, tied embedding,
vocabulary 50304, sequence 1024, batch 4), its layers stacked and run with
``jax.lax.scan`` under ``jax.checkpoint`` (activation checkpointing per layer,
as large models are trained; compile time does not grow with depth). Params
and gradients are float32, except in the rows "bf16 params + stochastic
rounding" (``--optimizers adamw_4bit_bf16``): params, and so gradients, in
bfloat16 (the math in float32 on a per-layer upcast), the optimizer at its
defaults (which append `optax4bit.round_params_stochastically` for bfloat16
params). Leaves with at
most 4096 elements keep fp32 moments (the paper's rule), the rest are
quantized.

"4-bit AdamW, state offloaded" is ``optax4bit.offload_state(adamw_4bit)``: the
state is given in ``pinned_host`` memory (params on the device) and its total
counts device memory only: the total above minus the arguments and outputs
(less those aliased) that the compiled ``entry_computation_layout`` places in
host memory space ``S(5)`` (``offload_memory.host_argument_bytes``), plus an
in-flight term (``--inflight``): the CPU compiler's host <-> device transfers
are no copies, while a GPU step holds device copies of the state leaves it is
updating; by default 2 x the largest parameter's state (its moments copied in
and the new moments before they go back), a leaf-at-a-time allowance, not a
bound on what XLA's GPU scheduler may prefetch.

Largest model: the family ``n_layer = k``, ``d_model = 128 k``, ``k`` heads of
128 (the shape of GPT-3 6.7B at k = 32), searched over integer k for the
largest total that fits each budget (24 GB and 80 GB; GB = 1e9 bytes): a
bracket guessed from the bytes per parameter at k = 32, widened until it
holds, then bisected; the answer k (fits) and k + 1 (does not) are both
compiled, so every reported figure is a compiled one.
The figures are from the CPU compiler of this machine (XLA's buffer
assignment for the CPU backend); a GPU compiler fuses differently, so read
them as estimates of a GPU's footprint, without framework overhead. With
``--gpu-target`` they are XLA:GPU's for that GPU, compiled on this machine
(no GPU needed; see benchmarks/offload_memory.py for the packages). The two
differ most for bfloat16 params: XLA:CPU's step temp grows with them (plain
``optax.sgd`` too), XLA:GPU's shrinks (benchmarks/history/2026-11-27-issue-36.md).

Usage:
  python benchmarks/training_memory.py                 # both tables
  python benchmarks/training_memory.py --budgets 24 80 --skip-table
  python benchmarks/training_memory.py --optimizers adamw_4bit_bf16 --skip-table \
      --out benchmarks/results/training_memory_bf16.json
  python benchmarks/training_memory.py --budgets 16 --skip-table --tpu-target v5e \
      --optimizers adamw adamw_4bit --out /tmp/tpu_v5e.json     # a TPU v5e's compiler
  python benchmarks/training_memory.py --optimizers adamw_4bit adamw_4bit_bf16 \
      --gpu-target benchmarks/gpu_target_h100.txtpb \
      --out benchmarks/results/training_memory_bf16_h100_target.json   # H100's compiler
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import optax4bit  # pylint: disable=wrong-import-position

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import offload_memory  # noqa: E402  (host_argument_bytes, ARG, _abstract)

GB = 1e9
# Device bytes added to an offloaded step for the state in flight on a GPU (the
# CPU compiler's transfers are no copies, so its temp holds none of them):
# "moments": the device copies of the largest parameter's state coming in and
# its new state going back (2 x its mu + nu); "leaf": the largest single state
# leaf once; "none": nothing (a lower bound). Set by --inflight.
INFLIGHT = "moments"
# The device of a GPU target (--gpu-target) to compile for instead of this machine's.
TARGET_DEVICE = None
OFFLOADED = "_offloaded"  # suffix: the optimizer wrapped in optax4bit.offload_state
# suffix: params (so gradients and activations) in bfloat16, rounded stochastically
# by the optimizer's default param_rounding="stochastic" (issue 36).
BF16 = "_bf16"
# suffix: bf16 params rounded to nearest (param_rounding="nearest"), the control
# that shows what the stochastic rounding itself costs.
BF16_NEAREST = "_bf16_nearest"
OPTIMIZERS = ("adamw", "adamw_8bit", "adamw_4bit", "adamw_4bit_factor",
              "adamw_4bit" + OFFLOADED, "adamw_4bit" + BF16, "adamw_4bit_factor" + BF16)
LABELS = {"adamw": "fp32 AdamW (optax)", "adamw_8bit": "8-bit AdamW",
          "adamw_4bit": "4-bit AdamW", "adamw_4bit_factor": "4-bit Factor"}


def label(opt_name: str) -> str:
  if opt_name.endswith(OFFLOADED):
    return LABELS[opt_name[:-len(OFFLOADED)]] + ", state offloaded"
  if opt_name.endswith(BF16):
    return LABELS[opt_name[:-len(BF16)]] + ", bf16 params + stochastic rounding"
  if opt_name.endswith(BF16_NEAREST):
    return LABELS[opt_name[:-len(BF16_NEAREST)]] + ", bf16 params, rounding to nearest"
  return LABELS[opt_name]


def param_dtype(opt_name: str):
  return jnp.bfloat16 if opt_name.endswith((BF16, BF16_NEAREST)) else jnp.float32


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  name: str
  n_layer: int
  d_model: int
  n_head: int
  vocab: int = 50304
  seq_len: int = 1024
  batch: int = 4

  @property
  def n_params(self) -> int:
    d, L = self.d_model, self.n_layer
    per_layer = 12 * d * d + 13 * d  # qkv, proj, fc1, fc2 (+ biases), two layer norms
    return L * per_layer + self.vocab * d + self.seq_len * d + 2 * d


def family(k: int, seq_len: int = 1024, batch: int = 4) -> GPTConfig:
  """The search family: k layers, d_model 128 k, k heads of 128."""
  return GPTConfig(f"k={k}", k, 128 * k, k, seq_len=seq_len, batch=batch)


TABLE_CONFIGS = (
    GPTConfig("GPT-2 124M", 12, 768, 12),
    GPTConfig("GPT-2 1.5B", 48, 1600, 25),
    dataclasses.replace(family(32), name="6.7B (k=32: 32 x 4096)"),
)
# The search starts from the bytes per parameter measured at this k.
ANCHOR_K = 32


def param_shapes(cfg: GPTConfig, dtype=jnp.float32) -> dict:
  d, L, f = cfg.d_model, cfg.n_layer, 4 * cfg.d_model
  s = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
  return {
      "wte": s(cfg.vocab, d), "wpe": s(cfg.seq_len, d),
      "layers": {
          "ln1_g": s(L, d), "ln1_b": s(L, d),
          "qkv_w": s(L, d, 3 * d), "qkv_b": s(L, 3 * d),
          "proj_w": s(L, d, d), "proj_b": s(L, d),
          "ln2_g": s(L, d), "ln2_b": s(L, d),
          "fc1_w": s(L, d, f), "fc1_b": s(L, f),
          "fc2_w": s(L, f, d), "fc2_b": s(L, d),
      },
      "lnf_g": s(d), "lnf_b": s(d),
  }


def _layer_norm(x, g, b):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + 1e-5) * g + b


def loss_fn(params, tokens, cfg: GPTConfig):
  x_tokens, y = tokens[:, :-1], tokens[:, 1:]
  b, t = x_tokens.shape
  h, d = cfg.n_head, cfg.d_model
  # bfloat16 params are stored (and their gradients come back) in bfloat16;
  # the math runs in float32 on a per-layer upcast (for float32 params a no-op).
  upcast = lambda tree: jax.tree.map(lambda a: a.astype(jnp.float32), tree)  # noqa: E731
  wte = params["wte"].astype(jnp.float32)
  x = wte[x_tokens] + params["wpe"][:t][None].astype(jnp.float32)

  def layer(x, p):
    p = upcast(p)
    z = _layer_norm(x, p["ln1_g"], p["ln1_b"]) @ p["qkv_w"] + p["qkv_b"]
    q, k, v = (a.reshape(b, t, h, d // h) for a in jnp.split(z, 3, axis=-1))
    a = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, d)
    x = x + a @ p["proj_w"] + p["proj_b"]
    z = jax.nn.gelu(_layer_norm(x, p["ln2_g"], p["ln2_b"]) @ p["fc1_w"] + p["fc1_b"])
    return x + z @ p["fc2_w"] + p["fc2_b"], None

  x, _ = jax.lax.scan(jax.checkpoint(layer), x, params["layers"])
  logits = _layer_norm(x, *upcast((params["lnf_g"], params["lnf_b"]))) @ wte.T
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


TPU_TOPOLOGIES = {"v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}


def tpu_target_device(generation: str):
  """The first device of a TPU slice of ``generation`` (compile-only)."""
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  name = TPU_TOPOLOGIES.get(generation, generation)
  return topologies.get_topology_desc(platform="tpu", topology_name=name).devices[0]


def make_optimizer(name: str, **kwargs) -> optax.GradientTransformation:
  if name.endswith(OFFLOADED):
    return optax4bit.offload_state(make_optimizer(name[:-len(OFFLOADED)]), "pinned_host")
  if name.endswith(BF16):  # the same optimizer: its default rounds bf16 params stochastically
    return make_optimizer(name[:-len(BF16)])
  if name.endswith(BF16_NEAREST):
    return make_optimizer(name[:-len(BF16_NEAREST)], param_rounding="nearest")
  if name == "adamw":
    return optax.adamw(1e-4)
  if TARGET_DEVICE is not None and TARGET_DEVICE.platform == "gpu":
    # `auto` cannot probe a GPU this process does not have (it runs the XLA engine);
    # on a TPU target `auto` follows the platform compiled for, the TPU engine.
    kwargs["implementation"] = "pallas"
  return getattr(optax4bit, name)(1e-4, **kwargs)


def host_output_bytes(compiled) -> tuple:
  """(all, aliased) bytes of the compiled step's outputs in host memory space S(5)."""
  header = re.search(r"HloModule[^\n]*", compiled.as_text()).group(0)
  # The output tuple: after "->", up to the module's next attribute.
  layout = re.split(r", [a-z_]+=", header.split("entry_computation_layout=", 1)[1]
                    .split(")->", 1)[1], maxsplit=1)[0]
  alias = re.search(r"input_output_alias=\{(.*?)\}, entry", header)
  aliased = {int(i) for i in re.findall(r"\{(\d+)\}:", alias.group(1))} if alias else set()
  itemsize = lambda t: 1 if t == "pred" else int(re.sub(r"\D", "", t)) // 8  # noqa: E731
  total = shared = 0
  for i, (dtype, dims, tail) in enumerate(offload_memory.ARG.findall(layout)):
    if "S(5)" in tail:
      n = math.prod(int(d) for d in dims.split(",") if d) * itemsize(dtype)
      total, shared = total + n, shared + (n if i in aliased else 0)
  return total, shared


def inflight_bytes(opt_state) -> tuple:
  """(largest state leaf, largest parameter's whole state) in bytes.

  The parameter a state leaf belongs to is its path's dict keys (``mu`` and
  ``nu`` of the same parameter, codes and scales, share it).
  """
  per_param, largest_leaf = {}, 0
  for path, x in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
    n = int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
    key = tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))
    per_param[key] = per_param.get(key, 0) + n
    largest_leaf = max(largest_leaf, n)
  return largest_leaf, max(per_param.values(), default=0)


def over_hbm_temp_bytes(message: str):
  """The temporaries' bytes of XLA:TPU's "Ran out of memory on HBM" compile
  error (None for any other error)."""
  match = re.search(r"memory required for HLO temporaries \(([0-9.]+)([KMG])\)", message)
  if "RESOURCE_EXHAUSTED" not in message or not match:
    return None
  return int(float(match.group(1)) * {"K": 2**10, "M": 2**20, "G": 2**30}[match.group(2)])


def step_memory(cfg: GPTConfig, opt_name: str) -> dict:
  """Compiles one training step and returns its memory (bytes) and compile time.

  An offloaded optimizer's state is given in ``pinned_host`` memory (params on
  the device) and its total counts device memory only: the step's arguments
  and outputs that the compiled entry layout places in host memory space are
  taken out, and the in-flight term (see the module docstring) is added.
  """
  tx = make_optimizer(opt_name)
  offloaded = opt_name.endswith(OFFLOADED)
  params = param_shapes(cfg, param_dtype(opt_name))
  opt_state = jax.eval_shape(tx.init, params)
  tokens = jax.ShapeDtypeStruct((cfg.batch, cfg.seq_len + 1), jnp.int32)
  if offloaded or TARGET_DEVICE is not None:
    # pylint: disable=protected-access
    params = offload_memory._abstract(params, "device", TARGET_DEVICE)
    opt_state = offload_memory._abstract(opt_state, "pinned_host" if offloaded else "device",
                                         TARGET_DEVICE)
    tokens = offload_memory._abstract(tokens, "device", TARGET_DEVICE)

  def train_step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens, cfg)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  start = time.perf_counter()
  param_bytes = sum(int(np.prod(p.shape)) * p.dtype.itemsize for p in jax.tree.leaves(params))
  state_bytes = optax4bit.state_nbytes(opt_state)
  try:
    compiled = jax.jit(train_step, donate_argnums=(0, 1)).lower(params, opt_state,
                                                                tokens).compile()
  except jax.errors.JaxRuntimeError as e:
    over = over_hbm_temp_bytes(str(e))
    if over is None:
      raise
    # XLA:TPU refuses a step larger than the chip's memory: its total is at least
    # the arguments and the temporaries it says it needed.
    return {"config": dataclasses.asdict(cfg), "optimizer": opt_name, "params": cfg.n_params,
            "param_bytes": param_bytes, "state_bytes": state_bytes, "temp_bytes": over,
            "total_bytes": param_bytes + state_bytes + over, "over_hbm": True,
            "compile_s": time.perf_counter() - start}
  seconds = time.perf_counter() - start
  m = compiled.memory_analysis()
  total = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
           + m.temp_size_in_bytes)
  r = {"config": dataclasses.asdict(cfg), "optimizer": opt_name, "params": cfg.n_params,
       "param_bytes": param_bytes, "state_bytes": state_bytes,
       "argument_bytes": m.argument_size_in_bytes, "output_bytes": m.output_size_in_bytes,
       "alias_bytes": m.alias_size_in_bytes, "temp_bytes": m.temp_size_in_bytes,
       "total_bytes": total, "compile_s": seconds}
  if offloaded and m.host_argument_size_in_bytes:
    # XLA:GPU: the fields count device memory only, the state in flight included.
    r.update(host_argument_bytes=m.host_argument_size_in_bytes,
             host_output_bytes=m.host_output_size_in_bytes, inflight_term="compiled",
             inflight_bytes=0, device_bytes_without_inflight=total)
  elif offloaded:
    host_arg = offload_memory.host_argument_bytes(compiled)
    host_out, host_alias = host_output_bytes(compiled)
    leaf, param_state = inflight_bytes(opt_state)
    inflight = {"moments": 2 * param_state, "leaf": leaf, "none": 0}[INFLIGHT]
    r.update(host_argument_bytes=host_arg, host_output_bytes=host_out,
             host_alias_bytes=host_alias, largest_state_leaf_bytes=leaf,
             largest_param_state_bytes=param_state, inflight_term=INFLIGHT,
             inflight_bytes=inflight,
             device_bytes_without_inflight=total - host_arg - host_out + host_alias)
    r["total_bytes"] = r["device_bytes_without_inflight"] + r["inflight_bytes"]
  return r


class MemoryCache:
  """Compiled step memory per (optimizer, layers, d_model, heads, seq, batch)."""

  def __init__(self, log):
    self.results, self.log = {}, log

  def __call__(self, cfg: GPTConfig, opt_name: str) -> dict:
    key = (opt_name,) + dataclasses.astuple(cfg)[1:]
    if key not in self.results:
      r = step_memory(cfg, opt_name)
      self.results[key] = r
      self.log(f"    {label(opt_name)}, {cfg.n_layer} x {cfg.d_model}: "
               f"{r['params'] / 1e9:.2f}B params, total {r['total_bytes'] / GB:.2f} GB "
               f"(compile {r['compile_s']:.0f} s)")
    return self.results[key]


def largest_fitting(opt_name: str, budget: float, mem: MemoryCache) -> dict:
  """Largest k whose compiled step fits ``budget`` bytes.

  Memory grows with k. The bracket starts at the guess from the bytes per
  parameter at ``ANCHOR_K`` (k0 and k0 + 1), widens until the lower end fits
  and the upper end does not, then bisects; the answer k and k + 1 are both
  compiled, so the result does not depend on the guess.
  """
  total = lambda k: mem(family(k), opt_name)["total_bytes"]  # noqa: E731
  per_param = total(ANCHOR_K) / family(ANCHOR_K).n_params
  k0 = max(1, max((k for k in range(1, 512) if per_param * family(k).n_params <= budget),
                  default=1))
  lo, hi, step = k0, k0 + 1, 1
  while lo > 1 and total(lo) > budget:
    lo, hi, step = max(1, lo - 2 * step), lo, 2 * step
  if total(lo) > budget:
    return {"k": None}
  while total(hi) <= budget:
    lo, hi, step = hi, hi + 2 * step, 2 * step
  while hi - lo > 1:
    mid = (lo + hi) // 2
    if total(mid) <= budget:
      lo = mid
    else:
      hi = mid
  return {"k": lo, **mem(family(lo), opt_name), "next_k_total_bytes": total(lo + 1)}


def plot(path: str, rows: list) -> None:
  """Stacked bars of the table: params, optimizer state, temp (and the rest)."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  configs = list(dict.fromkeys(r["config"]["name"] for r in rows))
  opts = list(dict.fromkeys(r["optimizer"] for r in rows))
  fig, axes = plt.subplots(1, len(configs), figsize=(3.6 * len(configs), 3.8), squeeze=False)
  for ax, name in zip(axes[0], configs):
    sub = {r["optimizer"]: r for r in rows if r["config"]["name"] == name}
    x = np.arange(len(opts))
    p = np.array([sub[o]["param_bytes"] for o in opts]) / GB
    # An offloaded state is in host memory: not a part of its device total.
    st = np.array([0 if o.endswith(OFFLOADED) else sub[o]["state_bytes"] for o in opts]) / GB
    tmp = np.array([sub[o]["temp_bytes"] for o in opts]) / GB
    rest = np.array([sub[o]["total_bytes"] for o in opts]) / GB - p - st - tmp
    ax.bar(x, p, label="params")
    ax.bar(x, st, bottom=p, label="optimizer state")
    ax.bar(x, tmp, bottom=p + st, label="temp: grads, activations, transients")
    ax.bar(x, rest, bottom=p + st + tmp, label="other (batch, loss; offloaded: in-flight state)")
    ax.set_xticks(x, [label(o).replace(" (optax)", "") for o in opts], rotation=30,
                  ha="right", fontsize=8)
    ax.set_title(name, fontsize=9)
    ax.set_ylabel("GB (1e9 bytes)")
    ax.grid(axis="y", alpha=0.3)
  axes[0][0].legend(fontsize=7)
  fig.suptitle("compiled training-step memory (CPU compiler, batch 4 x 1024, "
               "fp32 params unless bf16)", fontsize=10)
  fig.tight_layout()
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None) -> dict:
  global INFLIGHT, TARGET_DEVICE  # pylint: disable=global-statement
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--budgets", type=float, nargs="+", default=[24, 80], help="GB (1e9)")
  parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS))
  parser.add_argument("--skip-table", action="store_true", help="only the largest-model search")
  parser.add_argument("--inflight", default=INFLIGHT, choices=["moments", "leaf", "none"],
                      help="device bytes an offloaded state adds in flight (see INFLIGHT)")
  parser.add_argument("--skip-search", action="store_true", help="only the fixed configs")
  parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                   "training_memory.json"))
  parser.add_argument("--plot", default=os.path.join(ROOT, "benchmarks", "plots",
                                                    "training_memory.png"))
  parser.add_argument(
      "--gpu-target", metavar="TXTPB",
      help="compile for the GPU this GpuTargetConfigProto text describes, without one "
           "(benchmarks/gpu_target_h100.txtpb; see benchmarks/offload_memory.py); the "
           "state in flight is then the compiler's, not --inflight's")
  parser.add_argument(
      "--tpu-target", metavar="GEN",
      help="compile for the first device of a TPU slice (v5e, v5p, v6e: "
           "jax.experimental.topologies, libtpu from the tpu-check extra), without one")
  parser.add_argument("--replot", action="store_true",
                      help="only redraw --plot from the results saved in --out (no compiling)")
  args = parser.parse_args(argv)
  INFLIGHT = args.inflight
  if args.gpu_target:
    TARGET_DEVICE = offload_memory.gpu_target_device(args.gpu_target)
  if args.tpu_target:
    TARGET_DEVICE = tpu_target_device(args.tpu_target)
  if args.replot:
    with open(args.out) as f:
      saved = json.load(f)
    plot(args.plot, saved["table"])
    return saved
  start = time.perf_counter()
  env = (f"{datetime.date.today()}, {platform.machine()}, {os.cpu_count()} CPUs, "
         f"Python {platform.python_version()}, jax {jax.__version__}, "
         f"compiled for {(TARGET_DEVICE or jax.devices()[0]).device_kind}")
  print(f"# Training-step memory, compile-only ({env})", flush=True)
  log = lambda s: print(s, flush=True)  # noqa: E731
  out = {"environment": env, "inflight": INFLIGHT}
  mem = MemoryCache(log)

  if not args.skip_table:
    rows = []
    print("\n## Training step of GPT-like models (batch 4 x 1024, fp32 params unless bf16, "
          "per-layer remat)\n")
    lines = ["| model | params | optimizer | optimizer state | params + state | temp "
             "(grads, activations, transients) | total step memory |",
             "|---|---|---|---|---|---|---|"]
    for cfg in TABLE_CONFIGS:
      for opt in args.optimizers:
        r = mem(cfg, opt)
        rows.append(r)
        host = " in host memory" if opt.endswith(OFFLOADED) else ""
        lines.append(f"| {cfg.name} | {r['params'] / 1e6:,.0f}M | {label(opt)} "
                     f"| {r['state_bytes'] / GB:.2f} GB ({r['state_bytes'] / r['params']:.2f} "
                     f"B/param){host} | {(r['param_bytes'] + r['state_bytes']) / GB:.2f} GB "
                     f"| {r['temp_bytes'] / GB:.2f} GB | {r['total_bytes'] / GB:.2f} GB |")
    print()
    print("\n".join(lines), flush=True)
    out["table"] = rows
    out["table_md"] = "\n".join(lines)

  if not args.skip_search:
    print("\n## Largest model per budget (k layers, d_model 128k; batch 4 x 1024)\n", flush=True)
    found = []
    for opt in args.optimizers:
      for budget in sorted(args.budgets):
        r = largest_fitting(opt, budget * GB, mem)
        found.append({"optimizer": opt, "budget_gb": budget, **r})
    lines = ["| optimizer | budget | largest k (layers x d_model) | params | total step memory "
             "| k+1 would need |", "|---|---|---|---|---|---|"]
    for r in found:
      if r["k"] is None:
        lines.append(f"| {label(r['optimizer'])} | {r['budget_gb']:g} GB | none | | | |")
        continue
      lines.append(f"| {label(r['optimizer'])} | {r['budget_gb']:g} GB "
                   f"| {r['k']} ({r['k']} x {128 * r['k']}) | {r['params'] / 1e9:.2f}B "
                   f"| {r['total_bytes'] / GB:.1f} GB | {r['next_k_total_bytes'] / GB:.1f} GB |")
    print()
    print("\n".join(lines))
    out["largest"] = found
    out["largest_md"] = "\n".join(lines)

  out["elapsed_s"] = time.perf_counter() - start
  print(f"\ntotal {out['elapsed_s']:.0f} s")
  if "table" in out:
    plot(args.plot, out["table"])
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(out, f, indent=1)
  return out


if __name__ == "__main__":
  main()
