"""The 8-bit codecs' speed on this CPU: closed form against the table lookup it replaced.

`optax4bit.quant.dynamic_map` evaluates and searches the 8-bit ``DE`` tables
with arithmetic; before it, the jnp engine gathered from the 256-entry table
(an 8-level binary search over the midpoint thresholds, one gather per level,
and a gather to decode). Both are timed here side by side, interleaved, in one
process, on the jnp engine's work per element: decode a signed and an unsigned
code, encode two values to nearest. Prints the median seconds of each and
their ratio; the two must give the same codes (checked).

    JAX_PLATFORMS=cpu python benchmarks/codec_8bit_speed.py --elements 4194304
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from optax4bit.quant import maps


def _gather_nearest(x, mapping: str, signed: bool):
  """The binary search by gathers from the thresholds (the replaced code)."""
  bounds = maps.midpoint_thresholds(mapping, 8, signed)
  padded = jnp.asarray(np.append(bounds, np.float32(np.inf)))
  count = jnp.where(x > bounds[127], np.int32(128), np.int32(0))
  for level in range(1, 8):
    step = 2 ** (7 - level)
    count = jnp.where(x > padded[count + step - 1], count + step, count)
  return count


def _gather_decode(codes, mapping: str, signed: bool):
  return jnp.asarray(maps.qmap(mapping, 8, signed))[codes.astype(jnp.int32)]


def _work(decode, encode):
  def run(m_codes, v_codes, noise):
    m = decode(m_codes, "DE", True) * 0.9 + noise
    v = decode(v_codes, "DE", False) * 0.999 + noise * noise
    return (encode(jnp.clip(m, -1, 1), "DE", True).astype(jnp.uint8),
            encode(jnp.clip(v, 0, 1), "DE", False).astype(jnp.uint8))
  return jax.jit(run)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--elements", type=int, default=1 << 22)
  parser.add_argument("--repeats", type=int, default=15)
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  m_codes = jnp.asarray(rng.integers(0, 256, args.elements), jnp.uint8)
  v_codes = jnp.asarray(rng.integers(0, 256, args.elements), jnp.uint8)
  noise = jnp.asarray(rng.normal(0, 0.01, args.elements), jnp.float32)
  closed = _work(lambda c, mp, s: maps.decode(c, mp, 8, s),
                 lambda x, mp, s: maps.encode_nearest(x, mp, 8, s))
  gathered = _work(_gather_decode, _gather_nearest)
  for a, b in zip(closed(m_codes, v_codes, noise), gathered(m_codes, v_codes, noise)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  times = {"closed form": [], "gathers": []}
  for _ in range(args.repeats):
    for name, fn in (("closed form", closed), ("gathers", gathered)):
      start = time.perf_counter()
      jax.block_until_ready(fn(m_codes, v_codes, noise))
      times[name].append(time.perf_counter() - start)
  median = {name: statistics.median(t) for name, t in times.items()}
  print(f"jax {jax.__version__}, {platform.machine()}, {args.elements} elements, "
        f"{args.repeats} interleaved repeats, same codes: yes")
  for name, seconds in median.items():
    print(f"{name:12s} {seconds * 1e3:8.2f} ms  {seconds / args.elements * 1e9:6.2f} ns/element")
  print(f"closed form / gathers: {median['closed form'] / median['gathers']:.2f}x")


if __name__ == "__main__":
  main()
