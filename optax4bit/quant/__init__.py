"""Quantizers of the paper as a jnp reference: tables, normalizations, packing."""

from optax4bit.quant.array import QuantizedArray, dequantize, quantize
from optax4bit.quant.maps import qmap
from optax4bit.quant.spec import QuantSpec

__all__ = ["QuantSpec", "QuantizedArray", "dequantize", "qmap", "quantize"]
