"""The layering rules of ARCHITECTURE.md, and the one mechanism that orders
leaves (`optax4bit._leafwise.sequential_map`)."""

from __future__ import annotations

import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from optax4bit import _leafwise

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "optax4bit"
BACKENDS = ("pallas", "cpu")
MAX_LINES = 600


def _imported_modules(path: pathlib.Path) -> set:
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      names.add(node.module)
      names.update(f"{node.module}.{alias.name}" for alias in node.names)
  return names


def test_no_module_is_longer_than_600_lines():
  sources = [p for p in PACKAGE.rglob("*") if p.suffix in (".py", ".cc", ".h")]
  assert len(sources) > 20
  long = {str(p.relative_to(PACKAGE)): n for p in sources
          if (n := len(p.read_text().splitlines())) > MAX_LINES}
  assert not long, long


def test_no_backend_imports_another():
  for backend in BACKENDS:
    others = [f"optax4bit.{b}" for b in BACKENDS if b != backend] + ["optax4bit.dispatch"]
    files = list((PACKAGE / backend).glob("*.py"))
    assert files
    for path in files:
      bad = sorted(m for m in _imported_modules(path)
                   if any(m == o or m.startswith(o + ".") for o in others))
      assert not bad, (str(path.relative_to(PACKAGE)), bad)


def test_lower_layers_do_not_import_the_public_api():
  public = ("optax4bit.alias", "optax4bit.transform", "optax4bit.wrappers",
            "optax4bit.diagnostics", "optax4bit.checkpoint")
  lower = [PACKAGE / "_leafwise.py", PACKAGE / "_steps.py", PACKAGE / "_validation.py",
           *(PACKAGE / "quant").glob("*.py")]
  for path in lower:
    bad = sorted(m for m in _imported_modules(path) if m in public)
    assert not bad, (path.name, bad)


def test_after_previous_leaf_is_bit_exact_and_waits_for_the_previous_leaf():
  values = np.array([0.0, -0.0, 1.5, -2.0, np.inf, -np.inf, np.nan, 3e38], np.float32)

  def step(x, codes):
    tied = _leafwise.after_previous_leaf({"x": x, "codes": codes})
    return tied["x"] * 1.0, (tied["codes"],)

  def two_leaves(x, codes):
    return _leafwise.sequential_map(step, [x, x], [codes, codes])

  codes = jnp.arange(8, dtype=jnp.uint8)
  (u0, _), (u1, (c1,)) = jax.jit(two_leaves)(jnp.asarray(values), codes)
  for u in (u0, u1):
    np.testing.assert_array_equal(np.asarray(u).view(np.uint32), values.view(np.uint32))
  np.testing.assert_array_equal(c1, codes)  # integer leaves pass through untouched
  # The second leaf's input depends on the first leaf's stored codes.
  jaxpr = str(jax.make_jaxpr(two_leaves)(jnp.asarray(values), codes))
  assert "shift_right_logical" in jaxpr and jaxpr.count("sub") >= 1
  # Outside jit there is nothing to order: inputs come back as they are.
  assert _leafwise.after_previous_leaf({"x": values})["x"] is values
