"""The 8-bit dynamic-exponent maps in closed form (`optax4bit.quant.dynamic_map`)
against their tables: every entry bit for bit, and nearest and stochastic
rounding's searches against numpy's searchsorted over the stored thresholds,
at and around every entry and threshold."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from optax4bit.quant import dynamic_map, maps

MAPS = [("DE", True), ("DE", False), ("DE-0", False)]
TINY = np.finfo(np.float32).tiny


def _around_entries_and_thresholds(table, thresholds, ulps: int, signed: bool):
  """float32 values within ``ulps`` of every entry and threshold (both signs
  for a signed map), normal numbers only (XLA flushes subnormals)."""
  anchors = np.abs(np.concatenate([table, thresholds]).astype(np.float32)).view(np.int32)
  bits = (anchors[:, None] + np.arange(-ulps, ulps + 1, dtype=np.int32)[None, :]).ravel()
  x = bits[bits >= np.float32(TINY).view(np.int32)].view(np.float32)
  return np.concatenate([x, -x]) if signed else x


def _specials():
  return np.array([0.0, -0.0, 1.0, -1.0, 2.0, -2.0, 1e30, -1e30, np.inf, -np.inf], np.float32)


@pytest.mark.parametrize("mapping,signed", MAPS)
def test_every_entry_is_the_tables(mapping, signed):
  table = maps.qmap(mapping, 8, signed)
  decoded = jax.jit(lambda c: maps.decode(c, mapping, 8, signed))(jnp.arange(256))
  np.testing.assert_array_equal(np.asarray(decoded).view(np.int32), table.view(np.int32))


@pytest.mark.parametrize("mapping,signed", MAPS)
def test_nearest_is_the_count_of_thresholds_below(mapping, signed):
  table = maps.qmap(mapping, 8, signed)
  thresholds = maps.midpoint_thresholds(mapping, 8, signed)
  rng = np.random.default_rng(0)
  x = np.concatenate([
      _around_entries_and_thresholds(table, thresholds, 48, signed), _specials(),
      rng.uniform(-1.1, 1.1, 20000).astype(np.float32),
      (rng.uniform(-1, 1, 20000) * 10.0 ** rng.uniform(-8, 0, 20000)).astype(np.float32)])
  codes = jax.jit(lambda v: maps.encode_nearest(v, mapping, 8, signed))(x)
  expected = np.searchsorted(thresholds, x, side="left")  # thresholds strictly below x
  np.testing.assert_array_equal(np.asarray(codes), expected)
  nan_code = jax.jit(lambda v: maps.encode_nearest(v, mapping, 8, signed))(
      np.array([np.nan], np.float32))
  assert int(nan_code[0]) == 0  # as a search whose every compare is false


@pytest.mark.slow
def test_nearest_between_the_signed_maps_first_entries_exhaustively():
  """Every float32 around the one pair whose differences with ``x`` round (entries
  5.5e-7 and 3.25e-6: a stored threshold decides there), both signs."""
  thresholds = maps.midpoint_thresholds("DE", 8, True)
  bits = np.arange(np.float32(5e-7).view(np.int32), np.float32(3.3e-6).view(np.int32),
                   dtype=np.int32)
  x = bits.view(np.float32)
  x = np.concatenate([x, -x])
  codes = jax.jit(lambda v: maps.encode_nearest(v, "DE", 8, True))(x)
  np.testing.assert_array_equal(np.asarray(codes), np.searchsorted(thresholds, x, side="left"))


@pytest.mark.parametrize("mapping,signed", MAPS)
def test_bracket_is_the_entries_either_side(mapping, signed):
  """Stochastic rounding's search: the entry at or below ``x`` and the one above
  (where ``x`` is not an entry: on an entry the draw cannot round up)."""
  table = maps.qmap(mapping, 8, signed)
  thresholds = maps.midpoint_thresholds(mapping, 8, signed)
  rng = np.random.default_rng(1)
  x = np.concatenate([_around_entries_and_thresholds(table, thresholds, 8, signed),
                      rng.uniform(-1, 1, 20000).astype(np.float32), _specials()])
  x = np.clip(x, table[0], table[-1])
  lower, low, high = jax.jit(lambda v: dynamic_map.bracket(v, mapping, signed))(x)
  expected = np.searchsorted(table[1:], x, side="right")
  np.testing.assert_array_equal(np.asarray(lower), expected)
  np.testing.assert_array_equal(np.asarray(low), table[expected])
  off_entry = x != table[expected]
  np.testing.assert_array_equal(np.asarray(high)[off_entry],
                                table[np.minimum(expected + 1, 255)][off_entry])


@pytest.mark.parametrize("mapping,signed", MAPS + [("Linear", False)])
def test_stochastic_codes_are_a_neighbour_with_the_right_odds(mapping, signed):
  """Stochastic rounding on the 8-bit maps: always one of the two entries
  either side, rounding up with probability ``(x - low) / (high - low)``."""
  table = maps.qmap(mapping, 8, signed).astype(np.float64)
  rng = np.random.default_rng(2)
  x = rng.uniform(table[0], table[-1], 64).astype(np.float32)
  draws = 4000
  uniform = jax.random.uniform(jax.random.key(0), (draws, x.size))
  codes = np.asarray(jax.jit(lambda v, u: maps.encode_stochastic(
      jnp.broadcast_to(v, u.shape), u, mapping, 8, signed))(x, uniform))
  lower = np.searchsorted(table[1:], x.astype(np.float64), side="right")
  assert np.all((codes == lower) | (codes == np.minimum(lower + 1, 255)))
  gap = table[np.minimum(lower + 1, 255)] - table[lower]
  odds = np.where(gap > 0, (x - table[lower]) / np.where(gap > 0, gap, 1), 0)
  np.testing.assert_allclose((codes > lower).mean(axis=0), odds, atol=4.5 / np.sqrt(draws))


@pytest.mark.parametrize("mapping,signed", MAPS)
def test_no_gather(mapping, signed):
  """The reason for the closed form: no table lookup in the 8-bit codecs."""
  uniform = jnp.zeros(8)
  for fn, args in [(lambda v: maps.encode_nearest(v, mapping, 8, signed), (jnp.ones(8),)),
                   (lambda v, u: maps.encode_stochastic(v, u, mapping, 8, signed),
                    (jnp.ones(8), uniform)),
                   (lambda c: maps.decode(c, mapping, 8, signed), (jnp.zeros(8, jnp.uint8),))]:
    hlo = jax.jit(fn).lower(*args).as_text()
    assert "gather" not in hlo, hlo
