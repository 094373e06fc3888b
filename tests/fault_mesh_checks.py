"""Fault finding on 8 virtual CPU devices (issue 37); run by tests/test_fault_mesh.py.

* ``shardings N``: N random trees on random shardings, drawn by hypothesis
  (derandomized): no sharding (one device), replicated on a classic mesh,
  classic ``Mesh`` axes (``Auto``) and explicit axes (``jax.set_mesh``), each
  leaf's axes drawn among those that divide it. For each, every
  implementation (``"cpu"``, ``"auto"``) gives the jnp engine's result bit for
  bit over two steps, the sharded jnp engine gives the one-device result (bit
  for bit but for Factor's float sums), and the compiled step has no
  collective that ``optax``'s step on the same tree lacks, beyond the
  all-reduces of rank-1 statistics (a row or column of a leaf).
* ``remesh DIR``: a state saved from a (2, 4) mesh restores bit for bit on a
  (4, 2) mesh and on one device, and one more step there gives the
  uninterrupted run's state bit for bit.
* ``crash DIR``: saves step 1, then hangs inside the save of step 2 until the
  test kills it (SIGKILL); writes the expected states of steps 1 and 2.

Prints one ``RESULTS <json>`` line (tests/sharding_checks.py's format).
"""

from __future__ import annotations

import collections
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sharding_checks as sc  # noqa: E402  (sets the 8-device XLA_FLAGS first)

import checkpoint_checks  # noqa: E402  (after sharding_checks: keeps its 8 devices)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from hypothesis import HealthCheck, Phase, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import optax4bit  # noqa: E402
from optax4bit import checkpoint  # noqa: E402

MODES = ("none", "replicated", "auto", "explicit")
SHAPES = ((), (8,), (300,), (512,), (4096,), (16, 128), (64, 256), (16, 1024), (24, 40),
          (2, 4, 128))
AXES = ("data", "model", ("data", "model"), None)
OPTIMIZERS = {
    "adamw_4bit": (lambda impl: optax4bit.adamw_4bit(1e-3, min_quantize_size=0,
                                                     implementation=impl),
                   lambda: optax.adamw(1e-3, weight_decay=1e-4)),
    "adamw_4bit_factor": (lambda impl: optax4bit.adamw_4bit_factor(
        1e-3, min_quantize_size=0, implementation=impl),
                          lambda: optax.adamw(1e-3, weight_decay=1e-4)),
    "sgdm_4bit": (lambda impl: optax4bit.sgdm_4bit(1e-3, min_quantize_size=0,
                                                   implementation=impl),
                  lambda: optax.sgd(1e-3, momentum=0.9)),
}


def _names(axis):
  return (axis,) if isinstance(axis, str) else tuple(axis or ())


def _shards(axis, sizes):
  return math.prod(sizes[a] for a in _names(axis))


@st.composite
def cases(draw):
  """``(mode, mesh_shape, optimizer name, {leaf: (shape, dtype, spec, seed)})``."""
  mode = draw(st.sampled_from(MODES))
  mesh_shape = draw(st.sampled_from(((2, 4), (4, 2))))
  sizes = dict(zip(("data", "model"), mesh_shape))
  leaves = {}
  for i in range(draw(st.integers(1, 3))):
    shape = draw(st.sampled_from(SHAPES))
    spec, used = [], set()
    for j, d in enumerate(shape):
      # Mesh axes not taken by another dimension that divide this one; for the
      # last, into pieces of a multiple of 128 (else blocks would straddle
      # shards: a documented ValueError at init).
      options = [None]
      if mode in ("auto", "explicit"):
        options = [a for a in AXES if a and not used & set(_names(a))
                   and d % _shards(a, sizes) == 0
                   and (j < len(shape) - 1 or (d // _shards(a, sizes)) % 128 == 0)] + [None]
      axis = draw(st.sampled_from(options))
      used |= set(_names(axis))
      spec.append(axis)
    leaves[f"leaf{i}"] = (shape, draw(st.sampled_from(("float32", "bfloat16"))), tuple(spec),
                          draw(st.integers(0, 2**16)))
  return mode, mesh_shape, draw(st.sampled_from(sorted(OPTIMIZERS))), leaves


def _arrays(leaves, shardings):
  params, grads = {}, {}
  for k, (shape, dtype, _, seed) in leaves.items():
    rng = np.random.default_rng(seed)
    params[k] = jnp.asarray(rng.standard_normal(shape), dtype)
    grads[k] = jnp.asarray(rng.standard_normal(shape) * 10, dtype)
  if shardings is not None:
    params, grads = jax.device_put(params, shardings), jax.device_put(grads, shardings)
  return params, grads


def _update(tx):
  return jax.jit(lambda g, s, p: tx.update(g, s, p))


def _two_steps(tx, params, grads):
  """Updates and states of two steps (the second on ``grads + 1``), as numpy,
  and the compiled step's collectives as ``Counter((kind, elements))``."""
  update, state, out = _update(tx), jax.jit(tx.init)(params), []
  hlo = update.lower(grads, state, params).compile().as_text()
  for g in (grads, jax.tree.map(lambda x: x + 1, grads)):
    u, state = update(g, state, params)
    out.append(jax.tree.map(np.asarray, (u, state)))
  return out, collections.Counter(sc.collectives(hlo))


def _statistic_limit(leaves):
  """Elements of the largest rank-1 statistic of the tree (row or column
  maxima or means of a leaf's last two axes): what an all-reduce may carry."""
  sizes = [1]
  for shape, *_ in leaves.values():
    if len(shape) >= 2:
      sizes += [math.prod(shape[:-1]), math.prod(shape[:-2]) * shape[-1]]
  return max(sizes)


def one_case(mode, mesh_shape, name, leaves, impls=("cpu", "auto")):
  """Problems found in one case (empty: none)."""
  make, make_reference = OPTIMIZERS[name]
  problems = []
  mesh = shardings = None
  if mode == "explicit":
    mesh = jax.make_mesh(mesh_shape, ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  elif mode != "none":
    mesh = Mesh(np.array(jax.devices()).reshape(mesh_shape), ("data", "model"))
  if mesh is not None:
    shardings = {k: NamedSharding(mesh, P(*spec)) for k, (_, _, spec, _) in leaves.items()}
  one_device, _ = _two_steps(make("jnp"), *_arrays(leaves, None))
  with jax.set_mesh(mesh) if mode == "explicit" else sc._null():  # pylint: disable=protected-access
    params, grads = _arrays(leaves, shardings)
    reference, ref_colls = _two_steps(make("jnp"), params, grads)
    _, optax_colls = _two_steps(make_reference(), params, grads)
    for impl in impls:
      got, colls = _two_steps(make(impl), params, grads)
      if diff := sc.tree_equal(got, reference):
        problems.append(f"{impl} != jnp at {diff}")
      extra = colls - optax_colls
      if any(n > _statistic_limit(leaves) for _, n in extra):
        problems.append(f"{impl}: collectives beyond optax's {dict(extra)}")
  if any(n > _statistic_limit(leaves) for _, n in ref_colls - optax_colls):
    problems.append(f"jnp: collectives beyond optax's {dict(ref_colls - optax_colls)}")
  if name == "adamw_4bit_factor":  # row and column means: float sums per shard
    if (rel := sc.max_rel_diff([u for u, _ in reference], [u for u, _ in one_device])) > 1e-5:
      problems.append(f"sharded jnp vs one device: update rel diff {rel}")
  elif diff := sc.tree_equal(reference, one_device):
    problems.append(f"sharded jnp != one device at {diff}")
  return problems


# Cases run before the drawn ones: classic mesh axes (a sharded float32 matrix
# and bf16 vector; the only one run for 0 examples), then explicit axes.
EXAMPLES = [
    ("auto", (4, 2), "adamw_4bit", {"a": ((16, 256), "float32", ("data", "model"), 1),
                                    "b": ((512,), "bfloat16", ("model",), 2)}),
    ("explicit", (4, 2), "adamw_4bit_factor", {
        "a": ((64, 256), "bfloat16", ("data", "model"), 4), "b": ((4096,), "float32", ("model",), 5),
        "c": ((2, 4, 128), "bfloat16", (None, "data", None), 3)}),
]


def shardings(max_examples="2", impls="cpu,auto"):
  """Runs `EXAMPLES` (only the first if ``max_examples`` is 0) and
  ``max_examples`` drawn cases with the implementations ``impls`` (besides the
  jnp engine); returns how many ran and the failing ones."""
  ran, failures = [], []

  @settings(max_examples=max(int(max_examples), 1), deadline=None, derandomize=True,
            database=None, suppress_health_check=list(HealthCheck),
            phases=[Phase.explicit] + ([Phase.generate] if int(max_examples) else []))
  @given(case=cases())
  def check(case):
    ran.append(case[:3])
    try:
      problems = one_case(*case, impls=impls.split(","))
    except Exception as e:  # pylint: disable=broad-except
      problems = [f"{type(e).__name__}: {e}"[:2000]]
    if problems:
      failures.append({"case": repr(case), "problems": problems})

  for case in EXAMPLES if int(max_examples) else EXAMPLES[:1]:
    check = example(case=case)(check)
  check()
  return {"ran": len(ran), "modes": dict(collections.Counter(m for m, _, _ in ran)),
          "optimizers": dict(collections.Counter(n for _, _, n in ran)), "failures": failures}


# ----------------------------------------------------------------------------
# Checkpoints.

CKPT_LEAVES = {"w": ((64, 512), P("data", "model")), "v": ((1024,), P("model")),
               "s": ((16, 128), P("data", None))}


def _ckpt_params(mesh):
  params = {k: jax.random.normal(jax.random.fold_in(jax.random.key(1), i), shape)
            for i, (k, (shape, _)) in enumerate(sorted(CKPT_LEAVES.items()))}
  if mesh is None:
    return jax.device_put(params, jax.devices()[0])
  return jax.device_put(params, {k: NamedSharding(mesh, spec)
                                 for k, (_, spec) in CKPT_LEAVES.items()})


def _ckpt_train(params, start, steps, state=None):
  """Steps ``start, ..., start + steps - 1`` of 4-bit AdamW from ``state``
  (fresh if None), the gradient a function of the step number."""
  tx = optax4bit.adamw_4bit(1e-2)
  state = jax.jit(tx.init)(params) if state is None else state
  update = jax.jit(lambda g, s, p: tx.update(g, s, p))
  for i in range(start, start + steps):
    _, state = update(jax.tree.map(lambda p, i=i: jnp.sin(p * 3 + i), params), state, params)
  return tx, state


def _target(tx, params, mesh):
  """Restore target: the state's shardings on ``mesh`` (`state_shardings`),
  or on one device."""
  if mesh is None:
    return checkpoint.abstract(jax.jit(tx.init)(params))
  return checkpoint.abstract(jax.eval_shape(tx.init, params), optax4bit.state_shardings(
      tx, params, {k: NamedSharding(mesh, spec) for k, (_, spec) in CKPT_LEAVES.items()}))


def _as_numpy(tree):
  return jax.tree.map(np.asarray, tree)


def remesh(directory):
  """Saved on (2, 4); restored on (4, 2) and on one device."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  devices = np.array(jax.devices())
  meshes = {"(2, 4)": Mesh(devices.reshape(2, 4), ("data", "model")),
            "(4, 2)": Mesh(devices.reshape(4, 2), ("data", "model")), "one device": None}
  tx, state = _ckpt_train(_ckpt_params(meshes["(2, 4)"]), 0, 2)
  saved = _as_numpy(state)
  _, uninterrupted = _ckpt_train(_ckpt_params(meshes["(2, 4)"]), 2, 1, state)
  uninterrupted = _as_numpy(uninterrupted)
  out = {}
  with ocp.CheckpointManager(directory) as manager:
    checkpoint.save(manager, 2, state)
    manager.wait_until_finished()
    for label, mesh in meshes.items():
      params = _ckpt_params(mesh)
      restored = checkpoint.restore(manager, _target(tx, params, mesh), 2)
      devices_used = sorted({d.id for x in jax.tree.leaves(restored) for d in x.sharding.device_set})
      _, resumed = _ckpt_train(params, 2, 1, restored)
      out[label] = {"restored_diff": sc.tree_equal(_as_numpy(restored), saved),
                    "resumed_diff": sc.tree_equal(_as_numpy(resumed), uninterrupted),
                    "devices": devices_used}
  return out


def crash(directory):
  """Saves step 1, writes the expected states of steps 1 and 2, then hangs in
  the save of step 2 (after its data is written, before orbax's commit)."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
  params = _ckpt_params(mesh)
  _, state1 = _ckpt_train(params, 0, 1)
  manager = ocp.CheckpointManager(directory)
  checkpoint.save(manager, 1, state1)
  manager.wait_until_finished()
  _, state2 = _ckpt_train(params, 1, 1, state1)
  for step, state in ((1, state1), (2, state2)):
    checkpoint_checks.save_expected(os.path.join(directory, "..", f"expected_step{step}.npz"),
                                    state)
  checkpoint_checks.save_until_killed(manager, 2, state2)


def resume(directory):
  """Restores the latest complete step (on the saving mesh) and takes one step."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
  params = _ckpt_params(mesh)
  with ocp.CheckpointManager(directory) as manager:
    step = manager.latest_step()
    restored = checkpoint.restore(manager, _target(optax4bit.adamw_4bit(1e-2), params, mesh))
  _, resumed = _ckpt_train(params, step, 1, restored)
  out = {"latest_step": step}
  for label, state in (("restored", restored), ("resumed", resumed)):
    expected = np.load(os.path.join(directory, "..", f"expected_step{step + (label == 'resumed')}.npz"))
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    out[f"{label}_diff"] = [jax.tree_util.keystr(p) for p, x in leaves
                            if not np.array_equal(np.asarray(x), expected[jax.tree_util.keystr(p)])]
    out[f"{label}_leaves"] = [len(leaves), len(expected.files)]
  return out


if __name__ == "__main__":
  if sys.argv[1] == "crash":
    crash(sys.argv[2])
  else:
    sc.main([sys.argv[1]], {sys.argv[1]: lambda: globals()[sys.argv[1]](*sys.argv[2:])})
