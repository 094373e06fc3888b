"""Issue 18: classic GSPMD (``Auto`` mesh axes) with no wrapper.

``jax.jit(tx.init)(params)`` on committed sharded params places every 4-bit
state like its parameter, and the jitted update runs per shard (XLA hands the
shardings over through ``custom_partitioning``, see ``optax4bit._gspmd``):
no state-sized all-gather, the same bits as one device. The checks run with 8
virtual CPU devices in a separate process (tests/gspmd_checks.py).
"""

from __future__ import annotations

import os
import re

import pytest

from subprocess_json import TESTS, run_json

SCRIPT = os.path.join(TESTS, "gspmd_checks.py")
FAST = ("jit_init_placement", "auto_unwrapped", "issue_default", "replicated_and_misaligned",
        "auto_kernels")
SLOW = ("factor_unwrapped", "sgdm_unwrapped", "adamw8_unwrapped", "lion_unwrapped",
        "auto_wrapped", "temp_bytes")


@pytest.fixture(scope="module")
def fast():
  return run_json(SCRIPT, *FAST)


def _value(results, name):
  entry = results[name]
  assert entry["ok"], entry.get("error")
  return entry["value"]


@pytest.mark.parametrize("name", ["adamw_4bit", "adamw_4bit_factor", "sgdm_4bit"])
def test_jit_init_shards_state_like_param(fast, name):
  placed = _value(fast, "jit_init_placement")[name]
  assert len(placed["specs"]) == len(placed["want"])
  for got, want in zip(placed["specs"], placed["want"]):
    assert _norm(got) == _norm(want), placed
  # codes (512, 512) split 2 x 4: (256, 128) per device; rank-1 statistics
  # are split along their own axis only, so a device holds a bit over 1/8.
  assert placed["shard_shapes"][0] == [256, 128]
  assert placed["bytes_per_device"] <= placed["bytes_total"] / 8 * 1.05, placed


def _norm(spec: str) -> str:
  """A printed PartitionSpec without trailing Nones: P('a', None) == P('a',)."""
  return re.sub(r"(, None)*,?\)$", ")", spec)


def _check(result, *, bitwise=True):
  assert result["placed"] and result["kept"], result
  assert result["state_sized_gathers"] == [], result
  assert set(result["collective_kinds"]) <= {"all-reduce"}, result
  assert result["largest_collective"] <= 1024, result
  if bitwise:
    assert result["params_diff"] == [] and result["state_diff"] == [], result
  else:
    assert result["params_max_rel"] < 1e-5, result


def test_unwrapped_update_per_shard_bitwise(fast):
  _check(_value(fast, "auto_unwrapped"))


def test_issue_case_default_optimizer(fast):
  issue = _value(fast, "issue_default")
  assert issue["codes_spec"] == issue["new_codes_spec"] == "P('data', 'model')"
  assert issue["codes_shard_shape"] == [256, 128]
  assert all(c.startswith("all-reduce") for c in issue["collectives"]), issue
  assert issue["params_diff"] == [] and issue["state_diff"] == [], issue


def test_replicated_and_misaligned(fast):
  out = _value(fast, "replicated_and_misaligned")
  assert out["replicated_collectives"] == [] and out["replicated_diff"] == []
  assert "not a multiple of the block size 128" in out["misaligned_error"]


def test_fused_kernels_run_per_shard(fast):
  """The C++ kernel and the Pallas kernels (interpret mode) on Auto axes: per
  shard when the param is split, whole on every device when it is
  replicated; the same bits as one device either way."""
  runs = _value(fast, "auto_kernels")
  assert any(name.startswith("pallas_interpret") for name in runs)
  for name, run in runs.items():
    sharded = name.endswith("sharded") and not name.endswith("replicated")
    assert run["codes_spec"] == ("P('data', 'model')" if sharded else "P()"), (name, run)
    assert all(c.startswith("all-reduce") for c in run["collectives"]), (name, run)
    assert run["params_diff"] == [] and run["state_diff"] == [], (name, run)
    if run["kernel_calls"] is not None:
      assert run["kernel_calls"] >= 2, (name, run)  # the stats and apply calls


@pytest.mark.slow
def test_other_optimizers_unwrapped():
  results = run_json(SCRIPT, *SLOW)
  for name in ("sgdm_unwrapped", "adamw8_unwrapped", "lion_unwrapped", "auto_wrapped"):
    _check(_value(results, name))
  # Factored row/column means are float sums: per shard they add in another order.
  _check(_value(results, "factor_unwrapped"), bitwise=False)
  temp = _value(results, "temp_bytes")
  assert temp["unwrapped"] <= 1.25 * temp["shard_optimizer"], temp
