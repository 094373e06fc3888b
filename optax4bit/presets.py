"""Presets of `quantize_state` for optax's own optimizers: `lion_4bit`,
`ademamix_4bit` and `muon_4bit`, each the optax optimizer with its stateful
part wrapped."""

from __future__ import annotations

from typing import Any, Mapping, Optional

import optax

from optax4bit import param_rounding as _param_rounding
from optax4bit._validation import DEFAULT_MIN_QUANTIZE_SIZE, MaskOrFn, check_hyperparam
from optax4bit.quant.spec import QuantSpec
from optax4bit.wrappers import quantize_state

__all__ = ["MUON_MOMENTUM", "MUON_MOMENTUM_8BIT", "ademamix_4bit", "lion_4bit", "muon_4bit"]

# muon_4bit's 4-bit momentum (blocks of 32, stochastic rounding), and its
# default, the 8-bit one that tracks fp32 Muon; see its docstring.
MUON_MOMENTUM = QuantSpec("block", "NF", bits=4, signed=True, block_size=32, stochastic=True)
MUON_MOMENTUM_8BIT = QuantSpec("block", "DE", bits=8, signed=True, block_size=2048,
                               stochastic=False)


def lion_4bit(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.99,
    mu_dtype: Optional[Any] = None,
    weight_decay: optax.ScalarOrSchedule = 1e-3,
    mask: MaskOrFn = None,
    *,
    spec_for=None,
    min_quantize_size: int = DEFAULT_MIN_QUANTIZE_SIZE,
    quantize_mask: MaskOrFn = None,
    implementation: str = "auto",
    seed: int = 0,
    chunk_size: Optional[int] = None,
    recipe: str = "default",
    param_rounding: str = "stochastic",
) -> optax.GradientTransformationExtraArgs:
  """Lion with a 4-bit momentum: a drop-in for ``optax.lion``.

  The momentum is stored ``B128/NF`` with stochastic rounding (``B128/DE``
  with ``recipe="paper"``): Lion's momentum is an EMA with decay
  ``b2 = 0.99``, which round-to-nearest at 4 bits freezes.

  ``optax.chain(quantize_state(optax.scale_by_lion(b1, b2, mu_dtype)),
  optax.add_decayed_weights(weight_decay, mask),
  optax.scale_by_learning_rate(learning_rate))``, the composition of
  ``optax.lion`` with only the stateful part wrapped. About 0.53 byte of
  state per parameter instead of 4.

  Args:
    learning_rate: a float or an ``optax`` schedule.
    b1: rate to combine the momentum and the current gradient.
    b2: decay rate of the momentum.
    mu_dtype: dtype of the momentum when kept unquantized.
    weight_decay: decoupled weight decay (as in ``optax.lion``).
    mask: which leaves get weight decay.
    spec_for: see `quantize_state` (e.g. ``{"mu": "B2048/DE"}``).
    min_quantize_size: leaves with at most this many elements stay in full
      precision.
    quantize_mask: pytree of bools or callable; ``False`` leaves stay in
      full precision.
    implementation: ``"auto"`` / ``"jnp"`` (see `quantize_state`).
    seed: seed of stochastic rounding.
    chunk_size: elements per chunk of the update (bounds transient memory).
    recipe: ``"default"`` or ``"paper"`` quantizers (see `quantize_state`).
    param_rounding: ``"stochastic"`` (default) or ``"nearest"``: how new
      bfloat16/float16 params are rounded (see `optax4bit.adamw_4bit`; no
      effect on float32 params).

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, optax4bit
    >>> tx = optax4bit.lion_4bit(learning_rate=1e-4)
    >>> params = {"w": jnp.zeros((1024, 1024))}
    >>> state = tx.init(params)
    >>> round(optax4bit.state_nbytes(state) / (1024 * 1024), 3)
    0.531
    >>> grads = {"w": jnp.ones((1024, 1024))}
    >>> updates, state = jax.jit(tx.update)(grads, state, params)
    >>> round(float(updates["w"][0, 0]), 6)
    -0.0001
  """
  check_hyperparam("learning_rate", learning_rate, low=0)
  check_hyperparam("weight_decay", weight_decay, low=0)
  check_hyperparam("b1", b1, low=0, high=1)
  check_hyperparam("b2", b2, low=0, high=1)
  return optax.chain(
      quantize_state(optax.scale_by_lion(b1=b1, b2=b2, mu_dtype=mu_dtype), spec_for=spec_for,
                     min_quantize_size=min_quantize_size, quantize_mask=quantize_mask,
                     implementation=implementation, per_leaf=True, seed=seed,
                     chunk_size=chunk_size, recipe=recipe),
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(learning_rate),
      *_param_rounding.rounding_transforms(param_rounding, seed),
  )


def ademamix_4bit(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    b3: optax.ScalarOrSchedule = 0.9999,
    alpha: optax.ScalarOrSchedule = 5.0,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Optional[Any] = None,
    weight_decay: float = 0.0,
    mask: MaskOrFn = None,
    *,
    spec_for=None,
    min_quantize_size: int = DEFAULT_MIN_QUANTIZE_SIZE,
    quantize_mask: MaskOrFn = None,
    implementation: str = "auto",
    seed: int = 0,
    chunk_size: Optional[int] = None,
    recipe: str = "default",
    param_rounding: str = "stochastic",
) -> optax.GradientTransformationExtraArgs:
  """AdEMAMix with 4-bit states: a drop-in for ``optax.contrib.ademamix``.

  Both EMAs of the gradient (``m1``, ``m2``) are stored ``B128/NF`` with
  stochastic rounding and the second moment ``nu`` ``Rank-1/SqrtLinear``, also
  stochastic (``recipe="paper"``: ``B128/DE``, ``m2`` stochastic, and
  ``Rank-1/Linear``): about 1.6 bytes of state per
  parameter instead of 12. The composition of ``optax.contrib.ademamix`` with
  the stateful part wrapped:
  ``optax.chain(quantize_state(optax.contrib.scale_by_ademamix(...)),
  optax.add_decayed_weights(weight_decay, mask),
  optax.scale_by_learning_rate(learning_rate))``.

  Only available when the installed optax has
  ``optax.contrib.scale_by_ademamix`` (optax >= 0.2.4); otherwise raises
  ``NotImplementedError``.

  Args:
    learning_rate: a float or an ``optax`` schedule.
    b1: decay rate of the fast EMA.
    b2: decay rate of the second moment.
    b3: decay rate of the slow EMA (a float or a schedule).
    alpha: mixing coefficient of the slow EMA (a float or a schedule).
    eps: term added to the denominator outside the square root.
    eps_root: term added to the second moment inside the square root.
    mu_dtype: dtype of the accumulators when kept unquantized.
    weight_decay: decoupled weight decay (as in ``optax.contrib.ademamix``).
    mask: which leaves get weight decay.
    spec_for: see `quantize_state`.
    min_quantize_size: leaves with at most this many elements stay in full
      precision.
    quantize_mask: pytree of bools or callable; ``False`` leaves stay in
      full precision.
    implementation: ``"auto"`` / ``"jnp"`` (see `quantize_state`).
    seed: seed of stochastic rounding.
    chunk_size: elements per chunk of the update (bounds transient memory).
    recipe: ``"default"`` or ``"paper"`` quantizers (see `quantize_state`).
    param_rounding: ``"stochastic"`` (default) or ``"nearest"``: how new
      bfloat16/float16 params are rounded (see `optax4bit.adamw_4bit`; no
      effect on float32 params).

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Example:
    >>> import jax.numpy as jnp, optax4bit
    >>> tx = optax4bit.ademamix_4bit(learning_rate=1e-3)
    >>> state = tx.init({"w": jnp.zeros((1024, 1024))})
    >>> round(optax4bit.state_nbytes(state) / (1024 * 1024), 2)
    1.57
  """
  contrib = getattr(optax, "contrib", None)
  scale_by_ademamix = getattr(contrib, "scale_by_ademamix", None)
  if scale_by_ademamix is None:
    raise NotImplementedError(
        f"ademamix_4bit needs optax.contrib.scale_by_ademamix, which optax {optax.__version__} "
        "does not have (optax >= 0.2.4 does).")
  check_hyperparam("learning_rate", learning_rate, low=0)
  check_hyperparam("weight_decay", weight_decay, low=0)
  return optax.chain(
      quantize_state(scale_by_ademamix(b1=b1, b2=b2, b3=b3, alpha=alpha, eps=eps,
                                       eps_root=eps_root, mu_dtype=mu_dtype),
                     spec_for=spec_for, min_quantize_size=min_quantize_size,
                     quantize_mask=quantize_mask, implementation=implementation,
                     per_leaf=True, seed=seed, chunk_size=chunk_size, recipe=recipe),
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(learning_rate),
      *_param_rounding.rounding_transforms(param_rounding, seed),
  )


def muon_4bit(
    learning_rate: optax.ScalarOrSchedule,
    ns_coeffs=(3.4445, -4.775, 2.0315),
    ns_steps: int = 5,
    beta: float = 0.95,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    weight_decay_mask: MaskOrFn = None,
    mu_dtype: Optional[Any] = None,
    *,
    nesterov: bool = True,
    recipe: str = "default",
    spec_for=None,
    min_quantize_size: int = DEFAULT_MIN_QUANTIZE_SIZE,
    quantize_mask: MaskOrFn = None,
    seed: int = 0,
    chunk_size: Optional[int] = None,
    implementation: str = "auto",
    param_rounding: str = "stochastic",
    **muon_kwargs,
) -> optax.GradientTransformationExtraArgs:
  """Muon with a quantized (by default 8-bit) momentum: a drop-in for ``optax.contrib.muon``.

  ``quantize_state(optax.contrib.muon(...))``: Muon orthogonalizes the
  momentum of each matrix (Newton-Schulz) and runs Adam on the other
  parameters (``optax.multi_transform``); both run per leaf, so the wrapper
  runs them one leaf after another. **By default the momentum of the
  matrices is stored in 8 bits**, ``B2048/DE`` with rounding to nearest
  (`MUON_MOMENTUM_8BIT`), Adam's moments with the library's recipe
  (``recipe="default"``: ``B128/NF`` and ``Rank-1/SqrtLinear``, stochastic; or
  ``"paper"``): about 1.0 byte of state per matrix parameter instead of 4.
  ``spec_for={"MuonState.mu": optax4bit.presets.MUON_MOMENTUM}`` stores it
  in 4 bits (``B32/NF``, stochastic rounding; about 0.63 byte).

  Why 8 bits (issue 36): on the paired byte-level LM of
  benchmarks/quality.py at Muon's usual learning rate (0.02 on the
  matrices; benchmarks/bf16_quality.py, 2000 steps) the 4-bit momentum's
  validation loss is 3.1% above fp32 Muon's over the second half of training
  (3 seeds, growing from 1.9% at step 200 to 3.3% at 2000), the 8-bit one's
  -0.3%, against the 1% the 4-bit default had to meet.

  **At small learning rates a 4-bit momentum lags fp32 Muon** too: on the
  least-squares problem of benchmarks/history/log-to-2026-11.md ("4-bit Muon") the loss
  after 200 steps is 3.9x fp32 Muon's at learning rate 1e-2, 2.75x at 2e-2,
  1.35x at 3e-2 and 1.07x at 1e-1. Newton-Schulz maps every singular value
  of the momentum to about 1, so quantization noise in its small singular
  directions is amplified as much as the signal: a 4-bit momentum's relative
  error of 12-16% becomes an update 67-119% off fp32's, and no 4-bit block
  size, map or rounding measured reaches 1.5x at 1e-2 (blocks of 8: 2.75x;
  nearest rounding freezes the momentum: 28x). The 8-bit momentum (25% of
  fp32 Muon's state) cuts the update error to 13-34% and the gap to 1.29x
  at 1e-2, 1.15x at 2e-2 and about 1x above. Its rounding must be nearest: stochastic rounding's fresh noise at every step
  accumulates as a full-rank error that Newton-Schulz amplifies (8-bit
  stochastic: 4.25x).

  Args:
    learning_rate: a float or an ``optax`` schedule.
    ns_coeffs: Newton-Schulz coefficients (as in ``optax.contrib.muon``).
    ns_steps: Newton-Schulz iterations.
    beta: decay rate of the momentum.
    eps: term added to denominators (Newton-Schulz normalization).
    weight_decay: decoupled weight decay of the matrices.
    weight_decay_mask: which leaves get weight decay.
    mu_dtype: dtype of the momentum when kept unquantized.
    nesterov: Nesterov momentum.
    recipe: ``"default"`` or ``"paper"`` quantizers (see `quantize_state`).
    spec_for: per-field quantizers (see `quantize_state`), e.g.
      ``{"MuonState.mu": "B128/NF"}``; the momentum gets
      `MUON_MOMENTUM_8BIT` unless it names it.
    min_quantize_size: leaves with at most this many elements stay in full
      precision.
    quantize_mask: pytree of bools or callable; ``False`` leaves stay in
      full precision.
    seed: seed of stochastic rounding.
    chunk_size: elements per chunk of elementwise updates.
    implementation: ``"auto"`` / ``"jnp"`` (see `quantize_state`).
    param_rounding: ``"stochastic"`` (default) or ``"nearest"``: how new
      bfloat16/float16 params are rounded (see `optax4bit.adamw_4bit`; no
      effect on float32 params).
    **muon_kwargs: any other argument of the installed
      ``optax.contrib.muon`` (``adaptive``, ``adam_b1``, ``adam_b2``,
      ``adam_weight_decay``, ...), passed through.

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Example:
    >>> import jax, jax.numpy as jnp, optax4bit
    >>> tx = optax4bit.muon_4bit(learning_rate=1e-2)
    >>> params = {"w": jnp.zeros((1024, 1024)), "b": jnp.zeros(1024)}
    >>> state = tx.init(params)
    >>> round(optax4bit.state_nbytes(state) / (1024 * 1024), 2)
    1.01
    >>> grads = {"w": jnp.ones((1024, 1024)), "b": jnp.ones(1024)}
    >>> updates, state = jax.jit(tx.update)(grads, state, params)
  """
  if spec_for is None:
    spec_for = {"MuonState.mu": MUON_MOMENTUM_8BIT}
  elif isinstance(spec_for, Mapping) and not {"mu", "MuonState.mu"} & set(spec_for):
    spec_for = {"MuonState.mu": MUON_MOMENTUM_8BIT, **spec_for}
  contrib = getattr(optax, "contrib", None)
  muon = getattr(contrib, "muon", None)
  if muon is None:
    raise NotImplementedError(
        f"muon_4bit needs optax.contrib.muon, which optax {optax.__version__} does not have.")
  check_hyperparam("learning_rate", learning_rate, low=0)
  check_hyperparam("weight_decay", weight_decay, low=0)
  check_hyperparam("beta", beta, low=0, high=1, high_open=True)
  inner = muon(learning_rate, ns_coeffs=ns_coeffs, ns_steps=ns_steps, beta=beta, eps=eps,
               weight_decay=weight_decay, weight_decay_mask=weight_decay_mask,
               mu_dtype=mu_dtype, nesterov=nesterov, **muon_kwargs)
  rounding = _param_rounding.rounding_transforms(param_rounding, seed)
  quantized = quantize_state(inner, spec_for=spec_for, min_quantize_size=min_quantize_size,
                             quantize_mask=quantize_mask, seed=seed, chunk_size=chunk_size,
                             recipe=recipe, implementation=implementation)
  return optax.chain(quantized, *rounding) if rounding else quantized
