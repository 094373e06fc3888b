"""Fused Pallas GPU kernels (Triton lowering) for the 4-bit optimizers.

* `quantize` / `dequantize`: standalone block-wise, rank-1 and tensor
  quantizer kernels, equal to `optax4bit.quantize` / `optax4bit.dequantize`,
  for every 4-bit map and both roundings (stochastic rounding draws the same
  hashed uniforms as the jnp reference, from the same key).
* Fused optimizer steps (`optax4bit.pallas.optim`): one kernel per leaf reads
  the gradient and the packed moments and writes the update and the
  re-quantized moments in place; moments with rank-1 scales first take a
  stats pass for their maxima.
* `optax4bit.pallas.steps`: the fused steps of one leaf and `PallasConfig`;
  every optimizer takes ``implementation="pallas" | "pallas_interpret"`` or a
  `PallasConfig` (`optax4bit.dispatch.resolve` picks the backend).

The jnp implementation is the reference. In interpret mode the quantizer
kernels reproduce it bit for bit; the fused steps match it to a few ulps of
the update (the float32 contractions XLA chooses differ; see
`optax4bit.pallas._engine` for the design and for how GPU numerics can
differ), with codes equal where no value sits on a rounding boundary.
"""

from optax4bit._validation import IMPLEMENTATIONS
from optax4bit.pallas.steps import PallasConfig
from optax4bit.pallas.quant import dequantize, quantize

__all__ = ["IMPLEMENTATIONS", "PallasConfig", "dequantize", "quantize"]
