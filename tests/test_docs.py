"""The documentation site (docs/): its pages' examples run, and its API reference
names every public symbol.

The examples run in one fresh process with 8 virtual CPU devices
(tests/docs_doctests.py); the site itself is built by ``.ci/run``
(``sphinx-build -W``), not here.
"""

from __future__ import annotations

import os
import re

import docs_doctests
import optax4bit
from subprocess_json import ROOT, TESTS, run_json

PAGES = [p.relative_to(docs_doctests.DOCS).as_posix() for p in docs_doctests.pages()]
# Pages whose subject is code: each must show examples that run.
WITH_EXAMPLES = ("index.md", "getting_started.md", "quantize_state.md", "sharding.md",
                 "offload.md", "checkpoints.md", "diagnostics.md", "kernels.md",
                 "optimizers/adam.md", "optimizers/factor.md", "optimizers/adam_8bit.md",
                 "optimizers/sgdm.md", "optimizers/lion.md", "optimizers/ademamix.md",
                 "optimizers/muon.md")


def test_every_page_runs_its_examples():
  """One process for every page (a fixture shared by several tests would run once per
  xdist worker)."""
  results = run_json(os.path.join(TESTS, "docs_doctests.py"))
  assert sorted(results) == PAGES
  failed = {page: r for page, r in results.items() if r["failed"]}
  assert not failed, "\n".join(f"docs/{page}: {r['failed']} of {r['attempted']} examples "
                                f"failed\n{r['report']}" for page, r in failed.items())
  without = [page for page in WITH_EXAMPLES if results.get(page, {}).get("attempted", 0) < 2]
  assert not without, f"pages missing or without runnable examples: {without}"


def test_api_reference_lists_every_public_name():
  with open(os.path.join(ROOT, "docs", "api.md"), encoding="utf-8") as f:
    text = f.read()
  listed = set(re.findall(r"^ {3}(\w+)$", text, re.M)) | set(
      re.findall(r"^\.\. data:: (\w+)", text, re.M))
  missing = set(optax4bit.__all__) - listed
  assert not missing, f"docs/api.md does not list {sorted(missing)}"
