"""The C++ CPU kernel of 4-bit Adam (`optax4bit.cpu`) against the jnp path.

The kernel computes the jnp reference's float32 operations in the form XLA
compiles them to. XLA's form of the update depends on the program around it:
the kernel reproduces the one of leaves the jnp path splits into chunks (every
leaf of two rows or more), where codes, scales and updates must be bitwise
equal (`test_kernel_bitwise_matches_jnp`, both recipes). Elsewhere updates and
scales may differ in the last bits; a code differs only where a value lies
within rounding of a threshold. Criteria: at most 1e-4 of the codes differ, by
one level; scales within 8 ulps; updates within 8 ulps of the leaf's largest
update; identical NaN patterns.

The bitwise checks run on every ISA path of the kernel this CPU runs
(`optax4bit.cpu.isas`). The sharded check runs this file as a script with 8 virtual CPU devices (see
tests/subprocess_json.py).
"""

from __future__ import annotations

import os
import shutil
import sys

if __name__ == "__main__":
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")

import contextlib  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import optax4bit  # noqa: E402
import optax4bit.cpu  # noqa: E402
from optax4bit.cpu import ffi as cpu_ffi  # noqa: E402
from optax4bit import alias, dispatch  # noqa: E402
from optax4bit._steps import FusedStep  # noqa: E402
from optax4bit.pallas import steps as pallas_steps  # noqa: E402
from optax4bit._platform import default_platform  # noqa: E402

EPS32 = float(np.finfo(np.float32).eps)
needs_kernel = pytest.mark.skipif(not optax4bit.cpu.available(),
                                  reason=str(optax4bit.cpu.unavailable_reason()))

pytestmark = pytest.mark.usefixtures("cpu_default_device")


def _nibbles(codes) -> np.ndarray:
  codes = np.asarray(codes)
  return np.stack([codes & 15, codes >> 4]).astype(np.int32)


def compare_states(ref_state, state) -> dict:
  """Worst code, scale differences between two states' quantized moments."""
  ref_q = jax.tree.leaves(ref_state, is_leaf=lambda x: isinstance(x, optax4bit.QuantizedArray))
  got_q = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, optax4bit.QuantizedArray))
  differing, total, level, scale_ulps = 0, 0, 0, 0.0
  for a, b in zip(ref_q, got_q):
    if not isinstance(a, optax4bit.QuantizedArray):
      continue
    na, nb = _nibbles(a.codes), _nibbles(b.codes)
    differing += int(np.sum(na != nb))
    total += na.size
    level = max(level, int(np.max(np.abs(na - nb))))
    for sa, sb in zip(a.scales, b.scales):
      sa, sb = np.asarray(sa), np.asarray(sb)
      top = max(float(np.max(np.abs(sa))), np.finfo(np.float32).tiny)
      scale_ulps = max(scale_ulps, float(np.max(np.abs(sa - sb))) / (top * EPS32))
  return {"code_fraction": differing / max(total, 1), "code_level": level,
          "scale_ulps": scale_ulps}


def compare_updates(ref_updates, updates) -> dict:
  worst, same_nan = 0.0, True
  for a, b in zip(jax.tree.leaves(ref_updates), jax.tree.leaves(updates)):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    same_nan &= bool(np.array_equal(np.isnan(a), np.isnan(b)))
    finite = np.isfinite(a) & np.isfinite(b)
    if finite.any():
      top = max(float(np.max(np.abs(a[finite]))), np.finfo(np.float32).tiny)
      worst = max(worst, float(np.max(np.abs(a[finite] - b[finite]))) / (top * EPS32))
  return {"update_ulps": worst, "same_nan": same_nan}


def assert_close(codes: dict, updates: dict):
  assert codes["code_fraction"] <= 1e-4, codes
  assert codes["code_level"] <= 1, codes
  assert codes["scale_ulps"] <= 8, codes
  assert updates["update_ulps"] <= 8, updates
  assert updates["same_nan"], updates


def test_kernel_is_built_where_a_compiler_is():
  # CI installs with a C++ compiler: the kernel must be there, not skipped.
  if shutil.which("c++") or shutil.which("g++"):
    assert optax4bit.cpu.available(), optax4bit.cpu.unavailable_reason()


# Every ISA path of the row kernels; the tests run those this CPU runs.
ISAS = ("avx512", "avx2", "baseline")


@contextlib.contextmanager
def isa_path(name):
  """Kernel calls inside run the ISA path ``name`` (the caller blocks on
  their results inside: dispatch is asynchronous)."""
  before = optax4bit.cpu.isa()
  cpu_ffi._use_isa(name)  # pylint: disable=protected-access
  try:
    yield
  finally:
    cpu_ffi._use_isa(before)  # pylint: disable=protected-access


def _runnable_isas():
  return [name for name in ISAS if name in optax4bit.cpu.isas()]


@needs_kernel
def test_isa_paths():
  """The best path this CPU runs by default; OPTAX4BIT_CPU_ISA, read at load,
  forces another, and one this CPU does not run leaves the kernel unavailable."""
  isas = optax4bit.cpu.isas()
  assert isas[-1] == "baseline" and set(isas) <= set(ISAS)
  assert optax4bit.cpu.isa() == isas[0]
  script = ("import optax4bit.cpu as c; "
            "print(c.isa(), c.faster_than_jnp(), c.unavailable_reason() is None)")
  for name in isas:
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, env={**os.environ, cpu_ffi.ISA_ENV: name}).stdout.split()
    assert out == [name, str(name in cpu_ffi._FASTER_THAN_JNP), "True"]  # pylint: disable=protected-access
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       check=True, env={**os.environ, cpu_ffi.ISA_ENV: "sse9"}).stdout.split()
  assert out == ["None", "False", "False"]
  with pytest.raises(ValueError, match="sse9"):
    cpu_ffi._use_isa("sse9")  # pylint: disable=protected-access


def _steps_on_every_isa(txs, params, grads_per_step, pass_params=True):
  """Runs ``txs[0]`` (the jnp path) and ``txs[1]`` (the kernel, on every ISA
  path this CPU runs, each from its own state) over the gradients; yields
  ``(isa, u_ref, s_ref, u_cpu, s_cpu)`` after each step and path."""
  extra = (params,) if pass_params else ()
  ref_fn, cpu_fn = [jax.jit(tx.update) for tx in txs]
  s_ref = txs[0].init(params)
  states = {name: txs[1].init(params) for name in _runnable_isas()}
  for grads in grads_per_step:
    u_ref, s_ref = ref_fn(grads, s_ref, *extra)
    for name, state in states.items():
      with isa_path(name):
        u_cpu, s_cpu = jax.block_until_ready(cpu_fn(grads, state, *extra))
      yield name, u_ref, s_ref, u_cpu, s_cpu
      states[name] = s_cpu


def _lowered_text(tx, params, pass_params=True) -> str:
  extra = (params,) if pass_params else ()
  return jax.jit(tx.update).lower(params, tx.init(params), *extra).as_text()


def _mixed_grads(params, step):
  """Gradients in each parameter's dtype (bf16 leaves included)."""
  return {k: (0.1 * p.astype(jnp.float32) + 0.01 * jax.random.normal(
      jax.random.PRNGKey(10 * step + i), p.shape)).astype(p.dtype)
          for i, (k, p) in enumerate(params.items())}


def _grads(params, step):
  key = jax.random.PRNGKey(100 + step)
  grads = {k: 0.1 * p + 0.01 * jax.random.normal(jax.random.fold_in(key, i), p.shape, p.dtype)
           for i, (k, p) in enumerate(params.items())}
  if step == 2:  # non-finite elements: kept out of maxima, NaN encodes like 0
    grads["a"] = grads["a"].at[5, 7].set(jnp.nan).at[9, 1].set(jnp.inf)
  if step == 3:  # an all-zero leaf, a column of tiny values, a huge one
    grads["b"] = jnp.zeros_like(grads["b"])
    grads["a"] = grads["a"].at[:, 3].set(1e-30).at[0, 0].set(1e30)
  return grads


# Rows not a multiple of anything; one row; a leaf the kernel does not cover
# (last axis 130: jnp path); a 1-D leaf (jnp path).
SHAPES = {"a": (300, 256), "b": (64, 384), "c": (1, 128), "d": (33, 130), "e": (1000,)}


@needs_kernel
# -m slow: CI's time (18 s); test_kernel_bitwise_matches_jnp runs these steps bitwise.
@pytest.mark.slow
@pytest.mark.parametrize("nesterov", [False, True])
def test_kernel_matches_jnp(nesterov):
  params = {k: 0.02 * jax.random.normal(jax.random.PRNGKey(i), s)
            for i, (k, s) in enumerate(SHAPES.items())}
  txs = [optax4bit.scale_by_adam_4bit(min_quantize_size=0, nesterov=nesterov,
                                      implementation=impl) for impl in ("jnp", "cpu")]
  states = [tx.init(params) for tx in txs]
  updates_fns = [jax.jit(tx.update) for tx in txs]
  for step in range(6):
    grads = _grads(params, step)
    (u_ref, s_ref), (u_cpu, s_cpu) = [f(grads, s) for f, s in zip(updates_fns, states)]
    assert_close(compare_states(s_ref, s_cpu), compare_updates(u_ref, u_cpu))
    # Leaves the kernel does not cover run the jnp path: bit for bit.
    for k in ("d", "e"):
      np.testing.assert_array_equal(u_ref[k], u_cpu[k])
    states = [s_ref, s_cpu]
  for a, b in zip(jax.tree.leaves(s_ref), jax.tree.leaves(s_cpu)):
    assert jax.typeof(a) == jax.typeof(b)


@needs_kernel
def test_kernel_bf16_grads_and_auto_dispatch():
  params = {"w": jnp.ones((128, 256), jnp.bfloat16)}
  grads = {"w": (0.01 * jax.random.normal(jax.random.PRNGKey(0), (128, 256))).astype(jnp.bfloat16)}
  # param_rounding="nearest": the kernel's own bfloat16 update, not the appended rounding's
  # float32 one (tests/test_param_rounding.py covers that).
  ref = optax4bit.adamw_4bit(1e-3, min_quantize_size=0, implementation="jnp",
                             param_rounding="nearest")
  auto = optax4bit.adamw_4bit(1e-3, min_quantize_size=0, param_rounding="nearest")
  u_ref, s_ref = jax.jit(ref.update)(grads, ref.init(params), params)
  u_auto, s_auto = jax.jit(auto.update)(grads, auto.init(params), params)
  assert u_auto["w"].dtype == jnp.bfloat16
  assert_close(compare_states(s_ref, s_auto), compare_updates(u_ref, u_auto))
  # Both recipes run the kernel when asked for it.
  for recipe in ("default", "paper"):
    tx = optax4bit.adamw_4bit(1e-3, min_quantize_size=0, recipe=recipe, implementation="cpu")
    assert "optax4bit_adam_4bit_apply" in jax.jit(tx.update).lower(
        grads, tx.init(params), params).as_text()


@needs_kernel
@pytest.mark.parametrize("name", ISAS)
def test_auto_runs_the_kernel_only_where_it_is_faster(name):
  """"auto" decides by the ISA path (issue 15): the kernel's AVX-512 and AVX2
  paths beat the jnp path, its baseline path does not."""
  if name not in optax4bit.cpu.isas():
    pytest.skip(f"this CPU does not run the {name} path")
  faster = name != "baseline"
  params = {"w": jnp.ones((128, 256))}
  tx = optax4bit.adamw_4bit(1e-3, min_quantize_size=0)
  with isa_path(name):
    assert optax4bit.cpu.faster_than_jnp() == faster
    hlo = jax.jit(tx.update).lower(params, tx.init(params), params).as_text()
  assert ("optax4bit_adam_4bit_apply" in hlo) == faster


@needs_kernel
def test_auto_follows_the_default_device_not_the_backend(monkeypatch):
  """On a GPU machine an update traced under jax.default_device(cpu) runs on
  the CPU, so "auto" picks the CPU kernels there (by the backend alone it
  picked Pallas, which cannot lower for the CPU)."""
  if not optax4bit.cpu.faster_than_jnp():
    pytest.skip("auto runs the jnp path on this CPU's ISA path")
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  with jax.default_device(None):
    assert default_platform() == "gpu"
  with jax.default_device("cpu"):
    assert default_platform() == "cpu"
  with jax.default_device(jax.devices("cpu")[0]):
    assert default_platform() == "cpu"
    assert isinstance(dispatch.fused_steps("auto"), cpu_ffi.CpuSteps)
    assert dispatch.codecs("auto") is not None


def test_dispatch_names():
  assert not isinstance(dispatch.resolve("cpu").steps, pallas_steps.PallasSteps)
  steps = dispatch.fused_steps("jnp")
  assert steps is None
  if optax4bit.cpu.available():
    assert isinstance(dispatch.fused_steps("cpu"), cpu_ffi.CpuSteps)
  else:
    with pytest.raises(ValueError, match="implementation='cpu'"):
      optax4bit.adamw_4bit(1e-3, implementation="cpu")


def test_covers_both_recipes_only():
  def moments(shape, first="B128/DE", second="Rank-1/Linear"):
    tx = optax4bit.scale_by_adam_4bit(min_quantize_size=0, first_moment=first,
                                      second_moment=second)
    state = tx.init({"w": jnp.zeros(shape)})
    return state.mu["w"], state.nu["w"]
  g = jnp.zeros((4, 256))
  assert cpu_ffi.covers(g, moments((4, 256)))
  assert not cpu_ffi.covers(jnp.zeros((4, 130)), moments((4, 130)))
  assert not cpu_ffi.covers(g, moments((4, 256), first="B2048/DE"))
  assert not cpu_ffi.covers(g, moments((4, 256), second="B128/DE"))
  # Both recipes, and any mix of their quantizers, each moment rounded either way.
  assert cpu_ffi.covers(g, moments((4, 256), first=None, second=None))  # default recipe
  stochastic = optax4bit.QuantSpec.parse("B128/DE", signed=True, stochastic=True)
  assert cpu_ffi.covers(g, moments((4, 256), first=stochastic))
  assert cpu_ffi.covers(g, moments((4, 256), first="B128/NF", second="Rank-1/SqrtDE-0"))
  stochastic_v = optax4bit.QuantSpec.parse("Rank-1/Linear", signed=False, stochastic=True)
  assert cpu_ffi.covers(g, moments((4, 256), second=stochastic_v))
  # The stall rule (stall_only) on either moment.
  assert cpu_ffi.covers(g, moments((4, 256), first=_stall("B128/DE"),
                                   second=_stall("Rank-1/SqrtLinear")))
  assert cpu_ffi.covers_first_moment(g, moments((4, 256), first=_stall("B128/NF"))[0])
  assert not cpu_ffi.covers(g, moments((4, 256), second="Rank-1/DE-0"))
  assert not cpu_ffi.covers(g, moments((4, 256), first="B64/NF"))


def _bits(x) -> np.ndarray:
  return np.asarray(jnp.asarray(x).astype(jnp.float32)).view(np.uint32)


def assert_bitwise(ref_updates, ref_state, updates, state, leaves):
  """Codes, scales and updates of ``leaves`` bitwise equal."""
  for k in leaves:
    np.testing.assert_array_equal(_bits(ref_updates[k]), _bits(updates[k]), err_msg=k)
    for name in ("mu", "nu"):
      a, b = getattr(ref_state, name)[k], getattr(state, name)[k]
      assert isinstance(a, optax4bit.QuantizedArray) and a.spec == b.spec
      np.testing.assert_array_equal(np.asarray(a.codes), np.asarray(b.codes), err_msg=k)
      for sa, sb in zip(a.scales, b.scales):
        np.testing.assert_array_equal(_bits(sa), _bits(sb), err_msg=k)


STOCHASTIC_DE = optax4bit.QuantSpec("block", "DE", 4, signed=True, block_size=128,
                                    stochastic=True)
STOCHASTIC_SQRT_DE0, STOCHASTIC_LINEAR, STOCHASTIC_SQRT_LINEAR = (
    optax4bit.QuantSpec("rank1", mapping, 4, signed=False, stochastic=True)
    for mapping in ("SqrtDE-0", "Linear", "SqrtLinear"))
# (recipe, first moment override, second moment override, nesterov). Each
# runs every ISA path (about 9 s); the default run keeps each recipe, Nesterov,
# both moments stochastic and nearest-rounded m with stochastic v, and the
# other pairings run with -m slow (CI's time).
_slow = lambda *case: pytest.param(*case, marks=pytest.mark.slow)
BITWISE_CASES = [
    ("default", None, None, False),
    _slow("default", None, None, True),
    _slow("paper", None, None, False),
    ("paper", None, None, True),
    _slow("default", STOCHASTIC_DE, "Rank-1/Linear", False),  # the other pairings
    _slow("paper", "B128/NF", "Rank-1/SqrtDE-0", False),
    _slow("paper", "B128/NF", "Rank-1/SqrtLinear", False),
    # Second moments rounded stochastically: the table's slow and fast paths
    # (DE-0's crowded entries defeat the cells), Linear by its table.
    _slow("paper", None, STOCHASTIC_SQRT_DE0, False),
    ("paper", STOCHASTIC_DE, STOCHASTIC_LINEAR, True),
    ("default", "B128/DE", STOCHASTIC_SQRT_LINEAR, False),
]


@needs_kernel
@pytest.mark.parametrize("recipe,first,second,nesterov", BITWISE_CASES)
def test_kernel_bitwise_matches_jnp(recipe, first, second, nesterov):
  """Several steps with non-finite, zero, tiny and huge gradients, on every
  ISA path this CPU runs; the 1-row leaf "c" runs unchunked in the jnp path
  (close, see the module docstring)."""
  params = {k: 0.02 * jax.random.normal(jax.random.PRNGKey(i), s)
            for i, (k, s) in enumerate(SHAPES.items())}
  txs = [optax4bit.scale_by_adam_4bit(min_quantize_size=0, nesterov=nesterov, recipe=recipe,
                                      first_moment=first, second_moment=second,
                                      implementation=impl) for impl in ("jnp", "cpu")]
  assert "optax4bit_adam_4bit_apply" in _lowered_text(txs[1], params, pass_params=False)
  for _, u_ref, s_ref, u_cpu, s_cpu in _steps_on_every_isa(
      txs, params, (_grads(params, step) for step in range(5)), pass_params=False):
    assert_bitwise(u_ref, s_ref, u_cpu, s_cpu, ("a", "b"))
    assert_close(compare_states(s_ref, s_cpu), compare_updates(u_ref, u_cpu))
    np.testing.assert_array_equal(np.asarray(s_ref.mu["c"].codes),
                                  np.asarray(s_cpu.mu["c"].codes))
    for k in ("d", "e"):  # the jnp path in both
      np.testing.assert_array_equal(u_ref[k], u_cpu[k])


@needs_kernel
@pytest.mark.parametrize("recipe", ["default", "paper"])
def test_kernel_bitwise_bf16_and_chunked(recipe):
  """bf16 parameters and gradients; a 1024x1024 leaf that the jnp path runs in
  16 chunks (the stochastic draws must not depend on chunking); every ISA path
  this CPU runs."""
  params = {"w": 0.02 * jax.random.normal(jax.random.PRNGKey(0), (1024, 1024)),
            "h": (0.02 * jax.random.normal(jax.random.PRNGKey(1), (96, 512))).astype(jnp.bfloat16)}
  txs = [optax4bit.adamw_4bit(1e-3, min_quantize_size=0, recipe=recipe, chunk_size=1 << 16,
                              implementation=impl, param_rounding="nearest")
         for impl in ("jnp", "cpu")]
  for _, u_ref, s_ref, u_cpu, s_cpu in _steps_on_every_isa(
      txs, params, (_mixed_grads(params, step) for step in range(3))):
    assert u_cpu["h"].dtype == jnp.bfloat16
    assert_bitwise(u_ref, s_ref[0], u_cpu, s_cpu[0], ("w", "h"))


def _sharded_check() -> dict:
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
  mesh = jax.make_mesh((4, 2), ("x", "y"))
  shapes = {"w": (8, 512), "c": (6, 256), "t": (4, 6, 256)}  # "t": layers stacked
  specs = {"w": P("x", "y"), "c": P(None, "y"), "t": P("x", None, "y")}
  rng = np.random.RandomState(0)
  params = {k: jax.device_put(jnp.asarray(rng.standard_normal(s), jnp.float32),
                              NamedSharding(mesh, specs[k])) for k, s in shapes.items()}
  txs = [optax4bit.adamw_4bit(1e-2, min_quantize_size=0, implementation=impl)
         for impl in ("jnp", "cpu")]
  states = [tx.init(params) for tx in txs]
  worst = {}
  for step in range(4):
    grads = {k: jax.device_put(jnp.asarray(rng.standard_normal(s), jnp.float32),
                               NamedSharding(mesh, specs[k])) for k, s in shapes.items()}
    out = [jax.jit(tx.update)(grads, s, params) for tx, s in zip(txs, states)]
    result = {**compare_states(out[0][1], out[1][1]), **compare_updates(out[0][0], out[1][0])}
    try:  # every shard has two rows or more: bitwise (see the module docstring)
      assert_bitwise(out[0][0], out[0][1][0], out[1][0], out[1][1][0], tuple(shapes))
      result["bitwise"] = True
    except AssertionError:
      result["bitwise"] = False
    for key, value in result.items():
      if key in ("same_nan", "bitwise"):
        worst[key] = worst.get(key, True) and value
      else:
        worst[key] = max(worst.get(key, value), value)
    states = [o[1] for o in out]
  hlo = jax.jit(txs[1].update).lower(grads, states[1], params).as_text()
  worst["kernel_in_hlo"] = "optax4bit_adam_4bit_apply" in hlo
  worst["state_sharding_kept"] = all(
      a.sharding == b.sharding for a, b in zip(jax.tree.leaves(states[0]), jax.tree.leaves(states[1])))
  return worst


@needs_kernel
@pytest.mark.slow
def test_kernel_sharded_matches_jnp():
  from subprocess_json import run_json  # pylint: disable=import-outside-toplevel
  result = run_json(os.path.abspath(__file__))
  assert result.pop("kernel_in_hlo")
  assert result.pop("state_sharding_kept")
  assert result.pop("bitwise")  # the default recipe: stochastic draws hash global indices
  same_nan = result.pop("same_nan")
  assert_close({k: result[k] for k in ("code_fraction", "code_level", "scale_ulps")},
               {"update_ulps": result["update_ulps"], "same_nan": same_nan})


# Leaves of more than two axes (layers stacked for jax.lax.scan), run as the
# 2-D view of their rows: a one-row leaf, a 4-D leaf, one whose rank-1 scales
# meet a zeroed leading slice (its row scales 0 there).
STACKED_SHAPES = {"a": (3, 40, 256), "b": (2, 3, 4, 512), "c": (1, 1, 256), "z": (5, 7, 512)}


def _stacked_grads(params, step):
  grads = _grads(params, step)
  if step == 0:  # a leading slice and a column of v all 0 but for an inf where they meet
    grads["z"] = grads["z"].at[3].set(0.0).at[:, :, 5].set(0.0).at[3, 2, 5].set(jnp.inf)
  if step == 2:
    grads["a"] = grads["a"].at[1, 5, 7].set(jnp.nan).at[0, 9, 1].set(jnp.inf)
  if step == 3:
    grads["z"] = grads["z"].at[2].set(0.0)
    grads["b"] = grads["b"].at[:, 1].set(0.0).at[0, 0, 0, 0].set(1e30)
  return grads


@needs_kernel
@pytest.mark.parametrize("optimizer", [
    "default", pytest.param("paper, nesterov", marks=pytest.mark.slow),  # CI's time
    "adamw_8bit", "sgdm_4bit", "adamw_4bit_factor"])
def test_kernel_bitwise_matches_jnp_on_stacked_leaves(optimizer):
  """Every quantized moment, scale and update bitwise equal to the jnp path's
  on every ISA path this CPU runs; the kernel runs every leaf."""
  make, target = {
      "default": (lambda i: optax4bit.adamw_4bit(1e-3, min_quantize_size=0, implementation=i),
                  "adam_4bit_apply"),
      "paper, nesterov": (lambda i: optax4bit.adamw_4bit(
          1e-3, min_quantize_size=0, recipe="paper", nesterov=True, implementation=i),
                          "adam_4bit_apply"),
      "adamw_8bit": (lambda i: optax4bit.adamw_8bit(1e-3, min_quantize_size=0, implementation=i),
                     "adam_8bit_apply"),
      "sgdm_4bit": (lambda i: optax4bit.sgdm_4bit(1e-3, min_quantize_size=0, implementation=i),
                    "first_moment_apply"),
      "adamw_4bit_factor": (lambda i: optax4bit.adamw_4bit_factor(
          1e-3, min_quantize_size=0, implementation=i), "first_moment_apply"),
  }[optimizer]
  params = {k: 0.02 * jax.random.normal(jax.random.PRNGKey(i), s)
            for i, (k, s) in enumerate(STACKED_SHAPES.items())}
  txs = [make(impl) for impl in ("jnp", "cpu")]
  assert _lowered_text(txs[1], params).count(f"optax4bit_{target}") == len(params)
  for name, u_ref, s_ref, u_cpu, s_cpu in _steps_on_every_isa(
      txs, params, (_stacked_grads(params, step) for step in range(4))):
    for k in params:
      np.testing.assert_array_equal(_bits(u_ref[k]), _bits(u_cpu[k]), err_msg=f"{name} {k}")
    assert_states_bitwise(s_ref, s_cpu)


# The stall rule (QuantSpec stall_only: stochastic rounding only where the
# nearest code is the stored one), on m, on v and on both, by the table's fast
# path (NF, SqrtLinear, Linear) and its general one (DE, SqrtDE-0). Leaves:
# ragged rows, a 3-D leaf (run as its rows); with -m slow also one row and a
# last axis the kernel does not cover (jnp in both). The default run's cases
# take two leaves: the jnp path's stall rule compiles in about 2 s a leaf.
def _stall(name):
  return optax4bit.QuantSpec.parse(name, stochastic=True, stall_only=True)


STALL_SHAPES = {"a": (37, 256), "t": (3, 5, 256)}
STALL_SHAPES_SLOW = {**STALL_SHAPES, "c": (1, 128), "d": (5, 130)}
STOCHASTIC_NF = optax4bit.QuantSpec.parse("B128/NF", stochastic=True)


def _stall_grads(params, step):
  """As `_grads`: non-finite elements (step 2); a zero leaf, a column of tiny
  values and a huge one (step 3)."""
  key = jax.random.PRNGKey(100 + step)
  grads = {k: 0.1 * p + 0.01 * jax.random.normal(jax.random.fold_in(key, i), p.shape, p.dtype)
           for i, (k, p) in enumerate(params.items())}
  if step == 2:
    grads["a"] = grads["a"].at[5, 7].set(jnp.nan).at[9, 1].set(jnp.inf)
  if step == 3:
    grads["t"] = jnp.zeros_like(grads["t"])
    grads["a"] = grads["a"].at[:, 3].set(1e-30).at[0, 0].set(1e30)
  return grads


def _assert_steps_bitwise(txs, shapes, grads_of, target):
  """Updates and states of every leaf bitwise the jnp path's (txs[0]) over 4
  steps of grads_of(params, step), on every ISA path this CPU runs; the
  kernel (txs[1], its `target` call) runs every leaf whose last axis is a
  multiple of 128."""
  params = {k: 0.02 * jax.random.normal(jax.random.PRNGKey(i), s)
            for i, (k, s) in enumerate(shapes.items())}
  covered = sum(s[-1] % 128 == 0 for s in shapes.values())
  assert _lowered_text(txs[1], params, pass_params=False).count(target) == covered
  for name, u_ref, s_ref, u_cpu, s_cpu in _steps_on_every_isa(
      txs, params, (grads_of(params, step) for step in range(4)), pass_params=False):
    for k in shapes:
      np.testing.assert_array_equal(_bits(u_ref[k]), _bits(u_cpu[k]), err_msg=f"{name} {k}")
    assert_states_bitwise(s_ref, s_cpu)


@needs_kernel
@pytest.mark.parametrize("first,second,nesterov,shapes", [
    pytest.param(_stall("B128/NF"), _stall("Rank-1/SqrtDE-0"), False, STALL_SHAPES, id="both"),
    pytest.param(_stall("B128/NF"), STOCHASTIC_SQRT_LINEAR, False, STALL_SHAPES_SLOW, id="m",
                 marks=pytest.mark.slow),
    pytest.param(STOCHASTIC_NF, _stall("Rank-1/SqrtLinear"), False, STALL_SHAPES_SLOW, id="v",
                 marks=pytest.mark.slow),
    pytest.param(_stall("B128/DE"), _stall("Rank-1/SqrtDE-0"), True, STALL_SHAPES_SLOW,
                 id="both-general", marks=pytest.mark.slow),
    pytest.param(_stall("B128/NF"), _stall("Rank-1/Linear"), False, STALL_SHAPES_SLOW,
                 id="both-linear", marks=pytest.mark.slow),
    pytest.param(_stall("B128/DE"), "Rank-1/Linear", False, STALL_SHAPES_SLOW,
                 id="m-v-nearest", marks=pytest.mark.slow),
])
def test_kernel_stall_rule_bitwise_matches_jnp(first, second, nesterov, shapes):
  txs = [optax4bit.scale_by_adam_4bit(min_quantize_size=0, nesterov=nesterov,
                                      first_moment=first, second_moment=second,
                                      implementation=impl) for impl in ("jnp", "cpu")]
  _assert_steps_bitwise(txs, shapes, _stall_grads, "optax4bit_adam_4bit_apply")


@needs_kernel
@pytest.mark.parametrize("kind,first,shapes", [
    pytest.param("factored", _stall("B128/DE"), STALL_SHAPES, id="factored-general"),
    pytest.param("nesterov", _stall("B128/NF"), STALL_SHAPES_SLOW, id="nesterov",
                 marks=pytest.mark.slow),
    pytest.param("momentum", _stall("B128/DE"), STALL_SHAPES_SLOW, id="momentum-general",
                 marks=pytest.mark.slow),
    pytest.param("factored", _stall("B128/NF"), STALL_SHAPES_SLOW, id="factored",
                 marks=pytest.mark.slow),
])
def test_first_moment_kernels_stall_rule_bitwise_match_jnp(kind, first, shapes):
  """sgdm_4bit's and adamw_4bit_factor's steps with m rounded by the stall rule."""
  txs = [_first_moment_tx(kind, impl, first_moment=first) for impl in ("jnp", "cpu")]
  _assert_steps_bitwise(txs, shapes, _stall_grads, "optax4bit_first_moment_apply")


# 8-bit Adam (adamw_8bit): both moments B256/DE, one kernel call per leaf.
# Rows not a multiple of anything; one row; a last axis that is not a
# multiple of 256 (jnp path); a 1-D leaf (jnp path).
SHAPES_8BIT = {"a": (300, 256), "b": (64, 512), "c": (1, 256), "d": (33, 384), "e": (1000,)}


@needs_kernel
@pytest.mark.parametrize("nesterov", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_kernel_8bit_bitwise_matches_jnp(nesterov):
  """adamw_8bit: several steps with non-finite, zero, tiny and huge (g**2
  overflows, then normal steps: restart_overflowed) gradients, on every ISA
  path this CPU runs."""
  params = {k: 0.02 * jax.random.normal(jax.random.PRNGKey(i), s)
            for i, (k, s) in enumerate(SHAPES_8BIT.items())}
  txs = [optax4bit.adamw_8bit(1e-3, min_quantize_size=0, nesterov=nesterov,
                              implementation=impl) for impl in ("jnp", "cpu")]
  hlo = _lowered_text(txs[1], params)
  assert "optax4bit_adam_8bit_apply" in hlo and "optax4bit_adam_4bit" not in hlo
  for _, u_ref, s_ref, u_cpu, s_cpu in _steps_on_every_isa(
      txs, params, (_grads(params, step) for step in range(5))):
    assert_bitwise(u_ref, s_ref[0], u_cpu, s_cpu[0], ("a", "b", "c", "d", "e"))


@needs_kernel
def test_kernel_8bit_bitwise_bf16():
  """bf16 gradients, in a leaf the jnp path runs in chunks: codes, scales and
  update (rounded to bf16) bitwise those of the jnp path given the same
  gradients in float32. (XLA compiles the jnp path's bf16 program to a
  slightly different form: a few elements of its moments and update differ
  from its float32 program's in the last bit.)"""
  params = {"w": jnp.zeros((256, 1024), jnp.bfloat16)}
  txs = [optax4bit.scale_by_adam_4bit(min_quantize_size=0, chunk_size=1 << 16,
                                      first_moment=alias.EIGHT_BIT_FIRST_MOMENT,
                                      second_moment=alias.EIGHT_BIT_SECOND_MOMENT,
                                      implementation=impl) for impl in ("jnp", "cpu")]
  ref_fn, cpu_fn = [jax.jit(tx.update) for tx in txs]
  s_ref = txs[0].init(params)
  states = {name: txs[1].init(params) for name in _runnable_isas()}
  for step in range(3):
    grads = {"w": (0.01 * jax.random.normal(jax.random.PRNGKey(step), (256, 1024))).astype(
        jnp.bfloat16)}
    u_ref, s_ref = ref_fn({"w": grads["w"].astype(jnp.float32)}, s_ref)
    u_ref = {"w": u_ref["w"].astype(jnp.bfloat16)}
    for name, state in states.items():
      with isa_path(name):
        u_cpu, s_cpu = jax.block_until_ready(cpu_fn(grads, state))
      assert u_cpu["w"].dtype == jnp.bfloat16
      assert_bitwise(u_ref, s_ref, u_cpu, s_cpu, ("w",))
      states[name] = s_cpu


@needs_kernel
@pytest.mark.parametrize("name", ISAS)
def test_auto_runs_the_8bit_kernel_only_where_it_is_faster(name):
  """As for 4 bits: "auto" runs the 8-bit kernel on the AVX-512 and AVX2
  paths, not on the baseline path (slower than the jnp path)."""
  if name not in optax4bit.cpu.isas():
    pytest.skip(f"this CPU does not run the {name} path")
  params = {"w": jnp.ones((128, 256))}
  tx = optax4bit.adamw_8bit(1e-3, min_quantize_size=0)
  with isa_path(name):
    hlo = jax.jit(tx.update).lower(params, tx.init(params), params).as_text()
  assert ("optax4bit_adam_8bit_apply" in hlo) == (name != "baseline")


def _near_thresholds(mapping: str, signed: bool) -> np.ndarray:
  """An 8-bit map's thresholds, their float32 neighbours and its entries."""
  t = optax4bit.quant.maps.midpoint_thresholds(mapping, 8, signed)
  up, down = np.nextafter(t, np.float32(np.inf)), np.nextafter(t, np.float32(-np.inf))
  return np.concatenate([t, up, down, optax4bit.qmap(mapping, 8, signed)])


@needs_kernel
@pytest.mark.parametrize("second", ["DE", "DE-0"])
def test_kernel_8bit_codes_at_every_threshold(second):
  """The kernel's nearest rounding (a bucket lookup) against the jnp
  reference's binary search at every threshold and its neighbours: with
  b1 = b2 = 0 the new moments are g and g**2, encoded in blocks whose
  maximum is 1 (so normalized exactly to themselves)."""
  first = alias.EIGHT_BIT_FIRST_MOMENT
  v_spec = optax4bit.QuantSpec("block", second, 8, signed=False, block_size=256)
  m_values = _near_thresholds("DE", True)
  # g**2 rounds to the v thresholds or next to them.
  v_values = np.sqrt(_near_thresholds(second, False).astype(np.float64)).astype(np.float32)
  values = np.concatenate([m_values, -m_values, v_values, [np.nan, 0.0, -0.0, 3e-39]])
  row = np.resize(values.astype(np.float32), 255 * 2 * (-(-values.size // 510)))
  g = np.insert(row.reshape(-1, 255), 0, 1.0, axis=1).reshape(2, -1)  # a 1 leads each block
  g = jnp.asarray(g, jnp.float32)
  moments = [optax4bit.quant.array.zeros(g.shape, jnp.float32, spec) for spec in (first, v_spec)]
  # pylint: disable-next=protected-access
  coef = cpu_ffi._coefficients(0.0, 0.0, 1e-8, 0.0, jnp.int32(1))
  for name in _runnable_isas():
    with isa_path(name):
      _, (m, v) = jax.block_until_ready(cpu_ffi.adam_8bit_leaf(g, moments, coef, False))
    for got, x, spec in ((m, g, first), (v, g * g, v_spec)):
      ref = optax4bit.quantize(x, spec)
      np.testing.assert_array_equal(np.asarray(got.codes), np.asarray(ref.codes), err_msg=name)
      np.testing.assert_array_equal(_bits(got.scales[0]), _bits(ref.scales[0]), err_msg=name)


def test_covers_8bit():
  """adamw_8bit's quantizers (and a zero-free second moment) on a last axis
  that is a multiple of 256; no other 8-bit quantizers or pairings."""
  def moments(shape, first=alias.EIGHT_BIT_FIRST_MOMENT, second=alias.EIGHT_BIT_SECOND_MOMENT):
    state = optax4bit.scale_by_adam_4bit(min_quantize_size=0, first_moment=first,
                                         second_moment=second).init({"w": jnp.zeros(shape)})
    return state.mu["w"], state.nu["w"]
  g = jnp.zeros((4, 512))
  assert cpu_ffi.covers(g, moments((4, 512)))
  de0 = optax4bit.QuantSpec("block", "DE-0", 8, signed=False, block_size=256)
  assert cpu_ffi.covers(g, moments((4, 512), second=de0))
  assert not cpu_ffi.covers(jnp.zeros((4, 384)), moments((4, 384)))
  assert not cpu_ffi.covers(jnp.zeros((512,)), moments((512,)))
  stochastic = alias.EIGHT_BIT_FIRST_MOMENT.replace(stochastic=True)
  assert not cpu_ffi.covers(g, moments((4, 512), first=stochastic))
  b128 = alias.EIGHT_BIT_FIRST_MOMENT.replace(block_size=128)
  assert not cpu_ffi.covers(g, moments((4, 512), first=b128))
  assert not cpu_ffi.covers(g, moments((4, 512), second="Rank-1/Linear"))  # 8-bit with 4-bit
  assert not cpu_ffi.covers(g, moments((4, 512), first="B128/DE"))


# The momentum and factored kernels: one first-moment call (its row kernels
# shared with Adam's), bitwise against the jnp path.


def _first_moment_tx(kind, implementation, **kwargs):
  """``kind``: "momentum", "nesterov" or "factored"."""
  if kind == "factored":
    return optax4bit.scale_by_factored_adam_4bit(min_quantize_size=0,
                                                 implementation=implementation, **kwargs)
  return optax4bit.scale_by_momentum_4bit(0.9, nesterov=kind == "nesterov", min_quantize_size=0,
                                          implementation=implementation, **kwargs)


def assert_states_bitwise(ref_state, state):
  for a, b in zip(jax.tree.leaves(ref_state), jax.tree.leaves(state)):
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype == np.float32:
      a, b = a.view(np.uint32), b.view(np.uint32)
    np.testing.assert_array_equal(a, b)


@needs_kernel
@pytest.mark.parametrize("kind,recipe", [
    ("momentum", "default"), ("factored", "default"), ("nesterov", "paper"),
    # CI's time: each kind and each recipe stay in the default run.
    pytest.param("nesterov", "default", marks=pytest.mark.slow),
    pytest.param("momentum", "paper", marks=pytest.mark.slow),
    pytest.param("factored", "paper", marks=pytest.mark.slow)])
def test_first_moment_kernels_bitwise_match_jnp(kind, recipe):
  """sgdm_4bit's and adamw_4bit_factor's steps: several steps with
  non-finite, zero, tiny and huge gradients (the factored step's overflow
  restart), on every ISA path this CPU runs; every leaf bitwise, the one-row
  leaf included (leaves "d" and "e" run the jnp path in both)."""
  txs = [_first_moment_tx(kind, impl, recipe=recipe) for impl in ("jnp", "cpu")]
  _assert_steps_bitwise(txs, SHAPES, _grads, "optax4bit_first_moment_apply")


@needs_kernel
@pytest.mark.parametrize("optimizer", ["sgdm_4bit", "adamw_4bit_factor"])
def test_first_moment_kernels_bitwise_bf16_and_chunked(optimizer):
  """bf16 parameters and gradients; a 1024x512 leaf the jnp path runs in 8
  chunks (stochastic draws must not depend on chunking); every ISA path."""
  params = {"w": 0.02 * jax.random.normal(jax.random.PRNGKey(0), (1024, 512)),
            "h": (0.02 * jax.random.normal(jax.random.PRNGKey(1), (96, 512))).astype(jnp.bfloat16)}
  txs = [getattr(optax4bit, optimizer)(1e-3, min_quantize_size=0, chunk_size=1 << 16,
                                       implementation=impl, param_rounding="nearest")
         for impl in ("jnp", "cpu")]
  for name, u_ref, s_ref, u_cpu, s_cpu in _steps_on_every_isa(
      txs, params, (_mixed_grads(params, step) for step in range(2))):
    assert u_cpu["h"].dtype == jnp.bfloat16
    for k in params:
      np.testing.assert_array_equal(_bits(u_ref[k]), _bits(u_cpu[k]), err_msg=f"{name} {k}")
    assert_states_bitwise(s_ref, s_cpu)


@needs_kernel
def test_first_moment_kernels_decline_what_they_do_not_cover():
  """`CpuSteps.run` of the momentum and factored steps returns None (the jnp path runs) for
  leaves outside `covers_first_moment`."""
  steps = cpu_ffi.CpuSteps()
  key = jax.random.key(0)

  def trace(shape, spec="B128/DE"):
    tx = optax4bit.scale_by_momentum_4bit(min_quantize_size=0, first_moment=spec)
    return tx.init({"w": jnp.zeros(shape)}).trace["w"]

  def momentum(g, t, keys=(None,)):
    return steps.run(FusedStep.heavy_ball(0.9, False), g, (t,), (), keys)

  def factored(g, m, keys=(None,)):
    side = (jnp.ones(g.shape[:-1] + (1,)), jnp.ones(g.shape[:-2] + (1, g.shape[-1])),
            jnp.ones(g.shape[:-2] + (1, 1)))
    return steps.run(FusedStep.factored(0.9, 0.999, 1e-8, 0.0, jnp.int32(1)), g, (m,), side,
                     keys)

  g = jnp.ones((4, 256))
  for run in (momentum, factored):
    assert run(g, trace((4, 256))) is not None
    assert run(g, trace((4, 256), "B128/NF")) is not None
    stochastic = optax4bit.QuantSpec.parse("B128/NF", signed=True, stochastic=True)
    assert run(g, trace((4, 256), stochastic), (key,)) is not None
    assert run(g, trace((4, 256), stochastic)) is None  # no key: the jnp path raises
    assert run(jnp.ones((4, 130)), trace((4, 130))) is None
    assert run(g, jnp.zeros((4, 256))) is None  # kept in float32
    for spec in ("B64/DE", "B2048/DE", "Tensor/DE"):
      assert run(g, trace((4, 256), spec)) is None
    eight_bit = optax4bit.QuantSpec("block", "DE", 8, signed=True, block_size=128)
    assert run(g, trace((4, 256), eight_bit)) is None
  assert momentum(jnp.ones((512,)), trace((512,))) is None
  # Stacked leaves run as their rows (the factored step per leading index).
  assert momentum(jnp.ones((2, 4, 256)), trace((2, 4, 256))) is not None
  assert factored(jnp.ones((2, 4, 256)), trace((2, 4, 256))) is not None


@needs_kernel
@pytest.mark.parametrize("name", ISAS)
def test_auto_runs_the_first_moment_kernel_only_where_it_is_faster(name):
  if name not in optax4bit.cpu.isas():
    pytest.skip(f"this CPU does not run the {name} path")
  params = {"w": jnp.ones((128, 256))}
  for tx in (optax4bit.sgdm_4bit(1e-3, min_quantize_size=0),
             optax4bit.adamw_4bit_factor(1e-3, min_quantize_size=0)):
    with isa_path(name):
      hlo = jax.jit(tx.update).lower(params, tx.init(params), params).as_text()
    assert ("optax4bit_first_moment_apply" in hlo) == (name != "baseline")


def _sharded_first_moment_check() -> dict:
  """sgdm_4bit (both recipes) and adamw_4bit_factor sharded over 8 devices:
  bitwise against the jnp path (which also runs per shard)."""
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
  mesh = jax.make_mesh((4, 2), ("x", "y"))
  shapes = {"w": (8, 512), "c": (6, 256), "t": (4, 6, 256)}  # "t": layers stacked
  specs = {"w": P("x", "y"), "c": P(None, "y"), "t": P("x", None, "y")}
  rng = np.random.RandomState(0)
  params = {k: jax.device_put(jnp.asarray(rng.standard_normal(s), jnp.float32),
                              NamedSharding(mesh, specs[k])) for k, s in shapes.items()}
  result = {}
  for name, make in (("sgdm", lambda i: optax4bit.sgdm_4bit(1e-2, min_quantize_size=0,
                                                            implementation=i)),
                     ("sgdm_paper", lambda i: optax4bit.sgdm_4bit(
                         1e-2, min_quantize_size=0, recipe="paper", nesterov=True,
                         implementation=i)),
                     ("factor", lambda i: optax4bit.adamw_4bit_factor(
                         1e-2, min_quantize_size=0, implementation=i))):
    txs = [make(impl) for impl in ("jnp", "cpu")]
    states = [tx.init(params) for tx in txs]
    bitwise = True
    for _ in range(3):
      grads = {k: jax.device_put(jnp.asarray(rng.standard_normal(s), jnp.float32),
                                 NamedSharding(mesh, specs[k])) for k, s in shapes.items()}
      out = [jax.jit(tx.update)(grads, s, params) for tx, s in zip(txs, states)]
      try:
        for k in shapes:
          np.testing.assert_array_equal(_bits(out[0][0][k]), _bits(out[1][0][k]))
        assert_states_bitwise(out[0][1], out[1][1])
      except AssertionError:
        bitwise = False
      states = [o[1] for o in out]
    hlo = jax.jit(txs[1].update).lower(grads, states[1], params).as_text()
    result[name] = {"bitwise": bitwise, "kernel_in_hlo": "optax4bit_first_moment_apply" in hlo,
                    "state_sharding_kept": all(a.sharding == b.sharding for a, b in zip(
                        jax.tree.leaves(states[0]), jax.tree.leaves(states[1])))}
  return result


@needs_kernel
@pytest.mark.slow
def test_first_moment_kernels_sharded_match_jnp():
  from subprocess_json import run_json  # pylint: disable=import-outside-toplevel
  result = run_json(os.path.abspath(__file__), "first_moment")
  assert result == {name: {"bitwise": True, "kernel_in_hlo": True, "state_sharding_kept": True}
                    for name in ("sgdm", "sgdm_paper", "factor")}, result


if __name__ == "__main__":
  check = _sharded_first_moment_check if sys.argv[1:] == ["first_moment"] else _sharded_check
  print("RESULTS " + json.dumps(check()))
  sys.exit(0)
