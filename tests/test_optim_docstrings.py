"""The examples in the docstrings run and print what they claim."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import optax4bit.quant

MODULES = ["optax4bit", "optax4bit.alias", "optax4bit.dispatch", "optax4bit.transform",
           "optax4bit.wrappers", "optax4bit.presets", "optax4bit.tpu", "optax4bit.xla.steps"] + sorted(
    f"optax4bit.quant.{m.name}" for m in pkgutil.iter_modules(optax4bit.quant.__path__))


@pytest.mark.parametrize("module_name", MODULES)
def test_docstring_examples(module_name):
  module = importlib.import_module(module_name)
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
                           verbose=False, report=True)
  assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed"


def test_the_public_modules_have_examples():
  finder = doctest.DocTestFinder()
  for name in ("optax4bit.alias", "optax4bit.transform"):
    examples = sum(len(t.examples) for t in finder.find(importlib.import_module(name)))
    assert examples > 10, name
