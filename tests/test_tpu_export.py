"""Every optimizer's whole train step lowers for TPU (issue 16, "TPU
readiness"): `jax.export` for ``platforms=["tpu"]`` on this CPU machine.

On a TPU, ``implementation="auto"`` runs the jnp path (the Pallas kernels are
Triton, GPU only; the C++ kernel is for CPUs), so what must lower there is the
jnp path. Exporting from another backend needs ``implementation="jnp"``:
``"auto"`` resolves at trace time from the backend doing the tracing.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import optax
import pytest

import optax4bit

OPTIMIZERS = {
    "adamw_4bit": lambda: optax4bit.adamw_4bit(1e-3, implementation="jnp"),
    "adamw_4bit paper": lambda: optax4bit.adamw_4bit(1e-3, recipe="paper",
                                                     implementation="jnp"),
    "adamw_4bit_factor": lambda: optax4bit.adamw_4bit_factor(1e-3, implementation="jnp"),
    "sgdm_4bit": lambda: optax4bit.sgdm_4bit(1e-2, implementation="jnp"),
    "adamw_8bit": lambda: optax4bit.adamw_8bit(1e-3, implementation="jnp"),
    "lion_4bit": lambda: optax4bit.lion_4bit(1e-4, implementation="jnp"),
    "muon_4bit": lambda: optax4bit.muon_4bit(1e-2, implementation="jnp"),
    "quantize_state(adam)": lambda: optax4bit.quantize_state(optax.adam(1e-3),
                                                             implementation="jnp"),
}

PARAMS = {"w1": jnp.zeros((64, 256)), "b1": jnp.zeros((256,)), "w2": jnp.zeros((256, 128)),
          "conv": jnp.zeros((3, 3, 16, 256))}


def _loss(params, x):
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  return jnp.mean((h @ params["w2"]) ** 2) + jnp.mean(params["conv"] ** 2)


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
  # FFI handler, host callbacks) beyond XLA's own sharding annotations.
  targets = set(re.findall(r"stablehlo\.custom_call @([\w$.]+)", exported.mlir_module()))
  assert targets <= {"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape"}, targets


def test_auto_on_tpu_runs_the_jnp_path(monkeypatch):
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  assert optax4bit.dispatch.fused_steps("auto") is None
  assert optax4bit.dispatch.codecs("auto") is None
