"""Checkpoints of 4-bit optimizer states with orbax (optax4bit.checkpoint).

The round trip on 8 virtual devices (save, bit-identical restore, resume,
restore onto 4 devices with other PartitionSpecs, mismatch errors) runs in a
separate process (tests/checkpoint_checks.py); so does a save that is killed
with SIGKILL just before orbax's atomic rename.
"""

from __future__ import annotations

import doctest
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax4bit
from optax4bit import checkpoint
from subprocess_json import ROOT, TESTS, child_env, run_json

ocp = pytest.importorskip("orbax.checkpoint")

SCRIPT = os.path.join(TESTS, "checkpoint_checks.py")


# ----------------------------------------------------------------------------
# One device.


def _state(tx, shape=(256, 256)):
  params = {"w": jnp.ones(shape), "b": jnp.zeros(8)}
  return {"params": params, "opt_state": tx.init(params), "step": 0}


def test_describe_names_quantizers():
  meta = checkpoint.describe(_state(optax4bit.adamw_4bit(1e-3)))
  leaves = meta["leaves"]
  mu = leaves["['opt_state'][0].mu['w']"]
  assert mu["kind"] == "quantized" and mu["shape"] == [256, 256]
  assert mu["spec"]["normalization"] == "block" and mu["spec"]["block_size"] == 128
  assert mu["spec"]["mapping"] == "NF" and mu["spec"]["stochastic"]
  assert leaves["['opt_state'][0].nu['w']"]["spec"]["mapping"] == "SqrtLinear"
  assert leaves["['opt_state'][0].mu['b']"] == {"kind": "array", "shape": [8],
                                               "dtype": "float32"}


@pytest.mark.parametrize("other,match", [
    (optax4bit.adamw_4bit(1e-3, second_moment="Rank-1/DE-0"), "Rank-1/DE-0"),
    (optax4bit.adamw_4bit(1e-3, first_moment="B2048/DE"), "B2048/DE"),
    (optax4bit.adamw_4bit(1e-3, min_quantize_size=10**6), "target expects array"),
    (optax4bit.sgdm_4bit(1e-3), "state structures differ"),
    (optax.adamw(1e-3), "state structures differ|target expects array"),
])
def test_check_compatible_refuses_other_configs(other, match):
  saved = checkpoint.describe(_state(optax4bit.adamw_4bit(1e-3)))
  checkpoint.check_compatible(saved, _state(optax4bit.adamw_4bit(5e-3)))  # lr is not state
  with pytest.raises(checkpoint.CheckpointMismatchError, match=match):
    checkpoint.check_compatible(saved, jax.eval_shape(lambda: _state(other)))


def test_restore_refuses_checkpoints_without_description(tmp_path):
  state = _state(optax4bit.adamw_4bit(1e-3))
  with ocp.CheckpointManager(tmp_path) as manager:
    manager.save(0, args=ocp.args.Composite(
        optax4bit=ocp.args.JsonSave({"something": "else"})))
    manager.wait_until_finished()
    with pytest.raises(checkpoint.CheckpointMismatchError, match="no optax4bit description"):
      checkpoint.restore(manager, checkpoint.abstract(state))
  with ocp.CheckpointManager(tmp_path / "empty") as manager:
    with pytest.raises(FileNotFoundError):
      checkpoint.restore(manager, checkpoint.abstract(state))


def test_module_doctest():
  result = doctest.testmod(checkpoint, optionflags=doctest.ELLIPSIS)
  assert result.failed == 0 and result.attempted > 0


# ----------------------------------------------------------------------------
# 8 devices, in a separate process.


@pytest.fixture(scope="module")
def roundtrip(tmp_path_factory):
  result = run_json(SCRIPT, "roundtrip", str(tmp_path_factory.mktemp("ckpt") / "run"))
  assert result["ok"], result.get("error")
  return result["value"]


def test_restore_is_bit_identical(roundtrip):
  assert roundtrip["restored_diff"] == []
  assert roundtrip["restored_specs_same"]


def test_resumed_run_continues_exactly(roundtrip):
  assert roundtrip["resumed_diff"] == []


def test_restore_onto_other_mesh_and_specs(roundtrip):
  assert roundtrip["mesh4_diff"] == []
  assert roundtrip["mesh4_devices"] == [4, 5, 6, 7]
  assert "P(None, 'x')" in roundtrip["mesh4_specs"] and "P('x', None)" in roundtrip["mesh4_specs"]


def test_resume_on_other_mesh_only_changes_float_sums(roundtrip):
  # The global-norm clipping sums over 4 instead of 8 shards: float addition
  # order, a few ulps in the step; codes may flip at a rounding boundary.
  assert roundtrip["mesh4_resumed_params_max_rel"] < 1e-5


def test_restore_with_other_optimizer_fails_clearly(roundtrip):
  mismatch = roundtrip["mismatch"]
  assert "Rank-1/DE-0" in mismatch["second_moment_DE-0"]
  assert "Rank-1/SqrtLinear" in mismatch["second_moment_DE-0"]
  assert "target expects array" in mismatch["min_quantize_size"]
  assert "state structures differ" in mismatch["sgdm_4bit"]


def test_killed_save_restores_previous_step(tmp_path):
  """SIGKILL during a save (after the data is written, before orbax's atomic
  rename): the latest complete step is the previous one, restored exactly."""
  directory = tmp_path / "ckpt"
  proc = subprocess.Popen([sys.executable, SCRIPT, "crash", str(directory)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=child_env(), cwd=ROOT)
  try:
    deadline = time.time() + 300
    line = ""
    while time.time() < deadline:
      line = proc.stdout.readline()
      if not line or line.startswith("FINALIZING"):
        break
    assert line.startswith("FINALIZING"), proc.stderr.read()[-4000:]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
  finally:
    if proc.poll() is None:
      os.kill(proc.pid, signal.SIGKILL)
      proc.wait(timeout=60)
  assert proc.returncode == -signal.SIGKILL
  assert any(name.startswith("2.") and "tmp" in name for name in os.listdir(directory))

  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   optax4bit.adamw_4bit(1e-2, chunk_size=2**14))
  params = {"b": jnp.zeros(8192), "w1": jnp.zeros((256, 1024)), "w2": jnp.zeros((1024, 256))}
  # From arrays, not eval_shape: the child saved on its CPU, and a target without
  # shardings would make orbax restore onto the saved device (absent on a GPU machine).
  target = checkpoint.abstract({"params": params, "opt_state": tx.init(params),
                                "step": jnp.zeros((), jnp.int32)})
  with ocp.CheckpointManager(directory) as manager:
    assert manager.latest_step() == 1
    assert manager.all_steps() == [1]
    restored = checkpoint.restore(manager, target)
  expected = np.load(tmp_path / "expected_step1.npz")
  leaves = jax.tree_util.tree_flatten_with_path(restored)[0]
  assert len(leaves) == len(expected.files)
  for path, x in leaves:
    np.testing.assert_array_equal(np.asarray(x), expected[jax.tree_util.keystr(path)])


# ----------------------------------------------------------------------------
# Flax NNX (issue 37): ``nnx.state`` splits each QuantizedArray into plain
# codes/scales leaves; the quantizer must still be checked on restore.


def _nnx_optimizer(tx):
  nnx = pytest.importorskip("flax.nnx")

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.dense = nnx.Linear(256, 256, rngs=rngs)

  model = Model(nnx.Rngs(0))
  return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


@pytest.mark.parametrize("split", ["state", "split"])
def test_nnx_state_restore_refuses_other_quantizers(tmp_path, split):
  nnx = pytest.importorskip("flax.nnx")
  take = (lambda o: nnx.state(o)) if split == "state" else (lambda o: nnx.split(o)[1])
  model, opt = _nnx_optimizer(optax4bit.adamw_4bit(1e-3))
  opt.update(model, jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param)))
  saved = take(opt)
  with ocp.CheckpointManager(tmp_path) as manager:
    checkpoint.save(manager, 1, saved)
    manager.wait_until_finished()
    # Another recipe: the same array shapes, other maps (B128/DE, Rank-1/Linear).
    _, other = _nnx_optimizer(optax4bit.adamw_4bit(1e-3, recipe="paper"))
    abstract_other = nnx.state(nnx.eval_shape(
        lambda: _nnx_optimizer(optax4bit.adamw_4bit(1e-3, recipe="paper"))[1]))
    for target in (take(other), abstract_other):
      with pytest.raises(checkpoint.CheckpointMismatchError) as error:
        checkpoint.restore(manager, target)
      message = str(error.value)
      assert "['mu']['dense']['kernel']['scales'][0]" in message
      assert "B128/NF" in message and "B128/DE" in message
      assert "['nu']['dense']['kernel']['scales'][1]" in message
      assert "Rank-1/SqrtLinear" in message and "Rank-1/Linear" in message
    # The same optimizer restores bit for bit, and training goes on from it.
    _, fresh = _nnx_optimizer(optax4bit.adamw_4bit(1e-3))
    restored = checkpoint.restore(manager, take(fresh))
  nnx.update(fresh, restored)
  for a, b in zip(jax.tree.leaves(nnx.state(fresh)), jax.tree.leaves(saved)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  mu = fresh.opt_state[0].mu["dense"]["kernel"]
  assert isinstance(mu, optax4bit.QuantizedArray) and mu.spec.mapping == "NF"


def test_quantizer_key_round_trips():
  from optax4bit.quant import array as qarray  # pylint: disable=import-outside-toplevel
  for name in ("B128/NF", "B2048/DE", "Rank-1/SqrtDE-0", "Rank-1/SqrtLinear", "Tensor/Linear",
               "Rank-1/DE-0"):
    for stochastic in (False, True):
      spec = optax4bit.QuantSpec.parse(name, stochastic=stochastic)
      assert qarray.spec_of_key(qarray.quantizer_key(spec)) == spec
  assert qarray.spec_of_key("codes") is None and qarray.spec_of_key(0) is None


def test_format_1_checkpoints_get_a_clear_error():
  saved = checkpoint.describe(_state(optax4bit.adamw_4bit(1e-3)))
  saved["format"] = "optax4bit-state/1"
  with pytest.raises(checkpoint.CheckpointMismatchError, match="optax4bit 0.1"):
    checkpoint.check_compatible(saved, _state(optax4bit.adamw_4bit(1e-3)))


def test_the_stall_rule_does_not_block_a_restore():
  """Issue 50 made the stall rule the default's first-moment rounding: a state
  written with m rounded stochastically everywhere (the default before), or
  described before ``stall_only`` existed, restores into today's default; the
  rule changes how later steps round, not how the codes decode."""
  everywhere = optax4bit.QuantSpec.parse("B128/NF", stochastic=True)
  saved = checkpoint.describe(_state(optax4bit.adamw_4bit(1e-3, first_moment=everywhere)))
  target = _state(optax4bit.adamw_4bit(1e-3))
  assert saved != checkpoint.describe(target)
  checkpoint.check_compatible(saved, target)
  for entry in saved["leaves"].values():
    for field in ("spec", "quantizer"):
      entry.get(field, {}).pop("stall_only", None)
  checkpoint.check_compatible(saved, target)
  # Nearest rounding, a quantizer of its own (its scales' key), still refuses.
  with pytest.raises(checkpoint.CheckpointMismatchError, match="B128/NF"):
    checkpoint.check_compatible(saved, _state(optax4bit.adamw_4bit(1e-3, first_moment="B128/NF")))
