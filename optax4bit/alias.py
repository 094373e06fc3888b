"""Ready-made optimizers, built with ``optax.chain`` like optax's aliases (the
presets of `quantize_state` for optax's own optimizers are in `optax4bit.presets`)."""

from __future__ import annotations

import inspect
from typing import Any, Optional

import optax

from optax4bit import param_rounding as _param_rounding
from optax4bit import transform
from optax4bit._validation import DEFAULT_MIN_QUANTIZE_SIZE, MaskOrFn, check_hyperparam
from optax4bit.dispatch import Implementation
from optax4bit.quant.spec import QuantSpec, SpecLike

__all__ = [
    "adam_4bit",
    "adamw_4bit",
    "adamw_4bit_factor",
    "adamw_8bit",
    "inject_hyperparams",
    "sgdm_4bit",
]

# 8-bit dynamic-exponent maps with blocks of 256 for both moments (bitsandbytes).
EIGHT_BIT_FIRST_MOMENT = QuantSpec("block", "DE", bits=8, signed=True, block_size=256)
EIGHT_BIT_SECOND_MOMENT = QuantSpec("block", "DE", bits=8, signed=False, block_size=256)


def _check_learning_rate(learning_rate) -> None:
  check_hyperparam("learning_rate", learning_rate, low=0)


def _check_weight_decay(weight_decay) -> None:
  check_hyperparam("weight_decay", weight_decay, low=0)


def adam_4bit(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Optional[Any] = None,
    *,
    nesterov: bool = False,
    recipe: str = "default",
    first_moment: Optional[SpecLike] = None,
    second_moment: Optional[SpecLike] = None,
    min_quantize_size: int = DEFAULT_MIN_QUANTIZE_SIZE,
    quantize_mask: MaskOrFn = None,
    seed: int = 0,
    chunk_size: Optional[int] = None,
    implementation: Implementation = "auto",
    param_rounding: str = "stochastic",
) -> optax.GradientTransformation:
  """Adam with 4-bit moments: a drop-in for ``optax.adam``.

  ``optax.chain(scale_by_adam_4bit(...), optax.scale_by_learning_rate(lr))``.
  See `scale_by_adam_4bit` for the quantization arguments.

  Args:
    learning_rate: a float or an ``optax`` schedule.
    b1: decay rate of the first moment.
    b2: decay rate of the second moment.
    eps: term added to the denominator outside the square root.
    eps_root: term added to the second moment inside the square root.
    mu_dtype: dtype of first moments kept unquantized (default float32;
      optax's default is the parameters' dtype, but the step's math is
      float32 and such leaves are small). A quantized moment reports it
      (float32 by default); a complex one keeps the moments complex and
      unquantized; a complex parameter's moment stays complex.
    nesterov: Nesterov momentum.
    recipe: ``"default"`` or ``"paper"`` (see `optax4bit.recipes`).
    first_moment: quantizer of the first moment, overriding the recipe's.
    second_moment: quantizer of the second moment, overriding the recipe's.
    min_quantize_size: leaves with at most this many elements stay float32.
    quantize_mask: pytree of bools or callable; ``False`` leaves stay float32.
    seed: seed of stochastic rounding.
    chunk_size: elements per chunk of the update (bounds transient memory).
    implementation: ``"auto"`` (the platform's engine: the Pallas kernels
      on a CUDA GPU, the XLA engine on the leaves they decline; the Pallas
      TPU kernels on a TPU; the C++ kernel of `optax4bit.cpu` on CPUs where
      it beats the jnp path), ``"jnp"``, ``"xla"``, ``"tpu"``, ``"cpu"``,
      ``"pallas"``, ``"pallas_interpret"``, ``"tpu_interpret"`` or an
      ``optax4bit.pallas.PallasConfig`` (see `optax4bit.dispatch`).
    param_rounding: ``"stochastic"`` (default) or ``"nearest"``: how new
      bfloat16/float16 params are rounded (see `adamw_4bit`).

  Returns:
    An ``optax.GradientTransformation``.

  Example:
    >>> import jax, jax.numpy as jnp, optax4bit
    >>> tx = optax4bit.adam_4bit(learning_rate=0.1, min_quantize_size=0)
    >>> params = jnp.full((64, 64), 2.0)
    >>> state = tx.init(params)
    >>> update = jax.jit(tx.update)
    >>> for _ in range(100):
    ...   grads = jax.grad(lambda p: jnp.sum(p ** 2))(params)
    ...   updates, state = update(grads, state)
    ...   params = params + updates
    >>> bool(jnp.max(jnp.abs(params)) < 0.1)
    True
  """
  _check_learning_rate(learning_rate)
  return optax.chain(
      transform.scale_by_adam_4bit(
          b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov, recipe=recipe, first_moment=first_moment,
          second_moment=second_moment, min_quantize_size=min_quantize_size,
          quantize_mask=quantize_mask, seed=seed, chunk_size=chunk_size,
          implementation=implementation),
      optax.scale_by_learning_rate(learning_rate),
      *_param_rounding.rounding_transforms(param_rounding, seed),
  )


def adamw_4bit(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Optional[Any] = None,
    weight_decay: optax.ScalarOrSchedule = 1e-4,
    mask: MaskOrFn = None,
    *,
    nesterov: bool = False,
    recipe: str = "default",
    first_moment: Optional[SpecLike] = None,
    second_moment: Optional[SpecLike] = None,
    min_quantize_size: int = DEFAULT_MIN_QUANTIZE_SIZE,
    quantize_mask: MaskOrFn = None,
    seed: int = 0,
    chunk_size: Optional[int] = None,
    implementation: Implementation = "auto",
    param_rounding: str = "stochastic",
) -> optax.GradientTransformation:
  """AdamW with 4-bit moments (the paper's "4-bit AdamW"): a drop-in for
  ``optax.adamw``.

  About 1 byte per parameter instead of 8. With the default recipe the first
  moment is stored ``B128/NF`` (block-wise normal-float), the second
  ``Rank-1/SqrtLinear`` (rank-1 normalization of ``sqrt(v)``), both rounded
  stochastically;
  ``recipe="paper"`` gives the paper's ``B128/DE`` and ``Rank-1/Linear`` (see
  `optax4bit.recipes`). Weight decay is decoupled and applied exactly as in
  ``optax.adamw``:
  ``chain(scale_by_adam_4bit, add_decayed_weights(weight_decay, mask),
  scale_by_learning_rate(learning_rate))``.

  Args:
    learning_rate: a float or an ``optax`` schedule.
    b1: decay rate of the first moment.
    b2: decay rate of the second moment.
    eps: term added to the denominator outside the square root.
    eps_root: term added to the second moment inside the square root.
    mu_dtype: dtype of first moments kept unquantized (default float32;
      optax's default is the parameters' dtype, but the step's math is
      float32 and such leaves are small). A quantized moment reports it
      (float32 by default); a complex one keeps the moments complex and
      unquantized; a complex parameter's moment stays complex.
    weight_decay: decoupled weight decay (a float or a schedule).
    mask: which leaves get weight decay (as in ``optax.adamw``).
    nesterov: Nesterov momentum.
    recipe: ``"default"`` or ``"paper"`` (see `optax4bit.recipes`).
    first_moment: quantizer of the first moment, overriding the recipe's.
    second_moment: quantizer of the second moment, overriding the recipe's.
    min_quantize_size: leaves with at most this many elements stay float32.
    quantize_mask: pytree of bools or callable; ``False`` leaves stay float32.
    seed: seed of stochastic rounding.
    chunk_size: elements per chunk of the update (bounds transient memory).
    implementation: ``"auto"`` (the platform's engine: the Pallas kernels
      on a CUDA GPU, the XLA engine on the leaves they decline; the Pallas
      TPU kernels on a TPU; the C++ kernel of `optax4bit.cpu` on CPUs where
      it beats the jnp path), ``"jnp"``, ``"xla"``, ``"tpu"``, ``"cpu"``,
      ``"pallas"``, ``"pallas_interpret"``, ``"tpu_interpret"`` or an
      ``optax4bit.pallas.PallasConfig`` (see `optax4bit.dispatch`).
    param_rounding: how new bfloat16/float16 params are rounded:
      ``"stochastic"`` (default) appends `round_params_stochastically`, so
      that updates below half an ulp still move them (on average exactly);
      ``"nearest"`` leaves it to ``optax.apply_updates``, which loses them
      (4.8x the float32 loss on the fit of docs/bfloat16.md). No effect on
      float32 params (they pass through; the state gains a step count).
      With it, ``update`` needs ``params`` for bfloat16 or float16 updates,
      and returns float32 updates for them.

  Returns:
    An ``optax.GradientTransformation``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, optax4bit
    >>> params = {"w": jnp.ones((512, 512)), "b": jnp.zeros(512)}
    >>> tx = optax.chain(optax.clip_by_global_norm(1.0),
    ...                  optax4bit.adamw_4bit(learning_rate=1e-3))
    >>> state = tx.init(params)
    >>> grads = jax.tree.map(jnp.ones_like, params)
    >>> updates, state = jax.jit(tx.update)(grads, state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> optax4bit.state_nbytes(state) < 0.3 * 8 * (512 * 512 + 512)
    True
  """
  _check_learning_rate(learning_rate)
  _check_weight_decay(weight_decay)
  return optax.chain(
      transform.scale_by_adam_4bit(
          b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov, recipe=recipe, first_moment=first_moment,
          second_moment=second_moment, min_quantize_size=min_quantize_size,
          quantize_mask=quantize_mask, seed=seed, chunk_size=chunk_size,
          implementation=implementation),
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(learning_rate),
      *_param_rounding.rounding_transforms(param_rounding, seed),
  )


def adamw_4bit_factor(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    weight_decay: optax.ScalarOrSchedule = 1e-4,
    mask: MaskOrFn = None,
    *,
    recipe: str = "default",
    first_moment: Optional[SpecLike] = None,
    second_moment: Optional[SpecLike] = None,
    min_quantize_size: int = DEFAULT_MIN_QUANTIZE_SIZE,
    quantize_mask: MaskOrFn = None,
    factor_mask: MaskOrFn = None,
    seed: int = 0,
    chunk_size: Optional[int] = None,
    implementation: Implementation = "auto",
    param_rounding: str = "stochastic",
) -> optax.GradientTransformation:
  """The paper's "4-bit Factor": 4-bit first moment, factored second moment.

  About 0.5 byte per parameter of state. The second moment of every quantized
  tensor with ndim >= 2 is kept as Adafactor row and column factors (see
  `scale_by_factored_adam_4bit`); 1-D tensors, and those ``factor_mask``
  leaves unfactored, store it with ``second_moment``.

  Args:
    learning_rate: a float or an ``optax`` schedule.
    b1: decay rate of the first moment.
    b2: decay rate of the second moment.
    eps: term added to the denominator outside the square root.
    eps_root: term added to the second moment inside the square root.
    weight_decay: decoupled weight decay (a float or a schedule).
    mask: which leaves get weight decay (as in ``optax.adamw``).
    recipe: ``"default"`` or ``"paper"`` (see `optax4bit.recipes`).
    first_moment: quantizer of the first moment, overriding the recipe's.
    second_moment: quantizer of the second moment of 1-D tensors (and of those
      ``factor_mask`` leaves unfactored), overriding the recipe's.
    min_quantize_size: leaves with at most this many elements stay float32.
    quantize_mask: pytree of bools or callable; ``False`` leaves stay float32.
    factor_mask: pytree of bools or callable; ``False`` leaves keep a rank-1
      4-bit second moment (0.5 byte per parameter more) instead of factors.
      Factoring attention's matrices is what costs Factor on byte LMs (see
      the README's "Which recipe"); None factors every tensor of two or more
      axes.
    seed: seed of stochastic rounding.
    chunk_size: elements per chunk of the update (bounds transient memory).
    implementation: ``"auto"`` (the platform's engine: the Pallas kernels
      on a CUDA GPU, the XLA engine on the leaves they decline; the Pallas
      TPU kernels on a TPU; the C++ kernel of `optax4bit.cpu` on CPUs where
      it beats the jnp path), ``"jnp"``, ``"xla"``, ``"tpu"``, ``"cpu"``,
      ``"pallas"``, ``"pallas_interpret"``, ``"tpu_interpret"`` or an
      ``optax4bit.pallas.PallasConfig`` (see `optax4bit.dispatch`).
    param_rounding: ``"stochastic"`` (default) or ``"nearest"``: how new
      bfloat16/float16 params are rounded (see `adamw_4bit`).

  Returns:
    An ``optax.GradientTransformation``.

  Example:
    >>> import jax.numpy as jnp, optax4bit
    >>> tx = optax4bit.adamw_4bit_factor(learning_rate=1e-3)
    >>> state = tx.init({"w": jnp.zeros((1024, 1024))})
    >>> optax4bit.state_nbytes(state) / (1024 * 1024) < 0.55
    True
  """
  _check_learning_rate(learning_rate)
  _check_weight_decay(weight_decay)
  return optax.chain(
      transform.scale_by_factored_adam_4bit(
          b1, b2, eps, eps_root, recipe=recipe, first_moment=first_moment,
          second_moment=second_moment,
          min_quantize_size=min_quantize_size, quantize_mask=quantize_mask,
          factor_mask=factor_mask, seed=seed,
          chunk_size=chunk_size, implementation=implementation),
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(learning_rate),
      *_param_rounding.rounding_transforms(param_rounding, seed),
  )


def adamw_8bit(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Optional[Any] = None,
    weight_decay: optax.ScalarOrSchedule = 1e-4,
    mask: MaskOrFn = None,
    *,
    nesterov: bool = False,
    min_quantize_size: int = DEFAULT_MIN_QUANTIZE_SIZE,
    quantize_mask: MaskOrFn = None,
    chunk_size: Optional[int] = None,
    implementation: Implementation = "auto",
    param_rounding: str = "stochastic",
) -> optax.GradientTransformation:
  """AdamW with 8-bit moments (the bitsandbytes recipe): both moments 8-bit
  dynamic exponent, block-wise with blocks of 256. About 2 bytes per parameter.

  The 8-bit unsigned DE map has a zero code, so a second moment below about
  3e-7 of its block's maximum is stored as 0 (the paper's zero-point problem,
  much rarer at 8 bits than at 4). Where a parameter's gradient is almost
  always 0 next to large ones (e.g. the input weights of constant pixels) the
  step can become ``m / eps``; one of three seeds of the digits MLP test
  diverged that way. ``adamw_4bit(..., second_moment=QuantSpec("block",
  "DE-0", bits=8, block_size=256))`` keeps 8 bits without a zero code.

  Args:
    learning_rate: a float or an ``optax`` schedule.
    b1: decay rate of the first moment.
    b2: decay rate of the second moment.
    eps: term added to the denominator outside the square root.
    eps_root: term added to the second moment inside the square root.
    mu_dtype: dtype of first moments kept unquantized (default float32;
      optax's default is the parameters' dtype, but the step's math is
      float32 and such leaves are small). A quantized moment reports it
      (float32 by default); a complex one keeps the moments complex and
      unquantized; a complex parameter's moment stays complex.
    weight_decay: decoupled weight decay (a float or a schedule).
    mask: which leaves get weight decay (as in ``optax.adamw``).
    nesterov: Nesterov momentum.
    min_quantize_size: leaves with at most this many elements stay float32.
    quantize_mask: pytree of bools or callable; ``False`` leaves stay float32.
    chunk_size: elements per chunk of the update (bounds transient memory).
    implementation: ``"auto"`` (the platform's engine: the Pallas kernels
      on a CUDA GPU, the XLA engine on the leaves they decline; the Pallas
      TPU kernels on a TPU; the C++ kernel of `optax4bit.cpu` on CPUs where
      it beats the jnp path), ``"jnp"``, ``"xla"``, ``"tpu"``, ``"cpu"``,
      ``"pallas"``, ``"pallas_interpret"``, ``"tpu_interpret"`` or an
      ``optax4bit.pallas.PallasConfig`` (see `optax4bit.dispatch`).
    param_rounding: ``"stochastic"`` (default) or ``"nearest"``: how new
      bfloat16/float16 params are rounded (see `adamw_4bit`).

  Returns:
    An ``optax.GradientTransformation``.

  Example:
    >>> import jax.numpy as jnp, optax4bit
    >>> state = optax4bit.adamw_8bit(1e-3).init({"w": jnp.zeros((1024, 1024))})
    >>> round(optax4bit.state_nbytes(state) / (1024 * 1024), 2)
    2.03
  """
  return adamw_4bit(
      learning_rate, b1, b2, eps, eps_root, mu_dtype, weight_decay, mask, nesterov=nesterov,
      first_moment=EIGHT_BIT_FIRST_MOMENT, second_moment=EIGHT_BIT_SECOND_MOMENT,
      min_quantize_size=min_quantize_size, quantize_mask=quantize_mask, chunk_size=chunk_size,
      implementation=implementation, param_rounding=param_rounding)


def sgdm_4bit(
    learning_rate: optax.ScalarOrSchedule,
    momentum: float = 0.9,
    nesterov: bool = False,
    accumulator_dtype: Optional[Any] = None,
    *,
    recipe: str = "default",
    first_moment: Optional[SpecLike] = None,
    min_quantize_size: int = DEFAULT_MIN_QUANTIZE_SIZE,
    quantize_mask: MaskOrFn = None,
    seed: int = 0,
    chunk_size: Optional[int] = None,
    implementation: Implementation = "auto",
    param_rounding: str = "stochastic",
) -> optax.GradientTransformation:
  """SGD with a 4-bit momentum buffer: a drop-in for
  ``optax.sgd(learning_rate, momentum, nesterov, accumulator_dtype)``.

  Args:
    learning_rate: a float or an ``optax`` schedule.
    momentum: decay of the momentum buffer.
    nesterov: Nesterov momentum.
    accumulator_dtype: dtype of a momentum buffer kept unquantized (default
      float32; optax's default is the parameters' dtype). A quantized buffer
      reports it (float32 by default); a complex one keeps the buffer complex
      and unquantized.
    recipe: ``"default"`` (momentum ``B128/NF``, rounded stochastically
      where nearest rounding would keep its stored code) or
      ``"paper"`` (``B128/DE``, nearest rounding).
    first_moment: quantizer of the momentum buffer, overriding the recipe's.
    min_quantize_size: leaves with at most this many elements stay float32.
    quantize_mask: pytree of bools or callable; ``False`` leaves stay float32.
    seed: seed of stochastic rounding.
    chunk_size: elements per chunk of the update (bounds transient memory).
    implementation: ``"auto"`` (the platform's engine: the Pallas kernels
      on a CUDA GPU, the XLA engine on the leaves they decline; the Pallas
      TPU kernels on a TPU; the C++ kernel of `optax4bit.cpu` on CPUs where
      it beats the jnp path), ``"jnp"``, ``"xla"``, ``"tpu"``, ``"cpu"``,
      ``"pallas"``, ``"pallas_interpret"``, ``"tpu_interpret"`` or an
      ``optax4bit.pallas.PallasConfig`` (see `optax4bit.dispatch`).
    param_rounding: ``"stochastic"`` (default) or ``"nearest"``: how new
      bfloat16/float16 params are rounded (see `adamw_4bit`).

  Returns:
    An ``optax.GradientTransformation``.

  Example:
    >>> import jax.numpy as jnp, optax4bit
    >>> tx = optax4bit.sgdm_4bit(learning_rate=0.1, momentum=0.9)
    >>> state = tx.init({"w": jnp.zeros((128, 128))})
    >>> optax4bit.state_nbytes(state) / (128 * 128) < 0.6
    True
  """
  _check_learning_rate(learning_rate)
  return optax.chain(
      transform.scale_by_momentum_4bit(
          momentum, nesterov, accumulator_dtype, recipe=recipe, first_moment=first_moment, min_quantize_size=min_quantize_size,
          quantize_mask=quantize_mask, seed=seed, chunk_size=chunk_size,
          implementation=implementation),
      optax.scale_by_learning_rate(learning_rate),
      *_param_rounding.rounding_transforms(param_rounding, seed),
  )


# Arguments that must not be turned into arrays by optax.inject_hyperparams:
# they fix shapes and the quantization layout, or are masks (callables).
STATIC_ARGS = ("min_quantize_size", "chunk_size", "quantize_mask", "mask", "seed")


def inject_hyperparams(inner_factory, static_args=(), hyperparam_dtype=None):
  """``optax.inject_hyperparams`` with this library's structural arguments
  (``min_quantize_size``, ``chunk_size``, masks, ``seed``) kept static.

  ``optax.inject_hyperparams`` turns every number (defaults included) into an
  array; ``min_quantize_size`` and ``chunk_size`` decide shapes, so with plain
  ``optax.inject_hyperparams`` pass them in ``static_args`` yourself.

  Args:
    inner_factory: e.g. `adamw_4bit`.
    static_args: more arguments to keep static.
    hyperparam_dtype: as in ``optax.inject_hyperparams``.

  Returns:
    What ``optax.inject_hyperparams`` returns.

  Example:
    >>> import jax.numpy as jnp, optax4bit
    >>> tx = optax4bit.inject_hyperparams(optax4bit.adamw_4bit)(learning_rate=1e-3)
    >>> state = tx.init({"w": jnp.zeros((128, 128))})
    >>> state.hyperparams["learning_rate"] = 1e-4  # change it between steps
    >>> round(float(state.hyperparams["b1"]), 6)
    0.9
  """
  if isinstance(static_args, str):
    static_args = (static_args,)
  params = inspect.signature(inner_factory).parameters
  static = tuple(a for a in STATIC_ARGS if a in params) + tuple(static_args)
  return optax.inject_hyperparams(inner_factory, static_args=static,
                                  hyperparam_dtype=hyperparam_dtype)
