"""Tests of optax4bit.diagnostics.

The report's numbers are checked against float64 numpy computations written
here from their definitions (and, for one tiny state, worked out by hand); the
plot helpers are run on the Agg backend.
"""

from __future__ import annotations

import doctest
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax4bit
from optax4bit import diagnostics

B1, B2, EPS = 0.9, 0.999, 1e-8


def _grads(key, shapes, outlier=None):
  """Gaussian gradients; ``outlier`` = (leaf, index, value) plants one."""
  keys = jax.random.split(jax.random.key(key), len(shapes))
  grads = {name: jax.random.normal(k, shape) for k, (name, shape) in zip(keys, shapes.items())}
  if outlier is not None:
    name, index, value = outlier
    grads[name] = grads[name].at[index].set(value)
  return grads


# The float32 reference, jitted once for the whole module (compiles are cached by shape).
TX32 = optax.adam(1e-3, B1, B2, EPS)
UPDATE32 = jax.jit(TX32.update)


def _run_pair(tx4, shapes, steps=3, outlier=None):
  """Feeds the same gradients to ``tx4`` and to float32 ``optax.adam``."""
  params = {name: jnp.zeros(shape) for name, shape in shapes.items()}
  s4, s32 = tx4.init(params), TX32.init(params)
  up4, up32 = jax.jit(tx4.update), UPDATE32
  for step in range(steps):
    g = _grads(step, shapes, outlier)
    _, s4 = up4(g, s4, params)
    _, s32 = up32(g, s32, params)
  return s4, s32


def _f64(x):
  if isinstance(x, optax4bit.QuantizedArray):
    x = optax4bit.dequantize(x)
  return np.asarray(x, np.float64)


def _norm(x):
  return math.sqrt(float(np.sum(np.square(x, dtype=np.float64))))


def _top_share(mass, fraction, total):
  k = max(1, math.ceil(fraction * len(mass)))
  return sum(sorted(mass.tolist(), reverse=True)[:k]) / total


# ----------------------------------------------------------------------------
# Report numbers.


# One run shared by several tests: a quantized 1-D leaf, a leaf small enough
# to stay float32 and a quantized matrix with a planted outlier.
SHAPES = {"b": (2000,), "small": (8, 8), "w": (24, 256)}
STEPS = 3


@pytest.fixture(scope="module")
def adam_run():
  tx4 = optax4bit.adam_4bit(1e-3, B1, B2, EPS, recipe="paper", min_quantize_size=1024)
  return _run_pair(tx4, SHAPES, steps=STEPS, outlier=("w", (5, 7), 200.0))


def test_report_matches_float64_numpy(adam_run):
  s4, s32 = adam_run
  reports = diagnostics.quantization_report(s4, s32, top_fraction=0.05)
  assert [r.path for r in reports] == ["['b']", "['small']", "['w']"]
  adam4, adam32 = s4[0], s32[0]
  for r in reports:
    name = r.path[2:-2]
    m, v = _f64(adam4.mu[name]), _f64(adam4.nu[name])
    m32, v32 = _f64(adam32.mu[name]), _f64(adam32.nu[name])
    assert r.shape == SHAPES[name]
    np.testing.assert_allclose(r.rel_err_m, _norm(m - m32) / _norm(m32), rtol=1e-12)
    np.testing.assert_allclose(r.rel_err_v, _norm(v - v32) / _norm(v32), rtol=1e-12)
    d = (m / (1 - B1**STEPS)) / (np.sqrt(v / (1 - B2**STEPS)) + EPS)
    d32 = (m32 / (1 - B1**STEPS)) / (np.sqrt(v32 / (1 - B2**STEPS)) + EPS)
    np.testing.assert_allclose(r.rel_err_direction, _norm(d - d32) / _norm(d32), rtol=1e-12)
    assert r.v_zero_fraction == 0.0
    both = (v > 0) & (v32 > 0)
    np.testing.assert_allclose(r.v_step_scale,
                               np.exp(np.mean(0.5 * np.log(v32[both] / v[both]))), rtol=1e-12)
    assert r.nbytes == sum(x.size * x.dtype.itemsize for x in
                           jax.tree.leaves((adam4.mu[name], adam4.nu[name])))
    if name == "small":
      assert (r.m_spec, r.v_spec, r.quantized) == ("float32", "float32", False)
      assert max(r.rel_err_m, r.rel_err_v, r.rel_err_direction) < 1e-6
      assert abs(r.v_step_scale - 1) < 1e-6
    else:
      assert (r.m_spec, r.v_spec, r.quantized) == ("B128/DE", "Rank-1/Linear", True)
      assert 0 < r.rel_err_m < 0.5 and 0 < r.rel_err_v < 0.5 and 0 < r.rel_err_direction < 0.5
    if m.ndim == 1:
      assert all(math.isnan(c) for c in (r.m_row_concentration, r.m_col_concentration,
                                         r.v_row_concentration, r.v_col_concentration))
      continue
    for x, rows, cols in ((m32, r.m_row_concentration, r.m_col_concentration),
                          (v32, r.v_row_concentration, r.v_col_concentration)):
      a = np.abs(x)
      np.testing.assert_allclose(rows, _top_share(a.sum(1), 0.05, a.sum()), rtol=1e-12)
      np.testing.assert_allclose(cols, _top_share(a.sum(0), 0.05, a.sum()), rtol=1e-12)
  # The planted outlier: its row and column (2 of 24 rows, 13 of 256 columns)
  # hold far more than 5% of |m| and of v.
  w = reports[2]
  assert w.m_row_concentration > 0.12 and w.m_col_concentration > 0.1
  assert w.v_row_concentration > 0.5 and w.v_col_concentration > 0.5


def test_report_by_hand():
  """A tiny state whose quantization is worked out by hand.

  m (2 x 128), B128/DE: row 0 is [1, 0.3, ..., 0.3], block max 1, and 0.3 lies
  below the midpoint 0.325 of the entries 0.2125 and 0.4375, so it decodes to
  0.2125; row 1 is all 0.5, normalized to exactly 1. v, Rank-1/Linear: row 0
  all 1, row 1 all 0.25; every rank-1 scale equals the row's value, so v is
  exact.
  """
  m = np.full((2, 128), 0.3)
  m[0, 0], m[1] = 1.0, 0.5
  v = np.ones((2, 128))
  v[1] = 0.25
  state4 = optax4bit.ScaleByAdam4bitState(
      jnp.asarray(1, jnp.int32),
      {"w": optax4bit.quantize(jnp.asarray(m, jnp.float32), "B128/DE")},
      {"w": optax4bit.quantize(jnp.asarray(v, jnp.float32), "Rank-1/Linear")})
  state32 = optax.ScaleByAdamState(jnp.asarray(1, jnp.int32), {"w": jnp.asarray(m, jnp.float32)},
                                   {"w": jnp.asarray(v, jnp.float32)})
  (r,) = diagnostics.quantization_report(state4, state32, top_fraction=0.5)

  m_norm2 = 1 + 127 * 0.3**2 + 128 * 0.5**2
  np.testing.assert_allclose(r.rel_err_m, math.sqrt(127 * (0.3 - 0.2125)**2 / m_norm2),
                             rtol=1e-6)
  assert r.rel_err_v == 0.0
  # Step 1: m_hat = m / 0.1, sqrt(v_hat) = sqrt(v / 0.001): sqrt(1000) in row
  # 0 and sqrt(250) in row 1; only row 0's 0.3 entries are off.
  den0, den1 = math.sqrt(1000) + EPS, math.sqrt(250) + EPS
  err2 = 127 * ((0.3 - 0.2125) / 0.1 / den0)**2
  ref2 = (1 / 0.1 / den0)**2 + 127 * (0.3 / 0.1 / den0)**2 + 128 * (0.5 / 0.1 / den1)**2
  np.testing.assert_allclose(r.rel_err_direction, math.sqrt(err2 / ref2), rtol=1e-6)
  assert r.v_zero_fraction == 0.0
  # |m| row sums 39.1 and 64 (total 103.1): the top half (one row) holds 64.
  np.testing.assert_allclose(r.m_row_concentration, 64 / 103.1, rtol=1e-6)
  # Top 50% of 128 columns = 64 columns: column 0 (1.5) and 63 columns of 0.8.
  np.testing.assert_allclose(r.m_col_concentration, (1.5 + 63 * 0.8) / 103.1, rtol=1e-6)
  np.testing.assert_allclose(r.v_row_concentration, 128 / 160, rtol=1e-6)
  np.testing.assert_allclose(r.v_col_concentration, 0.5, rtol=1e-6)


@pytest.mark.parametrize("second_moment, zero_point", [
    ("B128/DE", True), ("Rank-1/Linear", False), ("B128/DE-0", False)])
def test_zero_point_problem(second_moment, zero_point):
  # One huge gradient per row block: its block's scale swamps the others.
  shapes = {"w": (16, 256)}
  # The paper's first moment: the default's stochastic rounding adds noise to
  # the direction of one step where one column dominates every block.
  tx4 = optax4bit.adam_4bit(1e-3, B1, B2, EPS, recipe="paper", second_moment=second_moment,
                            min_quantize_size=0)
  s4, s32 = _run_pair(tx4, shapes, steps=2, outlier=("w", (slice(None), 3), 300.0))
  (r,) = diagnostics.quantization_report(s4, s32)
  v, v32 = _f64(s4[0].nu["w"]), _f64(s32[0].nu["w"])
  expected = np.mean((v == 0) & (v32 > 0))
  assert r.v_zero_fraction == expected
  if zero_point:
    assert r.v_zero_fraction > 0.1
    assert r.rel_err_direction > 10  # m_hat / eps where v decoded to 0
  else:
    assert r.v_zero_fraction == 0.0
    assert r.rel_err_direction < 1


def test_factored_and_8bit_states():
  shapes = {"b": (5000,), "w": (32, 192)}
  s4, s32 = _run_pair(optax4bit.adamw_4bit_factor(1e-3, B1, B2, EPS, recipe="paper"), shapes,
                      steps=2)
  rb, rw = diagnostics.quantization_report(s4, s32)
  assert (rb.m_spec, rb.v_spec) == ("B128/DE", "Rank-1/Linear")
  assert (rw.m_spec, rw.v_spec) == ("B128/DE", "factored")
  factors = s4[0].nu["w"]
  row, col = np.asarray(factors.row, np.float64), np.asarray(factors.col, np.float64)
  v = row * col / row.mean()
  v32 = _f64(s32[0].nu["w"])
  np.testing.assert_allclose(rw.rel_err_v, _norm(v - v32) / _norm(v32), rtol=1e-9)
  assert rw.nbytes == (s4[0].mu["w"].nbytes + 4 * (32 + 192))

  s8, s32 = _run_pair(optax4bit.adamw_8bit(1e-3, B1, B2, EPS), {"w": (32, 256)}, steps=2)
  (r8,) = diagnostics.quantization_report(s8, s32)
  assert (r8.m_spec, r8.v_spec) == ("B256/DE 8-bit", "B256/DE 8-bit")
  assert r8.rel_err_m < 0.02


def test_quantized_only(adam_run):
  only = diagnostics.quantization_report(*adam_run, quantized_only=True)
  assert [r.path for r in only] == ["['b']", "['w']"]


def test_with_fp32_shadow_is_transparent_and_matches_a_separate_run():
  shapes = {"w": (64, 128)}
  params = {"w": jnp.ones((64, 128), jnp.bfloat16)}
  inner = optax4bit.adamw_4bit(1e-2, B1, B2, EPS)
  tx = optax.chain(optax.clip_by_global_norm(1.0), diagnostics.with_fp32_shadow(inner, B1, B2))
  ref = optax.chain(optax.clip_by_global_norm(1.0), inner)
  s, s_ref = tx.init(params), ref.init(params)
  fp32 = optax.scale_by_adam(B1, B2)
  s32 = fp32.init(jax.tree.map(lambda p: p.astype(jnp.float32), params))
  update, update_ref, update32 = jax.jit(tx.update), jax.jit(ref.update), jax.jit(fp32.update)
  for step in range(2):
    g = jax.tree.map(lambda x: x.astype(jnp.bfloat16), _grads(step, shapes))
    u, s = update(g, s, params)
    u_ref, s_ref = update_ref(g, s_ref, params)
    # The shadow sees the clipped bfloat16 gradients, in float32.
    clipped, _ = jax.jit(optax.clip_by_global_norm(1.0).update)(g, optax.EmptyState())
    _, s32 = update32(jax.tree.map(lambda x: x.astype(jnp.float32), clipped), s32)
    # bfloat16 params: the alias's stochastic param rounding returns float32 updates
    # (`round_params_stochastically`); the shadow must not change them.
    assert u["w"].dtype == u_ref["w"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(u["w"], np.float32),
                                  np.asarray(u_ref["w"], np.float32))
  shadow = s[1].shadow
  assert shadow.mu["w"].dtype == jnp.float32 and shadow.nu["w"].dtype == jnp.float32
  np.testing.assert_allclose(shadow.nu["w"], s32.nu["w"], rtol=1e-6)
  (r,) = diagnostics.quantization_report(s)
  (r_ref,) = diagnostics.quantization_report(s_ref, s32)
  assert r.m_spec == "B128/NF stochastic" and r.rel_err_m > 0
  for field in ("rel_err_m", "rel_err_v", "rel_err_direction", "m_row_concentration"):
    assert getattr(r, field) == pytest.approx(getattr(r_ref, field), rel=1e-4)


def test_finds_states_inside_inject_hyperparams_and_flax():
  shapes = {"w": (16, 512)}
  tx = optax.chain(optax.clip(1.0), optax4bit.inject_hyperparams(optax4bit.adamw_4bit)(1e-3))
  s4, s32 = _run_pair(tx, shapes, steps=1)
  (r,) = diagnostics.quantization_report(s4, s32)
  assert r.path == "['w']" and r.m_spec == "B128/NF stochastic"

  nnx = pytest.importorskip("flax.nnx")
  _, params = nnx.split(nnx.Linear(48, 128, rngs=nnx.Rngs(0)), nnx.Param)
  tx = diagnostics.with_fp32_shadow(optax4bit.adamw_4bit(1e-3, min_quantize_size=0))
  state = tx.init(params)
  _, state = jax.jit(tx.update)(jax.tree.map(jnp.ones_like, params), state, params)
  paths = [r.path for r in diagnostics.quantization_report(state)]
  assert paths == ["['bias']", "['kernel']"]


def test_errors(adam_run):
  s4, s32 = adam_run
  with pytest.raises(ValueError, match="exactly one ScaleByAdam4bitState"):
    diagnostics.quantization_report(s32, s32)
  with pytest.raises(ValueError, match="exactly one ScaleByAdamState"):
    diagnostics.quantization_report(s4)
  with pytest.raises(ValueError, match="2 were found"):
    diagnostics.quantization_report((s4, s4), s32)
  fresh = optax.adam(1e-3).init({name: jnp.zeros(shape) for name, shape in SHAPES.items()})
  with pytest.raises(ValueError, match="step 3 .* step 0"):
    diagnostics.quantization_report(s4, fresh)
  other = optax.ScaleByAdamState(s32[0].count, {"a": jnp.zeros(3)}, {"a": jnp.zeros(3)})
  with pytest.raises(ValueError, match="structure"):
    diagnostics.quantization_report(s4, other)
  with pytest.raises(ValueError, match="top_fraction"):
    diagnostics.quantization_report(s4, s32, top_fraction=0.0)
  with pytest.raises(ValueError, match="b2"):
    diagnostics.with_fp32_shadow(optax4bit.adamw_4bit(1e-3), b2=1.0)


def test_format_report(adam_run):
  reports = diagnostics.quantization_report(*adam_run)
  text = diagnostics.format_report(reports, max_path=8)
  lines = text.splitlines()
  assert lines[0].split()[:4] == ["path", "shape", "m", "v"]
  assert len(lines) == 5 and lines[-1].startswith("max / sum")
  assert lines[-1].split()[-1] == str(sum(r.nbytes for r in reports))
  assert lines[1].split()[:4] == ["['b']", "2000", "B128/DE", "Rank-1/Linear"]
  assert lines[1].split()[-3:-1] == ["-", "-"]  # no rows/columns for 1-D
  assert lines[2].split()[:4] == ["...all']", "8x8", "float32", "float32"]
  assert "24x256" in lines[3]
  assert diagnostics.format_report([]).split() == [
      "path", "shape", "m", "v", "err", "m", "err", "v", "err", "dir", "v=0", "m", "rows/cols",
      "v", "rows/cols", "bytes"]


# ----------------------------------------------------------------------------
# Plots.


@pytest.fixture
def pyplot():
  matplotlib = pytest.importorskip("matplotlib")
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  yield plt
  plt.close("all")


def test_plot_histograms(pyplot):
  v = np.square(np.asarray(jax.random.normal(jax.random.key(0), (32, 256))))
  v[:, 5] = 1e4  # outlier column: B128/DE rounds most of its blocks to 0
  fig = diagnostics.plot_histograms(v, "B128/DE")
  assert isinstance(fig, pyplot.Figure) and len(fig.axes) == 3
  assert all(ax.get_yscale() == "log" for ax in fig.axes)
  title = fig.axes[2].get_title()
  zero_share = float(title.split(": ")[1].split("%")[0])
  assert zero_share > 50
  # The table is drawn over the normalized histogram: 16 lines.
  assert len(fig.axes[1].lines) == 16

  fig = diagnostics.plot_histograms(v, "Rank-1/Linear", log_x=True, title="v")
  assert fig.axes[2].get_title().startswith("dequantized: 0.00%")
  assert fig.texts[0].get_text() == "v"

  _, axes = pyplot.subplots(1, 3)
  m = optax4bit.quantize(jnp.asarray(v - 1.0), "B128/DE")  # a QuantizedArray, signed
  stochastic = optax4bit.QuantSpec.parse("B128/DE", stochastic=True)
  assert diagnostics.plot_histograms(m, stochastic, ax=axes) is axes[0].figure
  with pytest.raises(ValueError, match="three axes"):
    diagnostics.plot_histograms(v, "B128/DE", ax=axes[:2])


def test_plot_outliers(pyplot):
  m = np.ones((600, 300), np.float32)
  m[:, 7] = 50.0
  fig = diagnostics.plot_outliers(m)
  image = fig.axes[0].images[0].get_array()
  assert image.shape == (200, 150)  # block maxima of 3 x 2 cells
  assert float(np.max(image[:, 3])) == 50.0 and float(np.max(image[:, 10])) == 1.0
  fig, ax = pyplot.subplots()
  assert diagnostics.plot_outliers(jnp.zeros(10), ax=ax, log=True, title="z") is fig
  assert ax.images[0].get_array().shape == (1, 10) and ax.get_title() == "z"
  fig = diagnostics.plot_outliers(jnp.ones((2, 3, 4)), max_size=2)
  assert fig.axes[0].images[0].get_array().shape == (2, 2)
  with pytest.raises(ValueError, match="max_size"):
    diagnostics.plot_outliers(m, max_size=0)


# ----------------------------------------------------------------------------
# Packaging and docs.


def test_docstring_examples(pyplot):
  del pyplot
  result = doctest.testmod(diagnostics, optionflags=doctest.ELLIPSIS)
  assert result.attempted > 10 and result.failed == 0


def test_submodule_export_without_matplotlib_import():
  code = ("import sys, optax4bit; assert optax4bit.diagnostics.quantization_report; "
          "from optax4bit import diagnostics; "
          "assert 'matplotlib' not in sys.modules, 'matplotlib imported eagerly'")
  subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
