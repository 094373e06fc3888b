"""The documentation site (docs/): its pages' examples run, and its API reference
names every public symbol.

The examples run in one fresh process with 8 virtual CPU devices
(tests/docs_doctests.py); the site itself is built by ``.ci/run``
(``sphinx-build -W``), not here.
"""

from __future__ import annotations

import os
import re

import pytest

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


@pytest.fixture(scope="module")
def results():
  return run_json(os.path.join(TESTS, "docs_doctests.py"))


@pytest.mark.parametrize("page", PAGES)
def test_page_examples_pass(results, page):
  result = results[page]
  assert result["failed"] == 0, f"{page}: {result['failed']} of {result['attempted']} " \
                                f"examples failed\n{result['report']}"


@pytest.mark.parametrize("page", WITH_EXAMPLES)
def test_page_has_examples(results, page):
  assert page in results, f"docs/{page} is missing"
  assert results[page]["attempted"] >= 2, f"docs/{page} shows no runnable example"


def test_api_reference_lists_every_public_name():
  with open(os.path.join(ROOT, "docs", "api.md"), encoding="utf-8") as f:
    text = f.read()
  listed = set(re.findall(r"^ {3}(\w+)$", text, re.M)) | set(
      re.findall(r"^\.\. data:: (\w+)", text, re.M))
  missing = set(optax4bit.__all__) - listed
  assert not missing, f"docs/api.md does not list {sorted(missing)}"
