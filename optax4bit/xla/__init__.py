"""The XLA engine: each leaf's fused step as whole-leaf XLA ops, for
accelerators without the Pallas kernels (TPUs, GPUs where Pallas' Triton
backend is absent): `steps.XlaSteps` and its fusible 4-bit codecs `codec`.

Example:
  >>> import jax, jax.numpy as jnp, optax4bit
  >>> tx = optax4bit.adamw_4bit(1e-3, implementation="xla")
  >>> params = {"w": jnp.zeros((64, 128))}
  >>> updates, state = jax.jit(tx.update)(params, tx.init(params), params)
"""

from optax4bit.xla import codec, steps
from optax4bit.xla.steps import XlaSteps

__all__ = ["XlaSteps", "codec", "steps"]
