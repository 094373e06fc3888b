"""Fused Pallas GPU kernels (Triton lowering) for the 4-bit optimizers.

* `quantize` / `dequantize`: standalone block-wise, rank-1 and tensor
  quantizer kernels, equal to `optax4bit.quantize` / `optax4bit.dequantize`,
  for every 4-bit map and both roundings (stochastic rounding draws the same
  hashed uniforms as the jnp reference, from the same key).
* Fused optimizer steps (`optax4bit.pallas.optim`): one kernel per leaf reads
  the gradient and the packed moments and writes the update and the
  re-quantized moments; a second pass encodes moments with rank-1 scales.
* Dispatch (`optax4bit.pallas.dispatch`): every optimizer takes
  ``implementation="auto" | "jnp" | "pallas" | "pallas_interpret"`` or a
  `PallasConfig`.

The jnp implementation is the reference; in interpret mode the quantizer
kernels reproduce it bit for bit, and the fused steps up to the float32
contractions XLA chooses (see `optax4bit.pallas._engine` for the design and
for how GPU numerics can differ).
"""

from optax4bit.pallas.dispatch import IMPLEMENTATIONS, PallasConfig, resolve
from optax4bit.pallas.quant import dequantize, quantize

__all__ = ["IMPLEMENTATIONS", "PallasConfig", "dequantize", "quantize", "resolve"]
