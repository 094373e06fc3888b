"""One GPU session: every optimizer timed on a lent H100 or H200 in one call.

Issue 35's session script. Within a global time budget (``--budget-seconds``,
checked before every row: a row that would not fit is skipped and listed, not
started) it records, in one JSON file rewritten after every row (a killed run
loses nothing measured):

1. The machine: device, JAX, jaxlib, CUDA plugin, triton and optax versions,
   a hash of the ``optax4bit`` sources it ran, and the bandwidth of a
   device-to-device copy (``x + 1`` on 1 GiB of float32: read + write).
2. Pallas == jnp checks on a few leaves (2-D, ragged, 3-D, 1-D), float32 and
   bfloat16, for every optimizer whose update runs a Pallas kernel: teacher-
   forced steps from the reference's state. With the tolerances of
   ``tests/test_pallas_optim.py``: codes bit for bit, scales within 2 ulps of
   the moment's largest scale, updates within 4 ulps of the leaf's largest
   update (float32) or 1 ulp (bfloat16). An optimizer whose update runs no
   Pallas kernel (8-bit, the ``quantize_state`` presets) is listed as such.
3. Step times of every optimizer against ``optax.adamw`` and
   ``optax.sgd(momentum=0.9)``, at ~110M and ~1.07B parameters (GPT-like trees
   of ``gpu_step.py``), float32 and bfloat16 params, in two settings
   (``"step"`` in the rows):

   * ``"update"``: the jitted ``tx.update`` + ``optax.apply_updates`` with
     params, state and a fresh copy of the gradients donated (the setting of
     ``gpu_step.py`` and of ``results/gpu_step_h100_1b.json``); per-step
     device-synchronized times, the copy made outside the timer.
   * ``"train"``: the jitted train step users run, ``jax.grad`` of a causal
     transformer's next-token loss on those params (tied embedding,
     RMS norms, ``--batch`` x ``--seq`` tokens) then the update, params and
     state donated; ``--steps`` steps back to back per sample.

   Each candidate optimizer is compiled (``compile_seconds``: trace, lower
   and compile) and then timed in ``--rounds`` rounds that alternate it with
   the two optax baselines, which stay compiled for the whole group. A row's
   ``seconds`` is the median of its samples; ``vs_optax_adamw`` (and
   ``vs_optax_sgd_momentum``) is the median over rounds of its time over the
   baseline's time in the same round, so drift of the machine cancels.
   ``bytes_moved`` is what the optimizer must move at least (read gradients
   and params, write params: 3x the params' bytes; read and write the state),
   in both settings; update rows give its ``share_of_copy_bandwidth``.

Rows run in priority order (``plan``): the issue's targets first (the 4-bit
AdamW recipes, Factor and SGD-M at 1B float32, update then train; then 110M
float32, with the jnp engine's 4-bit AdamW in the update; then 1B and 110M
bfloat16), then the 8-bit AdamW and the Lion, AdEMAMix and Muon presets in
the same order. The float32 checks run first, the bfloat16 ones after tier 1.

    python benchmarks/gpu_session.py --out $OUT          # on a GPU, ~8 minutes
    python benchmarks/gpu_session.py --smoke --out /tmp/s  # CPU, tiny sizes, seconds
    bash benchmarks/gpu_session.sh                          # what a device call runs

``--smoke`` runs everything on tiny trees on the CPU, the checks with the
kernels in Pallas interpret mode; its figures mean nothing (it keeps the
script from rotting: ``tests/test_gpu_session.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import hashlib
import importlib.metadata
import json
import math
import os
import pathlib
import platform
import statistics
import sys
import time
import warnings
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_step  # noqa: E402  (gpt_shapes, SIZES, copy_bandwidth, _ulps_of_max)

import optax4bit  # noqa: E402
import optax4bit.pallas  # noqa: E402  (resolve: what "auto" picks)
from optax4bit import QuantizedArray  # noqa: E402

SCHEMA = 1
ROOT = pathlib.Path(__file__).resolve().parents[1]
LR = 1e-3
SMOKE_SIZE = "smoke"
# The smoke tree has no layers (an embedding and a norm): its steps compile in
# a fraction of the time, which keeps the default test run short;
# tests/test_gpu_session.py checks the layers' loss and gradients apart.
SIZES = {"100M": gpu_step.SIZES["100M"], "1B": gpu_step.SIZES["1B"],
         SMOKE_SIZE: dict(gpu_step.DRY_RUN_SIZE, depth=0)}
# The tolerances of tests/test_pallas_optim.py (module docstring there).
UPDATE_ULPS = {"float32": 4.0, "bfloat16": 1.0}
SCALE_ULPS = 2.0
CHECK_SHAPES = {"w": (512, 1536), "ragged": (300, 301), "heads": (256, 4, 48), "b": (5001,)}
SMOKE_CHECK_SHAPES = {"ragged": (30, 301), "b": (4099,)}


@dataclasses.dataclass(frozen=True)
class Optimizer:
  """An optimizer to time: ``make(implementation)`` builds it. ``tier`` 1 runs
  before tier 2; ``sizes`` and ``steps``, when set, limit where it runs."""
  make: Callable[[str], optax.GradientTransformation]
  tier: int = 1
  sizes: Optional[tuple] = None
  steps: Optional[tuple] = None


def _not_in_place(implementation: str):
  """``implementation`` with the Pallas update in a fresh buffer
  (`optax4bit.pallas.PallasConfig.update_in_place`)."""
  if implementation == "auto" and not optax4bit.pallas.steps.kernels_run_here():
    return implementation  # the CPU's kernel (the smoke run)
  if implementation in ("auto", "pallas", "pallas_interpret"):
    return optax4bit.pallas.PallasConfig(interpret=implementation == "pallas_interpret",
                                         update_in_place=False)
  return implementation


BASELINES = {
    "optax.adamw": Optimizer(lambda impl: optax.adamw(LR)),
    "optax.sgd(momentum)": Optimizer(lambda impl: optax.sgd(LR, momentum=0.9)),
}
CANDIDATES = {
    "adamw_4bit": Optimizer(lambda impl: optax4bit.adamw_4bit(LR, implementation=impl)),
    "adamw_4bit paper recipe": Optimizer(
        lambda impl: optax4bit.adamw_4bit(LR, recipe="paper", implementation=impl)),
    "adamw_4bit_factor": Optimizer(
        lambda impl: optax4bit.adamw_4bit_factor(LR, implementation=impl)),
    "sgdm_4bit": Optimizer(lambda impl: optax4bit.sgdm_4bit(LR, 0.9, implementation=impl)),
    "adamw_8bit": Optimizer(lambda impl: optax4bit.adamw_8bit(LR, implementation=impl), tier=2),
    # The jnp engine on an accelerator (issue 35, item 3: <= 3x optax.adamw at
    # 110M), whatever "auto" picks.
    "adamw_4bit jnp engine": Optimizer(
        lambda impl: optax4bit.adamw_4bit(LR, implementation="jnp"),
        sizes=("100M", SMOKE_SIZE), steps=("update",)),
    # The same with chunks as large as the engine allows: two per leaf (it
    # keeps two so that the update stays in place), 3x fewer kernel launches
    # on an H100 target (benchmarks/history/2026-11-27-issue-35-session.md).
    "adamw_4bit jnp engine, two chunks per leaf": Optimizer(
        lambda impl: optax4bit.adamw_4bit(LR, implementation="jnp", chunk_size=2**30),
        sizes=("100M", SMOKE_SIZE), steps=("update",)),
    # The XLA engine: what "auto" runs on a GPU where the Pallas kernels do not
    # compile (issue 49: its timing beside Pallas decides auto's GPU choice).
    "adamw_4bit xla engine": Optimizer(
        lambda impl: optax4bit.adamw_4bit(LR, implementation="xla"),
        sizes=("100M", SMOKE_SIZE), steps=("update",)),
    "adamw_4bit_factor xla engine": Optimizer(
        lambda impl: optax4bit.adamw_4bit_factor(LR, implementation="xla"), tier=2,
        sizes=("100M", SMOKE_SIZE), steps=("update",)),
    # 8-bit leaves: "auto" on a GPU runs them in the XLA engine (the Pallas
    # kernels are 4-bit only and decline them); the jnp engine ran them before
    # (H100 target: 74 loops and 64.8 B/param against the XLA engine's 0, 34.8).
    "adamw_8bit jnp engine": Optimizer(
        lambda impl: optax4bit.adamw_8bit(LR, implementation="jnp"), tier=2,
        sizes=("100M", SMOKE_SIZE), steps=("update",)),
    # The update written into a fresh buffer, not over the gradient: jitted
    # alone, the in-place update makes XLA copy every gradient first (a jit
    # argument is writable only where it aliases an output).
    "adamw_4bit update not in place": Optimizer(
        lambda impl: optax4bit.adamw_4bit(LR, implementation=_not_in_place(impl)), tier=2,
        sizes=("1B", SMOKE_SIZE), steps=("update",)),
    # The presets wrap optax through quantize_state: "auto" or "jnp" only.
    "lion_4bit": Optimizer(lambda impl: optax4bit.lion_4bit(LR), tier=2),
    "ademamix_4bit": Optimizer(lambda impl: optax4bit.ademamix_4bit(LR), tier=2),
    "muon_4bit": Optimizer(lambda impl: optax4bit.muon_4bit(LR), tier=2),
}
OPTIMIZERS = {**BASELINES, **CANDIDATES}


class Session:
  """The results so far, the clock, and the JSON file rewritten after each row."""

  def __init__(self, path: str, budget_seconds: float, header: dict):
    self.path = path
    self.start = time.monotonic()
    self.budget = budget_seconds
    self.results = dict(header, checks=[], timings=[], skipped=[], errors=[],
                        finished=False)
    self.compile_seconds = {}  # (optimizer, size, step) -> seconds, for estimates
    self.groups = 0  # groups of rows timed side by side so far

  def left(self) -> float:
    return self.budget - (time.monotonic() - self.start)

  def fits(self, seconds: float, what: dict) -> bool:
    """Whether ``seconds`` more fit the budget; else records ``what`` as skipped."""
    if seconds <= self.left():
      return True
    self.results["skipped"].append(dict(what, reason=f"time budget: about {seconds:.0f} s "
                                        f"needed, {max(self.left(), 0):.0f} s left"))
    print(f"skipped (time budget, {max(self.left(), 0):.0f} s left): {what}", flush=True)
    self.write()
    return False

  def error(self, what: dict, e: Exception) -> None:
    self.results["errors"].append(dict(what, error=f"{type(e).__name__}: {str(e)[:600]}"))
    print(f"error: {what}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    self.write()

  def write(self) -> None:
    self.results["elapsed_seconds"] = time.monotonic() - self.start
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      json.dump(self.results, f, indent=1, default=float)
    os.replace(tmp, self.path)


# ----------------------------------------------------------------------------
# The machine.


def _version(distribution: str) -> Optional[str]:
  try:
    return importlib.metadata.version(distribution)
  except importlib.metadata.PackageNotFoundError:
    return None


def source_digest() -> str:
  """sha256 of optax4bit's Python and C++ sources: which code ran, without git."""
  digest = hashlib.sha256()
  package = ROOT / "optax4bit"
  for path in sorted(package.rglob("*")):
    if path.suffix in (".py", ".cc", ".h") and path.is_file():
      digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
  return digest.hexdigest()


def machine() -> dict:
  device = jax.devices()[0]
  plugins = {name: _version(name) for name in (
      "jax-cuda12-plugin", "jax-cuda13-plugin", "jax-cuda12-pjrt", "jax-cuda13-pjrt")}
  return dict(
      schema=SCHEMA, device=device.device_kind, platform=device.platform,
      device_count=jax.device_count(), jax=jax.__version__, jaxlib=_version("jaxlib"),
      cuda_plugins={k: v for k, v in plugins.items() if v}, triton=_version("triton"),
      optax=optax.__version__, numpy=np.__version__, python=platform.python_version(),
      host=platform.node(), optax4bit_sources_sha256=source_digest(),
      git_commit=os.environ.get("OPTAX4BIT_COMMIT"),
      started_utc=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


# ----------------------------------------------------------------------------
# Trees, the model, and which implementation a step runs.


def init_params(config: dict, dtype, seed: int = 0) -> dict:
  """GPT-like params of ``gpu_step.gpt_shapes(**config)``: normal(0.02)
  matrices, unit norm weights."""
  shapes, treedef = jax.tree.flatten(gpu_step.gpt_shapes(**config),
                                     is_leaf=gpu_step._is_shape)  # pylint: disable=protected-access
  keys = jax.random.split(jax.random.key(seed), len(shapes))
  return treedef.unflatten([
      jnp.ones(s, dtype) if len(s) == 1 else
      (jax.random.normal(k, s, jnp.float32) * 0.02).astype(dtype) for k, s in zip(keys, shapes)])


def _rms_norm(x, weight):
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
  return x32.astype(x.dtype) * weight


def gpt_loss(params: dict, tokens: jax.Array) -> jax.Array:
  """Next-token cross-entropy of a pre-norm causal transformer over ``params``
  (heads of 64; the embedding is tied to the output)."""
  embed = params["embed"]
  x = embed[tokens[:, :-1]]
  batch, seq, width = x.shape
  heads = width // 64
  causal = jnp.tril(jnp.ones((seq, seq), bool))
  for name in sorted(k for k in params if k.startswith("layer")):
    layer = params[name]
    q, k, v = jnp.split(_rms_norm(x, layer["attn_norm"]) @ layer["qkv"], 3, axis=-1)
    q, k, v = (t.reshape(batch, seq, heads, width // heads) for t in (q, k, v))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(width // heads)
    weights = jax.nn.softmax(jnp.where(causal, logits, -1e30), axis=-1).astype(x.dtype)
    attended = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, seq, width)
    x = x + attended @ layer["attn_out"]
    x = x + jax.nn.gelu(_rms_norm(x, layer["mlp_norm"]) @ layer["mlp_in"]) @ layer["mlp_out"]
  logits = (_rms_norm(x, params["final_norm"]) @ embed.T).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def primitive_names(jaxpr, names: Optional[set] = None) -> set:
  """Names of the primitives in a jaxpr and in the jaxprs its equations hold."""
  names = set() if names is None else names
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          primitive_names(inner, names)
  return names


def implementation_of(name: str, jaxpr) -> str:
  """What ran the optimizer's update: ``pallas`` kernels, the ``cpu`` C++
  kernel, or ``jnp`` (XLA fusions; optax's own for the baselines)."""
  if name in BASELINES:
    return "optax"
  names = primitive_names(jaxpr)
  if "pallas_call" in names:
    return "pallas"
  return "cpu" if "ffi_call" in names else "jnp"


# ----------------------------------------------------------------------------
# Pallas == jnp.


def _quantized(state) -> list:
  return [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, QuantizedArray))
          if isinstance(x, QuantizedArray)]


def _codes_differ(a: QuantizedArray, b: QuantizedArray) -> int:
  """How many codes differ (4-bit codes are packed two to a byte)."""
  xor = np.bitwise_xor(np.asarray(a.codes), np.asarray(b.codes))
  if a.spec.bits == 4:
    return int(np.count_nonzero(xor & 0x0F) + np.count_nonzero(xor >> 4))
  return int(np.count_nonzero(xor))


def check_optimizer(name: str, dtype: str, shapes: dict, steps: int, pallas: str) -> dict:
  """Teacher-forced steps of ``name`` built with ``implementation="jnp"`` and
  with ``pallas``, from the jnp run's state each step."""
  row = dict(check=name, dtype=dtype, steps=steps, shapes={k: list(s) for k, s in shapes.items()})
  params = {k: jax.random.normal(jax.random.key(n), s, jnp.float32).astype(dtype)
            for n, (k, s) in enumerate(sorted(shapes.items()))}
  make = OPTIMIZERS[name].make
  try:
    tx_ref, tx_pal = make("jnp"), make(pallas)
  except ValueError as e:
    return dict(row, ok=None, skipped=f"no Pallas implementation: {str(e)[:200]}")
  state = tx_ref.init(params)
  probe = jax.make_jaxpr(lambda s: tx_pal.update(params, s, params))(state)
  if implementation_of(name, probe.jaxpr) != "pallas":
    return dict(row, ok=None, skipped="its update runs no Pallas kernel (jnp on a GPU too)")

  @jax.jit
  def both(state, i):
    grads = gpu_step._grads(params, i)  # pylint: disable=protected-access
    return tx_ref.update(grads, state, params), tx_pal.update(grads, state, params)

  codes = codes_differ = 0
  update_ulps = scale_ulps = 0.0
  for i in range(steps):
    (u_ref, s_ref), (u_pal, s_pal) = both(state, i)
    for k in params:
      update_ulps = max(update_ulps, gpu_step._ulps_of_max(u_ref[k], u_pal[k], jnp.dtype(dtype)))  # pylint: disable=protected-access
    for a, b in zip(_quantized(s_ref), _quantized(s_pal), strict=True):
      codes += a.size
      codes_differ += _codes_differ(a, b)
      for sa, sb in zip(a.scales, b.scales, strict=True):
        scale_ulps = max(scale_ulps, gpu_step._ulps_of_max(sa, sb, jnp.float32))  # pylint: disable=protected-access
    state = s_ref
  ok = codes_differ == 0 and scale_ulps <= SCALE_ULPS and update_ulps <= UPDATE_ULPS[dtype]
  return dict(row, ok=ok, codes=codes, codes_differ=codes_differ,
              scale_ulps_of_max=scale_ulps, update_ulps_of_max=update_ulps,
              tolerance=dict(codes_differ=0, scale_ulps_of_max=SCALE_ULPS,
                             update_ulps_of_max=UPDATE_ULPS[dtype]))


def run_checks(session: Session, names, dtypes, shapes: dict, steps: int, pallas: str,
               seconds_each: float) -> None:
  """`check_optimizer` for each of ``names`` and ``dtypes``, within the budget."""
  for dtype in dtypes:
    for name in names:
      what = dict(check=name, dtype=dtype)
      if not session.fits(seconds_each, what):
        continue
      try:
        row = check_optimizer(name, dtype, shapes, steps, pallas)
      except Exception as e:  # pylint: disable=broad-except  (report it, go on)
        session.error(what, e)
        continue
      session.results["checks"].append(row)
      verdict = {True: "ok  ", False: "FAIL", None: "n/a "}[row["ok"]]
      print(f"{verdict} {name} {dtype}: " + ", ".join(
          f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
          if k in ("codes_differ", "scale_ulps_of_max", "update_ulps_of_max", "skipped")),
            flush=True)
      session.write()


# ----------------------------------------------------------------------------
# Timing.


class Runner:
  """One optimizer's compiled step on its own params and state."""

  def __init__(self, name: str, step_kind: str, params: dict, data, steps: int):
    self.name, self.step_kind, self.data, self.steps = name, step_kind, data, steps
    tx = OPTIMIZERS[name].make("auto")
    self.params = jax.tree.map(jnp.copy, params)  # the step donates (consumes) them
    self.state = tx.init(self.params)
    self.state_bytes = optax4bit.state_nbytes(self.state)

    if step_kind == "update":
      def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state
      donate = (0, 1, 2)  # a fresh copy of the gradients each call, as in gpu_step.py
    else:
      def step(params, state, tokens):
        loss, grads = jax.value_and_grad(gpt_loss)(params, tokens)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss
      donate = (0, 1)
    start = time.perf_counter()
    with warnings.catch_warnings():
      # Every output shaped like the gradients already aliases a donated param
      # or moment, so JAX warns that the gradients alias none; donating still
      # frees them in the step.
      warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
      traced = jax.jit(step, donate_argnums=donate).trace(self.params, self.state, data)
      self.fn = traced.lower().compile()
    self.compile_seconds = time.perf_counter() - start
    self.implementation = implementation_of(name, traced.jaxpr.jaxpr)
    self.samples, self.loss = [], None

  def sample(self) -> float:
    """Seconds per step over ``steps`` steps (appended to ``samples``)."""
    if self.step_kind == "update":
      times = []
      for _ in range(self.steps):
        grads = jax.block_until_ready(jax.tree.map(jnp.copy, self.data))
        start = time.perf_counter()
        self.params, self.state = jax.block_until_ready(self.fn(self.params, self.state, grads))
        times.append(time.perf_counter() - start)
      seconds = statistics.median(times)
    else:
      start = time.perf_counter()
      for _ in range(self.steps):
        self.params, self.state, loss = self.fn(self.params, self.state, self.data)
      jax.block_until_ready((self.params, self.state))
      seconds = (time.perf_counter() - start) / self.steps
      self.loss = float(loss)
    self.samples.append(seconds)
    return seconds

  def free(self) -> None:
    self.params = self.state = self.fn = None


def _paired(runner: Runner, baseline: Runner, rounds: int) -> dict:
  ratios = np.array(runner.samples[-rounds:]) / np.array(baseline.samples[-rounds:])
  return dict(median=float(np.median(ratios)),
              quartiles=[float(np.quantile(ratios, 0.25)), float(np.quantile(ratios, 0.75))])


def timing_row(session: Session, runner: Runner, group: dict, baselines: dict,
               rounds: Optional[int]) -> dict:
  """The JSON row of ``runner``; ratios over the last ``rounds`` rounds, or, for
  a baseline (``rounds`` None), over every round of the group."""
  bandwidth = session.results["copy_bandwidth_bytes_per_s"]
  seconds = statistics.median(runner.samples)
  moved = 3 * group["param_bytes"] + 2 * runner.state_bytes
  row = dict(group, optimizer=runner.name, implementation=runner.implementation,
             seconds=seconds, seconds_quartiles=[float(np.quantile(runner.samples, q))
                                                 for q in (0.25, 0.75)],
             samples=len(runner.samples), steps_per_sample=runner.steps,
             compile_seconds=runner.compile_seconds, state_bytes=runner.state_bytes,
             bytes_moved=moved, copy_bandwidth_bytes_per_s=bandwidth)
  del row["param_bytes"]
  if runner.step_kind == "update":  # a train step's time is mostly the model's
    row.update(bytes_moved_per_s=moved / seconds, share_of_copy_bandwidth=moved / seconds /
               bandwidth)
  for key, base in (("vs_optax_adamw", "optax.adamw"), ("vs_optax_sgd_momentum",
                                                        "optax.sgd(momentum)")):
    if base in baselines and baselines[base] is not runner:
      paired = _paired(runner, baselines[base], rounds or len(runner.samples))
      row[key], row[key + "_quartiles"] = paired["median"], paired["quartiles"]
  if runner.loss is not None:
    row["final_loss"] = runner.loss
  return row


def _put_row(session: Session, row: dict) -> None:
  """Adds ``row`` or replaces its earlier form (a baseline's, after more rounds)."""
  key = lambda r: (r["group"], r["optimizer"])  # noqa: E731
  rows = session.results["timings"]
  rows[:] = [r for r in rows if key(r) != key(row)] + [row]
  session.write()


def _round(runners: list, index: int) -> None:
  """One sample of each runner, in an order that rotates from round to round."""
  shift = index % len(runners)
  for runner in runners[shift:] + runners[:shift]:
    runner.sample()


def _estimate(session: Session, name: str, size: str, step_kind: str, default: float) -> float:
  """Compile seconds expected: this optimizer's at the same size and step, else
  its largest at this size, else ``default``."""
  seen = session.compile_seconds
  if (name, size, step_kind) in seen:
    return seen[(name, size, step_kind)]
  same_size = [s for (n, z, _), s in seen.items() if n == name and z == size]
  return max(same_size) if same_size else default


def time_group(session: Session, size: str, dtype: str, step_kind: str, names: list,
               args) -> None:
  """The baselines and each of ``names`` at one size, dtype and step kind."""
  params = init_params(SIZES[size], jnp.dtype(dtype))
  num = sum(x.size for x in jax.tree.leaves(params))
  session.groups += 1
  group = dict(group=session.groups, size=size, params=num, dtype=dtype, step=step_kind,
               param_bytes=sum(x.nbytes for x in jax.tree.leaves(params)))
  if step_kind == "update":
    data = gpu_step.random_tree(gpu_step.gpt_shapes(**SIZES[size]), jnp.dtype(dtype), seed=1)
  else:
    data = jax.random.randint(jax.random.key(2), (args.batch, args.seq + 1), 0,
                              SIZES[size]["vocab"], jnp.int32)
    group.update(batch=args.batch, seq=args.seq)
  print(f"\n## {size} ({num / 1e6:.0f}M params), {dtype}, step={step_kind}", flush=True)
  baselines = {}
  for name in BASELINES:
    what = dict(size=size, dtype=dtype, step=step_kind, optimizer=name)
    guess = _estimate(session, name, size, step_kind, args.guess_compile[size] / 4)
    if not session.fits(guess, what):
      for other in names:
        session.fits(math.inf, dict(what, optimizer=other))
      return
    try:
      baselines[name] = Runner(name, step_kind, params, data, args.steps)
    except Exception as e:  # pylint: disable=broad-except
      session.error(what, e)
      return
    session.compile_seconds[(name, size, step_kind)] = baselines[name].compile_seconds
  for runner in baselines.values():
    for _ in range(args.warmup):
      runner.sample()
  # Seconds per step of the baselines together, for the estimate of each round.
  base_step = sum(statistics.median(r.samples) for r in baselines.values())
  for runner in baselines.values():
    runner.samples.clear()

  timed_any = False
  for name in names:
    what = dict(size=size, dtype=dtype, step=step_kind, optimizer=name)
    # A candidate's step is assumed to take up to 4x the baselines' together.
    timing = (args.rounds + args.warmup) * args.steps * 5 * base_step + 2
    if not session.fits(_estimate(session, name, size, step_kind, args.guess_compile[size])
                        + timing, what):
      continue
    runner, kept = None, {n: len(r.samples) for n, r in baselines.items()}
    try:
      runner = Runner(name, step_kind, params, data, args.steps)
      session.compile_seconds[(name, size, step_kind)] = runner.compile_seconds
      for _ in range(args.warmup):
        runner.sample()
      runner.samples.clear()
      runners = [*baselines.values(), runner]
      for index in range(args.rounds):
        _round(runners, index)
      row = timing_row(session, runner, group, baselines, args.rounds)
      _put_row(session, row)
      for base in baselines.values():
        _put_row(session, timing_row(session, base, group, baselines, None))
      timed_any = True
      share = row.get("share_of_copy_bandwidth")
      print(f"  {name:26s} {row['implementation']:6s} {row['seconds'] * 1e3:9.3f} ms "
            f"{row['vs_optax_adamw']:6.2f}x adamw  " + (
                f"{100 * share:5.1f}% of copy bw  " if share else "") +
            f"compile {row['compile_seconds']:5.1f} s", flush=True)
    except Exception as e:  # pylint: disable=broad-except  (out of memory, a failed compile)
      session.error(what, e)
      for n, base in baselines.items():  # keep the baselines' rounds aligned
        del base.samples[kept[n]:]
    finally:
      if runner is not None:
        runner.free()
      del runner
      gc.collect()
  if not timed_any:  # the baselines alone, so that the group has their rows
    for index in range(args.rounds):
      _round(list(baselines.values()), index)
    for base in baselines.values():
      _put_row(session, timing_row(session, base, group, baselines, None))
  for base in baselines.values():
    print(f"  {base.name:26s} {base.implementation:6s} "
          f"{statistics.median(base.samples) * 1e3:9.3f} ms (median of {len(base.samples)} "
          f"samples)  compile {base.compile_seconds:5.1f} s", flush=True)
    base.free()
  gc.collect()


def plan(sizes, dtypes, steps, names) -> list:
  """``(tier, size, dtype, step, optimizers)`` groups in the order they run:
  tier 1 before tier 2; within a tier by the place of the dtype in ``dtypes``
  (weight 3), of the size (2) and of the step (1), ties to the first dtype:
  with the defaults 1B float32 update and train, 110M float32 update and
  train, then the same in bfloat16."""
  ranked = sorted(((3 * d + 2 * z + s, d), size, dtype, step)
                  for d, dtype in enumerate(dtypes) for z, size in enumerate(sizes)
                  for s, step in enumerate(steps))
  runs = lambda n, size, step: (  # noqa: E731
      (CANDIDATES[n].sizes is None or size in CANDIDATES[n].sizes)
      and (CANDIDATES[n].steps is None or step in CANDIDATES[n].steps))
  groups = []
  for tier in (1, 2):
    for _, size, dtype, step in ranked:
      chosen = [n for n in names if CANDIDATES[n].tier == tier and runs(n, size, step)]
      # A group of the baselines alone where no optimizer of either tier runs.
      alone = tier == 2 and not any(runs(n, size, step) for n in names)
      if chosen or alone:
        groups.append((tier, size, dtype, step, chosen))
  return groups


def _already_timed(path: Optional[str]) -> set:
  if not path:
    return set()
  with open(path) as f:
    rows = json.load(f).get("timings", [])
  return {(r["size"], r["dtype"], r["step"], r["optimizer"]) for r in rows}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default=os.environ.get("OUT", "."),
                      help="folder for gpu_session.json (default $OUT)")
  parser.add_argument("--smoke", action="store_true",
                      help="tiny sizes on the CPU, checks in interpret mode (seconds)")
  parser.add_argument("--budget-seconds", type=float, default=420.0,
                      help="wall clock for the whole run: rows that would not fit are skipped")
  parser.add_argument("--sizes", nargs="+", choices=["1B", "100M"], default=["1B", "100M"])
  parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"],
                      default=["float32", "bfloat16"])
  parser.add_argument("--steps-kinds", nargs="+", choices=["update", "train"],
                      default=["update", "train"], dest="step_kinds")
  parser.add_argument("--optimizers", nargs="+", choices=list(CANDIDATES),
                      default=list(CANDIDATES))
  parser.add_argument("--rounds", type=int, default=10)
  parser.add_argument("--steps", type=int, default=5, help="steps per sample")
  parser.add_argument("--warmup", type=int, default=2, help="samples dropped after a compile")
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--seq", type=int, default=256)
  parser.add_argument("--check-steps", type=int, default=3)
  parser.add_argument("--skip-checks", action="store_true")
  parser.add_argument("--skip-timed", metavar="JSON",
                      help="skip the rows this earlier gpu_session.json has (a second call)")
  args = parser.parse_args(argv)

  if args.smoke:
    args.sizes, args.batch, args.seq = [SMOKE_SIZE], 2, 16
    args.rounds, args.steps, args.warmup, args.check_steps = 2, 2, 1, 2
  elif jax.default_backend() != "gpu":
    print(f"No GPU: JAX's default backend is {jax.default_backend()!r}; nothing measured "
          "(--smoke runs the script on the CPU).")
    return 0
  pallas = "pallas_interpret" if args.smoke else "pallas"
  # Compile seconds assumed for an optimizer not yet compiled at a size (the
  # H100's 1B compiles took 13-28 s, RESULTS "GPU step, second H100 run").
  args.guess_compile = {"1B": 35.0, "100M": 20.0, SMOKE_SIZE: 2.0}

  os.makedirs(args.out, exist_ok=True)
  header = machine()
  header["args"] = {k: v for k, v in vars(args).items() if k != "guess_compile"}
  session = Session(os.path.join(args.out, "gpu_session.json"), args.budget_seconds, header)
  print(f"device: {header['device']}, jax {header['jax']}, jaxlib {header['jaxlib']}, "
        f"budget {args.budget_seconds:.0f} s", flush=True)

  # "auto"'s one compile probe of the Pallas kernels, outside every row's
  # compile time; whether it picked them.
  start = time.perf_counter()
  session.results["auto_runs_pallas"] = isinstance(optax4bit.dispatch.resolve("auto").steps,
                                                   optax4bit.pallas.steps.PallasSteps)
  session.results["auto_probe_seconds"] = time.perf_counter() - start
  bandwidth = gpu_step.copy_bandwidth(args.rounds * args.steps, 2**20 if args.smoke else 2**30)
  session.results["copy_bandwidth_bytes_per_s"] = bandwidth
  print(f"device-to-device copy (x + 1): {bandwidth / 1e9:.0f} GB/s", flush=True)
  session.write()

  checked = set(args.dtypes) if args.skip_checks else set()

  def checks(dtypes):
    for dtype in [d for d in dtypes if d not in checked]:
      checked.add(dtype)
      print(f"\n## Pallas == jnp, {dtype} (teacher-forced steps)", flush=True)
      run_checks(session, args.optimizers, [dtype],
                 SMOKE_CHECK_SHAPES if args.smoke else CHECK_SHAPES, args.check_steps, pallas,
                 seconds_each=5.0 if args.smoke else 20.0)

  done = _already_timed(args.skip_timed)
  for tier, size, dtype, step_kind, names in plan(args.sizes, args.dtypes, args.step_kinds,
                                                  args.optimizers):
    checks(args.dtypes[:1] if tier == 1 else args.dtypes)  # the others' after tier 1
    left = [n for n in names if (size, dtype, step_kind, n) not in done]
    if names and not left:  # timed by the earlier run, baselines and all
      continue
    try:
      time_group(session, size, dtype, step_kind, left, args)
    except Exception as e:  # pylint: disable=broad-except  (e.g. out of memory at 1B)
      session.error(dict(size=size, dtype=dtype, step=step_kind), e)
    gc.collect()
  checks(args.dtypes)

  session.results["finished"] = True
  session.write()
  failed = [c for c in session.results["checks"] if c["ok"] is False]
  print(f"\n{len(session.results['timings'])} rows, {len(session.results['skipped'])} "
        f"skipped, {len(session.results['errors'])} errors, {len(failed)} failed checks, "
        f"{time.monotonic() - session.start:.0f} s; JSON: {session.path}", flush=True)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
