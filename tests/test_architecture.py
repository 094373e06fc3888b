"""The layering rules of ARCHITECTURE.md, checked on the imports themselves,
and the one mechanism that orders leaves (`optax4bit._leafwise.sequential_map`).

The layer table is read from ARCHITECTURE.md, so the page and the code cannot
drift apart: every module of ``optax4bit/`` sits in exactly one layer, and
every import (lazy ones inside functions included) goes to the same layer or
a lower one, without cycles."""

from __future__ import annotations

import ast
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from optax4bit import _leafwise
from optax4bit._leaf_context import LeafContext

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "optax4bit"
BACKENDS = ("optax4bit.pallas", "optax4bit.cpu")
MAX_LINES = 600


def _module_name(path: pathlib.Path) -> str:
  parts = list(path.relative_to(ROOT).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def package_modules(package: pathlib.Path = PACKAGE) -> dict:
  """``{module name: path}`` of every Python module under ``package``."""
  return {_module_name(p): p for p in sorted(package.rglob("*.py"))}


def layer_table(text: str) -> list:
  """``[(layer, (module patterns...))]`` top to bottom, from the markdown
  table of ARCHITECTURE.md's "Layers" section: the modules column lists
  backticked names relative to ``optax4bit`` (``quant/array``), a trailing
  ``/`` for a whole package (``pallas/``), ``__init__`` for the package."""
  section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
  layers = []
  for line in section.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) < 3 or cells[0] in ("layer", "") or set(cells[0]) <= set("-: "):
      continue
    patterns = tuple(re.findall(r"`([^`]+)`", cells[1]))
    layers.append((cells[0], patterns))
  return layers


def _matches(module: str, pattern: str) -> bool:
  if pattern == "__init__":
    return module == "optax4bit"
  name = "optax4bit." + pattern.rstrip("/").replace("/", ".")
  return module == name or (pattern.endswith("/") and module.startswith(name + "."))


def layer_of(modules, layers) -> dict:
  """``{module: layer index}`` (0 the top); raises unless each module is in
  exactly one layer."""
  out = {}
  for module in modules:
    found = [i for i, (_, patterns) in enumerate(layers)
             if any(_matches(module, p) for p in patterns)]
    if len(found) != 1:
      raise AssertionError(f"{module} is in {len(found)} layers of ARCHITECTURE.md, not one: "
                           f"{[layers[i][0] for i in found]}")
    out[module] = found[0]
  return out


def _resolve(name: str, modules) -> str:
  """The module an imported dotted name belongs to (``a.b.c`` may name a
  function ``c`` of module ``a.b``)."""
  while name and name not in modules:
    name = name.rpartition(".")[0]
  return name


def imports_of(path: pathlib.Path, modules) -> tuple:
  """``(imported modules, private names)`` of one file: every ``optax4bit``
  module it imports, at any depth of its syntax tree (lazy imports included),
  and each private name it takes from another module (``from m import _x``,
  ``m._x``)."""
  tree = ast.parse(path.read_text())
  imported, private, aliases = set(), [], {}
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name.startswith("optax4bit"):
          imported.add(_resolve(alias.name, modules))
          aliases[alias.asname or alias.name.split(".")[0]] = _resolve(
              alias.name if alias.asname else alias.name.split(".")[0], modules)
    elif isinstance(node, ast.ImportFrom):
      assert node.level == 0, f"{path}: relative import"
      if not (node.module or "").startswith("optax4bit"):
        continue
      for alias in node.names:
        full = f"{node.module}.{alias.name}"
        if full in modules:  # a module
          imported.add(full)
          aliases[alias.asname or alias.name] = full
        else:
          imported.add(_resolve(node.module, modules))
          if alias.name.startswith("_") and not alias.name.startswith("__"):
            private.append(full)
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        and node.value.id in aliases and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and f"{aliases[node.value.id]}.{node.attr}" not in modules):
      private.append(f"{aliases[node.value.id]}.{node.attr}")
  return imported - {""}, private


# Module state that is set once, when the C++ library loads; nothing else in
# the package keeps state between calls or passes values beside signatures.
GLOBALS_ALLOWED = {"optax4bit.cpu.ffi": {"_library"}}


def hidden_channels(modules: dict) -> list:
  """Values passed beside the signatures: ``contextvars``, ``global``
  statements (but `GLOBALS_ALLOWED`), and ``implementation`` read anywhere
  but in `optax4bit.dispatch` (compared with a name)."""
  problems = []
  for module, path in modules.items():
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.Import, ast.ImportFrom)):
        names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
        if "contextvars" in names:
          problems.append(f"{module} imports contextvars")
      elif isinstance(node, ast.Global):
        extra = set(node.names) - GLOBALS_ALLOWED.get(module, set())
        if extra:
          problems.append(f"{module} sets the globals {sorted(extra)}")
      elif isinstance(node, ast.Compare) and module != "optax4bit.dispatch":
        operands = [node.left, *node.comparators]
        named = any(isinstance(o, ast.Name) and o.id == "implementation"
                    or isinstance(o, ast.Attribute) and o.attr == "implementation"
                    for o in operands)
        if named and any(isinstance(o, (ast.Constant, ast.Tuple)) for o in operands):
          problems.append(f"{module} interprets implementation (line {node.lineno}); "
                          "only dispatch.resolve may")
  return problems


def layering_problems(modules: dict, layers: list) -> list:
  """Every breach of the rules by ``modules`` (``{name: path}``): imports
  that climb a layer, a backend importing another, private names used
  across modules, and import cycles."""
  layer = layer_of(modules, layers)
  problems, graph = [], {}
  for module, path in modules.items():
    imported, private = imports_of(path, modules)
    graph[module] = imported - {module}
    problems += [f"{module} uses the private name {name}" for name in private
                 if _resolve(name, modules) != module]
    for target in sorted(graph[module]):
      if layer[target] < layer[module]:
        problems.append(f"{module} ({layers[layer[module]][0]}) imports {target}, a layer up "
                        f"({layers[layer[target]][0]})")
      mine = [b for b in BACKENDS if module == b or module.startswith(b + ".")]
      theirs = [b for b in BACKENDS if target == b or target.startswith(b + ".")]
      if mine and theirs and mine != theirs:
        problems.append(f"{module} imports another backend: {target}")
  problems += [f"import cycle: {' -> '.join(c)}" for c in _cycles(graph)]
  return problems


def _cycles(graph: dict) -> list:
  """One cycle through each strongly connected part of ``graph`` that has
  several modules (depth-first search)."""
  cycles, state, stack = [], {}, []

  def visit(node):
    state[node] = "open"
    stack.append(node)
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == "open":
        cycles.append(stack[stack.index(nxt):] + [nxt])
      elif nxt not in state:
        visit(nxt)
    stack.pop()
    state[node] = "done"

  for node in sorted(graph):
    if node not in state:
      visit(node)
  return cycles


@pytest.fixture(scope="module")
def layers():
  return layer_table((ROOT / "ARCHITECTURE.md").read_text())


def test_every_module_is_in_exactly_one_layer(layers):
  modules = package_modules()
  assert len(modules) > 40 and len(layers) >= 8
  assert set(layer_of(modules, layers)) == set(modules)
  # Every pattern of the table names a module that exists.
  for name, patterns in layers:
    for pattern in patterns:
      assert any(_matches(m, pattern) for m in modules), (name, pattern)


def test_imports_go_down_without_cycles_or_private_names(layers):
  assert layering_problems(package_modules(), layers) == []


def test_no_hidden_channels_and_one_place_reads_implementation():
  assert hidden_channels(package_modules()) == []


def test_the_public_api_is_the_top_layer_and_nothing_below_imports_it(layers):
  top = layers[0][1]
  for public in ("__init__", "alias", "transform", "wrappers", "sharding", "recipes"):
    assert public in top
  assert not [p for _, patterns in layers[1:] for p in patterns
              if not p.startswith("_")
              and p not in ("dispatch", "pallas/", "cpu/", "xla/", "tpu/", "quant/")]


def test_the_checks_catch_a_bad_import(layers, tmp_path):
  """The rules fail on a copy of the package with one climbing import, one
  cycle, one private name, one global and one reading of ``implementation``
  each added."""
  modules = package_modules()
  bad = dict(modules)

  def with_line(module, line):
    path = tmp_path / (module.replace(".", "_") + ".py")
    path.write_text(modules[module].read_text() + "\n\ndef _added():\n  " + line + "\n")
    bad[module] = path

  with_line("optax4bit._leafwise", "from optax4bit import transform")
  with_line("optax4bit._order", "import optax4bit._leafwise")
  with_line("optax4bit.cpu.codec", "return ffi._load()")
  with_line("optax4bit._codecs", "global _native_codecs")
  with_line("optax4bit.transform", "return implementation == 'auto'")
  problems = "\n".join(layering_problems(bad, layers) + hidden_channels(bad))
  assert "optax4bit._leafwise (engine) imports optax4bit.transform" in problems
  assert "import cycle" in problems and "optax4bit._order" in problems
  assert "optax4bit.cpu.codec uses the private name optax4bit.cpu.ffi._load" in problems
  assert "optax4bit._codecs sets the globals ['_native_codecs']" in problems
  assert "optax4bit.transform interprets implementation" in problems


def test_no_module_is_longer_than_600_lines():
  sources = [p for p in PACKAGE.rglob("*") if p.suffix in (".py", ".cc", ".h")]
  assert len(sources) > 20
  long = {str(p.relative_to(PACKAGE)): n for p in sources
          if (n := len(p.read_text().splitlines())) > MAX_LINES}
  assert not long, long


def test_after_previous_leaf_is_bit_exact_and_waits_for_the_previous_leaf():
  values = np.array([0.0, -0.0, 1.5, -2.0, np.inf, -np.inf, np.nan, 3e38], np.float32)

  def step(context, x, codes):
    tied = _leafwise.after_previous_leaf({"x": x, "codes": codes}, context)
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
  assert _leafwise.after_previous_leaf({"x": values}, LeafContext())["x"] is values
