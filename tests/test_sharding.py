"""Sharded 4-bit states (optax4bit.sharding).

Unit tests run here on one device; the multi-device checks run in a separate
process with 8 virtual CPU devices (tests/sharding_checks.py), share one
process per test tier, and are asserted on here.
"""

from __future__ import annotations

import doctest
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

import optax4bit
from optax4bit import _shard_map, _state_sharding, sharding
from subprocess_json import TESTS, run_json

SCRIPT = os.path.join(TESTS, "sharding_checks.py")
FAST = ("expected_specs", "misaligned", "eager_init", "adamw_explicit", "adamw_auto_wrapped")
SLOW = ("factor_explicit", "sgdm_explicit", "adamw8_explicit", "adamw_auto_unwrapped")
MESH = AbstractMesh((2, 4), ("data", "model"))


# ----------------------------------------------------------------------------
# One device.


@pytest.mark.parametrize("param_spec,state_shape,expected", [
    (P("data", "model"), (1024, 256), P("data", "model")),     # codes
    (P("data", "model"), (1024, 4), P("data", "model")),       # block scales
    (P("data", "model"), (1024, 1), P("data", None)),          # rank-1 rows
    (P("data", "model"), (1, 512), P(None, "model")),          # rank-1 columns
    (P("data", "model"), (1, 1), P(None, None)),               # tensor scale
    (P("data"), (1024, 256), P("data", None)),                 # short spec
    (P(("data", "model"), None), (1024, 1), P(("data", "model"), None)),
    (P("data", "model"), (), P()),                             # step count
])
def test_state_partition_spec(param_spec, state_shape, expected):
  assert sharding.state_partition_spec(param_spec, (1024, 512), state_shape) == expected


def _moment(shape, spec="B128/DE"):
  return jax.eval_shape(lambda: optax4bit.quantize(jnp.ones(shape), spec))


@pytest.mark.parametrize("shape,spec,qspec", [
    ((1024, 512), P("data", "model"), "B128/DE"),          # 128 per shard
    ((1024, 512), P("model", None), "Rank-1/Linear"),
    ((2048, 32), P(("data", "model"), None), "B128/DE"),   # 4 rows per block, 256 rows/shard
    ((8192,), P("model"), "B128/DE"),
    ((256, 384), P(None, "model"), "Rank-1/Linear"),       # rank-1: any even split
])
def test_alignment_ok(shape, spec, qspec):
  _state_sharding.check_alignment(_moment(shape, qspec), MESH, spec)


@pytest.mark.parametrize("shape,spec,qspec,match", [
    ((256, 384), P(None, "model"), "B128/DE", "not a multiple of the block size 128"),
    ((1024, 512), P(None, "model"), "B256/DE", "not a multiple of the block size 256"),
    ((1024, 32), P(None, "model"), "B128/DE", "cannot be sharded"),
    ((1022, 32), P("data", None), "B128/DE", "not a multiple of the 4 rows"),
    ((255, 512), P("data", None), "B128/DE", "does not split evenly"),
    ((64, 4), P(None, ("data", "model")), "Rank-1/Linear", "does not split evenly"),
    ((64, 12), P(None, "model"), "Rank-1/Linear", "must be even"),
])
def test_alignment_errors(shape, spec, qspec, match):
  with pytest.raises(ValueError, match=match) as info:
    _state_sharding.check_alignment(_moment(shape, qspec), MESH, spec)
  assert "quantize_mask" in str(info.value)


def test_hoist_partial_passes_arrays_and_keeps_numbers():
  def f(a, b, c, *, d):
    return a, b, c, d

  x = jnp.float32(2.0)
  rebuild, consts = _shard_map.hoist_partial(functools.partial(f, 0.9, x, d=x))
  assert len(consts) == 2 and all(c is x for c in consts)
  y = jnp.float32(3.0)
  assert rebuild((y, y))(5) == (0.9, y, 5, y)
  rebuild, consts = _shard_map.hoist_partial(lambda a: a)
  assert consts == () and rebuild(())(4) == 4


def test_hoist_partial_rebuilds_are_equal_for_equal_static_arguments():
  """The TPU engine jits its kernels with the rebuild static: equal rebuilds
  share one trace, and any other static argument gives another."""
  def f(a, b, *, c):
    return a, b, c

  x, y = jnp.float32(2.0), jnp.float32(5.0)
  first, _ = _shard_map.hoist_partial(functools.partial(f, 0.9, x, c=True))
  second, _ = _shard_map.hoist_partial(functools.partial(f, 0.9, y, c=True))
  assert first == second and hash(first) == hash(second)
  for other in (functools.partial(f, 0.8, x, c=True), functools.partial(f, -0.0, x, c=True),
                functools.partial(f, 0.9, x, c=False), functools.partial(lambda a, b, c: a, 0.9, x,
                                                                        c=True)):
    assert _shard_map.hoist_partial(other)[0] != first
  assert (_shard_map.hoist_partial(functools.partial(f, 0.0, x, c=True))[0]
          != _shard_map.hoist_partial(functools.partial(f, -0.0, x, c=True))[0])
  unhashable, _ = _shard_map.hoist_partial(functools.partial(f, np.ones(2), x, c=True))
  assert unhashable == unhashable
  assert unhashable != _shard_map.hoist_partial(functools.partial(f, np.ones(2), x, c=True))[0]


def test_single_device_unchanged():
  """Unsharded (single-device) params never take the shard_map path."""
  params = {"w": jnp.ones((256, 256))}
  assert _state_sharding.leaf_sharding(params["w"]) is None
  tx = optax4bit.adamw_4bit(1e-3)
  state = jax.jit(tx.init)(params)
  updates, _ = jax.jit(tx.update)(params, state, params)
  assert updates["w"].shape == (256, 256)


def test_state_shardings_any_optax_transform():
  mesh = jax.make_mesh((1, 1), ("data", "model"))
  shardings = {"w": jax.sharding.NamedSharding(mesh, P("data", "model"))}
  params = {"w": jnp.zeros((256, 512))}
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
  sh = optax4bit.state_shardings(tx, params, shardings)
  assert sh[1][0].mu["w"].spec == P("data", "model")
  assert sh[1][0].count.spec == P()


def test_module_doctests():
  for module in (sharding, _state_sharding):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, module.__name__


# ----------------------------------------------------------------------------
# 8 devices, in a separate process.


@pytest.fixture(scope="module")
def fast_results():
  return run_json(SCRIPT, *FAST)


def _value(results, name):
  entry = results[name]
  assert entry["ok"], entry.get("error")
  return entry["value"]


def test_state_specs_follow_params(fast_results):
  specs = _value(fast_results, "expected_specs")
  assert specs["w1"] == {"mu_codes": "P('data', 'model')", "mu_scales": ["P('data', 'model')"],
                         "nu_codes": "P('data', 'model')",
                         "nu_scales": ["P('data', None)", "P(None, 'model')"]}
  assert specs["w2"]["nu_scales"] == ["P('model', None)", "P(None, None)"]
  assert specs["b"]["mu_scales"] == ["P('model',)"]
  assert specs["narrow"]["mu_codes"] == "P(('data', 'model'), None)"
  assert specs["count"] == "P()"
  assert _value(fast_results, "eager_init") is True


def test_misaligned_params_raise_clear_errors(fast_results):
  errors = _value(fast_results, "misaligned")
  for name in ("ragged_blocks", "narrow_last_axis"):
    assert len(errors[name]) == 2, errors[name]  # state_shardings and jit(init)
    assert all("quantize_mask" in e for e in errors[name])
  assert "not a multiple of the block size 128" in errors["ragged_blocks"][0]
  assert len(errors["uneven"]) == 2  # JAX itself refuses the uneven sharding
  assert errors["masked_fp32_spec"] == "P(None, 'model')"


def _check_run(result, *, bitwise=True):
  assert result["placed_like_state_shardings"]
  assert result["shardings_kept"]
  # No all-gather / all-to-all / collective-permute: only all-reduces of the
  # rank-1 statistics (a few hundred floats) and of the global norm.
  assert set(result["collective_kinds"]) <= {"all-reduce"}, result["collective_kinds"]
  assert result["largest_collective"] <= 1024, result["largest_collective"]
  if bitwise:
    assert result["params_diff"] == [] and result["state_diff"] == [], result
  else:
    assert result["params_max_rel"] < 1e-5, result


@pytest.mark.parametrize("name", ["adamw_explicit", "adamw_auto_wrapped"])
def test_sharded_update_matches_single_device(fast_results, name):
  _check_run(_value(fast_results, name))


@pytest.mark.slow
def test_other_optimizers_sharded():
  results = run_json(SCRIPT, *SLOW)
  _check_run(_value(results, "sgdm_explicit"))
  _check_run(_value(results, "adamw8_explicit"))
  factor = _value(results, "factor_explicit")
  # Factored row/column means are float sums: sharded, they add in another order.
  _check_run(factor, bitwise=False)
  # Without shard_optimizer under Auto axes XLA partitions the update itself:
  # the same numbers, but the chunk loop gathers axis-0-sharded leaves.
  unwrapped = _value(results, "adamw_auto_unwrapped")
  assert unwrapped["params_diff"] == [] and unwrapped["state_diff"] == []
