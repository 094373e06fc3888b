"""The XLA engine (`optax4bit.xla`, ``implementation="xla"``) against the jnp
reference on CPU: codes and scales bit for bit, updates to float32 rounding,
for every hand-written optimizer, float32 and bfloat16, ragged, 1-D, 3-D and
small leaves, sharded and not; and its compiled step has no loop and no
gather, 8-bit moments included (their tables in closed form)."""


import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax4bit
from conftest import sharded_against_unsharded_jnp
from optax4bit import dispatch
from optax4bit._steps import FusedStep
from optax4bit.quant import array as qarray
from optax4bit.quant import packing
from optax4bit.quant.spec import QuantSpec
from optax4bit.xla import codec as xla_codec
from optax4bit.xla import steps as xla_steps

OPTIMIZERS = {
    "adamw_4bit": lambda impl: optax4bit.adamw_4bit(1e-2, implementation=impl),
    "adamw_4bit paper": lambda impl: optax4bit.adamw_4bit(1e-2, recipe="paper",
                                                          implementation=impl),
    "adamw_4bit nesterov": lambda impl: optax4bit.adamw_4bit(1e-2, nesterov=True,
                                                             implementation=impl),
    # The default's m rounds by the stall rule: m stochastic everywhere, and
    # the rule on v too.
    "adamw_4bit m stochastic": lambda impl: optax4bit.adamw_4bit(
        1e-2, first_moment=QuantSpec.parse("B128/NF", stochastic=True), implementation=impl),
    "adamw_4bit stall v": lambda impl: optax4bit.adamw_4bit(
        1e-2, second_moment=QuantSpec.parse("Rank-1/SqrtLinear", stochastic=True, stall_only=True),
        implementation=impl),
    "adamw_4bit_factor": lambda impl: optax4bit.adamw_4bit_factor(1e-2, implementation=impl),
    "adamw_8bit": lambda impl: optax4bit.adamw_8bit(1e-2, implementation=impl),
    "sgdm_4bit": lambda impl: optax4bit.sgdm_4bit(1e-2, momentum=0.9, implementation=impl),
}


def _params(dtype):
  shapes = {"ragged": (300, 257), "vector": (5000,), "cube": (3, 4, 600), "small": (64,),
            "narrow": (256, 40)}
  keys = jax.random.split(jax.random.key(0), len(shapes))
  return {name: (jax.random.normal(k, shape) * 0.1).astype(dtype)
          for k, (name, shape) in zip(keys, sorted(shapes.items()))}


def _run(tx, params, steps=3):
  state = tx.init(params)
  update = jax.jit(tx.update)
  for t in range(steps):
    grads = jax.tree.map(
        lambda p, t=t: (jnp.sin(7.0 * p.astype(jnp.float32) + t) * 0.5).astype(p.dtype), params)
    updates, state = update(grads, state, params)
  return updates, state


# The default run: the default recipe in float32; the other optimizers (adamw_8bit's leaves:
# `test_8bit_leaves_run_in_one_piece`), and bfloat16, with -m slow (CI's time: about 16 s
# each). The stall rule's XLA codes are checked by tests/test_stall_rounding.py.
_DEFAULT_RUN = {("adamw_4bit", "f32")}
CASES = [pytest.param(name, dtype, id=f"{name}-{dtype_id}",
                      marks=() if (name, dtype_id) in _DEFAULT_RUN else pytest.mark.slow)
         for name in OPTIMIZERS for dtype, dtype_id in ((jnp.float32, "f32"),
                                                        (jnp.bfloat16, "bf16"))]


@pytest.mark.parametrize("name,dtype", CASES)
def test_codes_and_updates_equal_the_jnp_engine(name, dtype):
  params = _params(dtype)
  ref_updates, ref_state = _run(OPTIMIZERS[name]("jnp"), params)
  updates, state = _run(OPTIMIZERS[name]("xla"), params)
  for (path, ref), got in zip(jax.tree_util.tree_leaves_with_path(ref_state),
                              jax.tree.leaves(state)):
    where = jax.tree_util.keystr(path)
    if where.endswith((".row", ".col")) or (dtype != jnp.float32 and ref.dtype != jnp.uint8):
      # Factor's float32 factors: whole-leaf sums against the jnp engine's chunked
      # ones; with bf16 gradients the float32 moments of small leaves (and so
      # scales) may differ by an ulp: XLA contracts a product into an FMA in one
      # fusion and not in the other (the jnp engine's note on issue 37).
      np.testing.assert_allclose(got, ref, rtol=1e-4, err_msg=where)
    else:
      np.testing.assert_array_equal(np.asarray(got), np.asarray(ref), err_msg=where)
  for ref, got in zip(jax.tree.leaves(ref_updates), jax.tree.leaves(updates)):
    chex.assert_trees_all_close(got.astype(jnp.float32), ref.astype(jnp.float32),
                                rtol=1e-5 if dtype == jnp.float32 else 1e-2, atol=1e-7)


@pytest.mark.parametrize("name", ["adamw_4bit", "adamw_4bit_factor", "sgdm_4bit", "adamw_8bit"])
def test_compiled_step_has_no_loop_and_no_gather(name):
  params = _params(jnp.float32)
  tx = OPTIMIZERS[name]("xla")
  hlo = jax.jit(tx.update).lower(params, tx.init(params), params).compile().as_text()
  # XLA:CPU keeps threefry's rounds as a loop on the scalar keys of stochastic rounding.
  loops = [line for line in hlo.splitlines() if " while(" in line and "threefry" not in line]
  assert not loops, loops
  assert " gather(" not in hlo


def test_8bit_leaves_run_in_one_piece():
  spec = QuantSpec.parse("B256/DE", bits=8)
  moments = (qarray.zeros((64, 512), jnp.float32, spec),
             qarray.zeros((64, 512), jnp.float32, QuantSpec.parse("B256/DE", bits=8,
                                                                  signed=False)))
  step = FusedStep.adam(0.9, 0.999, 1e-8, 0.0, jnp.int32(1), False)
  assert dispatch.resolve("xla").steps.run(step, jnp.ones((64, 512)), moments) is not None
  (m, _) = moments
  np.testing.assert_array_equal(xla_codec.decode(m.codes, m.scales, m.spec, m.layout, m.shape),
                                np.zeros((64, 512), np.float32))


@pytest.mark.parametrize("length", [1, 2, 7, 128, 257])
def test_unpack_fusible_equals_unpack(length):
  codes = jax.random.randint(jax.random.key(length), (3, length), 0, 16).astype(jnp.uint8)
  packed = packing.pack(codes, 4)
  np.testing.assert_array_equal(packing.unpack_fusible(packed, length, 4),
                                packing.unpack(packed, length, 4))
  np.testing.assert_array_equal(packing.unpack_fusible(packed, length, 4), codes)


def test_auto_runs_the_xla_engine_on_gpus_without_pallas_and_not_on_tpus(monkeypatch):
  from optax4bit.pallas import steps as pallas_steps
  monkeypatch.setattr(pallas_steps, "kernels_run_here", lambda: False)
  assert dispatch.resolve("auto", "gpu") == dispatch.resolve("xla")
  assert dispatch.resolve("auto", "tpu") == dispatch.resolve("tpu")
  assert not dispatch.resolve("auto", "cpu").whole_leaves


def test_auto_runs_the_leaves_pallas_declines_in_the_xla_engine(monkeypatch):
  """On a GPU with the Pallas kernels, a leaf they decline (8-bit here) runs
  the XLA engine, with its codecs: the XLA engine's codes and update, not
  None (which would send it to the jnp engine's row loops)."""
  from optax4bit.pallas import steps as pallas_steps  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(pallas_steps, "kernels_run_here", lambda: True)
  steps = dispatch.resolve("auto", "gpu").steps
  assert isinstance(steps, dispatch.FallbackSteps)
  assert isinstance(steps.first, pallas_steps.PallasSteps)
  assert steps.then == dispatch.resolve("xla").steps and steps.then_codecs is xla_codec
  interpret = dispatch.FallbackSteps(dispatch.resolve("pallas_interpret").steps, steps.then,
                                     steps.then_codecs)
  step = FusedStep.adam(0.9, 0.999, 1e-8, 0.0, jnp.int32(1), False)
  grad = jax.random.normal(jax.random.key(0), (64, 512))
  for spec in (QuantSpec.parse("B256/DE", bits=8), QuantSpec.parse("B128/DE")):
    moments = (qarray.zeros((64, 512), jnp.float32, spec),
               qarray.zeros((64, 512), jnp.float32, QuantSpec.parse("Rank-1/Linear",
                                                                    bits=spec.bits)))
    expected = (dispatch.resolve("xla") if spec.bits == 8 else
                dispatch.resolve("pallas_interpret")).steps.run(step, grad, moments)
    if spec.bits == 8:  # the Pallas kernels decline it
      assert dispatch.resolve("pallas_interpret").steps.run(step, grad, moments) is None
    chex.assert_trees_all_equal(interpret.run(step, grad, moments), expected)




@pytest.mark.slow  # CI's time (16 s): the XLA engine runs only on GPUs without the Pallas kernels
def test_sharded_codes_equal_the_unsharded_jnp_engine():
  out = sharded_against_unsharded_jnp("xla")
  for name, result in out.items():
    assert result["codes"] >= 3, (name, result)
    assert result["codes_equal"], (name, result)
    assert result["update_err"] < 1e-6, (name, result)


@pytest.mark.parametrize("shape", [(6, 384), (2, 3, 256), (5, 200)])
def test_row_sums_equal_sums_over_the_last_axis(shape):
  """The XLA engine's row sums (chunks of 128 first, where the last axis is a
  multiple of 128) against float64 sums; its backend gives them to 4-bit
  Factor's factors, the TPU's does not."""
  x = np.asarray(jax.random.uniform(jax.random.key(1), shape), np.float32)
  got = np.asarray(xla_steps.row_sums(jnp.asarray(x)))
  assert got.shape == shape[:-1] + (1,)
  np.testing.assert_allclose(got, x.astype(np.float64).sum(-1, keepdims=True), rtol=1e-6)
  assert dispatch.resolve("xla").row_sums is xla_steps.row_sums
  assert dispatch.resolve("auto", "tpu").row_sums is None  # its layout costs more on a TPU
