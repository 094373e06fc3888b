"""Fault finding on 8 virtual CPU devices (issue 37); run by tests/test_fault_mesh.py.

* ``shardings N IMPLS [MODES]``: N random trees on random shardings, drawn
  by hypothesis (derandomized) among MODES: no sharding (one device),
  replicated on a classic mesh, classic ``Mesh`` axes (``Auto``) and
  explicit axes (``jax.set_mesh``), each leaf's axes drawn among those that
  divide it. For each, every implementation of IMPLS (``"cpu"``, ``"auto"``:
  bit for bit; ``"pallas_interpret"``: equal codes, floats within 1e-5)
  gives the jnp engine's result over two steps, the sharded jnp engine
  gives the one-device result (bit for bit but for Factor's float sums),
  and the compiled step has no
  collective that ``optax``'s step on the same tree lacks, beyond the
  all-reduces of rank-1 statistics (a row or column of a leaf).
* ``remesh DIR [N]``: a state saved from a (2, 4) or (4, 2) mesh restores
  bit for bit on both meshes and on one device, and one more step there gives
  the uninterrupted run's state bit for bit (Factor's within 1e-5): a fixed
  4-bit AdamW tree, then (N > 0) a fixed Factor state and N trees and
  optimizers drawn by hypothesis.
* ``crash DIR``: saves step 1, then hangs inside the save of step 2 until the
  test kills it (SIGKILL); writes the expected states of steps 1 and 2.

Prints one ``RESULTS <json>`` line (tests/sharding_checks.py's format).
"""

from __future__ import annotations

import collections
import itertools
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


MESH_SHAPES = ((2, 4), (4, 2))


@st.composite
def trees(draw, sharded, mesh_shapes):
  """``{leaf: (shape, dtype, spec, seed)}``: 1-3 leaves, each axis on mesh axes
  (if ``sharded``) that divide it on every mesh of ``mesh_shapes``."""
  leaves = {}
  for i in range(draw(st.integers(1, 3))):
    shape = draw(st.sampled_from(SHAPES))
    spec, used = [], set()
    for j, d in enumerate(shape):
      # Mesh axes not taken by another dimension that divide this one; for the
      # last, into pieces of a multiple of 128 (else blocks would straddle
      # shards: a documented ValueError at init).
      options = [None]
      if sharded:
        options = [a for a in AXES if a and not used & set(_names(a))
                   and all(d % _shards(a, sizes) == 0 and (
                       j < len(shape) - 1 or (d // _shards(a, sizes)) % 128 == 0)
                           for sizes in (dict(zip(("data", "model"), m)) for m in mesh_shapes))
                   ] + [None]
      axis = draw(st.sampled_from(options))
      used |= set(_names(axis))
      spec.append(axis)
    leaves[f"leaf{i}"] = (shape, draw(st.sampled_from(("float32", "bfloat16"))), tuple(spec),
                          draw(st.integers(0, 2**16)))
  return leaves


@st.composite
def cases(draw, modes=MODES):
  """``(mode, mesh_shape, optimizer name, {leaf: (shape, dtype, spec, seed)})``."""
  mode = draw(st.sampled_from(modes))
  mesh_shape = draw(st.sampled_from(MESH_SHAPES))
  leaves = draw(trees(mode in ("auto", "explicit"), [mesh_shape]))
  return mode, mesh_shape, draw(st.sampled_from(sorted(OPTIMIZERS))), leaves


def _shardings(leaves, mesh):
  """Each leaf's `NamedSharding` on ``mesh`` (None: no mesh)."""
  if mesh is None:
    return None
  return {k: NamedSharding(mesh, P(*spec)) for k, (_, _, spec, _) in leaves.items()}


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


def _close(x, y, rtol):
  """Integers (codes) bitwise; floats within ``rtol`` of ``y`` or ``rtol / 10``
  of the leaf's largest ``|y|`` (tests/test_faults.py's ``_assert_same``: an
  update that nearly cancels is many of its own ulps off)."""
  x, y = np.asarray(x), np.asarray(y)
  if not jnp.issubdtype(y.dtype, jnp.floating):
    return np.array_equal(x, y)
  x, y = x.astype(np.float64), y.astype(np.float64)
  floor = rtol / 10 * np.abs(y).max(initial=0.0, where=np.isfinite(y))
  return np.allclose(x, y, rtol=rtol, atol=max(floor, 1e-30))


def _not_close(a, b, rtol=1e-5):
  """Paths where two trees differ beyond `_close`."""
  la = jax.tree_util.tree_flatten_with_path(a)[0]
  return [jax.tree_util.keystr(p) for (p, x), y in zip(la, jax.tree.leaves(b))
          if not _close(x, y, rtol)]


def one_case(mode, mesh_shape, name, leaves, impls=("cpu", "auto")):
  """Problems found in one case (empty: none). The Pallas fused steps give
  the jnp engine's codes and, to a few ulps, its floats (ARCHITECTURE.md,
  "Invariants"); the C++ kernel and ``"auto"`` give its bits."""
  make, make_reference = OPTIMIZERS[name]
  problems = []
  mesh = None
  if mode == "explicit":
    mesh = jax.make_mesh(mesh_shape, ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
  elif mode != "none":
    mesh = Mesh(np.array(jax.devices()).reshape(mesh_shape), ("data", "model"))
  shardings = _shardings(leaves, mesh)
  one_device, _ = _two_steps(make("jnp"), *_arrays(leaves, None))
  with jax.set_mesh(mesh) if mode == "explicit" else sc._null():  # pylint: disable=protected-access
    params, grads = _arrays(leaves, shardings)
    reference, ref_colls = _two_steps(make("jnp"), params, grads)
    _, optax_colls = _two_steps(make_reference(), params, grads)
    for impl in impls:
      got, colls = _two_steps(make(impl), params, grads)
      if diff := (_not_close if impl.startswith("pallas") else sc.tree_equal)(got, reference):
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


def _search(strategy, examples, max_examples, problems_of):
  """Runs ``problems_of`` on ``examples``, then on ``max_examples`` cases
  drawn from ``strategy`` (derandomized); returns the cases run and the
  failing ones with their problems."""
  ran, failures = [], []

  @settings(max_examples=max(max_examples, 1), deadline=None, derandomize=True,
            database=None, suppress_health_check=list(HealthCheck),
            phases=[Phase.explicit] + ([Phase.generate] if max_examples else []))
  @given(case=strategy)
  def check(case):
    ran.append(case)
    try:
      problems = problems_of(case)
    except Exception as e:  # pylint: disable=broad-except
      problems = [f"{type(e).__name__}: {e}"[:2000]]
    if problems:
      failures.append({"case": repr(case), "problems": problems})

  for case in examples:
    check = example(case=case)(check)
  check()
  return ran, failures


def shardings(max_examples="2", impls="cpu,auto", modes=",".join(MODES)):
  """Runs `EXAMPLES` (only the first if ``max_examples`` is 0) and
  ``max_examples`` cases drawn in ``modes`` with the implementations
  ``impls`` (besides the jnp engine); returns how many ran and the failing
  ones."""
  ran, failures = _search(cases(tuple(modes.split(","))),
                          EXAMPLES if int(max_examples) else EXAMPLES[:1], int(max_examples),
                          lambda case: one_case(*case, impls=impls.split(",")))
  return {"ran": len(ran), "modes": dict(collections.Counter(m for m, *_ in ran)),
          "optimizers": dict(collections.Counter(n for _, _, n, _ in ran)), "failures": failures,
          "cases": [repr(case) for case in ran]}


# ----------------------------------------------------------------------------
# Checkpoints.

CKPT_LEAVES = {"w": ((64, 512), "float32", ("data", "model"), 1),
               "v": ((1024,), "float32", ("model",), 2),
               "s": ((16, 128), "float32", ("data", None), 3)}


def _ckpt_params(leaves, mesh):
  return _arrays(leaves, _shardings(leaves, mesh))[0]


def _ckpt_train(tx, params, start, steps, state=None):
  """The state after steps ``start, ..., start + steps - 1`` of ``tx`` from
  ``state`` (fresh if None), the gradient a function of the step number."""
  state = jax.jit(tx.init)(params) if state is None else state
  update = _update(tx)
  for i in range(start, start + steps):
    _, state = update(jax.tree.map(lambda p, i=i: jnp.sin(p * 3 + i), params), state, params)
  return state


def _target(tx, params, leaves, mesh):
  """Restore target: the state's shardings on ``mesh`` (`state_shardings`),
  or on one device."""
  if mesh is None:
    return checkpoint.abstract(jax.jit(tx.init)(params))
  return checkpoint.abstract(jax.eval_shape(tx.init, params),
                             optax4bit.state_shardings(tx, params, _shardings(leaves, mesh)))


def _as_numpy(tree):
  return jax.tree.map(np.asarray, tree)


@st.composite
def saved_trees(draw):
  """``(optimizer name, saving mesh shape, leaves)``: leaves sharded so that
  they fit both meshes of `MESH_SHAPES`."""
  return (draw(st.sampled_from(sorted(OPTIMIZERS))), draw(st.sampled_from(MESH_SHAPES)),
          draw(trees(True, MESH_SHAPES)))


def _restores(directory, name, mesh_shape, leaves):
  """Problems of a state saved after 2 steps on a classic ``mesh_shape``
  mesh, restored on each mesh of `MESH_SHAPES` and on one device: the
  restored state must be the saved one and its next step the uninterrupted
  run's, bit for bit (Factor's next step within 1e-5: float sums per shard)."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  devices = np.array(jax.devices())
  meshes = {str(m): Mesh(devices.reshape(m), ("data", "model")) for m in MESH_SHAPES}
  meshes["one device"] = None
  tx = OPTIMIZERS[name][0]("auto")
  params = _ckpt_params(leaves, meshes[str(mesh_shape)])
  state = _ckpt_train(tx, params, 0, 2)
  saved, uninterrupted = _as_numpy(state), _as_numpy(_ckpt_train(tx, params, 2, 1, state))
  same_step = _not_close if name == "adamw_4bit_factor" else sc.tree_equal
  problems = []
  with ocp.CheckpointManager(directory) as manager:
    checkpoint.save(manager, 2, state)
    manager.wait_until_finished()
    for label, mesh in meshes.items():
      params = _ckpt_params(leaves, mesh)
      restored = checkpoint.restore(manager, _target(tx, params, leaves, mesh), 2)
      if diff := sc.tree_equal(_as_numpy(restored), saved):
        problems.append(f"restored on {label} != saved at {diff}")
      if diff := same_step(_as_numpy(_ckpt_train(tx, params, 2, 1, restored)), uninterrupted):
        problems.append(f"next step on {label} != uninterrupted at {diff}")
      used = sorted({d.id for x in jax.tree.leaves(restored) for d in x.sharding.device_set})
      if used != ([0] if mesh is None else sorted(d.id for d in mesh.devices.flat)):
        problems.append(f"restored on {label} lies on devices {used}")
  return problems


# Factor saved on (4, 2): a matrix on both axes, a bf16 stack on its first.
FACTOR_SAVED = ("adamw_4bit_factor", (4, 2), {
    "a": ((64, 1024), "float32", ("data", "model"), 7),
    "b": ((8, 4, 128), "bfloat16", (("data", "model"), None, None), 8)})


def remesh(directory, max_examples="0"):
  """`_restores` of the tree `CKPT_LEAVES` (4-bit AdamW saved on (2, 4)),
  then (if ``max_examples``) of `FACTOR_SAVED` and ``max_examples`` drawn
  trees and optimizers; returns how many ran and the failing ones."""
  number = itertools.count()
  fixed = [("adamw_4bit", (2, 4), CKPT_LEAVES)] + ([FACTOR_SAVED] if int(max_examples) else [])
  ran, failures = _search(saved_trees(), fixed, int(max_examples),
                          lambda case: _restores(os.path.join(directory, str(next(number))), *case))
  return {"ran": len(ran), "optimizers": dict(collections.Counter(n for n, *_ in ran)),
          "failures": failures, "cases": [repr(case) for case in ran]}


CRASH_TX = optax4bit.adamw_4bit(1e-2)


def crash(directory):
  """Saves step 1, writes the expected states of steps 1 and 2, then hangs in
  the save of step 2 (after its data is written, before orbax's commit)."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
  params = _ckpt_params(CKPT_LEAVES, mesh)
  state1 = _ckpt_train(CRASH_TX, params, 0, 1)
  manager = ocp.CheckpointManager(directory)
  checkpoint.save(manager, 1, state1)
  manager.wait_until_finished()
  state2 = _ckpt_train(CRASH_TX, params, 1, 1, state1)
  for step, state in ((1, state1), (2, state2)):
    checkpoint_checks.save_expected(os.path.join(directory, "..", f"expected_step{step}.npz"),
                                    state)
  checkpoint_checks.save_until_killed(manager, 2, state2)


def resume(directory):
  """Restores the latest complete step (on the saving mesh) and takes one step."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
  params = _ckpt_params(CKPT_LEAVES, mesh)
  with ocp.CheckpointManager(directory) as manager:
    step = manager.latest_step()
    restored = checkpoint.restore(manager, _target(CRASH_TX, params, CKPT_LEAVES, mesh))
  resumed = _ckpt_train(CRASH_TX, params, step, 1, restored)
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
