"""Shared helpers of the examples and the training benchmarks.

* `make_optimizer`: an optimizer by name (``adamw``, ``adamw_4bit``, ...), or
  any quantizer configuration of the paper's ablation (``--first-moment``,
  ``--second-moment``, or a named preset such as ``v=Rank-1/DE-0``).
* `load_stdlib_corpus`: the byte-level text corpus of the LM example: the
  Python standard library's own source files, split by file.
* `TransformerLM`, `MLP`, `CNN`: small Flax NNX models.
* `train`: a jitted training loop shared by the LM and digits examples.
* `save_json`, `plot_curves`: outputs (JSON, PNG with matplotlib's Agg backend).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
import zlib
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

# Run from a checkout without installing: `python examples/train_lm.py`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import optax4bit  # pylint: disable=wrong-import-position

# ----------------------------------------------------------------------------
# Optimizers.

OPTIMIZERS = ("adamw", "adamw_4bit", "adamw_4bit_factor", "adamw_8bit", "adafactor", "sgdm",
              "sgdm_4bit", "muon", "muon_4bit")

# The second-moment rows of the paper's Table 1 (first moment fixed at B128/DE).
# "Factor" is the factored second moment of `adamw_4bit_factor`.
ABLATION_SECOND_MOMENTS = ("B2048/DE", "B128/DE", "B128/DE-0", "Rank-1/DE-0", "Rank-1/Linear",
                           "Factor")
PRESETS = {f"v={name}": ("B128/DE", name) for name in ABLATION_SECOND_MOMENTS}


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """What `make_optimizer` builds.

  ``name`` is one of `OPTIMIZERS` or an ablation preset (a key of `PRESETS`).
  ``first_moment``/``second_moment`` override the quantizers of the 4-bit
  AdamW family (a ``second_moment`` of ``"Factor"`` means the factored second
  moment of ``adamw_4bit_factor``).
  """
  name: str = "adamw"
  learning_rate: float = 1e-3
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  momentum: float = 0.9
  first_moment: Optional[str] = None
  second_moment: Optional[str] = None
  stochastic_rounding: bool = False
  min_quantize_size: int = 4096
  clip_norm: Optional[float] = 1.0
  warmup_steps: int = 0
  total_steps: int = 1000
  seed: int = 0

  def label(self) -> str:
    """A short name for tables and file names' stems."""
    if self.first_moment is None and self.second_moment is None:
      return self.name
    label = f"{self.name}[m={self.first_moment or 'default'}"
    if self.name != "sgdm_4bit":
      label += f",v={self.second_moment or 'default'}"
    return label + "]"


def _spec(name: Optional[str], default: optax4bit.QuantSpec, stochastic: bool):
  """The quantizer ``name`` (None: the default recipe's ``default``), with
  stochastic rounding if asked for."""
  if name is None:
    return default.replace(stochastic=True) if stochastic else None
  if not stochastic:
    return name
  return optax4bit.QuantSpec.parse(name, stochastic=True)


_DEFAULT_RECIPE = optax4bit.recipes.RECIPES["default"]


def schedule(cfg: OptimizerConfig) -> optax.Schedule:
  """Linear warmup then cosine decay to 10% of the peak learning rate."""
  warmup = max(0, min(cfg.warmup_steps, cfg.total_steps - 1))
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0 if warmup else cfg.learning_rate, peak_value=cfg.learning_rate,
      warmup_steps=warmup, decay_steps=max(cfg.total_steps, warmup + 1),
      end_value=0.1 * cfg.learning_rate)


def _decay_mask(params):
  """Weight decay on matrices only (not on biases and norm scales)."""
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
  """The optimizer of ``cfg``, preceded by global-norm gradient clipping.

  Every AdamW variant gets the same learning rate schedule, betas, eps and
  weight decay (on matrices only), so that only the storage of the moments
  differs between them.
  """
  name = cfg.name
  first, second = cfg.first_moment, cfg.second_moment
  if name in PRESETS:  # explicit --first-moment/--second-moment still win
    first, second = first or PRESETS[name][0], second or PRESETS[name][1]
    name = "adamw_4bit_factor" if second == "Factor" else "adamw_4bit"
  elif name == "adamw_4bit" and second == "Factor":
    name = "adamw_4bit_factor"
  if name not in OPTIMIZERS:
    raise ValueError(f"unknown optimizer {cfg.name!r}: expected one of {OPTIMIZERS} or an "
                     f"ablation preset {tuple(PRESETS)}.")
  if (first or second) and name not in ("adamw_4bit", "adamw_4bit_factor", "sgdm_4bit"):
    raise ValueError(f"--first-moment/--second-moment configure the 4-bit optimizers, not "
                     f"{name!r}.")
  if name == "sgdm_4bit" and second:
    raise ValueError("sgdm_4bit has no second moment.")
  lr = schedule(cfg)
  quant = dict(min_quantize_size=cfg.min_quantize_size, seed=cfg.seed)
  adam = dict(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
              mask=_decay_mask)
  if name == "adamw":
    tx = optax.adamw(lr, **adam)
  elif name == "adamw_4bit":
    tx = optax4bit.adamw_4bit(
        lr, **adam, **quant, first_moment=_spec(first, _DEFAULT_RECIPE.first_moment, cfg.stochastic_rounding),
        second_moment=_spec(second, _DEFAULT_RECIPE.second_moment, cfg.stochastic_rounding))
  elif name == "adamw_4bit_factor":
    second = None if second == "Factor" else second
    tx = optax4bit.adamw_4bit_factor(
        lr, **adam, **quant, first_moment=_spec(first, _DEFAULT_RECIPE.first_moment, cfg.stochastic_rounding),
        second_moment=_spec(second, _DEFAULT_RECIPE.second_moment, cfg.stochastic_rounding))
  elif name == "adamw_8bit":
    tx = optax4bit.adamw_8bit(lr, **adam, min_quantize_size=cfg.min_quantize_size)
  elif name == "adafactor":
    # optax.adafactor adds weight_decay_rate * param after the learning rate
    # scaling; a schedule of lr_t * weight_decay makes it decoupled weight
    # decay exactly as in AdamW.
    decay = (lambda count: cfg.weight_decay * lr(count)) if cfg.weight_decay else None
    tx = optax.adafactor(lr, multiply_by_parameter_scale=False, momentum=cfg.momentum,
                         weight_decay_rate=decay, weight_decay_mask=_decay_mask)
  elif name in ("muon", "muon_4bit"):
    # Muon's learning rate is for the matrices; the Adam it runs on the other
    # parameters gets a tenth of it (Muon's rates are ~10x Adam's).
    adam_lr = schedule(dataclasses.replace(cfg, learning_rate=cfg.learning_rate / 10))
    muon_args = dict(weight_decay=cfg.weight_decay,
                     weight_decay_mask=_decay_mask, adam_b1=cfg.b1, adam_b2=cfg.b2,
                     adam_learning_rate=adam_lr)
    tx = (optax.contrib.muon(lr, **muon_args) if name == "muon"
          else optax4bit.muon_4bit(lr, **muon_args, **quant))
  elif name == "sgdm":
    tx = optax.sgd(lr, momentum=cfg.momentum)
  else:  # sgdm_4bit
    tx = optax4bit.sgdm_4bit(lr, momentum=cfg.momentum, **quant,
                             first_moment=_spec(first, _DEFAULT_RECIPE.first_moment, cfg.stochastic_rounding))
  if name in ("sgdm", "sgdm_4bit") and cfg.weight_decay:
    # L2 weight decay added to the gradient before the momentum (as torch.optim.SGD).
    tx = optax.chain(optax.add_decayed_weights(cfg.weight_decay, _decay_mask), tx)
  if cfg.clip_norm:
    tx = optax.chain(optax.clip_by_global_norm(cfg.clip_norm), tx)
  return tx


def add_optimizer_args(parser: argparse.ArgumentParser, *, lr: Optional[float],
                       weight_decay: float, b2: float = 0.999,
                       lr_help: str = "peak learning rate (%(default)s)") -> None:
  """The optimizer flags shared by the examples."""
  g = parser.add_argument_group("optimizer")
  g.add_argument("--optimizer", default="adamw_4bit",
                 help=f"one of {', '.join(OPTIMIZERS)}, or an ablation preset "
                      f"({', '.join(PRESETS)}); default %(default)s")
  g.add_argument("--first-moment", default=None,
                 help="quantizer of m for the 4-bit optimizers, e.g. B128/DE, B2048/DE")
  g.add_argument("--second-moment", default=None,
                 help="quantizer of v for adamw_4bit, e.g. Rank-1/Linear, B128/DE-0, "
                      "Rank-1/DE-0, or 'Factor' for the factored second moment")
  g.add_argument("--stochastic-rounding", action="store_true",
                 help="stochastic rounding of the quantized moments")
  g.add_argument("--min-quantize-size", type=int, default=4096,
                 help="leaves with at most this many elements keep fp32 moments "
                      "(default %(default)s, the paper's rule)")
  g.add_argument("--lr", type=float, default=lr, help=lr_help)
  g.add_argument("--weight-decay", type=float, default=weight_decay,
                 help="decoupled weight decay on matrices (%(default)s)")
  g.add_argument("--b2", type=float, default=b2, help="Adam beta2 (%(default)s)")
  g.add_argument("--clip-norm", type=float, default=1.0,
                 help="global gradient-norm clipping, 0 for none (%(default)s)")


def optimizer_config(args, *, total_steps: int, warmup_steps: int, seed: int) -> OptimizerConfig:
  return OptimizerConfig(
      name=args.optimizer, learning_rate=args.lr, weight_decay=args.weight_decay, b2=args.b2,
      first_moment=args.first_moment, second_moment=args.second_moment,
      stochastic_rounding=args.stochastic_rounding, min_quantize_size=args.min_quantize_size,
      clip_norm=args.clip_norm or None, warmup_steps=warmup_steps, total_steps=total_steps,
      seed=seed)


def default_lr(name: str, adam_lr: float, sgd_lr: float) -> float:
  return sgd_lr if name in ("sgdm", "sgdm_4bit") else adam_lr


def state_bytes_per_param(opt_state, params) -> tuple[int, int, float]:
  """(state bytes, parameter count, bytes per parameter) of an optimizer state
  as really stored (codes, scales, fp32 moments of small leaves, counters)."""
  nbytes = optax4bit.state_nbytes(opt_state)
  nparams = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
  return nbytes, nparams, nbytes / nparams


# ----------------------------------------------------------------------------
# Data.


def stdlib_dir() -> str:
  import os as _os  # pylint: disable=import-outside-toplevel,reimported
  return _os.path.dirname(_os.__file__)


def load_stdlib_corpus(root: Optional[str] = None, val_fraction: float = 0.1,
                       max_bytes: Optional[int] = None):
  """The Python standard library's ``.py`` files as two byte arrays.

  Files are listed under ``root`` (default: the directory of ``os.py``),
  skipping ``site-packages`` and ``__pycache__``, in sorted order. A file goes
  to validation when ``crc32(relative path) % 1000 < 1000 * val_fraction``:
  a deterministic split BY FILE, stable when files are added or removed.
  Files are concatenated, each followed by a NUL byte.

  Args:
    root: directory to read; default the standard library.
    val_fraction: share of files that go to validation.
    max_bytes: stop reading files once each split holds this many bytes
      (tests); None reads everything.

  Returns:
    ``(train, val, info)``: uint8 arrays and a dict describing the split.
  """
  root = root or stdlib_dir()
  paths = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
    paths.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
  paths.sort()
  if not paths:
    raise ValueError(f"no .py files under {root!r}")
  parts = {"train": [], "val": []}
  sizes = {"train": 0, "val": 0}
  files = {"train": 0, "val": 0}
  for path in paths:
    rel = os.path.relpath(path, root).replace(os.sep, "/")
    split = "val" if zlib.crc32(rel.encode()) % 1000 < 1000 * val_fraction else "train"
    if max_bytes is not None and sizes[split] >= max_bytes:
      continue
    try:
      with open(path, "rb") as f:
        data = f.read()
    except OSError:
      continue
    parts[split].append(data + b"\0")
    sizes[split] += len(data) + 1
    files[split] += 1
  train = np.frombuffer(b"".join(parts["train"]), np.uint8)
  val = np.frombuffer(b"".join(parts["val"]), np.uint8)
  if len(val) == 0 or len(train) == 0:
    raise ValueError(f"the split of {root!r} left an empty side")
  info = {"root": root, "train_files": files["train"], "val_files": files["val"],
          "train_bytes": int(len(train)), "val_bytes": int(len(val)),
          "python": sys.version.split()[0]}
  return train, val, info


def lm_batches(data: np.ndarray, batch_size: int, seq_len: int, seed: int):
  """Endless random windows ``(x, y)`` of ``seq_len`` bytes and the next ones."""
  rng = np.random.default_rng(seed)
  high = len(data) - seq_len - 1
  while True:
    starts = rng.integers(0, high, size=batch_size)
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    window = data[idx].astype(np.int32)
    yield window[:, :-1], window[:, 1:]


def lm_eval_windows(data: np.ndarray, num_windows: int, seq_len: int):
  """A fixed validation set: ``num_windows`` evenly spaced windows."""
  high = len(data) - seq_len - 1
  starts = np.linspace(0, high, num_windows).astype(np.int64)
  idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
  window = data[idx].astype(np.int32)
  return window[:, :-1], window[:, 1:]


def load_digits_split(test_fraction: float = 0.25):
  """scikit-learn's 8x8 digits, scaled to [0, 1], with a fixed stratified
  train/test split (``random_state=0``; seeds change init and batch order,
  never the split)."""
  from sklearn.datasets import load_digits  # pylint: disable=import-outside-toplevel
  from sklearn.model_selection import train_test_split  # pylint: disable=import-outside-toplevel
  digits = load_digits()
  x = (digits.images / 16.0).astype(np.float32)[..., None]  # (n, 8, 8, 1)
  y = digits.target.astype(np.int32)
  x_train, x_test, y_train, y_test = train_test_split(
      x, y, test_size=test_fraction, random_state=0, stratify=y)
  return (x_train, y_train), (x_test, y_test)


def classification_batches(x: np.ndarray, y: np.ndarray, batch_size: int, seed: int):
  """Endless shuffled epochs of ``(x, y)`` mini-batches (ragged tail dropped)."""
  rng = np.random.default_rng(seed)
  n = len(x)
  while True:
    perm = rng.permutation(n)
    for i in range(0, n - batch_size + 1, batch_size):
      j = perm[i:i + batch_size]
      yield x[j], y[j]


# ----------------------------------------------------------------------------
# Models (Flax NNX).


class CausalSelfAttention(nnx.Module):
  """Multi-head causal self-attention with a fused ``(d, 3d)`` projection
  (2-D kernels, as in GPT-2, so that rank-1 and factored second moments act on
  ``d_in x d_out`` matrices)."""

  def __init__(self, d_model: int, num_heads: int, *, rngs: nnx.Rngs):
    if d_model % num_heads:
      raise ValueError(f"d_model={d_model} is not a multiple of num_heads={num_heads}")
    self.num_heads = num_heads
    self.qkv = nnx.Linear(d_model, 3 * d_model, rngs=rngs)
    self.proj = nnx.Linear(d_model, d_model, rngs=rngs)

  def __call__(self, x):
    b, t, d = x.shape
    h = self.num_heads
    q, k, v = jnp.split(self.qkv(x), 3, axis=-1)
    q, k, v = (z.reshape(b, t, h, d // h) for z in (q, k, v))
    mask = jnp.tril(jnp.ones((t, t), bool))
    out = jax.nn.dot_product_attention(q, k, v, mask=mask[None, None])
    return self.proj(out.reshape(b, t, d))


class Block(nnx.Module):
  """Pre-norm transformer block."""

  def __init__(self, d_model: int, num_heads: int, *, rngs: nnx.Rngs):
    self.ln1 = nnx.LayerNorm(d_model, rngs=rngs)
    self.attn = CausalSelfAttention(d_model, num_heads, rngs=rngs)
    self.ln2 = nnx.LayerNorm(d_model, rngs=rngs)
    self.fc1 = nnx.Linear(d_model, 4 * d_model, rngs=rngs)
    self.fc2 = nnx.Linear(4 * d_model, d_model, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.ln1(x))
    return x + self.fc2(jax.nn.gelu(self.fc1(self.ln2(x))))


class TransformerLM(nnx.Module):
  """A small decoder-only byte-level transformer (learned positions, tied
  input/output embedding)."""

  def __init__(self, *, vocab_size: int = 256, seq_len: int = 128, d_model: int = 128,
               num_layers: int = 2, num_heads: int = 4, rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab_size, d_model, rngs=rngs)
    self.pos = nnx.Embed(seq_len, d_model, rngs=rngs)
    self.blocks = nnx.List([Block(d_model, num_heads, rngs=rngs) for _ in range(num_layers)])
    self.ln_f = nnx.LayerNorm(d_model, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens) + self.pos(jnp.arange(tokens.shape[1]))[None]
    for block in self.blocks:
      x = block(x)
    return self.embed.attend(self.ln_f(x))


class MLP(nnx.Module):
  """``64 -> hidden -> hidden -> 10`` with ReLU."""

  def __init__(self, hidden: int = 256, num_classes: int = 10, *, rngs: nnx.Rngs):
    self.fc1 = nnx.Linear(64, hidden, rngs=rngs)
    self.fc2 = nnx.Linear(hidden, hidden, rngs=rngs)
    self.out = nnx.Linear(hidden, num_classes, rngs=rngs)

  def __call__(self, x):
    x = x.reshape(x.shape[0], -1)
    x = jax.nn.relu(self.fc1(x))
    x = jax.nn.relu(self.fc2(x))
    return self.out(x)


class CNN(nnx.Module):
  """Two 3x3 convolutions (32, 64 channels), a 2x2 average pool, a dense head."""

  def __init__(self, num_classes: int = 10, *, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 32, (3, 3), rngs=rngs)
    self.conv2 = nnx.Conv(32, 64, (3, 3), rngs=rngs)
    self.fc = nnx.Linear(4 * 4 * 64, 128, rngs=rngs)
    self.out = nnx.Linear(128, num_classes, rngs=rngs)

  def __call__(self, x):
    x = jax.nn.relu(self.conv1(x))
    x = jax.nn.relu(self.conv2(x))
    x = nnx.avg_pool(x, (2, 2), strides=(2, 2))
    x = jax.nn.relu(self.fc(x.reshape(x.shape[0], -1)))
    return self.out(x)


# ----------------------------------------------------------------------------
# Training.


def cross_entropy(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                         labels).mean()


class Trainer:
  """One model and one optimizer, with a jitted (donated) train step.

  The model is split once into a graph definition and its parameters (an
  ``nnx.State`` pytree); the step is a pure function of the parameters, so any
  optax transformation applies unchanged.
  """

  def __init__(self, model: nnx.Module, tx: optax.GradientTransformation,
               loss_fn: Callable = cross_entropy):
    self.graphdef, self.params = nnx.split(model)
    self.tx = tx
    self.opt_state = tx.init(self.params)
    graphdef = self.graphdef

    def loss_of(params, x, y):
      return loss_fn(nnx.merge(graphdef, params)(x), y)

    def step(params, opt_state, x, y):
      loss, grads = jax.value_and_grad(loss_of)(params, x, y)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    def evaluate(params, x, y):
      logits = nnx.merge(graphdef, params)(x)
      return loss_fn(logits, y), jnp.mean(jnp.argmax(logits, -1) == y)

    self._step = jax.jit(step, donate_argnums=(0, 1))
    self._eval = jax.jit(evaluate)

  def step(self, x, y) -> float:
    """One training step; returns the training loss (synchronously)."""
    self.params, self.opt_state, loss = self._step(self.params, self.opt_state, x, y)
    return float(loss)

  def evaluate(self, x, y, batch_size: int) -> tuple[float, float]:
    """Mean loss and accuracy over ``x`` in batches (equal-sized except the last)."""
    total_loss, total_acc, n = 0.0, 0.0, len(x)
    for i in range(0, n, batch_size):
      loss, acc = self._eval(self.params, x[i:i + batch_size], y[i:i + batch_size])
      k = len(x[i:i + batch_size])
      total_loss += float(loss) * k
      total_acc += float(acc) * k
    return total_loss / n, total_acc / n

  def state_stats(self) -> dict:
    nbytes, nparams, per_param = state_bytes_per_param(self.opt_state, self.params)
    return {"params": nparams, "state_bytes": nbytes, "state_bytes_per_param": per_param}


# ----------------------------------------------------------------------------
# Instability, as counted by the ablation (also recorded by every run).

SPIKE_WINDOW = 20
SPIKE_FACTOR = 1.5


def count_spikes(losses: Sequence[float], window: int = SPIKE_WINDOW,
                 factor: float = SPIKE_FACTOR) -> int:
  """Number of steps whose training loss exceeds ``factor`` times the median
  of the previous ``window`` training losses (steps before ``window`` are not
  judged; a non-finite loss counts as a spike)."""
  spikes = 0
  for t in range(window, len(losses)):
    if not math.isfinite(losses[t]):
      spikes += 1
    else:
      prev = [v for v in losses[t - window:t] if math.isfinite(v)]
      if prev and losses[t] > factor * statistics.median(prev):
        spikes += 1
  return spikes


def diverged(losses: Sequence[float], final_val_loss: float, initial_val_loss: float) -> bool:
  """A run diverged when any training loss is non-finite or the final
  validation loss is not below the validation loss at initialization."""
  return (not all(math.isfinite(v) for v in losses) or not math.isfinite(final_val_loss)
          or final_val_loss >= initial_val_loss)


ROSE_TOLERANCE = 0.01


def val_loss_rose(val_curve: Sequence, tol: float = ROSE_TOLERANCE) -> bool:
  """Whether the validation loss rose by more than ``tol`` from one evaluation
  to the next (``val_curve``: ``(step, loss)`` pairs). Under a cosine schedule
  a healthy short run improves at every evaluation."""
  values = [v for _, v in val_curve]
  return any(not math.isfinite(b) or b - a > tol for a, b in zip(values, values[1:]))


# ----------------------------------------------------------------------------
# Outputs.


def save_json(path: str, obj) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

  def default(x):
    if isinstance(x, (np.floating, np.integer)):
      return x.item()
    if isinstance(x, np.ndarray):
      return x.tolist()
    return str(x)

  with open(path, "w") as f:
    json.dump(obj, f, indent=1, default=default, allow_nan=True)
    f.write("\n")


def plot_curves(path: str, curves: dict, *, title: str, ylabel: str = "loss",
                logy: bool = False) -> None:
  """``curves``: label -> {"train": [(step, value)], "val": [(step, value)]};
  train curves thin, validation curves with markers, one color per label."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig, ax = plt.subplots(figsize=(7, 4.2))
  for i, (label, curve) in enumerate(curves.items()):
    color = f"C{i % 10}"
    if curve.get("train"):
      s, v = zip(*curve["train"])
      ax.plot(s, _smooth(v), color=color, alpha=0.45, lw=1)
    if curve.get("val"):
      s, v = zip(*curve["val"])
      ax.plot(s, v, color=color, marker="o", ms=3, lw=1.5, label=f"{label} (val)")
  ax.set_xlabel("step")
  ax.set_ylabel(ylabel)
  if logy:
    ax.set_yscale("log")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _smooth(values, alpha: float = 0.9):
  out, ema = [], None
  for v in values:
    if not math.isfinite(v):
      out.append(v)
      continue
    ema = v if ema is None else alpha * ema + (1 - alpha) * v
    out.append(ema)
  return out


def slug(text: str) -> str:
  """A file-name-safe version of a label."""
  return "".join(c if c.isalnum() or c in "-_." else "_" for c in text).strip("_")


def now() -> float:
  return time.perf_counter()


# ----------------------------------------------------------------------------
# Benchmark helpers (benchmarks/quality.py, benchmarks/zero_point_ablation.py).


def enable_compile_cache(path: str = os.path.join("runs", "jax_cache")) -> None:
  """JAX's persistent compilation cache: runs that differ only by seed reuse
  the compiled step instead of compiling it again."""
  jax.config.update("jax_compilation_cache_dir", os.path.abspath(path))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def _canonical(obj):
  return json.loads(json.dumps(obj, sort_keys=True, default=str))


def run_cached(path: str, key: dict, fn: Callable[[], dict], *, fresh: bool = False) -> dict:
  """``fn()``'s result, saved as JSON at ``path`` with ``key``; a later call
  with the same key loads it instead of training again."""
  key = _canonical(key)
  if not fresh and os.path.exists(path):
    with open(path) as f:
      cached = json.load(f)
    if cached.get("cache_key") == key:
      cached["cached"] = True
      return cached
  result = fn()
  result["cache_key"] = key
  save_json(path, result)
  result["cached"] = False
  return result


def mean_std(values: Sequence[float]) -> tuple[float, float]:
  """Mean and sample standard deviation (ddof=1; 0 for a single value)."""
  values = [float(v) for v in values]
  if not values:
    return float("nan"), float("nan")
  return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)
