"""Gradients whose square overflows float32, and non-finite gradients (issue
17, "never amplifies a bad gradient").

optax.adamw keeps ``v = inf`` for an element whose ``g**2`` overflowed and
freezes it; a quantized ``v`` stores it finite (`optax4bit.quantize`), so the
Adam steps restart that element's first moment from 0
(`optax4bit._steps.restart_overflowed`): the bad gradient is dropped, never
turned into a step of ``m / eps``. The figures are compared with optax's, not
hard-coded; every implementation available here runs (the C++ kernel on
every ISA path this CPU runs).
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax4bit
from optax4bit.cpu import ffi as cpu_ffi
from conftest import on_the_cpu

SHAPE = (256, 512)
LR = 1e-3


def _implementations():
  out = ["jnp", "pallas_interpret"]
  if optax4bit.cpu.available():
    out += [f"cpu:{name}" for name in optax4bit.cpu.isas()]
  return out


IMPLEMENTATIONS = _implementations()


@contextlib.contextmanager
def _isa(implementation: str):
  """``implementation`` without its ISA suffix, with the C++ kernel's ISA
  path set to the suffix inside, and the CPU as the default device (the
  kernel steps CPU arrays; the tests' arrays are uncommitted and follow it)."""
  if not implementation.startswith("cpu:"):
    yield implementation
    return
  before = optax4bit.cpu.isa()
  cpu_ffi._use_isa(implementation[4:])  # pylint: disable=protected-access
  try:
    with on_the_cpu():
      yield "cpu"
  finally:
    cpu_ffi._use_isa(before)  # pylint: disable=protected-access


# name -> (optax4bit builder of an implementation, the optax reference).
OPTIMIZERS = {
    "adamw_4bit": (lambda impl: optax4bit.adamw_4bit(LR, implementation=impl),
                   lambda: optax.adamw(LR)),
    "adamw_4bit paper": (lambda impl: optax4bit.adamw_4bit(LR, recipe="paper",
                                                           implementation=impl),
                         lambda: optax.adamw(LR)),
    "adamw_4bit_factor": (lambda impl: optax4bit.adamw_4bit_factor(LR, implementation=impl),
                          lambda: optax.adamw(LR)),
    "sgdm_4bit": (lambda impl: optax4bit.sgdm_4bit(LR, implementation=impl),
                  lambda: optax.sgd(LR, momentum=0.9)),
    "adamw_8bit": (lambda impl: optax4bit.adamw_8bit(LR, implementation=impl),
                   lambda: optax.adamw(LR)),
}


def _params(dtype):
  return (0.1 * jax.random.normal(jax.random.key(0), SHAPE)).astype(dtype)


def _overflow_sequence(dtype):
  """g = 1e30, then 1e-30, then N(0, 1), as issue 17."""
  return [jnp.full(SHAPE, 1e30, jnp.float32).astype(dtype),
          jnp.full(SHAPE, 1e-30, jnp.float32).astype(dtype),
          jax.random.normal(jax.random.key(1), SHAPE).astype(dtype)]


def _run(tx, params, grads_seq):
  state = tx.init(params)
  update = jax.jit(tx.update)
  for g in grads_seq:
    updates, state = update(g, state, params)
    params = optax.apply_updates(params, updates)
  return np.asarray(params, np.float32), state


def _cases():
  for name in OPTIMIZERS:
    for impl in IMPLEMENTATIONS:
      for dtype in ("float32", "bfloat16"):
        if dtype == "bfloat16" and impl not in ("jnp", "pallas_interpret"):
          continue  # the C++ kernel covers float32 leaves only
        yield pytest.param(name, impl, dtype, id=f"{name}-{impl}-{dtype}")


@functools.lru_cache(maxsize=None)
def _reference_max(name: str, dtype: str) -> float:
  dtype = jnp.dtype(dtype)
  ref, _ = _run(OPTIMIZERS[name][1](), _params(dtype), _overflow_sequence(dtype))
  return float(np.abs(ref).max())


@pytest.mark.parametrize("name,impl,dtype", list(_cases()))
def test_overflowing_gradient_is_not_amplified(name, impl, dtype):
  """max |p| within 10x of optax's after g = 1e30, 1e-30, N(0, 1); no NaN."""
  build = OPTIMIZERS[name][0]
  ref_max = _reference_max(name, dtype)
  dtype = jnp.dtype(dtype)
  grads_seq = _overflow_sequence(dtype)
  with _isa(impl) as implementation:
    got, _ = _run(build(implementation), _params(dtype), grads_seq)
  assert not np.isnan(got).any()
  assert 0.1 <= np.abs(got).max() / ref_max <= 10, (np.abs(got).max(), ref_max)


BAD = (37, 300)


def _one_bad_element(value):
  """Three steps of N(0, 1) gradients, the second with ``value`` at BAD."""
  keys = jax.random.split(jax.random.key(2), 3)
  grads = [jax.random.normal(k, SHAPE) for k in keys]
  grads[1] = grads[1].at[BAD].set(value)
  return grads


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_one_overflowing_element_moves_like_an_ordinary_step(impl):
  """One g = 1e30 in a normal gradient: optax.adamw freezes that parameter;
  here it takes ordinary Adam steps afterwards (at most a few lr), and every
  other parameter ends exactly where a run with 0 at that element puts it
  outside the element's row, column (rank-1 v) and block of 128 (m)."""
  params = _params(jnp.float32)
  with _isa(impl) as implementation:
    tx = OPTIMIZERS["adamw_4bit paper"][0](implementation)
    got, state = _run(tx, params, _one_bad_element(1e30))
    clean, clean_state = _run(tx, params, _one_bad_element(0.0))
  ref, _ = _run(optax.adamw(LR), params, _one_bad_element(1e30))
  p0 = np.asarray(params)
  assert abs(ref[BAD] - p0[BAD]) <= 1.01 * LR  # optax froze it after its first step
  assert abs(got[BAD] - p0[BAD]) <= 3 * 3 * LR
  assert np.isfinite(got).all()
  other = np.ones(SHAPE, bool)
  other[BAD[0], :] = other[:, BAD[1]] = False
  np.testing.assert_array_equal(got[other], clean[other])
  for moment, clean_moment in ((state[0].mu, clean_state[0].mu), (state[0].nu, clean_state[0].nu)):
    a, b = np.asarray(moment.dequantize()), np.asarray(clean_moment.dequantize())
    np.testing.assert_array_equal(a[other], b[other])


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_gradient_matches_optax_nan_pattern(impl, value):
  """A NaN or +-inf gradient element: its parameter becomes NaN as with
  optax.adamw (optax propagates NaN), every other one stays finite, the
  stored state stays finite."""
  params = _params(jnp.float32)
  grads = _one_bad_element(value)
  ref, _ = _run(optax.adamw(LR), params, grads)
  with _isa(impl) as implementation:
    got, state = _run(OPTIMIZERS["adamw_4bit"][0](implementation), params, grads)
  np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
  assert np.isnan(got[BAD]) and np.isnan(got).sum() == 1
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state)
             if jnp.issubdtype(x.dtype, jnp.floating))


def test_restart_overflowed_leaves_float32_adam_equal_to_optax():
  """With unquantized moments the rule changes no update: v stays inf, so
  m / inf is 0 whatever m is (optax.adamw's frozen parameter)."""
  params = jnp.asarray(_params(jnp.float32)[:8, :8])
  grads = [g[:8, :8] for g in _overflow_sequence(jnp.float32)]
  ref, _ = _run(optax.adamw(LR), params, grads)
  got, _ = _run(optax4bit.adamw_4bit(LR, implementation="jnp"), params, grads)
  np.testing.assert_array_equal(got, ref)


WRAPPED = {  # quantize_state and the presets built on it, against optax's own
    "quantize_state(adamw)": (lambda: optax4bit.quantize_state(optax.adamw(LR)),
                              lambda: optax.adamw(LR)),
    "quantize_state(adamw) chunked": (
        lambda: optax4bit.quantize_state(optax.adamw(LR), chunk_size=4096),
        lambda: optax.adamw(LR)),
    "ademamix_4bit": (lambda: optax4bit.ademamix_4bit(LR), lambda: optax.contrib.ademamix(LR)),
}


@pytest.mark.parametrize("name", sorted(WRAPPED))
def test_wrapped_optimizer_does_not_amplify_an_overflowing_gradient(name):
  """The same sequence through `quantize_state`: where a quantized v becomes
  inf, the leaf's other quantized moments restart (before: max |p| 4.7e34)."""
  make, make_ref = WRAPPED[name]
  params, grads_seq = _params(jnp.float32), _overflow_sequence(jnp.float32)
  ref, _ = _run(make_ref(), params, grads_seq)
  got, _ = _run(make(), params, grads_seq)
  assert not np.isnan(got).any()
  assert 0.1 <= np.abs(got).max() / np.abs(ref).max() <= 10, (np.abs(got).max(),
                                                               np.abs(ref).max())


def test_restart_beside_overflow_touches_quantized_fields_only():
  from optax4bit._quantize_state import restart_beside_overflow  # pylint: disable=g-import-not-at-top
  m, v, plain = jnp.array([5.0, 6.0]), jnp.array([jnp.inf, 1.0]), jnp.array([7.0, 8.0])
  out = restart_beside_overflow([m, v, plain], [True, True, False])
  np.testing.assert_array_equal(out[0], [0.0, 6.0])
  np.testing.assert_array_equal(out[1], [np.inf, 1.0])
  np.testing.assert_array_equal(out[2], [7.0, 8.0])
  # A lone quantized field (or a plain v) changes nothing.
  np.testing.assert_array_equal(restart_beside_overflow([m, v], [True, False])[0], m)
