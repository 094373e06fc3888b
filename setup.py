"""Builds the optional XLA CPU kernel (``optax4bit.cpu``); metadata is in pyproject.toml.

The kernel is C++ against the XLA FFI headers that ship with jaxlib. Where it
cannot be built (no C++17 compiler, an unsupported platform) the build goes
on without it and optax4bit runs its jnp implementation on CPU.
"""

import glob
import importlib.metadata
import importlib.util
import os
import sys

import setuptools
from setuptools.command.build_ext import build_ext


class BuildWithXlaHeaders(build_ext):
  """Adds jaxlib's XLA FFI include directory and the jaxlib version."""

  def build_extensions(self):
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
      raise RuntimeError("building optax4bit's CPU kernel needs jaxlib (a build requirement).")
    include = os.path.join(spec.submodule_search_locations[0], "include")
    version = importlib.metadata.version("jaxlib")
    for ext in self.extensions:
      if sys.platform == "win32":
        ext.include_dirs.append(include)
      else:
        # A system include: its own warnings (about 100 under GCC and Clang) are jaxlib's.
        ext.extra_compile_args += ["-isystem", include]
      ext.define_macros.append(("OPTAX4BIT_JAXLIB_VERSION", f'"{version}"'))
    super().build_extensions()


# Exact float32 semantics (the kernel must equal the jnp reference): no
# contraction into fused multiply-adds; errno/trap freedom lets loops vectorize.
# -Wno-psabi: the ABI notes on passing wide vectors concern calls across
# objects; the row kernels are internal to this one (Clang gave 369 of them).
_FLAGS = ([] if sys.platform == "win32" else
          ["-std=c++17", "-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math",
           "-Wno-psabi"])
# Python's own CFLAGS carry -g: unstripped, the library is 2.7 MB instead of 0.24 MB (Linux).
_LINK_FLAGS = ["-s"] if sys.platform.startswith("linux") else []

setuptools.setup(
    ext_modules=[
        setuptools.Extension(
            "optax4bit.cpu._kernels",
            sources=["optax4bit/cpu/kernels.cc"],
            depends=sorted(glob.glob("optax4bit/cpu/*.h")),
            language="c++",
            extra_compile_args=_FLAGS,
            extra_link_args=_LINK_FLAGS,
            optional=True,
        )
    ],
    cmdclass={"build_ext": BuildWithXlaHeaders},
)
