"""optax4bit.offload_state: the optimizer state lives in pinned host memory.

Checked on one device: memory kinds after init and after donated jitted
steps, bitwise equality with the same optimizer without offload, orbax
checkpoints, ``flax.nnx.Optimizer`` and the error for a bad memory kind. The
sharded case runs on 8 virtual devices in a separate process
(tests/offload_checks.py), with -m slow.
"""

from __future__ import annotations

import doctest
import os
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax4bit
from optax4bit import checkpoint
from optax4bit import offload
from conftest import assert_trees_bitwise, training_step
from subprocess_json import ROOT, TESTS, child_env, run_json

# JAX deprecations are errors here (orbax's own are not ours to fix). On a GPU, JAX
# >= 0.11 warns at every Pallas Triton lowering that the backend is deprecated; the
# move to Mosaic GPU is open work (benchmarks/history/log-to-2026-11.md, "GPU step").
pytestmark = pytest.mark.filterwarnings(
    "error::DeprecationWarning", "ignore::DeprecationWarning:orbax.*",
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

TXS = {
    "adamw_4bit": lambda: optax4bit.adamw_4bit(1e-3, weight_decay=0.1),
    "adamw_4bit_factor": lambda: optax4bit.adamw_4bit_factor(1e-3, weight_decay=0.1),
    "optax.adamw": lambda: optax.adamw(1e-3, weight_decay=0.1),
}


def _params():
  k1, k2 = jax.random.split(jax.random.key(0))
  return {"w": jax.random.normal(k1, (256, 384)), "b": jax.random.normal(k2, (384,)),
          "small": jnp.ones(16)}


def _grads(step, params):
  return jax.tree.map(
      lambda p: jax.random.normal(jax.random.fold_in(jax.random.key(1), step), p.shape),
      params)


def _train(tx, steps):
  """``steps`` donated jitted steps; returns params and state."""
  params = _params()
  step = jax.jit(training_step(tx), donate_argnums=(0, 1))
  state = tx.init(params)
  for i in range(steps):
    params, state = step(params, state, _grads(i, params))
  return params, state


def _memory_kinds(tree) -> set:
  return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def _assert_placed(state, params, offload_param_shaped=False):
  """Scalars, and unless ``offload_param_shaped`` arrays shaped like a param,
  in device memory (they could be paired with a device output of a donating
  step); every other array in pinned host memory."""
  shapes = {p.shape for p in jax.tree.leaves(params)}
  for x in jax.tree.leaves(state):
    on_device = x.ndim == 0 or (x.shape in shapes and not offload_param_shaped)
    assert x.sharding.memory_kind == ("device" if on_device else "pinned_host"), x.shape


def test_docstring_example():
  result = doctest.testmod(offload, optionflags=doctest.ELLIPSIS, report=True)
  assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("name", sorted(TXS))
def test_init_puts_state_in_host_memory(name):
  state = optax4bit.offload_state(TXS[name]()).init(_params())
  _assert_placed(state, _params())
  if name != "optax.adamw":  # the codes and scales: the bulk of a 4-bit state
    assert state[0].mu["w"].codes.sharding.memory_kind == "pinned_host"
  state = optax4bit.offload_state(TXS[name](), offload_param_shaped=True).init(_params())
  _assert_placed(state, _params(), offload_param_shaped=True)


@pytest.mark.parametrize("name", sorted(TXS))
def test_bitwise_equal_and_stays_on_host_after_donated_steps(name):
  params, state = _train(optax4bit.offload_state(TXS[name]()), steps=4)
  ref_params, ref_state = _train(TXS[name](), steps=4)
  _assert_placed(state, params)
  assert_trees_bitwise(params, ref_params)
  assert_trees_bitwise(state, ref_state)
  params, state = _train(optax4bit.offload_state(TXS[name](), offload_param_shaped=True), 4)
  _assert_placed(state, params, offload_param_shaped=True)
  assert _memory_kinds(params) == {"device"}
  assert_trees_bitwise(params, ref_params)
  assert_trees_bitwise(state, ref_state)


def test_quantized_leaves_keep_metadata():
  plain = optax4bit.adamw_4bit(1e-3).init(_params())
  offloaded = optax4bit.offload_state(optax4bit.adamw_4bit(1e-3)).init(_params())
  # Same treedef: QuantizedArray spec, shape and dtype are unchanged.
  assert jax.tree.structure(offloaded) == jax.tree.structure(plain)
  mu = offloaded[0].mu["w"]
  assert isinstance(mu, optax4bit.QuantizedArray)
  assert mu.codes.dtype == jnp.uint8 and mu.codes.sharding.memory_kind == "pinned_host"


def test_unknown_memory_kind_is_an_error():
  with pytest.raises(ValueError, match=r"memory_kind must be one of \['pinned_host'\].*'hbm'"):
    optax4bit.offload_state(optax.adam(1e-3), memory_kind="hbm")


def test_checkpoint_round_trip_restores_into_host_memory():
  ocp = pytest.importorskip("orbax.checkpoint")
  tx = optax4bit.offload_state(optax4bit.adamw_4bit(1e-3))
  params, opt_state = _train(tx, steps=2)
  state = {"params": params, "opt_state": opt_state}
  with ocp.CheckpointManager(tempfile.mkdtemp()) as manager:
    checkpoint.save(manager, 0, state)
    manager.wait_until_finished()
    restored = checkpoint.restore(manager, checkpoint.abstract(state))
    # The state structure is the inner optimizer's: a checkpoint of the
    # offloaded state restores into a target built without offload.
    plain = checkpoint.restore(manager, checkpoint.abstract(
        {"params": params, "opt_state": optax4bit.adamw_4bit(1e-3).init(params)}))
  _assert_placed(restored["opt_state"], params)
  assert_trees_bitwise(restored, state)
  assert_trees_bitwise(plain, state)
  # Training resumes from the restored host state.
  step = jax.jit(training_step(tx), donate_argnums=(0, 1))
  _, new_state = step(restored["params"], restored["opt_state"], _grads(2, params))
  _assert_placed(new_state, params)


def test_nnx_optimizer():
  nnx = pytest.importorskip("flax.nnx")

  class MLP(nnx.Module):

    def __init__(self, rngs):
      self.l1 = nnx.Linear(64, 256, rngs=rngs)
      self.l2 = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x):
      return self.l2(nnx.relu(self.l1(x)))

  x = jax.random.normal(jax.random.key(1), (16, 64))
  y = jax.random.randint(jax.random.key(2), (16,), 0, 10)

  @nnx.jit
  def train_step(model, optimizer):
    grads = nnx.grad(
        lambda m: optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean())(model)
    optimizer.update(model, grads)

  models = []
  for tx in (optax4bit.offload_state(optax4bit.adamw_4bit(1e-3)), optax4bit.adamw_4bit(1e-3)):
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    for _ in range(3):
      train_step(model, optimizer)
    models.append((model, optimizer))
  (model, optimizer), (ref_model, _) = models
  _assert_placed(nnx.as_pure(optimizer.opt_state), nnx.as_pure(nnx.state(model, nnx.Param)))
  assert_trees_bitwise(nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param))


# Issue 37: with only the state donated, JAX 0.10.2 paired a donated host
# array with a device output of its shape and aborted the process (SIGABRT).
# Each donation pattern runs in a child process, so an abort fails the test
# instead of killing the test run.
DONATION_CHILD = """
import sys, jax, jax.numpy as jnp, numpy as np, optax, optax4bit
donate = tuple(int(i) for i in sys.argv[1].split(",") if i)
params = {"w": jnp.ones((512, 1024)), "b": jnp.full((1024,), 0.5)}
grads = jax.tree.map(lambda p: jnp.sin(p + 0.1), params)
results = []
for tx in (optax4bit.offload_state(optax4bit.adamw_4bit(1e-3)), optax4bit.adamw_4bit(1e-3)):
  update = jax.jit(tx.update, donate_argnums=donate)
  state = tx.init(params)
  for _ in range(3):
    updates, state = update(jax.tree.map(jnp.copy, grads), state,
                            jax.tree.map(jnp.copy, params))
  results.append((updates, state))
(updates, state), (ref_updates, ref_state) = results
for x, y in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1])):
  np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
assert state[0].mu["w"].codes.sharding.memory_kind == "pinned_host"
print("DONE")
"""


@pytest.mark.parametrize("donate", ["1,2", *(pytest.param(d, marks=pytest.mark.slow)
                                            for d in ("1", "0,1", "0,1,2", ""))])
def test_any_donation_pattern_runs(donate):
  proc = subprocess.run([sys.executable, "-c", DONATION_CHILD, donate], capture_output=True,
                        text=True, timeout=300, env=child_env(), cwd=ROOT, check=False)
  assert proc.returncode == 0 and "DONE" in proc.stdout, (proc.returncode, proc.stderr[-3000:])


# -m slow: CI's time (28 s, a subprocess of 8 devices); sharded steps are tested
# unoffloaded by tests/test_sharding.py.
@pytest.mark.slow
def test_sharded_on_8_devices():
  results = run_json(os.path.join(TESTS, "offload_checks.py"))
  failed = {k: v for k, v in results.items() if v is not True}
  assert not failed, failed


def _gpu_target_device():
  """A device of an H100 target for XLA's deviceless compile; skips the test without one.

  Needs jax's CUDA plugin (``jax-cuda12-plugin`` and the CUDA runtime wheels),
  not a GPU; without the plugin the test is skipped.
  """
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  path = os.path.join(os.path.dirname(TESTS), "benchmarks", "gpu_target_h100.txtpb")
  with open(path) as f:
    target = f.read()
  try:
    return topologies.get_topology_desc(
        "h100", "cuda", target_config=target, topology="1x1x1").devices[0]
  except Exception as error:  # no CUDA plugin here: jax raises several kinds
    pytest.skip(f"no deviceless XLA:GPU compile here (jax's CUDA plugin): {error}")


def _abstract(tree, device, kind):
  """``tree``'s shapes and dtypes on ``device`` in memory ``kind`` (compile only)."""
  sharding = jax.sharding.SingleDeviceSharding(device, memory_kind=kind)
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


@pytest.mark.parametrize("implementation", ["pallas", "jnp"])
@pytest.mark.parametrize("name", ["adamw_4bit", "adamw_4bit_factor"])
def test_offloaded_step_compiles_for_a_gpu(name, implementation):
  # XLA:GPU in jaxlib 0.10 rejected an offloaded 4-bit step ("Copy-start ... doesn't
  # have correct host memory space color S(5)"): the new state came out of an in-place
  # kernel or an optimization_barrier straight into a move to host.
  device = _gpu_target_device()
  tx = offload.offload_state(getattr(optax4bit, name)(1e-3, implementation=implementation))
  params = {"w": jax.ShapeDtypeStruct((512, 768), jnp.float32), "b": jax.ShapeDtypeStruct(
      (768,), jnp.float32)}

  # Where init places them: scalars and param-shaped arrays stay on the device.
  shapes = {p.shape for p in jax.tree.leaves(params)}
  state = jax.tree.map(
      lambda x: _abstract(x, device, "device" if x.ndim == 0 or x.shape in shapes
                          else "pinned_host"), jax.eval_shape(tx.init, params))
  compiled = jax.jit(training_step(tx), donate_argnums=(0, 1)).lower(
      _abstract(params, device, "device"), state, _abstract(params, device, "device")).compile()
  host_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state)
                   if x.sharding.memory_kind == "pinned_host")
  assert compiled.memory_analysis().host_argument_size_in_bytes == host_bytes


@pytest.mark.parametrize("name", ["adamw_4bit", "optax.adamw"])
def test_offload_adds_no_temp_memory_on_the_cpu(name):
  # Host and device memory are one on the CPU: the offloaded step should plan the
  # same temporaries as the plain one. On the CPU device even where a GPU is the
  # default one. The GPU's elementwise pass before the move to host, run on the CPU,
  # adds a copy of optax.adamw's new state (789764 bytes against 68); XLA:CPU does
  # adamw_4bit's in place (+384 bytes). 1 KiB of slack: JAX 0.12's XLA packs the same
  # temporaries 320 bytes apart when the state is in host memory.
  def temp_bytes(tx):
    params = _params()
    compiled = jax.jit(training_step(tx), donate_argnums=(0, 1)).lower(
        params, tx.init(params), params).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  with jax.default_device(jax.devices("cpu")[0]):
    assert temp_bytes(offload.offload_state(TXS[name]())) <= temp_bytes(TXS[name]()) + 1024


def _lm_step_device_bytes(tx, device, offloaded: bool) -> tuple:
  """(device bytes planned, state bytes) of a compiled training step of a small tied-embedding
  language model (layers under ``scan`` and ``checkpoint``, as training_memory.py's GPT), its
  logits larger than its optimizer state; the state is given in host memory if ``offloaded``.
  Compile only: nothing is allocated."""
  vocab, d, layers, batch, seq = 8192, 512, 4, 8, 512
  params = {"wte": jax.ShapeDtypeStruct((vocab, d), jnp.float32),
            "w1": jax.ShapeDtypeStruct((layers, d, 4 * d), jnp.float32),
            "w2": jax.ShapeDtypeStruct((layers, 4 * d, d), jnp.float32)}
  state = jax.eval_shape(tx.init, params)

  def loss_fn(params, tokens):
    x = params["wte"][tokens[:, :-1]]

    def layer(x, w):
      return x + jax.nn.gelu(x @ w[0]) @ w[1], None

    x, _ = jax.lax.scan(jax.checkpoint(layer), x, (params["w1"], params["w2"]))
    logits = x @ params["wte"].T
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  def step(params, state, tokens):
    grads = jax.grad(loss_fn)(params, tokens)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)
  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
      _abstract(params, device, "device"),
      _abstract(state, device, "pinned_host" if offloaded else "device"),
      _abstract(tokens, device, "device")).compile()
  m = compiled.memory_analysis()
  # XLA:GPU counts device memory only in these fields (the host arguments in host_*).
  total = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
           + m.temp_size_in_bytes)
  return total, optax4bit.state_nbytes(state)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="device memory is host memory here")
@pytest.mark.parametrize("name", ["adamw_4bit", "optax.adamw"])
def test_offloaded_state_is_off_the_device_at_the_step_peak(name):
  # JAX 0.11's XLA:GPU started the state's copies to the device during the backward
  # pass, so the whole state sat on the device at the step's peak and offload saved
  # nothing (benchmarks/history/log-to-2026-11.md, "Host offload on XLA:GPU");
  # offload_state makes the copies wait for the gradients.
  device = jax.devices()[0]
  plain, state_bytes = _lm_step_device_bytes(TXS[name](), device, offloaded=False)
  # Every state array offloaded (the step donates params and state together).
  offloaded, _ = _lm_step_device_bytes(
      offload.offload_state(TXS[name](), offload_param_shaped=True), device, offloaded=True)
  print(f"{name}: device bytes {plain} plain, {offloaded} offloaded, state {state_bytes}")
  assert offloaded <= plain - state_bytes // 2, (plain, offloaded, state_bytes)
