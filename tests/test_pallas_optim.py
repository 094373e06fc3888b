"""Fused Pallas optimizer steps against the jnp reference, and dispatch.

The kernels run in interpret mode (CPU). What "equal" means here:

* Codes: equal, except where the value lies within a few float32 ulps of a
  midpoint between two table entries (a rounding tie that the last bit of the
  moment decides). Checked independently: a mismatching code must sit at
  such a tie of the float64 moment computed from the reference's old state.
* Scales (block maxima, rank-1 statistics): within 2 ulps of the moment's
  largest scale. A block whose new value cancels (``(1 - b1) g + b1 m``
  near 0) carries the rounding error of its larger terms, so a small scale
  can differ by several of its own ulps.
* Updates: within 4 ulps of the leaf's largest update (float32); within one
  ulp of the half-precision dtype for bf16/fp16.
* Params after 50 free-running steps: within 2 ulps of the leaf's largest
  parameter.

Not bit for bit because XLA compiles the two differently: its CPU backend
contracts ``a * b + c * d`` into a fused multiply-add, and which product it
fuses depends on the fusion the expression lands in (the jnp reference itself
is not consistent across its own fusions at that level). The kernels follow
the reference's arithmetic operation by operation, including XLA's algebraic
rewrites (see `optax4bit.pallas.optim`).
"""

from __future__ import annotations

import doctest
import functools
import logging
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax4bit
from conftest import export_cuda, near_midpoint
from optax4bit import dispatch, pallas
from optax4bit._platform import installed_platforms
from optax4bit.pallas import PallasConfig
from optax4bit.pallas import steps as pallas_steps
from optax4bit.quant import maps, normalize
from optax4bit.quant.array import QuantizedArray

INTERPRET = PallasConfig(interpret=True, tile_bytes=64)  # small tiles: many programs
# Tiles of 4 rows x 64 bytes on (5, 301): a ragged second row tile, and
# rank-1 column maxima reduced over several rows per program.
INTERPRET_ROWS = PallasConfig(interpret=True, tile_bytes=256)

# Ragged 2-D (odd last axis, ragged block), 3-D with blocks of several short
# rows (last axis 20 <= 64) and a 3-D rank-1 second moment, 1-D ragged.
SHAPES = {"a": (5, 301), "g": (3, 4, 20), "v": (257,)}

B1, B2, MOMENTUM = 0.9, 0.999, 0.9

# The default's first moment rounds by the stall rule (issue 50: stochastic
# rounding only where rounding to nearest would keep the stored code); these
# round it stochastically everywhere (the default until then), and v by the
# rule too.
M_STOCHASTIC = optax4bit.recipes.RECIPES["default"].first_moment.replace(stall_only=False)
V_STALL = optax4bit.recipes.RECIPES["default"].second_moment.replace(stall_only=True)


def _params(shapes, dtype=jnp.float32):
  rng = np.random.RandomState(0)
  return {k: jnp.asarray(rng.standard_normal(s), dtype) for k, s in shapes.items()}


def _grads(params, i):
  key = jax.random.fold_in(jax.random.key(1), i)
  return {k: (jax.random.normal(jax.random.fold_in(key, n), p.shape) * (1 + n)).astype(p.dtype)
          for n, (k, p) in enumerate(sorted(params.items()))}


# (builder of the scale_by_* transformation, float64 new-moment functions of
# (grad, old moments) per state field) for each optimizer.
def _adam_moments(g, old):
  m, v = old
  return ((1 - B1) * g + B1 * m, (1 - B2) * g * g + B2 * v)


# The scale_by_* builders and aliases default to the "default" recipe (first
# moment B128/NF by the stall rule, second moment Rank-1/SqrtLinear stochastic);
# "*_paper" variants run the paper's (B128/DE, Rank-1/Linear, nearest).
VARIANTS = {
    "adam": (functools.partial(optax4bit.scale_by_adam_4bit, B1, B2), _adam_moments),
    "adam_paper": (functools.partial(optax4bit.scale_by_adam_4bit, B1, B2, recipe="paper"),
                   _adam_moments),
    "adam_nesterov": (functools.partial(optax4bit.scale_by_adam_4bit, B1, B2, nesterov=True),
                      _adam_moments),
    "adam_b128_v": (functools.partial(optax4bit.scale_by_adam_4bit, B1, B2,
                                      second_moment="B128/Linear"), _adam_moments),
    "factor": (functools.partial(optax4bit.scale_by_factored_adam_4bit, B1, B2),
               lambda g, old: ((1 - B1) * g + B1 * old[0],)),
    "factor_paper": (functools.partial(optax4bit.scale_by_factored_adam_4bit, B1, B2,
                                       recipe="paper"),
                     lambda g, old: ((1 - B1) * g + B1 * old[0],)),
    "sgdm": (functools.partial(optax4bit.scale_by_momentum_4bit, MOMENTUM, True),
             lambda g, old: (g + MOMENTUM * old[0],)),
    "sgdm_paper": (functools.partial(optax4bit.scale_by_momentum_4bit, MOMENTUM, True,
                                     recipe="paper"),
                   lambda g, old: (g + MOMENTUM * old[0],)),
    # Whole alias chains (weight decay, learning rate) with their defaults:
    # the moments are the same functions of the gradient as above.
    "adamw_4bit": (functools.partial(optax4bit.adamw_4bit, 1e-2, B1, B2, weight_decay=1e-2),
                   _adam_moments),
    "adamw_4bit_factor": (functools.partial(optax4bit.adamw_4bit_factor, 1e-2, B1, B2,
                                            weight_decay=1e-2),
                          lambda g, old: ((1 - B1) * g + B1 * old[0],)),
    "sgdm_4bit": (functools.partial(optax4bit.sgdm_4bit, 1e-2, MOMENTUM),
                  lambda g, old: (g + MOMENTUM * old[0],)),
}
# The alias chains with m rounded stochastically everywhere ("_m_stochastic")
# or with the stall rule on v too ("_stall_v").
for _name, _kwargs in {"adamw_4bit_m_stochastic": dict(first_moment=M_STOCHASTIC),
                       "adamw_4bit_factor_m_stochastic": dict(first_moment=M_STOCHASTIC),
                       "sgdm_4bit_m_stochastic": dict(first_moment=M_STOCHASTIC),
                       "adamw_4bit_stall_v": dict(second_moment=V_STALL)}.items():
  _make, _new_moments = VARIANTS[_name.rsplit("_m_stochastic", 1)[0].rsplit("_stall_v", 1)[0]]
  VARIANTS[_name] = (functools.partial(_make, **_kwargs), _new_moments)


def _inner(state):
  """The scale_by_* state (with a step ``count``) of a chain's state."""
  def has_count(s):  # a NamedTuple with a count field (tuples have a count method)
    return "count" in getattr(s, "_fields", ())

  return state if has_count(state) else next(s for s in state if has_count(s))


def _moments(state):
  """The quantized moments of a scale_by_* (or alias chain) state, per params
  key, in the order of their rounding keys (``mu`` first)."""
  state = _inner(state)
  fields = [f for f in ("mu", "nu", "trace") if hasattr(state, f)]
  return {k: tuple(getattr(state, f)[k] for f in fields
                   if isinstance(getattr(state, f)[k], QuantizedArray))
          for k in getattr(state, fields[0])}


def _ulps_of_max(a, b, dtype) -> float:
  a = np.asarray(a, np.float32)
  b = np.asarray(b, np.float32)
  scale = float(np.max(np.abs(a)))
  if scale == 0:
    return float(np.max(np.abs(b)))
  return float(np.max(np.abs(a - b)) / (scale * float(jnp.finfo(dtype).eps)))


def _near_stochastic_tie(n64, table, uniform, ulps: float = 8.0) -> np.ndarray:
  """Whether float64 ``n64`` lies within ``ulps`` float32 ulps of a point where
  stochastic rounding with draw ``uniform`` changes its code: between entries
  ``T[k]`` and ``T[k + 1]`` the code goes from ``k`` to ``k + 1`` where
  ``(n - T[k]) / (T[k + 1] - T[k])`` passes ``uniform``. The ulps are those of
  the larger of ``|n|`` and the two entries (the float32 round-up
  probability is exact to a few ulps of ``T[k + 1] - T[k]``)."""
  t = np.asarray(table, np.float64)
  n64 = np.asarray(n64, np.float64)[..., None]
  u = np.asarray(uniform, np.float64)[..., None]
  flips = t[:-1] + u * (t[1:] - t[:-1])
  size = np.maximum(np.abs(n64), np.maximum(np.abs(t[:-1]), np.abs(t[1:])))
  close = np.abs(n64 - flips) <= ulps * np.finfo(np.float32).eps * size
  return close.any(axis=-1)


def _unpacked(q: QuantizedArray) -> np.ndarray:
  return np.asarray(optax4bit.quant.array.packing.unpack(q.codes, q.shape[-1], 4))


def _normalized64(q: QuantizedArray, value64: np.ndarray) -> np.ndarray:
  """float64 ``value64`` over ``q``'s scales."""
  scale = np.asarray(normalize.expand_scales(q.scales, q.layout, q.shape), np.float64)
  return np.where(scale > 0, value64 / np.where(scale > 0, scale, 1), 0)


def _check_codes(new_ref: QuantizedArray, new_pal: QuantizedArray, value64: np.ndarray,
                 uniform=None):
  """Codes equal except at ties of the float64 new moment (for stochastic
  rounding: where its draw ``uniform`` equals the round-up probability; for
  the stall rule, also where rounding to nearest is at a tie)."""
  differ = _unpacked(new_ref) != _unpacked(new_pal)
  if differ.any():
    n64 = _normalized64(new_ref, value64)
    table = optax4bit.qmap(new_ref.spec.mapping, 4, new_ref.spec.signed)
    if new_ref.spec.mapping in ("SqrtDE-0", "SqrtLinear"):  # nearest in the square root
      roots = optax4bit.qmap(new_ref.spec.mapping[len("Sqrt"):], 4, False)
      tie = near_midpoint(np.sqrt(np.maximum(n64, 0)), roots, ulps=8)
    else:
      tie = near_midpoint(n64, table, ulps=8)
    if new_ref.spec.stochastic:
      stochastic_tie = _near_stochastic_tie(n64, table, uniform)
      tie = (tie | stochastic_tie) if new_ref.spec.stall_only else stochastic_tie
    assert tie[differ].all(), f"{int(differ.sum())} codes differ away from rounding ties"
  for a, b in zip(new_ref.scales, new_pal.scales):
    assert _ulps_of_max(a, b, jnp.float32) <= 2.0


def _rounding_uniforms(state, params) -> dict:
  """Per params key, the draws of stochastic rounding of each moment in the
  update that follows ``state`` (the optimizers' default ``seed=0``), as
  `optax4bit.transform` keys them and `optax4bit.quant.maps` draws them."""
  count_inc = optax.safe_increment(_inner(state).count)
  keys = sorted(params)
  leaf_keys = optax4bit.transform._leaf_keys(0, count_inc, len(keys), 2, True)  # pylint: disable=protected-access
  return {k: [maps.hashed_uniform(maps.rounding_seed(key), params[k].shape)
              for key in leaf_keys[n]] for n, k in enumerate(keys)}


def _teacher_forced(variant: str, shapes, dtype=jnp.float32, steps: int = 50,
                    config: PallasConfig = INTERPRET, exact_codes: bool = False) -> list:
  """Runs the jnp and Pallas steps from the same (reference) state
  (``exact_codes``: every code equal). Returns, per step, leaf and
  ``stall_only`` moment, the fraction of elements whose nearest code (of the
  float64 new moment) is the stored one: where the stall rule rounds
  stochastically."""
  make, new_moments = VARIANTS[variant]
  tx_ref = make(min_quantize_size=0, implementation="jnp")
  tx_pal = make(min_quantize_size=0, implementation=config)
  params = _params(shapes, dtype)

  @jax.jit
  def both(state, i):
    grads = _grads(params, i)
    return grads, tx_ref.update(grads, state, params), tx_pal.update(grads, state, params)

  state = tx_ref.init(params)
  worst_update, stalled = 0.0, []
  for i in range(steps):
    old = _moments(state)
    uniforms = _rounding_uniforms(state, params)
    grads, (u_ref, s_ref), (u_pal, s_pal) = both(state, i)
    jax.tree.map(lambda a, b: np.testing.assert_equal((a.shape, a.dtype), (b.shape, b.dtype)),
                 s_ref, s_pal)
    for k in shapes:
      worst_update = max(worst_update, _ulps_of_max(u_ref[k], u_pal[k], dtype))
      g64 = np.asarray(grads[k], np.float64)
      old64 = [np.asarray(optax4bit.dequantize(q), np.float64) for q in old[k]]
      values = new_moments(g64, old64)
      for ref, pal, value, u, stored in zip(_moments(s_ref)[k], _moments(s_pal)[k], values,
                                            uniforms[k], old[k]):
        if exact_codes:
          np.testing.assert_array_equal(_unpacked(pal), _unpacked(ref), err_msg=f"{k}, step {i}")
        _check_codes(ref, pal, value, u)
        if ref.spec.stall_only:
          n = jnp.asarray(_normalized64(ref, value), jnp.float32)
          nearest = maps.encode_nearest(n, ref.spec.mapping, 4, ref.spec.signed)
          stalled.append(float(np.mean(np.asarray(nearest) == _unpacked(stored))))
    state = s_ref
  limit = 4.0 if dtype == jnp.float32 else 1.0
  assert worst_update <= limit, worst_update
  return stalled


@pytest.mark.slow  # CI's time (22 s); the 10-step variants below run by default
def test_adam_teacher_forced_50_steps():
  _teacher_forced("adam", SHAPES)


@pytest.mark.slow  # CI's time (18 s); the teacher-forced 50 steps stay
def test_adamw_free_running_50_steps():
  """Whole ``adamw_4bit`` chains (weight decay, learning rate), 50 steps each."""
  params = _params(SHAPES)

  def run(implementation):
    tx = optax4bit.adamw_4bit(1e-2, weight_decay=1e-2, min_quantize_size=0,
                              implementation=implementation)

    @jax.jit
    def step(params, state, i):
      updates, state = tx.update(_grads(params, i), state, params)
      return optax.apply_updates(params, updates), state

    p, state = params, tx.init(params)
    for i in range(50):
      p, state = step(p, state, i)
    return p, state

  p_ref, s_ref = run("jnp")
  p_pal, s_pal = run(INTERPRET)
  for k in SHAPES:
    assert _ulps_of_max(p_ref[k], p_pal[k], jnp.float32) <= 2.0, k
  for a, b in zip(jax.tree.leaves(s_ref), jax.tree.leaves(s_pal)):
    if a.dtype == jnp.uint8:
      assert np.mean(np.asarray(a) != np.asarray(b)) < 1e-3


@pytest.mark.parametrize("variant", ["adam_b128_v", "factor", "sgdm", "adam_paper"])
def test_variants_teacher_forced(variant):
  _teacher_forced(variant, {"a": SHAPES["a"]}, steps=10, config=INTERPRET_ROWS)


@pytest.mark.parametrize("dtype", [jnp.bfloat16])
def test_half_precision_grads(dtype):
  _teacher_forced("adam", {"a": SHAPES["a"]}, dtype=dtype, steps=10, config=INTERPRET_ROWS)


@pytest.mark.parametrize("variant,dtype", [
    ("adamw_4bit", jnp.float32), ("adamw_4bit", jnp.bfloat16),
    ("adamw_4bit_m_stochastic", jnp.float32),
    ("adamw_4bit_factor", jnp.float32),
    pytest.param("adamw_4bit_factor", jnp.bfloat16, marks=pytest.mark.slow),
    pytest.param("sgdm_4bit", jnp.float32, marks=pytest.mark.slow),
    ("sgdm_4bit", jnp.bfloat16)])
def test_default_recipe_matches_jnp(variant, dtype):
  """The default recipe (B128/NF first moment by the stall rule, or
  stochastic everywhere, Rank-1/SqrtLinear second moment) runs the kernels,
  and they draw the reference's numbers: codes, scales and updates as in
  the other equality tests, on a ragged 2-D and a 1-D leaf (whose second
  moment falls back to B128/SqrtLinear)."""
  shapes = {"a": SHAPES["a"], "v": SHAPES["v"]}
  make, _ = VARIANTS[variant]
  tx = make(min_quantize_size=0, implementation=INTERPRET_ROWS)
  params = _params(shapes, dtype)
  # One call per leaf, plus the second pass of the rank-1 second moment of
  # adamw_4bit's 2-D leaf (Factor's is factored).
  assert _count_pallas_calls(tx, params) == (3 if variant.startswith("adamw_4bit_m") or
                                              variant == "adamw_4bit" else 2)
  _teacher_forced(variant, shapes, dtype=dtype, steps=3, config=INTERPRET_ROWS)


# Each stall-rule variant, and the same without the rule on m.
STALL_FREE = {"adamw_4bit": "adamw_4bit_m_stochastic",
              "adamw_4bit_stall_v": "adamw_4bit_m_stochastic",
              "adamw_4bit_factor": "adamw_4bit_factor_m_stochastic",
              "sgdm_4bit": "sgdm_4bit_m_stochastic"}


@pytest.mark.parametrize("variant,shapes", [
    ("adamw_4bit_stall_v", {"a": SHAPES["a"]}),
    pytest.param("adamw_4bit_stall_v", SHAPES, marks=pytest.mark.slow),
    pytest.param("adamw_4bit", SHAPES, marks=pytest.mark.slow),
    pytest.param("adamw_4bit_factor", SHAPES, marks=pytest.mark.slow),
    pytest.param("sgdm_4bit", SHAPES, marks=pytest.mark.slow)])
def test_stall_rule_matches_jnp(variant, shapes):
  """``stall_only`` moments (block-wise and rank-1 encodes; on a ragged 2-D
  leaf by default, with blocks of several short rows and a 1-D leaf with -m
  slow) run the kernels, as many as without the rule, and their codes are the
  jnp engine's bit for bit (their scales, which no rounding decides, as in
  the other tests), with the rule's both branches taken."""
  make, _ = VARIANTS[variant]
  base, _ = VARIANTS[STALL_FREE[variant]]
  params = _params(shapes)
  count = lambda make: _count_pallas_calls(make(min_quantize_size=0,
                                                implementation=INTERPRET_ROWS), params)
  assert count(make) == count(base) > 0
  stalled = _teacher_forced(variant, shapes, steps=3, config=INTERPRET_ROWS, exact_codes=True)
  state = make(min_quantize_size=0, implementation="jnp").init(params)
  assert len(stalled) == 3 * sum(q.spec.stall_only for m in _moments(state).values() for q in m)
  assert 0.01 < np.mean(stalled) < 0.99, stalled


def test_stall_rule_takes_small_tiles_on_ragged_leaves_only():
  """Without `PallasConfig.tile_bytes`, a ragged leaf with a ``stall_only``
  moment runs tiles of 512 code bytes (2048 overflow 128 registers, 1024
  spill on sm_89: benchmarks/gpu_compile.py); regular leaves and the other
  specs keep the steps' 2048."""
  def tile(shape, m_spec, v_spec):
    moments = [optax4bit.quant.array.zeros(shape, jnp.float32, s) for s in (m_spec, v_spec)]
    return pallas_steps._step_tile_bytes(shape, moments)  # pylint: disable=protected-access

  default = optax4bit.recipes.RECIPES["default"]
  assert tile((300, 301), default.first_moment, default.second_moment) == 512
  assert tile((300, 301), M_STOCHASTIC, V_STALL) == 512
  assert tile((1024, 2048), default.first_moment, V_STALL) == 2048
  assert tile((300, 301), M_STOCHASTIC, default.second_moment) == 2048


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["adam_nesterov", "adam_b128_v", "factor", "sgdm",
                                     "adam_paper", "factor_paper", "sgdm_paper"])
def test_variants_teacher_forced_50_steps(variant):
  _teacher_forced(variant, SHAPES)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_50_steps(dtype):
  _teacher_forced("adam", SHAPES, dtype=dtype)


# ----------------------------------------------------------------------------
# Dispatch.


def test_implementation_validation_and_auto():
  with pytest.raises(ValueError, match="implementation must be one of"):
    optax4bit.adamw_4bit(1e-3, implementation="triton")
  with pytest.raises(ValueError, match="tile_bytes"):
    PallasConfig(tile_bytes=100)
  assert dispatch.resolve("jnp") == dispatch.Backend()
  assert dispatch.resolve("pallas_interpret").steps.options == PallasConfig(interpret=True).options
  assert dispatch.resolve("pallas").steps.options == PallasConfig().options
  assert dispatch.resolve(PallasConfig(num_warps=8)).steps.options.num_warps == 8
  auto = dispatch.resolve("auto").steps
  if jax.default_backend() == "gpu":
    assert auto.options == PallasConfig().options
  else:
    assert not isinstance(auto, pallas_steps.PallasSteps)
  assert dispatch.resolve("auto", "tpu") == dispatch.resolve("tpu")  # the TPU engine


def test_auto_runs_the_xla_engine_where_the_kernels_do_not_compile(monkeypatch, caplog):
  """A CUDA GPU whose compiler rejects the kernels (mocked): ``auto`` probes
  once per compute capability, logs one line with the reason and runs the
  XLA engine; a capability where the probe compiles gets the kernels."""
  probes = []

  def failing_probe():
    probes.append("fail")
    raise RuntimeError("ptxas fatal: mocked failure\nsecond line")

  monkeypatch.setattr(pallas_steps, "_on_cuda", lambda: True)
  monkeypatch.setattr(pallas_steps, "_compute_capability", lambda: "mock 8.0")
  monkeypatch.setattr(pallas_steps, "_compile_probe", failing_probe)
  pallas_steps._kernels_compile.cache_clear()
  try:
    with caplog.at_level(logging.WARNING, logger=pallas_steps.__name__):
      assert dispatch.resolve("auto", "gpu") == dispatch.resolve("xla")
      assert dispatch.resolve("auto", "gpu") == dispatch.resolve("xla")
    assert probes == ["fail"]
    (record,) = caplog.records
    message = record.getMessage()
    assert "capability mock 8.0" in message and "RuntimeError: ptxas fatal: mocked" in message
    assert "\n" not in message
    assert dispatch.resolve("pallas", "gpu").steps is not None  # explicit choices: no probe
    monkeypatch.setattr(pallas_steps, "_compute_capability", lambda: "mock 9.0")
    monkeypatch.setattr(pallas_steps, "_compile_probe", lambda: probes.append("ok"))
    steps = dispatch.resolve("auto", "gpu").steps  # the kernels, then the XLA engine
    assert steps.first.options == PallasConfig().options
    assert steps.then == dispatch.resolve("xla").steps
    assert probes == ["fail", "ok"]
  finally:
    pallas_steps._kernels_compile.cache_clear()


def _count_pallas_calls(tx, params) -> int:
  state = tx.init(params)
  return str(jax.make_jaxpr(tx.update)(params, state, params)).count("pallas_call")


def test_dispatch_covers_quantized_leaves_only():
  params = {"big": jnp.ones((8, 256)), "small": jnp.ones((16,)), "v": jnp.ones((512,))}
  # Rank-1 v: two passes on the 2-D leaf, one on the 1-D leaf (B128
  # fallback); the small leaf keeps float32 moments (jnp).
  assert _count_pallas_calls(optax4bit.adamw_4bit(1e-3, min_quantize_size=64,
                                                  implementation="pallas_interpret"), params) == 3
  assert _count_pallas_calls(optax4bit.adamw_4bit(1e-3, min_quantize_size=64,
                                                  implementation="jnp"), params) == 0
  if jax.default_backend() != "gpu":
    # A CPU host traces a branch per platform it can compile for: with
    # libtpu installed, the TPU engine's kernels (2 on the 2-D leaf) too.
    tpu_kernels = (_count_pallas_calls(optax4bit.adamw_4bit(1e-3, min_quantize_size=64,
                                                            implementation="tpu"), params)
                   if "tpu" in installed_platforms() else 0)
    assert _count_pallas_calls(optax4bit.adamw_4bit(1e-3, min_quantize_size=64),
                               params) == tpu_kernels
  # 8-bit has no kernel: the jnp reference runs.
  assert _count_pallas_calls(optax4bit.adamw_8bit(1e-3, min_quantize_size=64,
                                                  implementation="pallas_interpret"), params) == 0
  # Stochastic rounding (the default first moment) and every 4-bit map have kernels.
  stochastic = optax4bit.QuantSpec.parse("B128/DE", stochastic=True)
  for kwargs in ({"first_moment": stochastic}, {"recipe": "paper"},
                 {"second_moment": optax4bit.QuantSpec.parse("Rank-1/SqrtDE-0", stochastic=True)}):
    assert _count_pallas_calls(optax4bit.adamw_4bit(1e-3, min_quantize_size=64,
                                                    implementation="pallas_interpret", **kwargs),
                               params) == 3, kwargs
  assert _count_pallas_calls(optax4bit.sgdm_4bit(1e-3, min_quantize_size=64,
                                                 implementation="pallas_interpret"), params) == 2
  assert _count_pallas_calls(optax4bit.adamw_4bit_factor(
      1e-3, min_quantize_size=64, implementation="pallas_interpret"), params) == 2


def test_inject_hyperparams_keeps_pallas():
  params = {"w": jnp.ones((8, 256))}
  tx = optax4bit.inject_hyperparams(optax4bit.adamw_4bit)(
      learning_rate=1e-3, min_quantize_size=0, implementation="pallas_interpret")
  ref = optax4bit.inject_hyperparams(optax4bit.adamw_4bit)(
      learning_rate=1e-3, min_quantize_size=0, implementation="jnp")
  grads = _grads(params, 0)
  u_pal, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  u_ref, _ = jax.jit(ref.update)(grads, ref.init(params), params)
  assert _ulps_of_max(u_ref["w"], u_pal["w"], jnp.float32) <= 4


def test_module_doctests():
  from optax4bit.pallas import quant, steps  # pylint: disable=import-outside-toplevel
  for module in (steps, quant):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0, module.__name__


# ----------------------------------------------------------------------------
# CUDA lowering of whole optimizer updates (no GPU needed).


OPTIMIZERS = {
    "adamw": lambda: optax4bit.adamw_4bit(1e-3, min_quantize_size=0, implementation="pallas"),
    "adamw_nesterov": lambda: optax4bit.adamw_4bit(1e-3, min_quantize_size=0, nesterov=True,
                                                   implementation="pallas"),
    "adamw_b128_v": lambda: optax4bit.adamw_4bit(1e-3, min_quantize_size=0,
                                                 second_moment="B128/Linear",
                                                 implementation="pallas"),
    "factor": lambda: optax4bit.adamw_4bit_factor(1e-3, min_quantize_size=0,
                                                  implementation="pallas"),
    "sgdm": lambda: optax4bit.sgdm_4bit(1e-3, min_quantize_size=0, nesterov=True,
                                        implementation="pallas"),
    "sgdm_plain": lambda: optax4bit.sgdm_4bit(1e-3, min_quantize_size=0,
                                              implementation="pallas"),
}
# Some of them with the paper's recipe (nearest rounding, DE and Linear maps).
PAPER = {
    "adamw": lambda: optax4bit.adamw_4bit(1e-3, min_quantize_size=0, recipe="paper",
                                          implementation="pallas"),
    "factor": lambda: optax4bit.adamw_4bit_factor(1e-3, min_quantize_size=0, recipe="paper",
                                                  implementation="pallas"),
    "sgdm": lambda: optax4bit.sgdm_4bit(1e-3, min_quantize_size=0, nesterov=True,
                                        recipe="paper", implementation="pallas"),
}


def _triton_calls(exported) -> int:
  return exported.mlir_module().count("stablehlo.custom_call @__gpu$xla.gpu.triton")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_update_lowers_for_cuda(name, dtype):
  """Every update lowers for CUDA (the default recipe: stochastic rounding,
  NF and SqrtLinear maps); it runs as many kernels as the paper's recipe,
  which lowers too, i.e. none of its leaves falls back to the jnp path."""
  params = {k: jnp.zeros(s, dtype) for k, s in SHAPES.items()}
  tx = OPTIMIZERS[name]()
  state = tx.init(params)
  exported = export_cuda(tx.update, params, state, params)
  assert "__gpu$xla.gpu.triton" in exported.mlir_module()
  if name in PAPER:
    paper = PAPER[name]()
    assert _triton_calls(exported) == _triton_calls(
        export_cuda(paper.update, params, paper.init(params), params))


def test_update_in_place_off_gives_the_same_step_without_aliasing_the_gradient():
  """``PallasConfig(update_in_place=False)``: the same update and state, and
  the step kernel's update (its output 0) no longer aliases an operand, so
  that an update jitted alone need not copy its gradients."""
  params = {"w": jax.random.normal(jax.random.key(0), (64, 256), jnp.float32)}
  grads = {"w": jax.random.normal(jax.random.key(1), (64, 256), jnp.float32)}
  results = {}
  for in_place in (True, False):
    config = PallasConfig(interpret=True, tile_bytes=64, update_in_place=in_place)
    tx = optax4bit.adamw_4bit(1e-3, implementation=config, min_quantize_size=0)
    results[in_place] = jax.jit(tx.update)(grads, tx.init(params), params)
    compiled = optax4bit.adamw_4bit(1e-3, implementation=PallasConfig(update_in_place=in_place),
                                    min_quantize_size=0)
    module = export_cuda(compiled.update, grads, compiled.init(params), params).mlir_module()
    aliases = re.findall(r"output_operand_alias<output_tuple_indices = \[(\d+)\]", module)
    assert aliases and ("0" in aliases) == in_place, aliases
  chex.assert_trees_all_equal(results[True], results[False])
  with pytest.raises(ValueError, match="update_in_place must be a bool"):
    PallasConfig(update_in_place=1)
