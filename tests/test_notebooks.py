"""The notebooks in notebooks/: clean nbformat v4 files that run top to bottom.

They are executed with nbclient in a fresh kernel with ``OPTAX4BIT_NB_SMALL=1``
(tiny sizes). The quickstart runs in the default test run; the other two take
longer and are marked ``slow``.
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
  # The first code cell installs the package on Colab from a location the user sets; no
  # repository address is made up.
  install = code[0].source
  assert '"google.colab" in sys.modules' in install
  assert "OPTAX4BIT_SOURCE" in install and "pip" in install
  assert all(url.startswith("https://<") for url in re.findall(r"https?://\S*", install)), install
  # Small settings for CI, and the backend decides the sizes otherwise.
  source = "\n".join(cell.source for cell in code)
  assert "OPTAX4BIT_NB_SMALL" in source and "jax.default_backend()" in source


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


@pytest.mark.slow
def test_memory_and_speed_runs(monkeypatch):
  text = _text(_execute("memory_and_speed.ipynb", monkeypatch))
  assert "LLaMA-7B shapes" in text and "ms/step" in text


@pytest.mark.slow
def test_diagnostics_notebook_runs(monkeypatch):
  text = _text(_execute("diagnostics.ipynb", monkeypatch))
  assert "% of non-zero v decoded to 0" in text and "max / sum" in text
