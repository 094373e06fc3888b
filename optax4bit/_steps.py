"""The optimizer steps every backend runs, and the scalars they take.

A step is an elementwise function ``step(g, old_moments, side) -> (update,
new_moments)`` on float32 arrays (`optax4bit._leafwise.StepFn`): the jnp
engine runs these on chunks of rows. The fused kernels (`optax4bit.pallas`,
`optax4bit.cpu`) implement the same steps and take their scalar coefficients
as a float32 vector computed here, by the same expressions, so that their
results match the jnp path.

A step whose new second moment is ``+inf`` (``g**2`` overflowed float32)
stores a first moment of 0 there (`restart_overflowed`): a quantized second
moment cannot keep the ``inf`` that makes optax freeze the element, and the
huge first moment must not meet the finite value it is stored as.

Steps are partials of module-level functions, not closures: the engine passes
their traced arguments into ``shard_map`` explicitly (see
`optax4bit._shard_map.hoist_partial`). A backend's fused step gets a
`FusedStep`: which step, and the hyperparameters its coefficients come from.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax


def adam_step(b1, b2, eps, eps_root, count_inc, nesterov):
  """The elementwise Adam step, arranged exactly as ``optax.scale_by_adam``."""
  correction1 = 1 - b1**count_inc
  correction2 = 1 - b2**count_inc
  correction1_next = 1 - b1**optax.safe_increment(count_inc)
  return functools.partial(_adam_step, b1, b2, eps, eps_root, correction1, correction2,
                           correction1_next, nesterov)


def _adam_step(b1, b2, eps, eps_root, correction1, correction2, correction1_next, nesterov,
               g, old, side):
  del side
  m, v = old
  m = (1 - b1) * g + b1 * m
  # |g|**2 for complex leaves, as optax's update_moment_per_elem_norm.
  g_squared = jnp.real(g * jnp.conj(g)) if jnp.iscomplexobj(g) else g * g
  v = (1 - b2) * g_squared + b2 * v
  if nesterov:
    m_hat = b1 * (m / correction1_next.astype(m.dtype)) + (1 - b1) * (
        g / correction1.astype(g.dtype))
  else:
    m_hat = m / correction1.astype(m.dtype)
  v_hat = v / correction2.astype(v.dtype)
  return m_hat / (jnp.sqrt(v_hat + eps_root) + eps), (restart_overflowed(m, v), v)


def restart_overflowed(m, v):
  """The first moment to store: 0 where the new second moment is ``+inf``.

  ``v`` is ``+inf`` where ``g**2`` overflowed float32 (``|g| > 1.8e19``) or
  ``g`` is ``+-inf``. The update of this step is then 0 (or NaN for an
  infinite ``g``), as ``optax.adam``'s. optax keeps ``v = inf`` and freezes
  the element for good; a quantized ``v`` cannot store ``inf`` (scales are
  maxima of the finite values, see `optax4bit.quantize`): it comes back as
  the largest finite value of its block, row or column, or 0. Keeping the
  huge ``m`` beside that would turn the next step into ``m / eps`` (a step of
  1e34 after a gradient of 1e30). So the element's first moment restarts from
  0 instead: the next steps are ordinary Adam steps of the new gradients and
  the bad gradient is dropped, never amplified. With float32 moments this
  changes no update (``v`` stays ``inf``: ``m / inf`` is 0 for any finite
  ``m``). Every backend applies the same rule (the Pallas Adam step calls this
  function, the C++ kernel applies it after its update).
  """
  return jnp.where(jnp.isposinf(v), jnp.zeros((), m.dtype), m)


def factored_step(b1, b2, eps, eps_root, count_inc):
  """Adam's step on the first moment with the second moment rebuilt from its
  Adafactor factors (side inputs ``row``, ``col`` and the mean of ``row``)."""
  return functools.partial(_factored_step, b1, eps, eps_root, 1 - b1**count_inc,
                           1 - b2**count_inc)


def _factored_step(b1, eps, eps_root, correction1, correction2, g, old, side):
  (m,) = old
  row, col, row_mean = side
  m = (1 - b1) * g + b1 * m
  positive = row_mean > 0
  v = jnp.where(positive, row * col / jnp.where(positive, row_mean, 1), 0)
  m_hat = m / correction1.astype(m.dtype)
  v_hat = v / correction2.astype(v.dtype)
  update = m_hat / (jnp.sqrt(v_hat + eps_root) + eps)
  return restart_factored_overflow(g, update, m)


def restart_factored_overflow(g, update, m):
  """`restart_overflowed` for 4-bit Factor, whose factors leave out a
  non-finite ``g**2`` (one bad element must not poison its row and column):
  where ``g**2`` is ``+inf`` the update is ``0 * g`` (0, or NaN for an
  infinite ``g``, as Adam's) and the first moment restarts from 0."""
  overflowed = jnp.isposinf(g * g)
  zero = jnp.zeros((), m.dtype)
  return (jnp.where(overflowed, zero * g, update),
          (jnp.where(overflowed, zero, m),))


def momentum_step(momentum, nesterov: bool):
  """The heavy-ball step of ``optax.trace``."""
  return functools.partial(_momentum_step, momentum, nesterov)


def _momentum_step(momentum, nesterov, g, old, side):
  del side
  (t,) = old
  t = g + momentum * t
  return (g + momentum * t if nesterov else t), (t,)


# Coefficient vectors of the fused kernels.


def _vector(*values) -> jax.Array:
  return jnp.stack([jnp.asarray(v, jnp.float32).reshape(()) for v in values])


def adam_coefficients(b1, b2, eps, eps_root, count_inc) -> jax.Array:
  """Scalars of the Adam step, by the expressions of `adam_step` (reciprocals
  of the bias corrections as XLA computes them, see
  `optax4bit.pallas.optim`)."""
  correction1 = 1 - b1**count_inc
  correction2 = 1 - b2**count_inc
  correction1_next = 1 - b1**optax.safe_increment(count_inc)
  one = np.float32(1)
  return _vector(b1, 1 - b1, b2, 1 - b2, eps, eps_root, correction1, one / correction2,
                 one / correction1, one / correction1_next)


def momentum_coefficients(momentum) -> jax.Array:
  return _vector(momentum)


class FusedStep(NamedTuple):
  """One leaf step for a backend to fuse: ``kind`` (``"adam"``,
  ``"adam_nesterov"``, ``"factored"``, ``"momentum"``,
  ``"momentum_nesterov"``; the keys of `optax4bit.pallas.optim.STEPS`) and the
  hyperparameters of its coefficients (`adam_coefficients` for the Adam and
  factored kinds, `momentum_coefficients` for momentum)."""
  kind: str
  b1: Any = None
  b2: Any = None
  eps: Any = None
  eps_root: Any = None
  count_inc: Any = None
  momentum: Any = None

  @classmethod
  def adam(cls, b1, b2, eps, eps_root, count_inc, nesterov: bool) -> "FusedStep":
    return cls("adam_nesterov" if nesterov else "adam", b1, b2, eps, eps_root, count_inc)

  @classmethod
  def factored(cls, b1, b2, eps, eps_root, count_inc) -> "FusedStep":
    return cls("factored", b1, b2, eps, eps_root, count_inc)

  @classmethod
  def heavy_ball(cls, momentum, nesterov: bool) -> "FusedStep":
    return cls("momentum_nesterov" if nesterov else "momentum", momentum=momentum)

  @property
  def nesterov(self) -> bool:
    return self.kind.endswith("_nesterov")

  def elementwise(self):
    """The elementwise step (`adam_step`, `factored_step` or `momentum_step`)
    of ``kind``, for a backend that runs the step as XLA ops."""
    if self.kind.startswith("momentum"):
      return momentum_step(self.momentum, self.nesterov)
    if self.kind == "factored":
      return factored_step(self.b1, self.b2, self.eps, self.eps_root, self.count_inc)
    return adam_step(self.b1, self.b2, self.eps, self.eps_root, self.count_inc, self.nesterov)

  def coefficients(self) -> jax.Array:
    """The float32 coefficient vector the kernels of ``kind`` take."""
    if self.kind.startswith("momentum"):
      return momentum_coefficients(self.momentum)
    return adam_coefficients(self.b1, self.b2, self.eps, self.eps_root, self.count_inc)
