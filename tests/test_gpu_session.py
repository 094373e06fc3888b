"""benchmarks/gpu_session.py, the one-call GPU session script, on the CPU.

The script is meant for a lent GPU, where a failure costs the lease; these
tests run its ``--smoke`` mode (tiny trees, the checks in Pallas interpret
mode) and check the JSON it writes, so that it cannot rot between leases.
Its figures on the CPU mean nothing and are not asserted.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax4bit
from optax4bit import QuantSpec

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import gpu_session  # noqa: E402

ROW_FIELDS = {"size", "params", "dtype", "step", "optimizer", "implementation", "seconds",
              "compile_seconds", "state_bytes", "bytes_moved", "copy_bandwidth_bytes_per_s",
              "group", "samples"}
HEADER_FIELDS = {"schema", "device", "platform", "jax", "jaxlib", "optax", "auto_runs_pallas",
                 "optax4bit_sources_sha256", "copy_bandwidth_bytes_per_s", "checks",
                 "timings", "skipped", "errors", "finished", "elapsed_seconds", "args"}


def _run(tmp_path, *args) -> dict:
  assert gpu_session.main(["--smoke", "--out", str(tmp_path), *args]) == 0
  with open(tmp_path / "gpu_session.json") as f:
    return json.load(f)


def _param_count(size: str) -> int:
  return sum(x.size for x in jax.tree.leaves(gpu_session.init_params(
      gpu_session.SIZES[size], jnp.float32)))


def test_smoke_run_writes_every_field(tmp_path):
  """One optimizer, float32, both steps: checks, rows and ratios, with the
  bytes that a step moves checked against the state's own layout."""
  results = _run(tmp_path, "--optimizers", "sgdm_4bit", "--dtypes", "float32")
  assert HEADER_FIELDS <= set(results) and results["finished"]
  assert results["auto_runs_pallas"] is False  # no CUDA here
  assert results["errors"] == [] and results["skipped"] == []
  assert results["copy_bandwidth_bytes_per_s"] > 0

  (check,) = results["checks"]
  assert check["check"] == "sgdm_4bit" and check["ok"] is True
  assert check["codes_differ"] == 0 and check["codes"] > 0

  num = _param_count(gpu_session.SMOKE_SIZE)
  rows = {(r["step"], r["optimizer"]): r for r in results["timings"]}
  assert set(rows) == {(s, o) for s in ("update", "train")
                       for o in ("optax.adamw", "optax.sgd(momentum)", "sgdm_4bit")}
  for (step, name), row in rows.items():
    assert ROW_FIELDS <= set(row), (step, name)
    assert row["params"] == num and row["size"] == gpu_session.SMOKE_SIZE
    assert row["seconds"] > 0 and row["compile_seconds"] > 0
    assert row["bytes_moved"] == 3 * 4 * num + 2 * row["state_bytes"]
    if step == "train":
      assert np.isfinite(row["final_loss"]) and (row["batch"], row["seq"]) == (2, 16)
    else:
      assert row["share_of_copy_bandwidth"] == pytest.approx(
          row["bytes_moved"] / row["seconds"] / results["copy_bandwidth_bytes_per_s"])
  # optax's states, counted by hand: AdamW mu, nu and an int32 count; SGD a trace.
  assert rows["update", "optax.adamw"]["state_bytes"] == 8 * num + 4
  assert rows["update", "optax.sgd(momentum)"]["state_bytes"] == 4 * num
  for step in ("update", "train"):
    base = rows[step, "optax.adamw"]
    assert base["implementation"] == "optax" and "vs_optax_adamw" not in base
    row = rows[step, "sgdm_4bit"]
    assert row["implementation"] in ("cpu", "jnp")
    assert row["samples"] == results["args"]["rounds"]
    for key in ("vs_optax_adamw", "vs_optax_sgd_momentum"):
      low, high = row[key + "_quartiles"]
      assert 0 < low <= row[key] <= high


  # A second call given this JSON skips its rows, and their groups' baselines.
  again = _run(tmp_path / "again", "--optimizers", "sgdm_4bit", "--dtypes", "float32",
               "--skip-checks", "--skip-timed", str(tmp_path / "gpu_session.json"))
  assert again["timings"] == again["checks"] == again["skipped"] == []


def test_zero_budget_skips_every_row_and_check(tmp_path):
  results = _run(tmp_path, "--budget-seconds", "0", "--dtypes", "float32", "--optimizers",
                 "adamw_4bit", "lion_4bit")
  assert results["finished"] and results["timings"] == [] and results["checks"] == []
  skipped = {(s.get("step"), s.get("optimizer") or s.get("check")) for s in results["skipped"]}
  assert {("update", "optax.adamw"), (None, "adamw_4bit"), (None, "lion_4bit"),
          ("update", "adamw_4bit"), ("train", "lion_4bit")} <= skipped
  assert all("time budget" in s["reason"] for s in results["skipped"])


def test_plan_puts_the_issue_targets_first():
  names = list(gpu_session.CANDIDATES)
  groups = gpu_session.plan(["1B", "100M"], ["float32", "bfloat16"], ["update", "train"], names)
  assert groups[0] == (1, "1B", "float32", "update",
                       ["adamw_4bit", "adamw_4bit paper recipe", "adamw_4bit_factor",
                        "sgdm_4bit"])
  assert [g[1:4] for g in groups[:4]] == [("1B", "float32", "update"),
                                          ("1B", "float32", "train"),
                                          ("100M", "float32", "update"),
                                          ("100M", "float32", "train")]
  timed = {(n, g[1], g[2], g[3]) for g in groups for n in g[4]}
  assert len(timed) == sum(len(g[4]) for g in groups)  # none timed twice
  assert {n for n, *_ in timed} == set(names)
  for name in ("adamw_4bit jnp engine", "adamw_4bit jnp engine, two chunks per leaf"):
    assert {(s, d, k) for n, s, d, k in timed if n == name} == {
        ("100M", "float32", "update"), ("100M", "bfloat16", "update")}
  assert max(i for i, g in enumerate(groups) if g[0] == 1) < min(
      i for i, g in enumerate(groups) if g[0] == 2)


def test_train_loss_at_init_is_that_of_a_uniform_guess():
  """Small embeddings give logits of std about 0.02 sqrt(width) = 0.23, which
  add about half their variance (0.03) to the loss of a uniform guess,
  log(vocab); every leaf, the layer's too, gets a gradient."""
  config = dict(vocab=300, width=128, depth=1)
  params = gpu_session.init_params(config, jnp.float32)
  tokens = jax.random.randint(jax.random.key(0), (2, 17), 0, config["vocab"])
  loss, grads = jax.jit(jax.value_and_grad(gpu_session.gpt_loss))(params, tokens)
  vocab = config["vocab"]
  assert 0 < float(loss) - math.log(vocab) < 0.1
  assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))


def test_codes_differ_counts_each_4bit_code():
  x = jax.random.normal(jax.random.key(0), (4, 256))
  a = optax4bit.quantize(x, QuantSpec("block", "NF", bits=4, block_size=128, signed=True))
  codes = np.asarray(a.codes).copy()
  codes[0, 0] ^= 0x01  # low nibble
  codes[1, 5] ^= 0x30  # high nibble
  codes[2, 7] ^= 0x11  # both codes of one byte
  b = dataclasses.replace(a, codes=jnp.asarray(codes))
  assert gpu_session._codes_differ(a, a) == 0
  assert gpu_session._codes_differ(a, b) == 4


@pytest.mark.slow
def test_smoke_run_of_every_optimizer(tmp_path):
  """The whole smoke plan: every optimizer, both dtypes, both steps."""
  results = _run(tmp_path, "--budget-seconds", "3000")
  assert results["errors"] == [] and results["skipped"] == []
  timed = {(r["optimizer"], r["dtype"], r["step"]) for r in results["timings"]}
  for name, optimizer in gpu_session.OPTIMIZERS.items():
    for dtype in ("float32", "bfloat16"):
      for step in optimizer.steps or ("update", "train"):
        assert (name, dtype, step) in timed
  checks = {(c["check"], c["dtype"]): c for c in results["checks"]}
  for name in ("adamw_4bit", "adamw_4bit paper recipe", "adamw_4bit_factor", "sgdm_4bit"):
    for dtype in ("float32", "bfloat16"):
      assert checks[name, dtype]["ok"] is True, checks[name, dtype]
