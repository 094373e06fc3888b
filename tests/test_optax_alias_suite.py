"""optax's own alias test suite (``optax/_src/alias_test.py``, shipped in its
wheel) with every optimizer wrapped by `optax4bit.quantize_state`: a
conformance suite for something that claims to be an optax optimizer.

* `WrappedAliasTest` (slow): all of ``AliasTest`` with every state leaf
  quantized (``min_quantize_size=0``); ``test_optimization`` alone runs
  10,000 steps per configuration.
* `WrappedAliasOptimizationTest` (slow): ``test_optimization`` with the
  default ``min_quantize_size``.
* `WrappedAliasQuickTest`, in the default run: the tests of `QUICK` for every
  configuration, ``min_quantize_size=0``.
"""

from __future__ import annotations

import functools
from unittest import mock

import pytest

import optax4bit

alias_test = pytest.importorskip("optax._src.alias_test")


def _wrapped_get_opt(original, wrapper_kwargs, test_case, opt_name: str):
  factory = original(test_case, opt_name)

  @functools.wraps(factory)
  def wrapped(*args, **kwargs):
    return optax4bit.quantize_state(factory(*args, **kwargs), **wrapper_kwargs)

  return wrapped


class _Wrapped(alias_test.AliasTest):
  wrapper_kwargs = {"min_quantize_size": 0}

  def setUp(self):
    super().setUp()
    patcher = mock.patch.object(alias_test, "_get_opt", functools.partial(
        _wrapped_get_opt, alias_test._get_opt, self.wrapper_kwargs))
    patcher.start()
    self.addCleanup(patcher.stop)


def _keep_only(cls, prefixes: tuple):
  for name in dir(cls):
    if name.startswith("test") and not name.startswith(prefixes):
      setattr(cls, name, None)  # not a test of this class


@pytest.mark.slow
class WrappedAliasTest(_Wrapped):
  """All of optax's AliasTest, wrapped."""


@pytest.mark.slow
class WrappedAliasOptimizationTest(_Wrapped):
  """optax's convergence test, wrapped with the default min_quantize_size."""
  wrapper_kwargs = {}


class WrappedAliasQuickTest(_Wrapped):
  """A subset of optax's AliasTest, wrapped."""


QUICK = ("test_optimizers_accept_extra_args",
         "test_optimizers_can_be_wrapped_in_inject_hyperparams")
_keep_only(WrappedAliasOptimizationTest, ("test_optimization",))
_keep_only(WrappedAliasQuickTest, QUICK)
del _Wrapped
