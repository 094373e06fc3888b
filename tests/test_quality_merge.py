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


def _entry(values: dict, training=None, environment="env") -> dict:
  """A problem entry with one checkpoint and these per-variant seed values."""
  return {"environment": environment, "seeds": [0, 1], "reference": "adamw", "checkpoints": [10],
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
  assert merged["variants_from_previous_run"] == {"environments": {"env": ["b"]}}


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


def test_each_kept_variant_keeps_the_environment_it_was_trained_in(quality):
  # Run 1 trains a, b, c; run 2 retrains a only; run 3 retrains b only. After
  # run 3, a comes from run 2 and c from run 1 (not both from run 2).
  ref = {"adamw": (1.0, 2.0)}
  first = _entry({**ref, "a": (1.1, 2.1), "b": (1.2, 2.2), "c": (1.3, 2.3)}, environment="e1")
  second = quality.merge_unrun_variants(first, _entry({**ref, "a": (1.4, 2.4)}, environment="e2"))
  assert second["variants_from_previous_run"] == {"environments": {"e1": ["b", "c"]}}
  third = quality.merge_unrun_variants(second, _entry({**ref, "b": (1.5, 2.5)}, environment="e3"))
  assert third["environment"] == "e3"
  assert third["variants_from_previous_run"] == {"environments": {"e1": ["c"], "e2": ["a"]}}
  assert third["paired"]["a"]["10"]["values"] == [1.4, 2.4]
  assert third["paired"]["c"]["10"]["values"] == [1.3, 2.3]


def test_entries_of_the_old_format_give_their_single_environment(quality):
  previous = _entry({"adamw": (1.0, 2.0), "b": (0.9, 1.9), "c": (0.8, 1.8)}, environment="e2")
  previous["variants_from_previous_run"] = {"environment": "e1", "variants": ["c"]}
  merged = quality.merge_unrun_variants(previous, _entry({"adamw": (1.0, 2.0)}, environment="e3"))
  assert merged["variants_from_previous_run"] == {"environments": {"e1": ["c"], "e2": ["b"]}}


def test_the_configured_warmup_is_kept_unless_the_run_is_shortened(quality):
  issue40 = quality.PROBLEMS["lm_stdlib_issue40"]
  assert issue40.training.steps == 800 and issue40.training.warmup_steps == 100
  assert quality.training_for(issue40, 800).warmup_steps == 100  # not 800 // 10
  assert quality.training_for(issue40, 800) == issue40.training
  assert quality.training_for(issue40, 40).warmup_steps == 4      # --quick: a tenth
  assert quality.training_for(issue40, 500).warmup_steps == 50
  assert quality.training_for(issue40, 2000).warmup_steps == 100  # longer: as configured
  assert quality.training_for(quality.PROBLEMS["lsq"], 300).warmup_steps is None


def test_a_variant_whose_quantizers_changed_is_not_kept(quality):
  """Issue 50 changed the default recipe's m: a kept Factor entry of the old
  m would be reported as today's Factor."""
  previous = _entry({"adamw": (1.0, 2.0), "adamw_4bit_factor": (1.5, 2.5),
                     "adamw_4bit_paper": (0.9, 1.9)})
  previous["quantizers"]["adamw_4bit_factor"] = {"first_moment": "an older m",
                                                 "second_moment": "Factor"}
  previous["quantizers"]["adamw_4bit_paper"] = quality.variant_quantizers("adamw_4bit_paper")
  merged = quality.merge_unrun_variants(previous, _entry({"adamw": (1.0, 2.0)}))
  assert set(merged["paired"]) == {"adamw", "adamw_4bit_paper"}
  assert "adamw_4bit_factor" not in merged["quantizers"]
  assert merged["variants_from_previous_run"] == {"environments": {"env": ["adamw_4bit_paper"]}}
