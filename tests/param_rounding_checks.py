"""`round_params_stochastically` on 8 virtual CPU devices; run by
tests/test_param_rounding.py.

Uses the harness of tests/sharding_checks.py (``run_sharded``: the same
leaves, shardings and steps as the optimizers' checks, a comparison with a
single-device unchunked run, the collectives of the compiled HLO) with the
parameters in bfloat16. Prints one ``RESULTS <json>`` line.
"""

from __future__ import annotations

import sys

import sharding_checks as sc  # sets the 8-device XLA flag before JAX starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import optax4bit  # noqa: E402

_float32_params = sc.make_params


def bfloat16_params():
  return jax.tree.map(lambda p: p.astype(jnp.bfloat16), _float32_params())


_float32_grads = sc.grads_at


def bfloat16_grads(params, i):
  """The harness's gradients computed in float32 and rounded to bfloat16
  once: XLA may fuse bfloat16 arithmetic differently per partitioning,
  which would change the gradients themselves."""
  as_float32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
  return jax.tree.map(lambda g: g.astype(jnp.bfloat16), _float32_grads(as_float32, i))


# run_sharded and its single-device reference build params and grads with these.
sc.make_params, sc.grads_at = bfloat16_params, bfloat16_grads


def adamw(chunk):
  return optax4bit.adamw_4bit(1e-3, chunk_size=chunk)  # param_rounding="stochastic"


def check(mode):
  result = sc.run_sharded("bf16_adamw", adamw, mode)
  result["param_dtypes"] = sorted({str(x.dtype) for x in jax.tree.leaves(bfloat16_params())})
  return result


CHECKS = {"explicit": lambda: check("explicit"), "auto": lambda: check("auto")}

if __name__ == "__main__":
  sc.main(sys.argv[1:], CHECKS)
