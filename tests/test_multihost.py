"""Two JAX processes on localhost (4 CPU devices each, gloo collectives) train
examples/multihost.py's sharded model with adamw_4bit, checkpoint, restore and
resume; both must agree with a single process holding all 8 devices."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from subprocess_json import ROOT, child_env

pytest.importorskip("orbax.checkpoint")

EXAMPLE = os.path.join(ROOT, "examples", "multihost.py")
TIMEOUT = 600


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start(tmp_path, name, *args):
  out = tmp_path / f"{name}.json"
  log = open(tmp_path / f"{name}.log", "w", encoding="utf-8")  # pylint: disable=consider-using-with
  proc = subprocess.Popen([sys.executable, EXAMPLE, "--json", str(out), *args], stdout=log,
                          stderr=subprocess.STDOUT, env=child_env(), cwd=ROOT)
  return proc, out, log


def _finish(procs):
  try:
    for proc, _, _ in procs:
      proc.wait(timeout=TIMEOUT)
  finally:
    for proc, _, log in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
      log.close()
  results = []
  for proc, out, log in procs:
    text = open(log.name, encoding="utf-8").read()
    assert proc.returncode == 0, f"{log.name} exited with {proc.returncode}:\n{text[-6000:]}"
    results.append(json.loads(out.read_text()))
  return results


def test_two_processes_agree_with_one(tmp_path):
  port = str(_free_port())
  ckpt = str(tmp_path / "checkpoints")
  procs = [_start(tmp_path, f"process{i}", "--num-processes", "2", "--process-id", str(i),
                  "--port", port, "--checkpoint-dir", ckpt) for i in range(2)]
  single = _start(tmp_path, "single", "--num-processes", "1",
                  "--checkpoint-dir", str(tmp_path / "single_checkpoints"))
  p0, p1, one = _finish(procs + [single])

  assert (p0["process"], p1["process"]) == (0, 1)
  assert p0["processes"] == p1["processes"] == 2 and p0["local_devices"] == 4
  assert one["processes"] == 1 and one["local_devices"] == 8
  for run in (p0, p1, one):
    # States follow the parameters across hosts; each device holds a block.
    assert run["layout"] == {"mu_codes": "P('data', 'model')",
                             "nu_scales": ["P('data', None)", "P(None, 'model')"],
                             "local_codes_shape": [128, 128]}
    assert run["restored_equal"] and run["resumed_equal"]
    assert run["losses"][-1] < 0.5 * run["losses"][0]
  # Both processes see the same global state, equal to the single-process run.
  for key in ("losses", "saved_digest", "final_digest"):
    assert p0[key] == p1[key] == one[key], key
