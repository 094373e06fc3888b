"""Fault finding on meshes and through checkpoints (issue 37).

The checks run on 8 virtual CPU devices in a separate process
(tests/fault_mesh_checks.py):

* random trees on random shardings (none, replicated, classic ``Mesh`` axes,
  explicit axes), drawn by hypothesis (in the default run only its first
  explicit case): every implementation gives the jnp
  engine's result bit for bit, the sharded engine the one-device result, and
  the compiled step has no collective that optax's step lacks beyond the
  all-reduces of rank-1 statistics;
* the Pallas kernels (interpret mode) on the first explicit case and (slow)
  a few drawn meshed cases: the jnp engine's codes, its floats within 1e-5;
* a state saved from a (2, 4) mesh restores bit for bit on a (4, 2) mesh and
  on one device, and its next step is the uninterrupted run's, bit for bit:
  a fixed tree, and (slow) drawn trees and optimizers;
* a run killed (SIGKILL) inside the save of step 2 resumes from step 1, and
  its next step is the uninterrupted run's step 2, bit for bit.

tests/test_faults.py has the one-device properties; tests/test_checkpoint.py
the NNX and plain round trips and the refusal of other quantizers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from subprocess_json import ROOT, TESTS, child_env, run_json

SCRIPT = os.path.join(TESTS, "fault_mesh_checks.py")


def _value(results, name):
  entry = results[name]
  assert entry["ok"], entry.get("error")
  return entry["value"]


def _random_shardings(examples, impls, modes="none,replicated,auto,explicit"):
  found = _value(run_json(SCRIPT, "shardings", str(examples), impls, modes, timeout=3000),
                 "shardings")
  assert found["ran"] == examples + (2 if examples else 1), found  # and explicit cases
  assert found["failures"] == [], found
  return found


def test_shardings():
  """The first explicit case only (classic mesh axes, a sharded float32
  matrix and bf16 vector), with the C++ kernel and the Pallas kernels in
  interpret mode (3 s of CPU more); "auto" is "cpu" on an x86-64 CPU with
  AVX2."""
  _random_shardings(0, "cpu,pallas_interpret")


@pytest.mark.slow
def test_random_shardings_many():
  found = _random_shardings(40, "cpu,auto")
  assert set(found["modes"]) == {"none", "replicated", "auto", "explicit"}, found


@pytest.mark.slow
def test_random_shardings_pallas():
  """The Pallas kernels (interpret mode) on meshes: the 2 explicit cases and
  6 drawn on replicated, classic-axis and explicit-axis meshes (one device
  is tests/test_faults.py's); equal codes, floats within 1e-5 of the jnp
  engine, no collective beyond optax's."""
  found = _random_shardings(6, "pallas_interpret", "replicated,auto,explicit")
  assert set(found["modes"]) <= {"replicated", "auto", "explicit"}, found


def _restores(tmp_path, examples):
  found = _value(run_json(SCRIPT, "remesh", str(tmp_path / "run"), str(examples),
                          timeout=3000), "remesh")
  assert found["ran"] == examples + (2 if examples else 1), found  # and the fixed trees
  assert found["failures"] == [], found
  return found


@pytest.mark.slow
def test_state_restores_onto_other_meshes(tmp_path):
  """A 4-bit AdamW state saved on a (2, 4) mesh: restored on (2, 4), (4, 2)
  and one device, then stepped, bit for bit."""
  _restores(tmp_path, 0)


@pytest.mark.slow
def test_random_states_restore_onto_other_meshes(tmp_path):
  """The same for a Factor state saved on (4, 2) and 6 drawn trees (1-3
  leaves of the sharding suite's shapes, float32 or bf16, on axes that fit
  both meshes) and optimizers."""
  found = _restores(tmp_path, 6)
  assert "adamw_4bit_factor" in found["optimizers"], found


@pytest.mark.slow
def test_run_killed_mid_save_resumes_bitwise(tmp_path):
  """SIGKILL inside the save of step 2 (its data written, orbax's commit not
  done): the latest complete step is 1; restored and stepped once, the state
  is the uninterrupted run's step 2, bit for bit."""
  directory = tmp_path / "run"
  proc = subprocess.Popen([sys.executable, SCRIPT, "crash", str(directory)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=child_env(), cwd=ROOT)
  try:
    deadline, line = time.time() + 600, ""
    while time.time() < deadline and not line.startswith("FINALIZING"):
      line = proc.stdout.readline()
      if not line:
        break
    assert line.startswith("FINALIZING"), proc.stderr.read()[-4000:]
  finally:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
  assert proc.returncode == -signal.SIGKILL
  assert any(name.startswith("2.") and "tmp" in name for name in os.listdir(directory))
  found = _value(run_json(SCRIPT, "resume", str(directory)), "resume")
  assert found["latest_step"] == 1, found
  assert found["restored_diff"] == [] and found["resumed_diff"] == [], found
  assert found["restored_leaves"][0] == found["restored_leaves"][1] > 0, found
