"""Fused optimizer steps for one leaf: the elementwise math of
`optax4bit.transform`, written for the kernels of `optax4bit.pallas._engine`.

Each step reads the gradient and the packed moments (codes plus scales),
runs the float32 update, writes the update in the gradient's dtype and the
re-quantized moments (in place: the kernels alias the gradient and the old
code and block-scale buffers). A moment with block-wise scales is encoded in
the same pass; a moment with rank-1 (or tensor) scales needs the maxima of its
whole new value first, which a stats pass computes from the gradient and its
old codes before the step pass (no float32 moment buffer is ever stored).

The arithmetic mirrors the jnp reference operation by operation and its
scalar coefficients (``1 - b1``, bias corrections, ...) are computed by the
same expressions outside the kernels, so interpret mode reproduces the jnp
path bit for bit. Weight decay and the learning rate stay in the later
``optax.chain`` elements (``add_decayed_weights``, ``scale_by_learning_rate``),
as in optax: the kernels return the update of ``scale_by_*``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from optax4bit._steps import restart_factored_overflow, restart_overflowed

__all__ = ["STEPS"]


# The jnp reference writes ``m_hat = m / c1``, ``v_hat = v / c2`` and
# ``m_hat / (sqrt(v_hat + eps_root) + eps)``. XLA's algebraic simplifier (the
# same pass on CPU and GPU) rewrites that into ``m / (c1 * (sqrt(v * (1 / c2))
# + eps))``: a division by a broadcast scalar becomes a multiplication by its
# reciprocal, and ``(a / b) / c`` becomes ``a / (b * c)``. The steps below are
# written directly in that rewritten form, which XLA leaves alone, so that the
# kernels compute what the compiled reference computes (bit for bit in
# interpret mode; the equivalence tests pin it).


def _adam_denominator(kmath, v, inv_c2, eps_root, eps):
  return kmath.sqrt(v * inv_c2 + eps_root) + eps


def _adam_step(nesterov: bool):

  def step(kmath, coef, dense, old, side):
    del side
    b1, one_minus_b1, b2, one_minus_b2, eps, eps_root, c1, inv_c2, inv_c1, inv_c1_next = coef
    (g,) = dense
    m, v = old
    m = one_minus_b1 * g + b1 * m
    v = one_minus_b2 * (g * g) + b2 * v
    denominator = _adam_denominator(kmath, v, inv_c2, eps_root, eps)
    if nesterov:
      update = kmath.div(b1 * (m * inv_c1_next) + one_minus_b1 * (g * inv_c1), denominator)
    else:
      update = kmath.div(m, c1 * denominator)
    return (update,), (restart_overflowed(m, v), v)

  return step


def _factored_step(kmath, coef, dense, old, side):
  """Adam with the second moment rebuilt from Adafactor factors (side
  inputs: row factor, column factor, mean of the row factor and its
  reciprocal ``1 / where(mean > 0, mean, 1)``)."""
  b1, one_minus_b1, _, _, eps, eps_root, c1, inv_c2, _, _ = coef
  (g,) = dense
  (m,) = old
  row, col, row_mean, inv_row_mean = side
  m = one_minus_b1 * g + b1 * m
  v = jnp.where(row_mean > 0, (row * col) * inv_row_mean, np.float32(0))
  update = kmath.div(m, c1 * _adam_denominator(kmath, v, inv_c2, eps_root, eps))
  update, new = restart_factored_overflow(g, update, m)
  return (update,), new


def _momentum_step(nesterov: bool):

  def step(kmath, coef, dense, old, side):
    del kmath, side
    (momentum,) = coef
    (g,) = dense
    (t,) = old
    t = g + momentum * t
    return ((g + momentum * t) if nesterov else t,), (t,)

  return step


# kind -> elementwise kernel step; run by `optax4bit.pallas.steps.PallasSteps`.
STEPS = {
    "adam": _adam_step(False),
    "adam_nesterov": _adam_step(True),
    "factored": _factored_step,
    "momentum": _momentum_step(False),
    "momentum_nesterov": _momentum_step(True),
}
