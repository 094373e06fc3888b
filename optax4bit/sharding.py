"""Sharded 4-bit states: they follow the parameters' ``PartitionSpec``.

Codes and scales keep the parameter's rank (`QuantizedArray`), so a state array
takes its parameter's spec axis by axis; an axis of length 1 in the state
(a rank-1 statistic of another axis, a tensor scale, a factored row or
column) is replicated along that axis:

=========================  ====================  ===========================
state array                shape                 spec (param ``P(a, b)``)
=========================  ====================  ===========================
packed codes               ``(r, ceil(d/2))``    ``P(a, b)``
block scales ``B<k>``      ``(r, ceil(d/k))``    ``P(a, b)``
rank-1 statistics          ``(r, 1)``, ``(1, d)``  ``P(a, None)``, ``P(None, b)``
tensor scale               ``(1, 1)``            ``P(None, None)``
factored ``row``/``col``   ``(r, 1)``, ``(1, d)``  ``P(a, None)``, ``P(None, b)``
step count                 ``()``                ``P()``
=========================  ====================  ===========================

How the optimizer learns the sharding:

* **Explicit sharding** (``jax.make_mesh`` defaults to ``AxisType.Explicit``
  in JAX 0.10): array types carry their sharding, so ``tx.init`` places the
  state like the parameters and ``tx.update`` runs each sharded leaf under
  ``jax.shard_map``, with no argument to pass.
* **Concrete arrays** (``tx.init`` called outside ``jit``): the state is created
  directly sharded like each parameter's ``NamedSharding``.
* **Auto sharding** (``jax.sharding.Mesh(...)``, ``AxisType.Auto``): types
  inside ``jit`` name the mesh but not the spec. ``jax.jit(tx.init)(params)``
  ties each state array to its parameter by a data dependence
  (``optax4bit._state_sharding.tie_to_param``), so XLA's sharding
  propagation places it like the parameter; each leaf's update is a
  ``custom_partitioning`` call (``optax4bit._gspmd``) whose partition
  callback receives the gradient's sharding from XLA and runs the per-shard
  update below, the fused kernels' included
  (``optax4bit._fused_leaf.run_fused``). `shard_optimizer` states the
  shardings up front instead.

Per shard, each leaf runs the ordinary update on its local block (in chunks of
local rows): block-wise scales are local, rank-1 and tensor scales are
reduced with ``lax.pmax`` over the mesh axes of the other dimensions, so that
they are the maxima of the global tensor. Nothing state-sized crosses devices:
only the rank-1/tensor statistics (one float per row or column) are
all-reduced. Results equal the single-device run bit for bit, stochastic
rounding included: its random numbers hash the element's index in the global
tensor (each shard knows where its block starts).

Alignment. A parameter can be split like its state only if no quantization
block straddles two shards: every sharded axis must divide evenly, and if the
last axis is sharded its per-shard length must be a multiple of the block
size (and even, for 4-bit packing). Blocks that span whole rows (last axis at
most half a block) need the last axis unsharded and a per-shard row count that
is a multiple of the rows per block. Anything else raises a ``ValueError``
naming the leaf and the remedies (another block size, another axis, or
``quantize_mask`` to keep the leaf in float32): optax4bit never reshuffles
blocks across devices silently.
"""

from __future__ import annotations

import jax
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from optax4bit._state_sharding import state_partition_spec

__all__ = ["shard_optimizer", "state_partition_spec", "state_shardings"]


# ----------------------------------------------------------------------------
# Public helpers.


def _flat_shardings(params, param_shardings):
  leaves, treedef = jax.tree.flatten(params)
  if param_shardings is None:
    shardings = [getattr(p, "sharding", None) for p in leaves]
  else:
    try:
      shardings = treedef.flatten_up_to(param_shardings)
    except (ValueError, TypeError):
      shardings = jax.tree.leaves(param_shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
      if len(shardings) != len(leaves):
        raise ValueError(
            "param_shardings must be a pytree of NamedSharding with the structure of the params "
            f"({len(leaves)} leaves), got {len(shardings)} shardings.") from None
  meshes = {s.mesh for s in shardings if isinstance(s, NamedSharding)}
  for s in shardings:
    if not isinstance(s, NamedSharding):
      raise ValueError(f"param_shardings must hold jax.sharding.NamedSharding, got {s!r}.")
  if len(meshes) > 1:
    raise ValueError("all parameters must be sharded over the same mesh.")
  return leaves, treedef, shardings, (meshes.pop() if meshes else None)


def _explicit_mesh(mesh):
  return jax.sharding.Mesh(mesh.devices, mesh.axis_names,
                           axis_types=(AxisType.Explicit,) * len(mesh.axis_names))


def state_shardings(tx: optax.GradientTransformation, params, param_shardings=None):
  """Shardings of ``tx.init(params)`` when the params are sharded.

  Use them as ``jax.jit(..., out_shardings=...)`` for ``tx.init`` or a train
  step, and as the target of a checkpoint restore. Every array of the state
  follows its parameter (see `state_partition_spec`); arrays that belong to
  no parameter (step counts, hyperparameters) are replicated. Works for any
  optax transformation, optax4bit or not, and for chains of them.

  Args:
    tx: the optimizer.
    params: the parameters (arrays or ``jax.ShapeDtypeStruct``); only shapes
      and dtypes are used.
    param_shardings: a pytree of ``NamedSharding`` like ``params``; default:
      the params' own ``.sharding``.

  Returns:
    A pytree of ``NamedSharding`` with the structure of ``tx.init(params)``.

  Raises:
    ValueError: if a quantized state cannot be split like its parameter (see
      the module docstring on alignment).

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax4bit
    >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    >>> mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    >>> params = {"w": jnp.zeros((256, 512))}
    >>> tx = optax4bit.adamw_4bit(1e-3)
    >>> sh = optax4bit.state_shardings(tx, params, {"w": NamedSharding(mesh, P("data", "model"))})
    >>> sh[0].nu["w"].scales[0].spec, sh[0].mu["w"].codes.spec
    (P('data', None), P('data', 'model'))
  """
  leaves, treedef, shardings, mesh = _flat_shardings(params, param_shardings)
  if mesh is None:
    raise ValueError("state_shardings needs at least one parameter.")
  explicit = _explicit_mesh(mesh)
  abstract = treedef.unflatten([
      jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=NamedSharding(explicit, s.spec))
      for p, s in zip(leaves, shardings)])
  with jax.sharding.use_abstract_mesh(explicit.abstract_mesh):
    state = jax.eval_shape(tx.init, abstract)

  def to_sharding(x):
    s = getattr(x, "sharding", None)
    spec = s.spec if isinstance(s, NamedSharding) else PartitionSpec()
    return NamedSharding(mesh, spec)

  return jax.tree.map(to_sharding, state)


def shard_optimizer(tx: optax.GradientTransformation,
                    param_shardings) -> optax.GradientTransformationExtraArgs:
  """Wraps ``tx`` so that its state and update follow ``param_shardings``.

  Optional: with ``Auto`` mesh axes (``jax.sharding.Mesh(devices, names)``)
  an unwrapped ``tx`` learns the shardings from XLA (see the module
  docstring) and with explicit axes from the array types. The wrapper states
  them up front, which keeps the fused kernels on sharded leaves.
  ``init`` returns the state sharded by `state_shardings`; ``update`` runs
  ``tx.update`` with the mesh axes made explicit
  (``jax.sharding.explicit_axes``), so that every sharded leaf is updated per
  shard without all-gathers.

  Args:
    tx: any optax transformation (e.g. a chain with `adamw_4bit`).
    param_shardings: a pytree of ``NamedSharding`` like the params.

  Returns:
    The wrapped transformation.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax4bit
    >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    >>> mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    >>> shardings = {"w": NamedSharding(mesh, P("data", "model"))}
    >>> tx = optax4bit.shard_optimizer(optax4bit.adamw_4bit(1e-3), shardings)
    >>> params = jax.device_put({"w": jnp.ones((256, 512))}, shardings)
    >>> state = tx.init(params)
    >>> updates, state = jax.jit(tx.update)(params, state, params)
  """
  tx = optax.with_extra_args_support(tx)

  def init_fn(params):
    return jax.jit(tx.init, out_shardings=state_shardings(tx, params, param_shardings))(params)

  def update_fn(updates, state, params=None, **extra_args):
    leaves, treedef, shardings, mesh = _flat_shardings(updates, param_shardings)
    if mesh is None or all(t == AxisType.Explicit for t in mesh.axis_types):
      return tx.update(updates, state, params, **extra_args)
    auto = tuple(n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Auto)
    param_specs = treedef.unflatten([s.spec for s in shardings])
    state_specs = jax.tree.map(lambda s: s.spec, state_shardings(tx, updates, param_shardings))
    params_specs = None if params is None else param_specs

    def run(u, s, p, extra):
      return tx.update(u, s, p, **extra)

    extra_specs = jax.tree.map(lambda _: PartitionSpec(), extra_args)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return jax.sharding.explicit_axes(
          run, axes=auto, in_sharding=(param_specs, state_specs, params_specs, extra_specs))(
              updates, state, params, extra_args)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
