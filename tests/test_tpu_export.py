"""Every optimizer's whole train step lowers for TPU (issue 16, "TPU
readiness"): `jax.export` for ``platforms=["tpu"]`` on this CPU machine, with
default arguments.

``implementation="auto"`` follows the platform the update is lowered for
(`optax4bit.dispatch.per_platform`, issue 49): on a TPU the Pallas TPU
kernels (`optax4bit.tpu`; the leaves they do not cover the jnp engine), on a
GPU the process cannot probe the XLA engine, on the CPU the C++ kernel, each
from the same trace on this CPU host. The tests make the process one that
compiles for every platform (`optax4bit._platform.installed_platforms`, the
TPU's compiler being libtpu): a process with only a CPU traces its one
engine, and exports for another platform with ``implementation="jnp"``.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax4bit
from optax4bit import dispatch

OPTIMIZERS = {
    "adamw_4bit": lambda: optax4bit.adamw_4bit(1e-3),
    "adamw_4bit paper": lambda: optax4bit.adamw_4bit(1e-3, recipe="paper"),
    "adamw_4bit_factor": lambda: optax4bit.adamw_4bit_factor(1e-3),
    "sgdm_4bit": lambda: optax4bit.sgdm_4bit(1e-2),
    "adamw_8bit": lambda: optax4bit.adamw_8bit(1e-3),
    "lion_4bit": lambda: optax4bit.lion_4bit(1e-4),
    "muon_4bit": lambda: optax4bit.muon_4bit(1e-2),
    "quantize_state(adam)": lambda: optax4bit.quantize_state(optax.adam(1e-3)),
}

PARAMS = {"w1": jnp.zeros((64, 256)), "b1": jnp.zeros((256,)), "w2": jnp.zeros((256, 128)),
          "conv": jnp.zeros((3, 3, 16, 256))}


def _loss(params, x):
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  return jnp.mean((h @ params["w2"]) ** 2) + jnp.mean(params["conv"] ** 2)


@pytest.fixture
def every_platform(monkeypatch):
  """This process compiles for CUDA and TPUs too (their compilers installed):
  "auto" traces a branch per engine."""
  monkeypatch.setattr(dispatch, "installed_platforms",
                      lambda: frozenset({"cpu", "cuda", "rocm", "tpu"}))


@pytest.mark.usefixtures("every_platform")
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_train_step_exports_for_tpu(name):
  tx = OPTIMIZERS[name]()

  def train_step(params, state, x):
    grads = jax.grad(_loss)(params, x)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state = jax.eval_shape(tx.init, PARAMS)
  assert any(isinstance(x, optax4bit.QuantizedArray) for x in jax.tree.leaves(
      state, is_leaf=lambda x: isinstance(x, optax4bit.QuantizedArray))), "nothing quantized"
  exported = jax.export.export(jax.jit(train_step, donate_argnums=(0, 1)), platforms=["tpu"])(
      PARAMS, state, jax.ShapeDtypeStruct((8, 64), jnp.float32))
  assert exported.platforms == ("tpu",)
  # Nothing a TPU cannot run: no custom call (Triton kernels, the CPU kernel's
  # FFI handler, host callbacks) beyond XLA's own sharding annotations and the
  # Pallas TPU kernels (w1 is the leaf they cover), which jax.export keeps stable.
  targets = set(re.findall(r"stablehlo\.custom_call @([\w$.]+)", exported.mlir_module()))
  assert targets <= {"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape",
                     "tpu_custom_call"}, targets
  hand_written = name in ("adamw_4bit", "adamw_4bit paper", "adamw_4bit_factor", "sgdm_4bit",
                          "adamw_8bit")
  assert ("tpu_custom_call" in targets) == hand_written, targets


def test_auto_on_tpu_runs_the_tpu_engine(monkeypatch):
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  assert optax4bit.dispatch.fused_steps("auto") == optax4bit.tpu.TpuSteps()
  assert optax4bit.dispatch.codecs("auto") is None


def _lowered(tx, platform: str) -> str:
  state = jax.eval_shape(tx.init, PARAMS)
  return jax.jit(tx.update).trace(PARAMS, state, PARAMS).lower(
      lowering_platforms=(platform,)).as_text()


def _targets(text: str) -> set:
  return set(re.findall(r"stablehlo\.custom_call @([\w$.]+)", text))


@pytest.mark.usefixtures("every_platform")
def test_auto_lowers_each_platforms_engine_from_one_trace():
  # Chunks of 32 rows: the jnp engine loops over the larger leaves, the XLA
  # engine takes each leaf whole, the TPU kernels take w1 (the leaves they do
  # not cover run the jnp engine).
  tx = optax4bit.adamw_4bit(1e-3, chunk_size=32 * 256)
  cpu, cuda, tpu = (_lowered(tx, p) for p in ("cpu", "cuda", "tpu"))
  kernel = {"optax4bit_adam_4bit_stats", "optax4bit_adam_4bit_apply"}
  assert (kernel <= _targets(cpu)) == optax4bit.cpu.faster_than_jnp()
  assert not _targets(tpu) & kernel and not _targets(cuda) & kernel
  assert "tpu_custom_call" in _targets(tpu)
  assert "tpu_custom_call" not in _targets(cpu) | _targets(cuda)
  assert "stablehlo.while" not in cuda  # the XLA engine
  jnp_engine = _lowered(optax4bit.adamw_4bit(1e-3, chunk_size=32 * 256, implementation="jnp"),
                        "tpu")
  assert tpu.count("stablehlo.while") < jnp_engine.count("stablehlo.while")


def test_a_cpu_only_process_traces_one_engine(monkeypatch):
  monkeypatch.setattr(dispatch, "installed_platforms", lambda: frozenset({"cpu"}))
  tx = optax4bit.adamw_4bit(1e-3)
  jaxpr = lambda: str(jax.make_jaxpr(lambda *a: tx.update(*a))(  # noqa: E731  (a new trace)
      PARAMS, tx.init(PARAMS), PARAMS))
  assert "platform_index" not in jaxpr()
  monkeypatch.setattr(dispatch, "installed_platforms", lambda: frozenset({"cpu", "tpu"}))
  assert "platform_index" in jaxpr()  # the TPU's kernels, and the CPU's engine


@pytest.mark.usefixtures("every_platform")
# quantize_state(adam) with -m slow: CI's time (15 s); it dispatches as the others.
@pytest.mark.parametrize("name", ["adamw_4bit", "adamw_4bit_factor", "sgdm_4bit",
                                  pytest.param("quantize_state(adam)", marks=pytest.mark.slow)])
def test_auto_with_every_platforms_branch_runs_the_cpus_engine(name):
  """Compiled for this CPU, the branches of the other platforms leave the
  result bit for bit the CPU engine's."""
  tx = OPTIMIZERS[name]()
  params = jax.tree.map(lambda p: jnp.asarray(
      np.random.default_rng(0).normal(size=p.shape), jnp.float32), PARAMS)
  state = tx.init(params)
  # A new function each time: jit's cache does not see installed_platforms.
  with_branches = jax.jit(lambda *a: tx.update(*a))(params, state, params)
  branches = name != "quantize_state(adam)" or dispatch.codecs("auto") is not None
  assert ("platform_index" in str(jax.make_jaxpr(lambda *a: tx.update(*a))(
      params, state, params))) == branches
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(dispatch, "installed_platforms", lambda: frozenset({"cpu"}))
    alone = jax.jit(lambda *a: tx.update(*a))(params, state, params)
  for a, b in zip(jax.tree.leaves(with_branches), jax.tree.leaves(alone)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_an_accelerator_host_traces_its_engine_and_the_jnp_engine(monkeypatch):
  """On a GPU or TPU host the accelerator's engine and, for its CPU, the jnp
  engine (the C++ kernel is left to CPU hosts)."""
  monkeypatch.setattr(dispatch, "installed_platforms", lambda: frozenset({"cpu", "cuda", "tpu"}))
  tx = optax4bit.adamw_4bit(1e-3, chunk_size=32 * 256)
  jaxpr = lambda: str(jax.make_jaxpr(lambda *a: tx.update(*a))(  # noqa: E731  (a new trace)
      PARAMS, tx.init(PARAMS), PARAMS))
  monkeypatch.setattr(dispatch, "default_platform", lambda: "tpu")
  assert "platform_index" in jaxpr()
  # (A new optimizer: jit's cache would keep this trace for the GPU host below.)
  fresh = optax4bit.adamw_4bit(1e-3, chunk_size=32 * 256)
  assert "tpu_custom_call" in _targets(_lowered(fresh, "tpu"))
  assert "tpu_custom_call" not in _targets(_lowered(fresh, "cpu"))
  monkeypatch.setattr(dispatch, "default_platform", lambda: "gpu")
  assert "platform_index" in jaxpr()
  cpu, cuda = (_lowered(tx, p) for p in ("cpu", "cuda"))
  assert not _targets(cpu) & {"optax4bit_adam_4bit_stats", "optax4bit_adam_4bit_apply"}
  assert "stablehlo.while" in cpu and "stablehlo.while" not in cuda
