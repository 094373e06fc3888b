"""Runs the examples of the documentation pages (docs/**/*.md) as doctests.

Every ``>>>`` line of a page is an example (doctest's file format; the pages show them
in ``pycon`` code blocks), run in order in one namespace per page, with ELLIPSIS and
NORMALIZE_WHITESPACE, from a temporary working directory (the checkpoint pages write
there), on 8 virtual CPU devices (the sharding pages build meshes). Prints one line
``RESULTS <json>``: per page (its path under docs/), the examples attempted, failed, and
doctest's report of the failures.
"""

from __future__ import annotations

import contextlib
import doctest
import io
import json
import os
import pathlib
import sys
import tempfile

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def pages() -> list:
  """The hand-written pages (not the build's output or autosummary's stubs)."""
  return sorted(p for p in DOCS.rglob("*.md")
                if not {"_build", "_autosummary"} & set(p.relative_to(DOCS).parts))


def run_page(path: pathlib.Path) -> dict:
  # A code fence right after an example would read as its expected output: fences become
  # blank lines (line numbers kept).
  text = "\n".join("" if line.lstrip().startswith(("```", ":::")) else line
                   for line in path.read_text(encoding="utf-8").splitlines())
  test = doctest.DocTestParser().get_doctest(text, {}, path.name, str(path), 0)
  runner = doctest.DocTestRunner(optionflags=FLAGS)
  report = io.StringIO()
  with contextlib.redirect_stdout(report):
    failed, attempted = runner.run(test, out=report.write)
  return {"attempted": attempted, "failed": failed, "report": report.getvalue()[-6000:]}


def main(argv) -> None:
  # Before the first page imports JAX (tests/test_docs.py imports this module for
  # pages() only, and must keep its own process on one device).
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")
  selected = [p for p in pages() if not argv or p.relative_to(DOCS).as_posix() in argv]
  results = {}
  with tempfile.TemporaryDirectory() as tmp:
    cwd = os.getcwd()
    os.chdir(tmp)
    try:
      for path in selected:
        results[path.relative_to(DOCS).as_posix()] = run_page(path)
    finally:
      os.chdir(cwd)
  print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
  main(sys.argv[1:])
