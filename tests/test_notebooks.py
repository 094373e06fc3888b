"""The notebooks in notebooks/: clean nbformat v4 files that run top to bottom.

They are executed with nbclient in a fresh kernel with ``OPTAX4BIT_NB_SMALL=1``
(tiny sizes), all three in the default test run (about 30 s for the two besides the
quickstart on the 2-core CI machine).
"""

from __future__ import annotations

import pathlib
import re

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
NAMES = ("quickstart.ipynb", "memory_and_speed.ipynb", "diagnostics.ipynb")


def _read(name):
  return nbformat.read(NOTEBOOKS / name, as_version=nbformat.NO_CONVERT)


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_clean_nbformat_v4(name):
  nb = _read(name)
  nbformat.validate(nb)
  assert nb.nbformat == 4
  assert nb.metadata["kernelspec"]["name"] == "python3"
  code = [cell for cell in nb.cells if cell.cell_type == "code"]
  assert code, name
  for cell in code:
    assert cell.outputs == [] and cell.execution_count is None, "outputs must be cleared"
  # The first code cell installs the package from what it finds (test_first_cell_*), with
  # nothing to set by hand and no repository address made up.
  install = code[0].source
  assert install == _read(NAMES[0]).cells[1].source, "the notebooks' first cells differ"
  assert "pip" in install and "OPTAX4BIT_SOURCE" not in install
  assert not re.findall(r"https?://", install), install
  # Small settings for CI, and the backend decides the sizes otherwise.
  source = "\n".join(cell.source for cell in code)
  assert "OPTAX4BIT_NB_SMALL" in source and "jax.default_backend()" in source


def _run_first_cell(folder, monkeypatch, capsys) -> tuple:
  """The notebooks' first code cell run from ``folder`` where optax4bit is not importable,
  pip replaced by a recorder: (what pip was asked to install, what the cell printed)."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  find_spec = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *args: None if name == "optax4bit" else find_spec(name, *args))
  installed = []
  monkeypatch.setattr(subprocess, "run", lambda cmd, check: installed.append(cmd[-1]))
  monkeypatch.chdir(folder)
  cell = next(c for c in _read(NAMES[0]).cells if c.cell_type == "code")
  exec(compile(cell.source, "first cell", "exec"), {})  # pylint: disable=exec-used
  return installed, capsys.readouterr().out


def test_first_cell_installs_the_checkout_it_is_in(tmp_path, monkeypatch, capsys):
  (tmp_path / "pyproject.toml").write_text('[project]\nname = "optax4bit"\n')
  (tmp_path / "notebooks").mkdir()
  installed, _ = _run_first_cell(tmp_path / "notebooks", monkeypatch, capsys)
  assert installed == [f"{tmp_path.resolve()}[examples]"]
  # This repository's notebooks folder finds this repository.
  installed, _ = _run_first_cell(NOTEBOOKS, monkeypatch, capsys)
  assert installed == [f"{NOTEBOOKS.parent}[examples]"]


@pytest.mark.parametrize("where", ["dist/optax4bit-0.1.0-cp311-cp311-linux_x86_64.whl",
                                   "optax4bit-0.1.0.tar.gz"])
def test_first_cell_installs_a_built_wheel_or_sdist(tmp_path, monkeypatch, capsys, where):
  (tmp_path / where).parent.mkdir(exist_ok=True)
  (tmp_path / where).write_bytes(b"")
  (tmp_path / "pyproject.toml").write_text('[project]\nname = "another"\n')
  installed, _ = _run_first_cell(tmp_path, monkeypatch, capsys)
  assert installed == [f"{(tmp_path / where).resolve()}[examples]"]


def test_first_cell_without_a_source_prints_one_line(tmp_path, monkeypatch, capsys):
  installed, out = _run_first_cell(tmp_path, monkeypatch, capsys)
  assert installed == [] and len(out.splitlines()) == 1 and "python -m build" in out, out


def _execute(name, monkeypatch):
  for module in ("ipykernel", "flax", "matplotlib"):  # what the notebooks import
    pytest.importorskip(module)
  monkeypatch.setenv("OPTAX4BIT_NB_SMALL", "1")
  nb = _read(name)
  client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                   resources={"metadata": {"path": str(NOTEBOOKS)}})
  client.execute()
  return nb


def _text(nb) -> str:
  out = []
  for cell in nb.cells:
    for output in cell.get("outputs", []):
      if output.output_type == "stream":
        out.append(output.text)
      elif "data" in output:
        out.append(output.data.get("text/plain", ""))
  return "\n".join(out)


def test_quickstart_runs(monkeypatch):
  nb = _execute("quickstart.ipynb", monkeypatch)
  text = _text(nb)
  assert "optax4bit.adamw_4bit" in text and "bytes/param" in text
  assert "QuantizedArray(B128/NF" in text


def test_memory_and_speed_runs(monkeypatch):
  text = _text(_execute("memory_and_speed.ipynb", monkeypatch))
  assert "LLaMA-7B shapes" in text and "ms/step" in text


# -m slow: CI's time (38 s); optax4bit.diagnostics is tested by tests/test_diagnostics.py.
@pytest.mark.slow
def test_diagnostics_notebook_runs(monkeypatch):
  text = _text(_execute("diagnostics.ipynb", monkeypatch))
  assert "% of non-zero v decoded to 0" in text and "max / sum" in text
