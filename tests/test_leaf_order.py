"""Ordering the leaves of a step adds no collective (issue 37).

`optax4bit._leafwise.sequential_map` keeps one leaf's update after another's
with a runtime zero made from the previous leaf's stored codes. On a classic
``Mesh`` (``Auto`` axes) it was made outside the per-shard code and XLA
all-gathered whole leaves' codes for it (two ``u8[256,1024]`` all-gathers of
``b``'s codes for `adamw_4bit` on the tree below). Now each device makes it
from its own shard. The checks compile steps on 8 virtual CPU devices in a
separate process (tests/leaf_order_checks.py).
"""

from __future__ import annotations

import collections
import os

import pytest

from subprocess_json import TESTS, run_json

SCRIPT = os.path.join(TESTS, "leaf_order_checks.py")
# The largest rank-1 statistic of the tree (b's column maxima): the only
# collectives a step needs are the all-reduces of such statistics.
LARGEST_STATISTIC = 2048


def _value(results, name):
  entry = results[name]
  assert entry["ok"], entry.get("error")
  return entry["value"]


def _kinds(counter):
  return {key.split()[0] for key in counter}


@pytest.fixture(scope="module")
def issue_tree():
  return _value(run_json(SCRIPT, "issue_tree"), "issue_tree")


@pytest.mark.parametrize("name", ["adamw_4bit", "adamw_4bit_factor"])
def test_issue_tree_has_no_gather(issue_tree, name):
  """a (512, 1024) P("data", "model"), b (256, 2048) P(None, "model"),
  c (8192,) P("model") on a 2 x 4 classic Mesh: no all-gather, only the
  all-reduces of rank-1 statistics."""
  run = issue_tree[name]
  assert _kinds(run["whole"]) <= {"all-reduce"}, run
  assert all(int(key.split()[1]) <= LARGEST_STATISTIC for key in run["whole"]), run
  if name == "adamw_4bit":
    assert run["params_max_rel"] == 0.0 and run["state_diff"] == [], run
  else:  # factored row/column means: float sums in another order per shard
    assert run["params_max_rel"] < 1e-5, run


@pytest.mark.slow
def test_no_order_and_no_mesh_adds_a_collective():
  """Every order of the three leaves, on 2 x 4 and 4 x 2 classic meshes and
  an explicit mesh: the step's collectives are a sub-multiset of those of the
  leaves' steps run alone (where nothing is ordered); the first order of each
  mesh bitwise against one device."""
  runs = _value(run_json(SCRIPT, "orders", timeout=3000), "orders")
  assert len(runs) == 2 * 2 * 6 + 2
  for label, run in runs.items():
    whole, alone = collections.Counter(run["whole"]), collections.Counter(run["alone"])
    assert not whole - alone, (label, run)
    if "params_max_rel" not in run:
      continue
    if label.startswith("adamw_4bit "):
      assert run["params_max_rel"] == 0.0 and run["state_diff"] == [], (label, run)
    else:
      assert run["params_max_rel"] < 1e-5, (label, run)
