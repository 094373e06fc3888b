"""Platforms: the one an update traced now will run on, for
``implementation="auto"`` (`default_platform`), those this process can
compile for (`installed_platforms`), and a check, when a computation is
compiled, that a kernel is compiled for a platform it runs on
(`compiled_only_for`)."""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import pkgutil

import jax
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

__all__ = ["compiled_only_for", "default_platform", "installed_platforms"]


def default_platform() -> str:
  """The platform of ``jax.default_device`` where one is set (a device or a
  platform name), else ``jax.default_backend()``: uncommitted arrays, and so
  an update traced inside ``with jax.default_device(jax.devices("cpu")[0])``
  on a GPU machine, run there. ``"gpu"`` for CUDA and ROCm devices, as
  ``jax.default_backend()`` says."""
  device = jax.config.jax_default_device
  if device is None:
    return jax.default_backend()
  if isinstance(device, str):
    device = jax.devices(device)[0]
  return device.platform


@functools.cache
def installed_platforms() -> frozenset:
  """XLA's names of the platforms this process can compile for, devices or
  not (a deviceless compile): ``"cpu"``, ``"tpu"`` where libtpu is
  installed, and ``"cuda"``/``"rocm"`` where a JAX plugin of that name is.
  Found without initializing a backend.

  Example:
    >>> from optax4bit._platform import installed_platforms
    >>> "cpu" in installed_platforms()
    True
  """
  platforms = {"cpu"}
  if importlib.util.find_spec("libtpu") is not None or os.environ.get("TPU_LIBRARY_PATH"):
    platforms.add("tpu")
  try:
    import jax_plugins  # pylint: disable=import-outside-toplevel  (a namespace package)
    plugins = [m.name for m in pkgutil.iter_modules(jax_plugins.__path__)]
  except ImportError:
    plugins = []
  plugins += [e.name for e in importlib.metadata.entry_points(group="jax_plugins")]
  platforms.update(p for p in ("cuda", "rocm") if any(p in name for name in plugins))
  return frozenset(platforms)


# The kernels are chosen when the update is traced, but the platform is known
# only when it is compiled (committed arrays, jax.export): XLA would then fail
# with its own words ("No FFI handler registered ... CUDA", "Only interpret mode
# is supported on CPU backend"), which name neither optax4bit nor the argument
# to change. An identity primitive on a kernel's operand lowers to nothing where
# the kernel runs and raises the library's error elsewhere.
_COMPILED_ONLY_FOR = Primitive("optax4bit_compiled_only_for")
_COMPILED_ONLY_FOR.def_abstract_eval(lambda x, **_: x)


def _lower(ctx, x, *, platforms, error):
  compiled_for = tuple(ctx.module_context.platforms)
  if not set(compiled_for) <= set(platforms):
    raise ValueError(error.format(platforms=", ".join(repr(p) for p in compiled_for)))
  return [x]


def _check_eager(x, *, platforms, error):
  """Outside a trace: an array's devices decide (``"gpu"`` for CUDA and ROCm
  devices) and ``x`` is returned as it is; anything else goes through the
  lowering (a jitted identity, which would copy an array)."""
  if not isinstance(x, jax.Array):
    return _compiled_identity(x, platforms=platforms, error=error)
  allowed = {"gpu" if p in ("cuda", "rocm") else p for p in platforms}
  on = {device.platform for device in x.devices()}
  if not on <= allowed:
    raise ValueError(error.format(platforms=", ".join(repr(p) for p in sorted(on))))
  return x


mlir.register_lowering(_COMPILED_ONLY_FOR, _lower)
batching.primitive_batchers[_COMPILED_ONLY_FOR] = (
    lambda args, dims, **params: (_COMPILED_ONLY_FOR.bind(*args, **params), dims[0]))
_compiled_identity = jax.jit(lambda x, **params: _COMPILED_ONLY_FOR.bind(x, **params),
                             static_argnames=("platforms", "error"))
_COMPILED_ONLY_FOR.def_impl(_check_eager)


def compiled_only_for(x: jax.Array, platforms: tuple, error: str) -> jax.Array:
  """``x`` itself, in a computation compiled for ``platforms`` (XLA's names:
  ``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``); compiled for any other, a
  `ValueError` with the message ``error``, formatted with ``platforms``: the
  ones it was compiled for.

  Example:
    >>> import jax.numpy as jnp
    >>> from optax4bit._platform import compiled_only_for
    >>> x = compiled_only_for(jnp.ones(2), ("cpu",), "needs a CPU, not {platforms}")
    >>> x.tolist()
    [1.0, 1.0]
  """
  return _COMPILED_ONLY_FOR.bind(x, platforms=tuple(platforms), error=error)
