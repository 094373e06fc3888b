"""optax4bit: optax optimizers whose moments are stored in 4 bits.

After "Memory Efficient Optimizers with 4-bit States" (Li, Chen, Zhu, 2023).

Example:
  >>> import jax.numpy as jnp, optax, optax4bit
  >>> tx = optax.chain(optax.clip_by_global_norm(1.0), optax4bit.adamw_4bit(1e-3))
  >>> state = tx.init({"w": jnp.zeros((256, 256))})
"""

import importlib.metadata

from optax4bit.alias import (
    adam_4bit,
    adamw_4bit,
    adamw_4bit_factor,
    adamw_8bit,
    inject_hyperparams,
    sgdm_4bit,
)
from optax4bit.presets import ademamix_4bit, lion_4bit, muon_4bit
from optax4bit.quant import QuantizedArray, QuantSpec, dequantize, qmap, quantize
from optax4bit.offload import offload_state
from optax4bit.param_rounding import RoundParamsStochasticallyState, round_params_stochastically
from optax4bit.sharding import shard_optimizer, state_partition_spec, state_shardings
from optax4bit.transform import (
    FactoredMoment,
    ScaleByAdam4bitState,
    ScaleByFactoredAdam4bitState,
    ScaleByMomentum4bitState,
    scale_by_adam_4bit,
    scale_by_factored_adam_4bit,
    scale_by_momentum_4bit,
    state_nbytes,
)
from optax4bit.wrappers import KNOWN_STATE_FIELDS, QuantizedState, quantize_state
from optax4bit import diagnostics  # submodule; its plots import matplotlib lazily
from optax4bit import recipes  # submodule: recipe names and resolve()

try:
  __version__ = importlib.metadata.version("optax4bit")
except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
  __version__ = "0+unknown"

__all__ = [
    "FactoredMoment",
    "KNOWN_STATE_FIELDS",
    "QuantSpec",
    "QuantizedArray",
    "QuantizedState",
    "RoundParamsStochasticallyState",
    "ScaleByAdam4bitState",
    "ScaleByFactoredAdam4bitState",
    "ScaleByMomentum4bitState",
    "adam_4bit",
    "adamw_4bit",
    "adamw_4bit_factor",
    "adamw_8bit",
    "ademamix_4bit",
    "dequantize",
    "diagnostics",
    "inject_hyperparams",
    "lion_4bit",
    "muon_4bit",
    "offload_state",
    "qmap",
    "quantize",
    "quantize_state",
    "recipes",
    "round_params_stochastically",
    "scale_by_adam_4bit",
    "scale_by_factored_adam_4bit",
    "scale_by_momentum_4bit",
    "sgdm_4bit",
    "shard_optimizer",
    "state_nbytes",
    "state_partition_spec",
    "state_shardings",
]
