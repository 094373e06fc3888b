"""Flax with sharded 4-bit optimizer states: NNX `nnx.Optimizer` and a Linen
`TrainState`, on 8 (virtual CPU) devices.

* NNX: parameters carry partitioning metadata (``nnx.with_partitioning``) and
  are created sharded on an explicit-axes mesh (``jax.make_mesh``);
  ``nnx.Optimizer(model, optax4bit.adamw_4bit(...), wrt=nnx.Param)`` then
  creates and updates every 4-bit state sharded like its parameter, with no
  other change.
* Linen: ``nn.with_partitioning`` metadata on an ``Auto`` mesh (the classic
  GSPMD setup). ``optax4bit.shard_optimizer`` tells the optimizer the
  parameters' shardings, ``optax4bit.state_shardings`` gives the train state's
  shardings for ``jax.jit``.

Run: ``python examples/flax_sharded.py`` (``--json FILE`` writes a summary).
"""

from __future__ import annotations

import argparse
import json
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import linen as nn  # noqa: E402
from flax import nnx  # noqa: E402
from flax.training import train_state  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import optax4bit  # noqa: E402

IN, HIDDEN, OUT, BATCH = 256, 1024, 256, 64


def data():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(BATCH, IN)).astype(np.float32)
  y = np.tanh(x @ rng.normal(0, 0.1, (IN, OUT)).astype(np.float32))
  return x, y


def spec_summary(opt_state_leaf) -> dict:
  """Specs of a 4-bit moment's codes and scales."""
  return {"codes": str(opt_state_leaf.codes.sharding.spec),
          "scales": [str(s.sharding.spec) for s in opt_state_leaf.scales]}


# ----------------------------------------------------------------------------
# NNX, explicit sharding.


class MLP(nnx.Module):
  """Tensor parallel: fc1 splits its output features, fc2 its input features."""

  def __init__(self, rngs: nnx.Rngs):
    init = nnx.initializers.lecun_normal()
    self.fc1 = nnx.Linear(IN, HIDDEN, rngs=rngs,
                          kernel_init=nnx.with_partitioning(init, (None, "model")),
                          bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("model",)))
    self.fc2 = nnx.Linear(HIDDEN, OUT, rngs=rngs,
                          kernel_init=nnx.with_partitioning(init, ("model", None)))

  def __call__(self, x):
    h = nnx.gelu(self.fc1(x))
    return self.fc2(h, out_sharding=P("data", None))  # contracts the sharded axis


def train_nnx(steps: int) -> dict:
  mesh = jax.make_mesh((2, 4), ("data", "model"))  # explicit axes
  x, y = data()
  with jax.set_mesh(mesh):
    model = MLP(nnx.Rngs(0))  # parameters are created sharded
    optimizer = nnx.Optimizer(model, optax4bit.adamw_4bit(1e-2, min_quantize_size=1024),
                              wrt=nnx.Param)
    x = jax.device_put(x, P("data", None))
    y = jax.device_put(y, P("data", None))

    @nnx.jit
    def train_step(model, optimizer, x, y):
      loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
      optimizer.update(model, grads)
      return loss

    losses = [float(train_step(model, optimizer, x, y)) for _ in range(steps)]
  mu = optimizer.opt_state[0].mu
  nu = optimizer.opt_state[0].nu
  return {
      "losses": losses,
      "kernel1": str(model.fc1.kernel.get_value().sharding.spec),
      "mu_fc1_kernel": spec_summary(mu["fc1"]["kernel"]),
      "nu_fc1_kernel": spec_summary(nu["fc1"]["kernel"]),
      "mu_fc2_kernel": spec_summary(mu["fc2"]["kernel"]),
      "mu_fc1_bias": str(mu["fc1"]["bias"].sharding.spec),  # 1024 elements: float32
  }


# ----------------------------------------------------------------------------
# Linen, Auto (GSPMD) sharding.


class LinenMLP(nn.Module):
  """FSDP-style: both kernels sharded over both mesh axes."""

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.lecun_normal()
    x = nn.Dense(HIDDEN, kernel_init=nn.with_partitioning(init, ("data", "model")))(x)
    x = nn.gelu(x)
    return nn.Dense(OUT, kernel_init=nn.with_partitioning(init, ("model", "data")))(x)


def train_linen(steps: int) -> dict:
  devices = np.array(jax.devices()).reshape(2, 4)
  mesh = jax.sharding.Mesh(devices, ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  model = LinenMLP()
  x, y = data()
  # Parameter shardings from the partitioning metadata, then sharded init.
  abstract = jax.eval_shape(model.init, jax.random.key(0), x)
  param_shardings = nn.get_sharding(abstract, mesh)["params"]
  init = jax.jit(lambda k: nn.meta.unbox(model.init(k, x))["params"],
                 out_shardings=nn.meta.unbox(param_shardings))
  params = init(jax.random.key(0))
  param_shardings = jax.tree.map(lambda p: p.sharding, params)

  tx = optax4bit.shard_optimizer(optax4bit.adamw_4bit(1e-2, min_quantize_size=1024),
                                 param_shardings)
  state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
  # The train state's shardings: the params', the 4-bit states' (they follow
  # the params), a replicated step.
  state_shardings = state.replace(
      step=NamedSharding(mesh, P()), params=param_shardings,
      opt_state=optax4bit.state_shardings(tx, params, param_shardings))
  batch = NamedSharding(mesh, P("data", None))
  x, y = jax.device_put(x, batch), jax.device_put(y, batch)

  def train_step(state, x, y):
    def loss_fn(params):
      return jnp.mean((state.apply_fn({"params": params}, x) - y) ** 2)
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  step = jax.jit(train_step, in_shardings=(state_shardings, batch, batch),
                 out_shardings=(state_shardings, None), donate_argnums=0)
  losses = []
  for _ in range(steps):
    state, loss = step(state, x, y)
    losses.append(float(loss))
  mu, nu = state.opt_state[0].mu, state.opt_state[0].nu
  return {
      "losses": losses,
      "kernel0": str(state.params["Dense_0"]["kernel"].sharding.spec),
      "mu_dense0_kernel": spec_summary(mu["Dense_0"]["kernel"]),
      "nu_dense0_kernel": spec_summary(nu["Dense_0"]["kernel"]),
      "mu_dense1_kernel": spec_summary(mu["Dense_1"]["kernel"]),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--json", default=None)
  args = parser.parse_args()
  summary = {"nnx": train_nnx(args.steps), "linen": train_linen(args.steps)}
  for name, result in summary.items():
    print(f"{name}: loss {result['losses'][0]:.4f} -> {result['losses'][-1]:.4f}")
    for key, value in result.items():
      if key != "losses":
        print(f"  {key}: {value}")
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(summary, f)


if __name__ == "__main__":
  main()
