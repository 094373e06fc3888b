"""Shared test helpers: independent references for the quantizer tests.

Everything here is written from the published tables and definitions (the paper,
bitsandbytes, QLoRA), not from the library: the
literal 4-bit tables, a float64 re-construction of the dynamic-exponent maps,
a brute-force nearest-entry encoder, a numpy nibble unpacker and numpy scales.
The quantizer tests compare the library against these.

Import them in a test module with ``from conftest import ...`` (pytest puts the
tests directory on ``sys.path``).
"""

from __future__ import annotations

import contextlib
import textwrap
import sys
import subprocess
import os
import json
import functools
import math

import numpy as np
import pytest

# --- The exact 4-bit tables (float32), copied literally. --------------------

SPEC_DE_SIGNED_4BIT = (
    -0.8875, -0.6625, -0.4375, -0.2125, -0.0775, -0.0325, -0.0055,
    0.0, 0.0055, 0.0325, 0.0775, 0.2125, 0.4375, 0.6625, 0.8875, 1.0)
SPEC_DE_UNSIGNED_4BIT = (
    0.0, 0.00325, 0.00775, 0.02125, 0.04375, 0.06625, 0.08875, 0.15625, 0.26875,
    0.38125, 0.49375, 0.60625, 0.71875, 0.83125, 0.94375, 1.0)
# "the DE unsigned table with entry 0 replaced by 0.00325"
SPEC_DE0_4BIT = (0.00325,) + SPEC_DE_UNSIGNED_4BIT[1:]
# "(i + 1) / 16 for i = 0..15"
SPEC_LINEAR_4BIT = tuple((i + 1) / 16 for i in range(16))

SPEC_TABLES_4BIT = {
    ("DE", True): SPEC_DE_SIGNED_4BIT,
    ("DE", False): SPEC_DE_UNSIGNED_4BIT,
    ("DE-0", False): SPEC_DE0_4BIT,
    ("Linear", False): SPEC_LINEAR_4BIT,
}

# Every (mapping, signed) pair that exists; each comes in 4 and 8 bits.
TABLE_KINDS = (("DE", True), ("DE", False), ("DE-0", False), ("Linear", False))
ALL_TABLES = tuple((m, b, s) for b in (4, 8) for (m, s) in TABLE_KINDS)

# Presets of the issue: (spec name, bits). Unsigned ones quantize |x|.
PRESETS = (
    ("B128/DE", 4),
    ("B2048/DE", 4),
    ("B128/DE-0", 4),
    ("Rank-1/DE-0", 4),
    ("Rank-1/Linear", 4),
    ("Tensor/Linear", 4),
    ("B256/DE", 8),
)


def de_reference(bits: int, signed: bool) -> np.ndarray:
  """The bitsandbytes dynamic map, re-built from SPEC.md's recipe in float64.

  E = N = bits - 1; for i = 0..E-1 the midpoints of linspace(0.1, 1, 2^(i+N-E)+1)
  (2^(i+N-E+1)+1 points unsigned), scaled by 10^(i-(E-1)), mirrored if signed;
  plus 0 and 1; sorted.
  """
  e = n = bits - 1
  values = [0.0, 1.0]
  for i in range(e):
    points = 2 ** (i + n - e + (0 if signed else 1)) + 1
    edges = np.linspace(0.1, 1.0, points)
    mids = (edges[:-1] + edges[1:]) / 2 * 10.0 ** (i - (e - 1))
    values += list(mids)
    if signed:
      values += list(-mids)
  return np.sort(np.array(values, dtype=np.float64))


@functools.lru_cache(maxsize=None)
def reference_table(mapping: str, bits: int, signed: bool) -> np.ndarray:
  """Reference table as float32 (4-bit: SPEC literals; 8-bit: the recipe)."""
  if bits == 4:
    table = np.array(SPEC_TABLES_4BIT[(mapping, signed)], dtype=np.float32)
  elif mapping == "Linear":
    table = ((np.arange(2**bits) + 1) / 2**bits).astype(np.float32)
  else:
    table = de_reference(bits, signed).astype(np.float32)
    if mapping == "DE-0":
      table[0] = table[1]
  table.setflags(write=False)
  return table


def has_duplicates(table: np.ndarray) -> bool:
  return bool(np.any(table[1:] == table[:-1]))


def argmin_codes(n, table) -> np.ndarray:
  """Brute-force nearest entry in float64, ties to the LOWER index.

  Values beyond the ends clamp to them (clipping first is equivalent to the
  argmin and also handles +-inf). NaN is not handled.
  """
  t = np.asarray(table, dtype=np.float64)
  n = np.clip(np.asarray(n, dtype=np.float64), t[0], t[-1])
  return np.argmin(np.abs(n[..., None] - t), axis=-1)  # first minimum = lower index


def near_midpoint(n64, table, ulps: float = 4.0) -> np.ndarray:
  """Whether float64 ``n64`` lies within ``ulps`` float32 ulps of a midpoint
  between neighbouring entries (where a float32 rounding of ``x / scale`` may
  legitimately change the nearest entry)."""
  t = np.asarray(table, dtype=np.float64)
  mids = (t[:-1] + t[1:]) / 2
  n64 = np.asarray(n64, dtype=np.float64)
  dist = np.min(np.abs(n64[..., None] - mids), axis=-1)
  ulp = np.spacing(np.abs(n64).astype(np.float32)).astype(np.float64)
  return dist <= ulps * np.maximum(ulp, np.spacing(np.float32(1e-30)))


def unpack_nibbles(packed, length: int) -> np.ndarray:
  """numpy unpacking: element 2k in the low nibble, 2k+1 in the high nibble."""
  packed = np.asarray(packed, dtype=np.uint8)
  out = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],), np.uint8)
  out[..., 0::2] = packed & 0x0F
  out[..., 1::2] = packed >> 4
  return out[..., :length]


def finite_abs64(x) -> np.ndarray:
  x = np.asarray(x, dtype=np.float64)
  return np.where(np.isfinite(x), np.abs(x), 0.0)


def reference_scale(x, norm: str, block: int = 128) -> np.ndarray:
  """Per-element scale (broadcast to x.shape), float64, from SPEC.md 2.

  ``norm``: "tensor", "rank1" (falls back to B128 for 1-D) or "block". Blocks
  run along the last axis; when the last axis d satisfies 2 d <= B (and ndim >=
  2) a block is B // d consecutive whole rows of axis -2 (the documented
  short-last-axis layout). Maxima over finite values only.
  """
  a = finite_abs64(x)
  if norm == "rank1" and a.ndim < 2:
    norm, block = "block", 128
  if norm == "tensor":
    return np.broadcast_to(a.max(), a.shape)
  if norm == "rank1":
    scale = np.full(a.shape, np.inf)
    for axis in range(a.ndim):
      others = tuple(k for k in range(a.ndim) if k != axis)
      scale = np.minimum(scale, a.max(axis=others, keepdims=True))
    return scale
  out = np.empty_like(a)
  d = a.shape[-1]
  if a.ndim >= 2 and 2 * d <= block:
    g = block // d
    r = a.shape[-2]
    for start in range(0, r, g):
      m = a[..., start:start + g, :].max(axis=(-2, -1), keepdims=True)
      out[..., start:start + g, :] = m
    return out
  for start in range(0, d, block):
    out[..., start:start + block] = a[..., start:start + block].max(axis=-1, keepdims=True)
  return out


def reference_scale_shape(shape, norm: str, block: int = 128) -> tuple:
  """Expected shape of the (single) block/tensor scale array."""
  if norm == "rank1" and len(shape) < 2:
    norm, block = "block", 128
  if norm == "tensor":
    return (1,) * len(shape)
  d = shape[-1]
  if len(shape) >= 2 and 2 * d <= block:
    return tuple(shape[:-2]) + (math.ceil(shape[-2] / (block // d)), 1)
  return tuple(shape[:-1]) + (math.ceil(d / block),)


def parse_norm(name: str):
  """("block", 128) / ("rank1", 0) / ("tensor", 0) from a preset name."""
  norm = name.split("/")[0]
  if norm == "Tensor":
    return "tensor", 0
  if norm == "Rank-1":
    return "rank1", 0
  return "block", int(norm[1:])


def worst_case_error_fraction(table, signed: bool) -> float:
  """Largest distance (as a fraction of the scale) from a normalized value in
  the domain ([-1, 1] signed, [0, 1] unsigned) to its nearest table entry:
  half the largest gap between neighbours, or the uncovered stretch at an end
  of the domain, whichever is larger."""
  t = np.asarray(table, dtype=np.float64)
  lo = -1.0 if signed else 0.0
  return max(np.max(np.diff(t)) / 2, t[0] - lo, 1.0 - t[-1])


def train_nnx_beside_functional(tx, steps: int, param_dtype=None):
  """Trains a small ``flax.nnx`` MLP with ``nnx.Optimizer(model, tx)`` and, step
  by step, the same parameters with a plain jitted optax loop fed the same
  gradients (the reference). ``param_dtype`` (e.g. bfloat16) is that of the
  params and of the layers' math; the loss is float32.

  Returns ``(losses, optimizer, reference_params, reference_state,
  model_params)``, the params as pure pytrees.
  """
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx

  dtype = param_dtype or jnp.float32

  class MLP(nnx.Module):

    def __init__(self, rngs):
      self.l1 = nnx.Linear(64, 128, param_dtype=dtype, dtype=dtype, rngs=rngs)
      self.l2 = nnx.Linear(128, 10, param_dtype=dtype, dtype=dtype, rngs=rngs)

    def __call__(self, x):
      return self.l2(nnx.relu(self.l1(x)))

  x = jax.random.normal(jax.random.key(1), (16, 64), dtype)
  y = jax.random.randint(jax.random.key(2), (16,), 0, 10)

  def loss_fn(model):
    return optax.softmax_cross_entropy_with_integer_labels(
        model(x).astype(jnp.float32), y).mean()

  model = MLP(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  state = tx.init(params)

  @nnx.jit
  def train_step(model, optimizer):
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss, grads

  @jax.jit
  def functional_step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  losses = []
  for _ in range(steps):
    loss, grads = train_step(model, optimizer)
    losses.append(float(loss))
    params, state = functional_step(params, state, nnx.as_pure(nnx.state(grads, nnx.Param)))
  return losses, optimizer, params, state, nnx.as_pure(nnx.state(model, nnx.Param))


def training_step(tx):
  """A training step's update: ``(params, state, grads) -> (params, state)``."""
  import optax  # pylint: disable=import-outside-toplevel

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def assert_trees_bitwise(a, b):
  """Same tree structure, and every leaf the same bits, dtype and shape."""
  import jax  # pylint: disable=import-outside-toplevel
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), strict=True)


@contextlib.contextmanager
def on_the_cpu():
  """The CPU as the default device: the C++ kernel steps CPU arrays, and on a
  GPU machine the tests' uncommitted arrays then go to its CPU."""
  import jax  # pylint: disable=import-outside-toplevel
  with jax.default_device(jax.devices("cpu")[0]):
    yield


@functools.cache
def benchmark_script(name: str):
  """benchmarks/<name>.py, loaded once (it is a script, not a package)."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  import pathlib  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
  spec = importlib.util.spec_from_file_location(f"optax4bit_{name}", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up
  spec.loader.exec_module(module)
  return module


def gpu_compile():
  """benchmarks/gpu_compile.py, loaded once."""
  return benchmark_script("gpu_compile")


def export_cuda(fn, *args):
  """``jax.jit(fn)`` exported for CUDA through Pallas' Triton backend, on any
  machine (for an abstract H100: `gpu_compile().cuda_target`)."""
  import jax  # pylint: disable=import-outside-toplevel
  with gpu_compile().cuda_target():
    return jax.export.export(
        jax.jit(fn), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(*args)


@pytest.fixture
def cpu_default_device():
  """`on_the_cpu` for a whole test."""
  with on_the_cpu():
    yield


# Each optimizer's update on a tree sharded on a 2 x 2 mesh (explicit axes) of 4 CPU
# devices against the unsharded jnp engine's, in a subprocess (the device count is set
# before JAX starts); IMPLEMENTATION is filled in by `sharded_against_unsharded_jnp`.
_SHARDED_AGAINST_JNP = textwrap.dedent("""
    import json, os
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + \\
        " --xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp, numpy as np, optax4bit
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    specs = {"w": P("data", "model"), "v": P("model"), "c": P(None, "data", "model")}
    shapes = {"w": (512, 1024), "v": (8192,), "c": (2, 256, 512)}
    params = {k: jax.random.normal(jax.random.key(i), s) * 0.1
              for i, (k, s) in enumerate(sorted(shapes.items()))}
    out = {}
    for name, make in [("adamw_4bit", lambda i: optax4bit.adamw_4bit(1e-2, implementation=i)),
                       ("factor", lambda i: optax4bit.adamw_4bit_factor(1e-2, implementation=i)),
                       ("sgdm_4bit", lambda i: optax4bit.sgdm_4bit(1e-2, implementation=i))]:
      results = []
      for impl, sharded in (("jnp", False), (IMPLEMENTATION, True)):
        tx = make(impl)
        p = params
        if sharded:
          p = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
        state = tx.init(p)
        grads = jax.tree.map(lambda x: jnp.sin(7.0 * x), p)
        updates, state = jax.jit(tx.update)(grads, state, p)
        results.append((updates, state))
      (u0, s0), (u1, s1) = results
      codes = [bool(np.array_equal(a, b)) for a, b in zip(jax.tree.leaves(s0), jax.tree.leaves(s1))
               if a.dtype == np.uint8]
      err = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                for a, b in zip(jax.tree.leaves(u0), jax.tree.leaves(u1)))
      out[name] = {"codes_equal": all(codes), "codes": len(codes), "update_err": err}
    print(json.dumps(out))
""")


def sharded_against_unsharded_jnp(implementation: str) -> dict:
  """Per optimizer: whether its codes equal the unsharded jnp engine's
  (``codes_equal``, over ``codes`` packed arrays) and the largest update
  difference (``update_err``), for ``implementation`` on a sharded tree."""
  script = _SHARDED_AGAINST_JNP.replace("IMPLEMENTATION", repr(implementation))
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=900, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])
