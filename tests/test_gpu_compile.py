"""Every Pallas kernel compiled for real GPUs without a GPU (issue 16).

`benchmarks/gpu_compile.py` lowers each kernel for CUDA, reads the Triton
module that JAX embeds in the ``__gpu$xla.gpu.triton`` custom call and
compiles it with the ``triton`` package from PyPI for sm_75, sm_80, sm_89
and sm_90a through ptxas. These tests fail on a compile error, on any spill,
on registers above `gpu_compile.REGISTER_BUDGET` (128), and, by name, when
the installed triton cannot parse JAX's Triton IR (`TritonDriftError`) or is
not the release validated with this jaxlib.

The tests that compile need ``pip install -e .[gpu-check]`` (a pinned
triton, in the README's install command) and are skipped without it; the
extraction of the Triton modules and the occupancy arithmetic are checked
everywhere. The default run compiles every kernel (quantize, dequantize and
the fused steps of every optimizer and recipe) in float32 and bfloat16 on a
ragged (300, 301) leaf for sm_90a (52 compiles; sm_75, sm_80 and sm_89 with
-m slow: the four took 250 s on 2 loaded CPU cores). The fused steps with an instruction budget
(`gpu_compile.INSTRUCTION_BUDGETS`, issue 35) are also compiled on the
regular (1024, 2048) float32 leaf for sm_90a, and their SASS instructions
per parameter checked there. The whole matrix on the
regular leaf doubles the time and is marked slow:
``pytest -m slow tests/test_gpu_compile.py``.
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax.numpy as jnp
import pytest

from conftest import gpu_compile as load_gpu_compile

gpu_compile = load_gpu_compile()


@pytest.fixture(scope="module")
def triton():
  return pytest.importorskip("triton", reason="pip install -e .[gpu-check] to compile kernels")


def _check(rows):
  assert rows and all(r.registers is not None for r in rows), "a case without Pallas kernels"
  problems = [gpu_compile.format_row(r) for r in gpu_compile.problems(rows)]
  assert not problems, (f"spills, stack frames or more than {gpu_compile.REGISTER_BUDGET} "
                        "registers per thread:\n"
                        + "\n".join([gpu_compile._HEADER] + problems))
  for r in rows:
    assert 0 < r.occupancy <= 1 and r.shared_bytes >= 0, r
    if r.arch in ("sm_80", "sm_90a"):
      assert r.occupancy >= 0.25, gpu_compile.format_row(r)


# --- Without triton: extracting JAX's Triton modules, and the arithmetic. ---


def test_triton_modules_are_read_from_the_cuda_lowering():
  fn, args = gpu_compile.CASES["adamw_4bit paper"](jnp.dtype("float32"), (300, 301))
  kernels = gpu_compile.triton_kernels(fn, *args)
  assert [k.name for k in kernels] == ["optax4bit_stats", "optax4bit_step"]
  for k in kernels:
    assert k.ttir.startswith("module") and f"tt.func public @{k.name}(" in k.ttir
    assert "loc(" not in k.ttir  # printed without debug locations
    assert k.num_warps == 8 and k.num_stages == 1 and k.grid[2] == 1
  moved = gpu_compile.traffic(kernels[0], 300 * 301, "float32")
  # The stats pass reads the gradient (4 bytes) and the second moment's codes
  # (0.5 byte); the step pass reads the gradient again, writes the update
  # (over it), and reads and writes both moments' codes.
  assert moved["gradient"] == 4 and moved["update"] == 0
  assert moved["codes"] == pytest.approx(0.5, rel=0.02)
  moved = gpu_compile.traffic(kernels[1], 300 * 301, "float32")
  assert moved["gradient"] == 4 and moved["update"] == 4
  assert moved["codes"] == pytest.approx(4 * 0.5, rel=0.02)


def test_occupancy_matches_the_cuda_calculator():
  # 237 registers, 4 warps: 2 blocks of 128 threads per SM (issue 16).
  assert gpu_compile.occupancy(237, 2048, 4, 80) == 8 / 64
  assert gpu_compile.occupancy(128, 2048, 4, 80) == 16 / 64
  assert gpu_compile.occupancy(128, 2048, 4, 89) == 16 / 48
  assert gpu_compile.occupancy(64, 0, 4, 75) == 1.0
  assert gpu_compile.occupancy(32, 0, 4, 90) == 1.0
  assert gpu_compile.occupancy(255, 0, 4, 90) == 8 / 64
  # Shared memory: 100 KiB per block leaves room for one block on an A100.
  assert gpu_compile.occupancy(32, 100 * 1024, 4, 80) == 4 / 64


def test_instructions_per_parameter_count_every_thread_launched():
  row = gpu_compile.Row("c", "step", "float32", "regular", "sm_90a", 8, instructions=1000,
                        threads_per_param=256 * 1024 / (1024 * 2048))
  assert row.instructions_per_param == 125.0
  other = dataclasses.replace(row, kernel="stats", instructions=200)
  assert gpu_compile.step_instructions([row, other]) == {
      "c": {"step": 125.0, "stats": 25.0, "total": 150.0}}
  # Only the budget's shape, architecture and dtype count.
  assert gpu_compile.step_instructions([dataclasses.replace(row, arch="sm_80")]) == {}
  assert gpu_compile.over_instruction_budget([row, other], {"c": 149}) == [("c", 150.0, 149)]
  assert not gpu_compile.over_instruction_budget([row, other], {"c": 150})


# --- With triton: compiled through ptxas. ---


def test_triton_is_the_release_validated_with_this_jaxlib(triton):
  """Drift between jaxlib's bundled Triton and PyPI's fails here, by name,
  rather than passing with numbers from a mismatched compiler. A triton that
  did not come from the gpu-check extra (e.g. PyTorch's, on a GPU machine)
  skips: nothing here pins it."""
  root = pathlib.Path(gpu_compile.__file__).resolve().parents[1]
  pyproject = (root / "pyproject.toml").read_text()
  [pinned] = gpu_compile.VALIDATED["triton"]
  assert f'"triton=={pinned};' in pyproject
  if gpu_compile.triton_version() != pinned:
    pytest.skip(f"triton {gpu_compile.triton_version()} is not the gpu-check extra's "
                f"{pinned}: the compile checks ran with it, unvalidated")
  problems = gpu_compile.version_drift()
  assert not problems, "\n".join(problems)


def test_a_jaxlib_triton_pair_not_validated_fails_the_check(triton, monkeypatch, capsys):
  del triton
  monkeypatch.setitem(gpu_compile.VALIDATED, "triton", ("0.0.0",))
  assert gpu_compile.main(["--cases", "sgdm_4bit paper"]) == 1
  out = capsys.readouterr().out
  assert "FAIL: triton" in out and "validated with triton 0.0.0" in out


# The default run: sm_90a, float32, the steps with the stall rule, where ragged
# tiles need the most registers (150-164 at 2048-byte tiles); every case,
# bfloat16 and sm_75, sm_80 and sm_89 with -m slow (CI's time: sm_90a's cases in
# both dtypes took 66 s of a worker on 2 cores, the longest test of the run).
STALL_CASES = ("adamw_4bit default", "adamw_4bit default stall v", "adamw_4bit_factor default",
               "sgdm_4bit default")


@pytest.mark.parametrize("cases,archs,dtypes", [
    (STALL_CASES, ("sm_90a",), ("float32",)),
    pytest.param(tuple(gpu_compile.CASES), ("sm_90a",), gpu_compile.DTYPES,
                 marks=pytest.mark.slow),
    pytest.param(tuple(gpu_compile.CASES), ("sm_75", "sm_80", "sm_89"), gpu_compile.DTYPES,
                 marks=pytest.mark.slow)])
def test_every_kernel_compiles_for_four_architectures_on_a_ragged_leaf(triton, cases, archs,
                                                                       dtypes):
  del triton
  assert set(archs) <= set(gpu_compile.ARCHS) and set(dtypes) <= set(gpu_compile.DTYPES)
  rows = gpu_compile.run_matrix(cases, dtypes=dtypes, shapes=["ragged"], archs=archs)
  assert {(r.case, r.dtype, r.arch) for r in rows} == {
      (c, d, a) for c in cases for d in dtypes for a in archs}
  assert {(r.case, r.kernel) for r in rows} >= {
      ("adamw_4bit default", k) for k in ("stats", "step")}
  _check(rows)


def test_a_module_triton_cannot_parse_is_reported_as_drift(triton, tmp_path):
  del triton
  fn, args = gpu_compile.CASES["sgdm_4bit paper"](jnp.dtype("float32"), (300, 301))
  (kernel,) = gpu_compile.triton_kernels(fn, *args)
  future = dataclasses.replace(kernel, ttir=kernel.ttir.replace("tt.make_range",
                                                                "tt.make_range_v2"))
  with pytest.raises(gpu_compile.TritonDriftError, match="drifted apart") as error:
    gpu_compile.compile_kernel(future, "sm_80", str(tmp_path))
  assert "tt.make_range_v2" in str(error.value)  # MLIR's diagnostic is kept


@pytest.mark.slow
@pytest.mark.parametrize("case", list(gpu_compile.CASES))
def test_every_kernel_compiles_for_four_architectures_on_a_regular_leaf(triton, case):
  del triton
  rows = gpu_compile.run_matrix([case], shapes=["regular"])
  assert {r.arch for r in rows} == set(gpu_compile.ARCHS)
  _check(rows)


def test_fused_steps_are_within_their_instruction_budgets_on_a_regular_leaf(triton):
  """Issue 35: the whole step's SASS instructions per parameter on sm_90a
  (float32, (1024, 2048)), and no spill there (the other architectures on
  this leaf: the slow regular-leaf matrix)."""
  del triton
  budgets = gpu_compile.INSTRUCTION_BUDGETS
  rows = gpu_compile.run_matrix(list(budgets), dtypes=["float32"], shapes=["regular"],
                                archs=[gpu_compile.BUDGET_ARCH])
  _check(rows)
  steps = gpu_compile.step_instructions(rows)
  assert set(steps) == set(budgets)
  for case, kernels in steps.items():
    assert 0 < kernels["total"] <= budgets[case], (case, kernels)
  # The default recipe's two passes: the rank-1 statistics, then the step.
  assert set(steps["adamw_4bit default"]) == {"stats", "step", "total"}
