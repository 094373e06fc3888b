"""The TPU engine: each 4-bit or 8-bit leaf's fused step as Pallas TPU (Mosaic)
kernels, `steps.TpuSteps` (``implementation="tpu"``; ``"tpu_interpret"``
runs them in Pallas interpret mode on any backend, for tests).

Example:
  >>> import jax, jax.numpy as jnp, optax4bit
  >>> tx = optax4bit.adamw_4bit(1e-3, implementation="tpu_interpret")
  >>> params = {"w": jnp.zeros((64, 256))}
  >>> updates, state = jax.jit(tx.update)(params, tx.init(params), params)
"""

from optax4bit.tpu import steps
from optax4bit.tpu.steps import TpuSteps

__all__ = ["TpuSteps", "steps"]
