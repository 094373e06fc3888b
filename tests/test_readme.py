"""The README: short, its commands the ones CI runs, its example running; and
benchmarks/RESULTS.md a short summary that links the dated log.

``.ci/run`` runs the README's test command (its install line and its pytest line, word for
word); the main job's command installs a subset of those extras and runs a script that
exists. The README's Python example runs as written.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex

from subprocess_json import ROOT

with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as _f:
  README = _f.read()
with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as _f:
  CI_RUN = _f.read()

FRESH_MACHINE = "python3 -m venv .venv && . .venv/bin/activate && "


def _blocks(language: str) -> list:
  return re.findall(rf"^```{language}\n(.*?)^```", README, re.S | re.M)


def _fresh_machine_commands() -> list:
  """The bash blocks that start from a fresh venv: (install words, run words) each."""
  out = []
  for block in _blocks("bash"):
    if block.startswith(FRESH_MACHINE):
      install, run = block[len(FRESH_MACHINE):].strip().split(" && ")
      out.append((shlex.split(install), shlex.split(run)))
  return out


def _extras(install_words: list) -> set:
  (target,) = [w for w in install_words if w.startswith(".[")]
  return set(target[2:-1].split(","))


def test_readme_is_short():
  assert README.count("\n") <= 200


def test_plain_install_line():
  assert any(block.strip() == "python -m pip install ." for block in _blocks("bash"))


def test_the_two_fresh_machine_commands_are_what_ci_runs():
  (main_install, main_run), (test_install, test_run) = _fresh_machine_commands()
  assert main_run == ["python", "examples/compare.py"]  # the main job comes first
  assert os.path.exists(os.path.join(ROOT, "examples", "compare.py"))
  # .ci/run's python commands, without its optional ${CI_EXTRA_REQUIREMENTS:-}.
  ci_lines = [shlex.split(re.sub(r"\$\{\w+:-\}", "", line)) for line in CI_RUN.splitlines()
              if line.startswith("python -m ")]
  assert test_install in ci_lines, f"{shlex.join(test_install)} is not in .ci/run"
  assert test_run in ci_lines, f"{shlex.join(test_run)} is not in .ci/run"
  assert _extras(main_install) <= _extras(test_install)


def test_readme_example_runs():
  (example,) = _blocks("python")
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    exec(compile(example, "README.md", "exec"), {})  # pylint: disable=exec-used
  megabytes = float(out.getvalue().split()[0])
  assert 1.0 < megabytes < 1.2, out.getvalue()  # 8.4 MB in float32


def test_results_opens_with_a_short_summary_linking_the_log():
  with open(os.path.join(ROOT, "benchmarks", "RESULTS.md"), encoding="utf-8") as f:
    results = f.read()
  assert results.count("\n") <= 150
  for link in re.findall(r"\]\((history/[^)]*)\)", results):
    assert os.path.exists(os.path.join(ROOT, "benchmarks", link)), link
  assert "](history/log-to-2026-11.md)" in results
