"""optax's own alias test suite (``optax/_src/alias_test.py``, shipped in its
wheel) with every optimizer wrapped as ``quantize_state(opt,
min_quantize_size=0)``: a conformance suite for something that claims to be
an optax optimizer.

`WrappedAliasTest` runs all of ``AliasTest`` (slow: ``test_optimization``
alone runs 10,000 steps per configuration); `WrappedAliasQuickTest`, in the
default run, the tests of `QUICK` for every configuration.
"""

from __future__ import annotations

import functools
from unittest import mock

import pytest

import optax4bit

alias_test = pytest.importorskip("optax._src.alias_test")


def _wrapped_get_opt(original, test_case, opt_name: str):
  factory = original(test_case, opt_name)

  @functools.wraps(factory)
  def wrapped(*args, **kwargs):
    return optax4bit.quantize_state(factory(*args, **kwargs), min_quantize_size=0)

  return wrapped


class _Wrapped(alias_test.AliasTest):

  def setUp(self):
    super().setUp()
    patcher = mock.patch.object(
        alias_test, "_get_opt", functools.partial(_wrapped_get_opt, alias_test._get_opt))
    patcher.start()
    self.addCleanup(patcher.stop)


@pytest.mark.slow
class WrappedAliasTest(_Wrapped):
  """All of optax's AliasTest, wrapped."""


class WrappedAliasQuickTest(_Wrapped):
  """A subset of optax's AliasTest, wrapped."""


QUICK = ("test_optimizers_accept_extra_args",
         "test_optimizers_can_be_wrapped_in_inject_hyperparams")
for _name in dir(WrappedAliasQuickTest):
  if _name.startswith("test") and not _name.startswith(QUICK):
    setattr(WrappedAliasQuickTest, _name, None)  # not a test in the quick run

del _Wrapped
