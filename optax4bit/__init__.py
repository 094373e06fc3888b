"""optax4bit: optax optimizers whose moments are stored in 4 bits.

After "Memory Efficient Optimizers with 4-bit States" (Li, Chen, Zhu, 2023).
"""

from optax4bit.quant import QuantSpec, QuantizedArray, dequantize, qmap, quantize

__version__ = "0.1.0"

__all__ = [
    "QuantSpec",
    "QuantizedArray",
    "dequantize",
    "qmap",
    "quantize",
]
