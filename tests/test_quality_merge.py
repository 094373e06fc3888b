"""benchmarks/quality.py's merge of a new problem entry into the previous one:
the variants a run did not retrain are kept only when both entries hold the
same reference runs, so every kept pair is still paired with the runs shown."""

from __future__ import annotations

import copy

import pytest
from conftest import benchmark_script


@pytest.fixture(scope="module")
def quality():
  return benchmark_script("quality")


def _entry(values: dict, training=None) -> dict:
  """A problem entry with one checkpoint and these per-variant seed values."""
  return {"environment": "env", "seeds": [0, 1], "reference": "adamw", "checkpoints": [10],
          "settings": {}, "training": training or {"steps": 10, "learning_rate": 0.1},
          "quantizers": {v: f"q-{v}" for v in values},
          "paired": {v: {"10": {"values": list(x)}} for v, x in values.items()}}


def test_unrun_variants_kept_when_the_reference_is_the_same(quality):
  previous = _entry({"adamw": (1.0, 2.0), "a": (1.5, 2.5), "b": (0.9, 1.9)})
  new = _entry({"adamw": (1.0, 2.0), "a": (1.2, 2.2)})
  merged = quality.merge_unrun_variants(copy.deepcopy(previous), new)
  assert merged["paired"]["a"]["10"]["values"] == [1.2, 2.2]  # the new run wins
  assert merged["paired"]["b"]["10"]["values"] == [0.9, 1.9]  # kept from the old entry
  assert merged["quantizers"]["b"] == "q-b"
  assert merged["variants_from_previous_run"] == {"environment": "env", "variants": ["b"]}


def test_nothing_kept_when_the_reference_runs_differ(quality):
  previous = _entry({"adamw": (1.0, 2.0), "b": (0.9, 1.9)})
  for new in (_entry({"adamw": (1.0, 2.0001)}),
              _entry({"adamw": (1.0, 2.0)}, training={"steps": 20, "learning_rate": 0.1})):
    merged = quality.merge_unrun_variants(copy.deepcopy(previous), new)
    assert set(merged["paired"]) == {"adamw"} and "variants_from_previous_run" not in merged


def test_a_training_field_added_since_counts_as_its_default(quality):
  base = {"steps": 10, "learning_rate": 0.1}
  previous = _entry({"adamw": (1.0, 2.0), "b": (0.9, 1.9)}, training=dict(base))
  default = quality.Training(steps=10, learning_rate=0.1).end_lr_fraction
  same = _entry({"adamw": (1.0, 2.0)}, training={**base, "end_lr_fraction": default})
  assert "b" in quality.merge_unrun_variants(copy.deepcopy(previous), same)["paired"]
  other = _entry({"adamw": (1.0, 2.0)}, training={**base, "end_lr_fraction": default / 2})
  assert "b" not in quality.merge_unrun_variants(copy.deepcopy(previous), other)["paired"]
