"""examples/flax_sharded.py: flax.nnx.Optimizer with sharded NNX params and a
Linen TrainState, both with 4-bit states sharded like the parameters
(8 virtual CPU devices, in a separate process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from subprocess_json import ROOT, child_env

pytest.importorskip("flax")

EXAMPLE = os.path.join(ROOT, "examples", "flax_sharded.py")


@pytest.fixture(scope="module")
def summary(tmp_path_factory):
  out = tmp_path_factory.mktemp("flax") / "summary.json"
  proc = subprocess.run([sys.executable, EXAMPLE, "--steps", "4", "--json", str(out)],
                        capture_output=True, text=True, env=child_env(), cwd=ROOT,
                        timeout=600, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
  return json.loads(out.read_text())


def test_nnx_optimizer_states_follow_params(summary):
  nnx_run = summary["nnx"]
  assert nnx_run["losses"][-1] < 0.5 * nnx_run["losses"][0]
  assert nnx_run["kernel1"] == "P(None, 'model')"
  assert nnx_run["mu_fc1_kernel"] == {"codes": "P(None, 'model')", "scales": ["P(None, 'model')"]}
  assert nnx_run["nu_fc1_kernel"]["scales"] == ["P(None, None)", "P(None, 'model')"]
  assert nnx_run["mu_fc2_kernel"]["codes"] == "P('model', None)"
  assert nnx_run["mu_fc1_bias"] == "P('model',)"


def test_linen_train_state_states_follow_params(summary):
  linen = summary["linen"]
  assert linen["losses"][-1] < 0.5 * linen["losses"][0]
  assert linen["kernel0"] == "P('data', 'model')"
  assert linen["mu_dense0_kernel"] == {"codes": "P('data', 'model')",
                                       "scales": ["P('data', 'model')"]}
  assert linen["nu_dense0_kernel"]["scales"] == ["P('data', None)", "P(None, 'model')"]
  assert linen["mu_dense1_kernel"]["codes"] == "P('model', 'data')"
