"""Convergence with quantization forced on every leaf (``min_quantize_size=0``).

In the style of optax's ``alias_test.py``: a parabola, the Rosenbrock function
and a matrix least-squares problem reach their optimum within 3e-2 (rtol and
atol), for every optimizer of the library. And a small MLP on scikit-learn's
digits reaches the test accuracy of ``optax.adamw`` with the same
hyperparameters to within one point (mean over seeds).

Rosenbrock note: with a constant learning rate of 0.1, Adam with a 4-bit first
moment stalls at a distance of about 0.035 from the optimum (a 2-element
tensor quantized with one block scale rounds the smaller moment coarsely; fp32
Adam reaches 4e-4), so the Adam-type optimizers get a cosine decay there, with
which they reach it to 1e-5.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax4bit

STEPS = 10_000
LSQ_STEPS = 2_000


def parabola():
  final = jnp.array([1.0, -1.0, 1.0])
  return jnp.array([-1.0, 10.0, 1.0]), final, lambda p: jnp.sum((p - final)**2)


def rosenbrock():
  a, b = 1.0, 100.0
  return (jnp.array([0.0, 0.0]), jnp.array([a, a**2]),
          lambda p: (a - p[0])**2 + b * (p[1] - p[0]**2)**2)


def least_squares():
  """min_W 0.5 |A W - B|^2 / n for a full-rank A: W* = the planted W."""
  rng = np.random.default_rng(0)
  a = jnp.asarray(rng.normal(size=(128, 48)), jnp.float32)
  w_true = jnp.asarray(rng.normal(size=(48, 96)), jnp.float32)
  b = a @ w_true
  return jnp.zeros((48, 96)), w_true, lambda w: 0.5 * jnp.sum((a @ w - b)**2) / a.shape[0]


TARGETS = {"parabola": (parabola, STEPS), "rosenbrock": (rosenbrock, STEPS),
           "least_squares": (least_squares, LSQ_STEPS)}


def adam_lr(target):
  if target == "parabola":
    return 1e-1
  return optax.cosine_decay_schedule(1e-1, TARGETS[target][1])


SGD_LR = {"parabola": 1e-3, "rosenbrock": 1e-3, "least_squares": 1e-1}

OPTIMIZERS = {
    "adamw_4bit": lambda t: optax4bit.adamw_4bit(adam_lr(t), min_quantize_size=0),
    "adam_4bit": lambda t: optax4bit.adam_4bit(adam_lr(t), min_quantize_size=0),
    "adamw_4bit_factor": lambda t: optax4bit.adamw_4bit_factor(adam_lr(t), min_quantize_size=0),
    "sgdm_4bit": lambda t: optax4bit.sgdm_4bit(SGD_LR[t], momentum=0.9, min_quantize_size=0),
    "adamw_8bit": lambda t: optax4bit.adamw_8bit(adam_lr(t), min_quantize_size=0),
}


def is_quantized(x):
  return isinstance(x, optax4bit.QuantizedArray)


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_optimization(opt_name, target):
  make_target, steps = TARGETS[target]
  initial, final, objective = make_target()
  opt = OPTIMIZERS[opt_name](target)
  state = opt.init(initial)
  # Quantization is really on for the (tiny) parameter.
  assert any(is_quantized(x) for x in jax.tree.leaves(state, is_leaf=is_quantized))
  # A no-op map over the params-shaped parts of the state keeps it usable.
  state = optax.tree.map_params(opt, lambda v: v, state)

  @jax.jit
  def run(params, state):
    def body(carry, _):
      params, state = carry
      updates, state = opt.update(jax.grad(objective)(params), state, params)
      return (optax.apply_updates(params, updates), state), None

    return jax.lax.scan(body, (params, state), None, length=steps)[0]

  params, state = run(initial, state)
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(state)
             if jnp.issubdtype(x.dtype, jnp.floating))
  np.testing.assert_allclose(np.asarray(params), np.asarray(final), rtol=3e-2, atol=3e-2)


# ----------------------------------------------------------------------------
# A small MLP on scikit-learn's digits.


def digits_data():
  from sklearn.datasets import load_digits  # ships its data with the package

  x, y = load_digits(return_X_y=True)
  x = (x / 16.0).astype(np.float32)
  y = y.astype(np.int32)
  perm = np.random.default_rng(0).permutation(len(x))
  x, y = x[perm], y[perm]
  n_train = 1437  # 80 %
  return tuple(map(jnp.asarray, (x[:n_train], y[:n_train], x[n_train:], y[n_train:])))


def init_mlp(key, hidden):
  k1, k2 = jax.random.split(key)
  return {"w1": jax.random.normal(k1, (64, hidden)) * np.sqrt(2 / 64), "b1": jnp.zeros(hidden),
          "w2": jax.random.normal(k2, (hidden, 10)) * np.sqrt(1 / hidden), "b2": jnp.zeros(10)}


def mlp_logits(p, x):
  return jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def mlp_test_accuracy(tx, seeds, *, hidden=128, epochs=10, batch=64):
  """Test accuracy after training from each seed (vmapped over seeds: one
  compilation; data enter as arguments, not as constants)."""
  data = digits_data()
  n_train = data[0].shape[0]
  num_batches = n_train // batch

  def loss(p, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(mlp_logits(p, x), y).mean()

  def train(seed, data):
    x_train, y_train, x_test, y_test = data
    key = jax.random.key(seed)
    params = init_mlp(key, hidden)

    def epoch(carry, k):
      order = jax.random.permutation(k, n_train)[:num_batches * batch]

      def step(carry, idx):
        params, state = carry
        grads = jax.grad(loss)(params, x_train[idx], y_train[idx])
        updates, state = tx.update(grads, state, params)
        return (optax.apply_updates(params, updates), state), None

      return jax.lax.scan(step, carry, order.reshape(num_batches, batch))[0], None

    keys = jax.random.split(jax.random.fold_in(key, 1), epochs)
    params, _ = jax.lax.scan(epoch, (params, tx.init(params)), keys)[0]
    return jnp.mean(jnp.argmax(mlp_logits(params, x_test), -1) == y_test)

  accuracies = jax.jit(jax.vmap(train, in_axes=(0, None)))(jnp.asarray(seeds), data)
  return np.asarray(accuracies)


DIGITS_HPARAMS = dict(learning_rate=3e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4)


@pytest.fixture(scope="module")
def adamw_digits_accuracy():
  return mlp_test_accuracy(optax.adamw(**DIGITS_HPARAMS), seeds=range(4))


@pytest.mark.parametrize("name", ["adamw_4bit"])
def test_digits_mlp_matches_adamw(name, adamw_digits_accuracy):
  tx = getattr(optax4bit, name)(**DIGITS_HPARAMS, min_quantize_size=0)
  acc = mlp_test_accuracy(tx, seeds=range(4))
  ref = adamw_digits_accuracy
  assert ref.mean() > 0.95, ref  # the reference itself trained
  assert acc.mean() >= ref.mean() - 0.01, (acc, ref)


@pytest.mark.slow
def test_digits_mlp_longer_more_seeds():
  """Longer training, more seeds, 4-bit AdamW, 4-bit Factor and 4-bit SGDM
  against their fp32 counterparts. (adamw_8bit is left out: with the
  bitsandbytes recipe its 8-bit DE second moment has a zero code, and input
  pixels that are almost always 0 give rows whose tiny v rounds to 0 while the
  8-bit m does not: some seeds diverge, the zero-point problem again.)"""
  seeds = range(8)
  ref = mlp_test_accuracy(optax.adamw(**DIGITS_HPARAMS), seeds, epochs=30)
  for name in ("adamw_4bit", "adamw_4bit_factor"):
    tx = getattr(optax4bit, name)(**DIGITS_HPARAMS, min_quantize_size=0)
    acc = mlp_test_accuracy(tx, seeds, epochs=30)
    assert acc.mean() >= ref.mean() - 0.01, (name, acc, ref)
  ref = mlp_test_accuracy(optax.sgd(3e-2, momentum=0.9), seeds, epochs=30)
  acc = mlp_test_accuracy(optax4bit.sgdm_4bit(3e-2, momentum=0.9, min_quantize_size=0), seeds,
                          epochs=30)
  assert acc.mean() >= ref.mean() - 0.01, ("sgdm_4bit", acc, ref)
