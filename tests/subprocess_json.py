"""Runs a check script in a fresh Python process and returns its JSON result.

The multi-device tests need 8 virtual CPU devices
(``--xla_force_host_platform_device_count=8``), which must be set before JAX
starts; a separate process keeps the rest of the suite on one device. A
script prints one line ``RESULTS <json>``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


def child_env(**extra) -> dict:
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # the scripts set their own device count
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
  env.update(extra)
  return env


def run_json(script: str, *args: str, timeout: float = 600) -> dict:
  """``RESULTS`` of ``python script *args``; fails with the output otherwise."""
  proc = subprocess.run([sys.executable, script, *args], capture_output=True, text=True,
                        timeout=timeout, env=child_env(), cwd=ROOT, check=False)
  for line in proc.stdout.splitlines():
    if line.startswith("RESULTS "):
      return json.loads(line[len("RESULTS "):])
  raise AssertionError(f"{script} {' '.join(args)} exited with {proc.returncode} and no "
                       f"RESULTS line.\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n"
                       f"{proc.stderr[-8000:]}")
