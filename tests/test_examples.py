"""The examples run end to end with tiny settings (imported, not subprocesses).

Each run trains a few steps, then the test checks the JSON it wrote (keys,
finite losses), the PNG, and the optimizer state it reports.
"""

from __future__ import annotations

import json
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax4bit

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
sys.path.insert(0, EXAMPLES)

import _common as C  # noqa: E402  pylint: disable=wrong-import-position
import compare  # noqa: E402  pylint: disable=wrong-import-position
import train_digits  # noqa: E402  pylint: disable=wrong-import-position
import train_lm  # noqa: E402  pylint: disable=wrong-import-position

TINY_LM = ["--steps", "3", "--eval-every", "2", "--seq-len", "16", "--batch-size", "2",
           "--d-model", "32", "--layers", "1", "--heads", "2", "--eval-windows", "4",
           "--warmup-steps", "1", "--max-corpus-bytes", "100000", "--no-progress",
           "--min-quantize-size", "0"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _check_png(path):
  with open(path, "rb") as f:
    assert f.read(8) == PNG_MAGIC


def _check_curve(curve, steps):
  assert [s for s, _ in curve] == list(range(1, steps + 1))
  assert all(math.isfinite(v) for _, v in curve)


def test_train_lm_writes_json_and_png(tmp_path):
  # An ablation configuration (also checks the optimizer flags reach the run).
  result = train_lm.main(TINY_LM + ["--optimizer", "adamw_4bit", "--first-moment", "B2048/DE",
                                    "--second-moment", "Rank-1/DE-0", "--out-dir",
                                    str(tmp_path)])
  assert result["optimizer"] == "adamw_4bit[m=B2048/DE,v=Rank-1/DE-0]"
  with open(result["json"]) as f:
    saved = json.load(f)
  for key in ("optimizer", "settings", "optimizer_config", "params", "state_bytes",
              "state_bytes_per_param", "initial_val_loss", "final_val_loss", "val_loss",
              "train_loss", "step_time_median_s", "spikes", "diverged", "corpus"):
    assert key in saved, key
  assert saved["optimizer_config"]["second_moment"] == "Rank-1/DE-0"
  _check_curve(saved["train_loss"], 3)
  assert [s for s, _ in saved["val_loss"]] == [0, 2, 3]
  assert math.isfinite(saved["final_val_loss"]) and saved["final_val_loss"] > 0
  # Every leaf is quantized (min_quantize_size 0): far below fp32 Adam's 8 bytes.
  assert saved["state_bytes_per_param"] < 2.0
  assert saved["corpus"]["train_files"] > 0 and saved["corpus"]["val_files"] > 0
  _check_png(result["png"])


def _digits(tmp_path, optimizer, model):
  result = train_digits.main([
      "--optimizer", optimizer, "--model", model, "--hidden", "32", "--steps", "4",
      "--eval-every", "2", "--batch-size", "16", "--warmup-steps", "1", "--no-progress",
      "--min-quantize-size", "0", "--out-dir", str(tmp_path)])
  with open(result["json"]) as f:
    saved = json.load(f)
  for key in ("final_val_accuracy", "final_val_loss", "val_accuracy", "state_bytes_per_param"):
    assert key in saved
  _check_curve(saved["train_loss"], 4)
  assert 0.0 <= saved["final_val_accuracy"] <= 1.0
  assert saved["state_bytes_per_param"] < 1.5
  _check_png(result["png"])


@pytest.mark.slow  # CI's time (9 s); the other examples' tests run their scripts
def test_train_digits_sgdm_4bit(tmp_path):
  _digits(tmp_path, "sgdm_4bit", "mlp")


@pytest.mark.slow
def test_train_digits_cnn_factor(tmp_path):
  _digits(tmp_path, "adamw_4bit_factor", "cnn")  # 4-D conv kernels


def _compare(tmp_path, optimizers):
  argv = ["--steps", "3", "--eval-every", "2", "--seq-len", "16", "--batch-size", "2",
          "--d-model", "32", "--layers", "1", "--heads", "2", "--eval-windows", "4",
          "--max-corpus-bytes", "100000", "--min-quantize-size", "0", "--no-progress",
          "--out-dir", str(tmp_path)]
  if optimizers:
    argv += ["--optimizers", *optimizers]
  return compare.main(argv)


def test_compare_prints_table(tmp_path, capsys):
  # Two of the three default optimizers keep the default test run short; the
  # slow test below runs the default set.
  result = _compare(tmp_path, ["adamw", "adamw_4bit_factor"])
  out = capsys.readouterr().out
  assert "| optimizer | final val loss" in out and "| adamw_4bit_factor |" in out
  rows = {r["optimizer"]: r for r in result["rows"]}
  assert list(rows) == ["adamw", "adamw_4bit_factor"]
  assert rows["adamw"]["state_bytes_per_param"] == pytest.approx(8.0, abs=0.01)
  assert rows["adamw_4bit_factor"]["state_bytes_per_param"] < 1.0
  assert rows["adamw"]["step_time_ratio"] == 1.0
  for r in rows.values():
    assert math.isfinite(r["final_val_loss"]) and r["step_time_ratio"] > 0
  assert os.path.exists(tmp_path / "compare.json")
  _check_png(tmp_path / "compare.png")


@pytest.mark.slow
def test_compare_default_optimizers(tmp_path):
  result = _compare(tmp_path, None)
  names = [r["optimizer"] for r in result["rows"]]
  assert names == ["adamw", "adamw_4bit", "adamw_4bit_factor"]
  per_param = {r["optimizer"]: r["state_bytes_per_param"] for r in result["rows"]}
  assert per_param["adamw_4bit_factor"] < per_param["adamw_4bit"] < 2.0


# --- the shared helpers -------------------------------------------------------


@pytest.mark.parametrize("name", C.OPTIMIZERS + tuple(C.PRESETS))
def test_make_optimizer_every_name(name):
  params = {"w": jnp.ones((8, 128)), "b": jnp.zeros(8)}
  cfg = C.OptimizerConfig(name=name, min_quantize_size=0, total_steps=10)
  state = C.make_optimizer(cfg).init(params)
  nbytes, nparams, _ = C.state_bytes_per_param(state, params)
  assert nparams == 8 * 128 + 8 and nbytes > 0
  if name in C.PRESETS and not name.endswith("Factor"):
    # The preset's second moment is the quantizer of nu.
    specs = {leaf.spec.name for leaf in jax.tree.leaves(
        state, is_leaf=lambda x: isinstance(x, optax4bit.QuantizedArray))
             if isinstance(leaf, optax4bit.QuantizedArray)}
    assert name[len("v="):] in specs


def test_make_optimizer_rejects_bad_configs():
  with pytest.raises(ValueError, match="unknown optimizer"):
    C.make_optimizer(C.OptimizerConfig(name="adam9"))
  with pytest.raises(ValueError, match="configure the 4-bit"):
    C.make_optimizer(C.OptimizerConfig(name="adamw", second_moment="B128/DE"))
  with pytest.raises(ValueError):
    C.make_optimizer(C.OptimizerConfig(name="adamw_4bit", second_moment="B128/XX"))


def test_presets_map_to_the_paper_rows():
  assert C.PRESETS["v=Rank-1/Linear"] == ("B128/DE", "Rank-1/Linear")
  assert set(C.PRESETS) == {f"v={n}" for n in C.ABLATION_SECOND_MOMENTS}


def test_quantized_optimizers_store_less(tmp_path):
  params = {"w": jnp.ones((256, 1024))}
  nbytes = {}
  for name in ("adamw", "adamw_4bit", "adamw_4bit_factor", "adamw_8bit"):
    tx = C.make_optimizer(C.OptimizerConfig(name=name))
    nbytes[name] = C.state_bytes_per_param(tx.init(params), params)[2]
  assert nbytes["adamw"] == pytest.approx(8.0, abs=1e-3)
  assert nbytes["adamw_8bit"] < 2.1 and nbytes["adamw_4bit"] < 1.1
  assert nbytes["adamw_4bit_factor"] < 0.6


def test_corpus_split_is_by_file_and_deterministic(tmp_path):
  for i in range(40):
    (tmp_path / f"m{i}.py").write_bytes(f"# file {i}\n".encode())
  (tmp_path / "notes.txt").write_bytes(b"ignored")
  (tmp_path / "site-packages").mkdir()
  (tmp_path / "site-packages" / "x.py").write_bytes(b"ignored too")
  train, val, info = C.load_stdlib_corpus(str(tmp_path), val_fraction=0.25)
  train2, val2, _ = C.load_stdlib_corpus(str(tmp_path), val_fraction=0.25)
  np.testing.assert_array_equal(train, train2)
  np.testing.assert_array_equal(val, val2)
  assert info["train_files"] + info["val_files"] == 40
  train_files = set(bytes(train).split(b"\0")) - {b""}
  val_files = set(bytes(val).split(b"\0")) - {b""}
  assert not train_files & val_files
  assert b"ignored" not in bytes(train) + bytes(val)


def test_lm_batches_are_shifted_windows():
  data = np.arange(200, dtype=np.uint8)
  x, y = next(C.lm_batches(data, 4, 8, seed=0))
  assert x.shape == y.shape == (4, 8)
  np.testing.assert_array_equal(x[:, 1:], y[:, :-1])


def test_spike_and_divergence_rules():
  flat = [2.0] * 30
  assert C.count_spikes(flat) == 0
  assert C.count_spikes(flat[:25] + [3.1] + flat[:4]) == 1
  assert C.count_spikes(flat[:25] + [float("nan")]) == 1
  assert C.count_spikes([5.0] * 5 + [100.0]) == 0  # too early to judge
  assert C.diverged([1.0, float("inf")], 1.0, 5.0)
  assert C.diverged([1.0, 1.0], 5.5, 5.5)
  assert not C.diverged([1.0, 1.0], 2.0, 5.5)
  assert not C.val_loss_rose([(0, 5.5), (50, 2.8), (100, 2.5)])
  assert C.val_loss_rose([(0, 5.5), (50, 2.8), (100, 3.4), (150, 2.4)])


def test_schedule_warms_up_and_decays():
  lr = C.schedule(C.OptimizerConfig(learning_rate=1.0, warmup_steps=10, total_steps=100))
  assert float(lr(0)) == 0.0 and float(lr(10)) == pytest.approx(1.0)
  assert float(lr(100)) == pytest.approx(0.1)
  assert isinstance(C.make_optimizer(C.OptimizerConfig(name="adamw")),
                    optax.GradientTransformation)
