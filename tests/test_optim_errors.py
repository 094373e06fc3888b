"""Wrong inputs give clear ``ValueError``s, at construction time where possible."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

import optax4bit
from optax4bit import QuantSpec
from optax4bit._platform import compiled_only_for

PARAMS = {"w": jnp.ones((64, 128)), "b": jnp.ones(3)}
GRADS = {"w": jnp.full((64, 128), 0.1), "b": jnp.full(3, 0.1)}

ALIASES = [optax4bit.adamw_4bit, optax4bit.adam_4bit, optax4bit.adamw_4bit_factor,
           optax4bit.adamw_8bit, optax4bit.sgdm_4bit]


def all_optimizers():
  return [optax4bit.adamw_4bit(1e-3, min_quantize_size=0),
          optax4bit.adam_4bit(1e-3, min_quantize_size=0),
          optax4bit.adamw_4bit_factor(1e-3, min_quantize_size=0),
          optax4bit.adamw_8bit(1e-3, min_quantize_size=0),
          optax4bit.sgdm_4bit(1e-3, min_quantize_size=0)]


OPT_IDS = ["adamw_4bit", "adam_4bit", "adamw_4bit_factor", "adamw_8bit", "sgdm_4bit"]


# ----------------------------------------------------------------------------
# Structure and shape mismatches at update time (no compilation needed: the
# checks run while tracing, so jax.eval_shape is enough).


@pytest.mark.parametrize("index", range(5), ids=OPT_IDS)
def test_updates_structure_mismatch(index):
  tx = all_optimizers()[index]
  state = tx.init(PARAMS)
  with pytest.raises(ValueError, match="structure"):
    jax.eval_shape(tx.update, {"w": GRADS["w"]}, state, PARAMS)
  with pytest.raises(ValueError, match="structure"):
    jax.eval_shape(tx.update, dict(GRADS, extra=GRADS["b"]), state, PARAMS)
  with pytest.raises(ValueError, match="structure"):
    jax.eval_shape(tx.update, [GRADS["w"], GRADS["b"]], state, PARAMS)


@pytest.mark.parametrize("index", range(5), ids=OPT_IDS)
def test_leaf_shape_mismatch_names_the_leaf(index):
  tx = all_optimizers()[index]
  state = tx.init(PARAMS)
  with pytest.raises(ValueError, match=r"\['w'\].*\(64, 64\).*\(64, 128\)"):
    jax.eval_shape(tx.update, {"w": jnp.ones((64, 64)), "b": GRADS["b"]}, state, PARAMS)
  with pytest.raises(ValueError, match=r"\['b'\]"):
    jax.eval_shape(tx.update, {"w": GRADS["w"], "b": jnp.ones(4)}, state, PARAMS)


def test_state_from_other_params():
  tx = optax4bit.adamw_4bit(1e-3)
  state = tx.init({"w": jnp.ones((64, 128))})
  with pytest.raises(ValueError, match="structure"):
    jax.eval_shape(tx.update, GRADS, state, PARAMS)


def test_params_structure_mismatch():
  tx = optax4bit.adamw_4bit(1e-3)
  state = tx.init(PARAMS)
  with pytest.raises(ValueError):
    jax.eval_shape(tx.update, GRADS, state, {"w": PARAMS["w"]})


@pytest.mark.parametrize("factory", [optax4bit.adamw_4bit, optax4bit.adamw_4bit_factor,
                                     optax4bit.adamw_8bit])
def test_params_none_with_weight_decay(factory):
  tx = factory(1e-3)
  state = tx.init(PARAMS)
  with pytest.raises(ValueError, match="params"):
    jax.eval_shape(tx.update, GRADS, state)


def test_params_may_be_omitted_without_weight_decay():
  for tx in (optax4bit.adam_4bit(1e-3), optax4bit.sgdm_4bit(1e-3),
             optax4bit.scale_by_factored_adam_4bit()):
    jax.eval_shape(tx.update, GRADS, tx.init(PARAMS))


# ----------------------------------------------------------------------------
# Invalid hyperparameters, at construction time.


@pytest.mark.parametrize("factory", ALIASES)
@pytest.mark.parametrize("lr", [-1e-3, float("nan"), float("inf")])
def test_invalid_learning_rate(factory, lr):
  with pytest.raises(ValueError, match="learning_rate"):
    factory(lr)


@pytest.mark.parametrize("factory", [optax4bit.adamw_4bit, optax4bit.adam_4bit,
                                     optax4bit.adamw_4bit_factor, optax4bit.adamw_8bit])
@pytest.mark.parametrize("name,value", [("b1", 1.0), ("b1", -0.1), ("b1", 1.5), ("b2", 1.0),
                                        ("b2", -1e-3), ("eps", -1e-8), ("eps_root", -1.0)])
def test_invalid_adam_hyperparameters(factory, name, value):
  with pytest.raises(ValueError, match=name):
    factory(1e-3, **{name: value})


@pytest.mark.parametrize("factory", [optax4bit.adamw_4bit, optax4bit.adamw_4bit_factor,
                                     optax4bit.adamw_8bit])
def test_invalid_weight_decay(factory):
  with pytest.raises(ValueError, match="weight_decay"):
    factory(1e-3, weight_decay=-1e-4)


@pytest.mark.parametrize("value", [1.0, -0.5])
def test_invalid_momentum(value):
  with pytest.raises(ValueError, match="momentum"):
    optax4bit.sgdm_4bit(1e-3, momentum=value)


@pytest.mark.parametrize("transform", [optax4bit.scale_by_adam_4bit,
                                       optax4bit.scale_by_factored_adam_4bit])
def test_invalid_hyperparameters_of_transforms(transform):
  with pytest.raises(ValueError, match="b1"):
    transform(b1=1.0)
  with pytest.raises(ValueError, match="eps"):
    transform(eps=-1.0)


@pytest.mark.parametrize("factory", ALIASES)
@pytest.mark.parametrize("name,value", [("min_quantize_size", -1), ("min_quantize_size", 1.5),
                                        ("min_quantize_size", "4096"), ("chunk_size", 0),
                                        ("chunk_size", 2.0)])
def test_invalid_structural_arguments(factory, name, value):
  with pytest.raises(ValueError, match=name):
    factory(1e-3, **{name: value})


def test_valid_edge_hyperparameters():
  optax4bit.adamw_4bit(0.0, b1=0.0, b2=0.0, eps=0.0, weight_decay=0.0)
  optax4bit.sgdm_4bit(0.0, momentum=0.0)
  optax4bit.adamw_4bit(optax.linear_schedule(1e-3, 0.0, 100),
                       weight_decay=optax.linear_schedule(1e-2, 0.0, 100))
  optax4bit.adamw_4bit(jnp.asarray(1e-3))  # arrays are not checked (they may be injected)


# ----------------------------------------------------------------------------
# Quantizer arguments.


@pytest.mark.parametrize("argname", ["first_moment", "second_moment"])
@pytest.mark.parametrize("bad", ["B100/DE", "Rank1/Linear", "B128/Log", "128/DE", "", "B128-DE",
                                 3, ("B128", "DE")])
def test_bad_quantizer_names(argname, bad):
  with pytest.raises(ValueError, match=argname):
    optax4bit.adamw_4bit(1e-3, **{argname: bad})


def test_bad_first_moment_of_momentum_and_factor():
  with pytest.raises(ValueError, match="first_moment"):
    optax4bit.sgdm_4bit(1e-3, first_moment="B128/Nope")
  with pytest.raises(ValueError, match="first_moment"):
    optax4bit.adamw_4bit_factor(1e-3, first_moment="Rank-1/Linear")  # no signed Linear
  with pytest.raises(ValueError, match="second_moment"):
    optax4bit.adamw_4bit_factor(1e-3, second_moment="B128")


def test_signed_spec_for_second_moment():
  with pytest.raises(ValueError, match="second_moment.*signed"):
    optax4bit.adamw_4bit(1e-3, second_moment=QuantSpec.parse("B128/DE"))  # signed by default
  with pytest.raises(ValueError, match="second_moment"):
    optax4bit.scale_by_factored_adam_4bit(second_moment=QuantSpec("block", "DE", signed=True,
                                                                  block_size=128))
  # A name is parsed unsigned for the second moment (the ablation's B128/DE row).
  state = optax4bit.adamw_4bit(1e-3, second_moment="B128/DE", min_quantize_size=0).init(PARAMS)
  assert state[0].nu["w"].spec == QuantSpec.parse("B128/DE", signed=False)


def test_unsigned_spec_for_first_moment():
  with pytest.raises(ValueError, match="first_moment.*signed"):
    optax4bit.adamw_4bit(1e-3, first_moment=QuantSpec.parse("B128/DE", signed=False))
  with pytest.raises(ValueError, match="first_moment"):
    optax4bit.sgdm_4bit(1e-3, first_moment=QuantSpec.parse("Rank-1/Linear"))


def test_invalid_quantspec_fields():
  with pytest.raises(ValueError, match="bits"):
    QuantSpec("block", "DE", bits=3, signed=True, block_size=128)
  with pytest.raises(ValueError, match="block_size"):
    QuantSpec("block", "DE", signed=True, block_size=100)


# ----------------------------------------------------------------------------
# quantize_mask.


@pytest.mark.parametrize("index", range(5), ids=OPT_IDS)
@pytest.mark.parametrize("mask", [{"w": True}, {"w": True, "b": False, "c": True},
                                  [True, False]], ids=["missing", "extra", "list"])
def test_quantize_mask_wrong_structure(index, mask):
  tx = [optax4bit.adamw_4bit, optax4bit.adam_4bit, optax4bit.adamw_4bit_factor,
        optax4bit.adamw_8bit, optax4bit.sgdm_4bit][index](1e-3, quantize_mask=mask)
  with pytest.raises(ValueError, match="quantize_mask"):
    tx.init(PARAMS)


@pytest.mark.parametrize("mask", [
    {"w": 1, "b": 0},
    {"w": jnp.array(True), "b": False},
    {"w": "yes", "b": False},
    {"w": None, "b": True},
    lambda p: {"w": 1.0, "b": True},
], ids=["ints", "array", "str", "none", "callable"])
def test_quantize_mask_non_bool_entries(mask):
  tx = optax4bit.adamw_4bit(1e-3, quantize_mask=mask)
  with pytest.raises(ValueError, match="quantize_mask"):
    tx.init(PARAMS)


def test_quantize_mask_valid_forms():
  is_q = lambda x: isinstance(x, optax4bit.QuantizedArray)
  for mask, expected in [(False, (False, False)), (True, (True, True)),
                         ({"w": True, "b": False}, (False, True)),
                         (lambda p: jax.tree.map(lambda x: x.ndim > 1, p), (False, True))]:
    state = optax4bit.adamw_4bit(1e-3, quantize_mask=mask, min_quantize_size=0).init(PARAMS)
    assert (is_q(state[0].mu["b"]), is_q(state[0].mu["w"])) == expected, mask


# ----------------------------------------------------------------------------
# optax.inject_hyperparams without static_args.


@pytest.mark.parametrize("factory", ALIASES)
def test_optax_inject_hyperparams_needs_static_args(factory):
  tx = optax.inject_hyperparams(factory)(learning_rate=1e-3)
  with pytest.raises(ValueError, match=r"min_quantize_size.*static_args"):
    tx.init(PARAMS)


@pytest.mark.skipif(not optax4bit.cpu.available(), reason="the C++ CPU kernel is not built")
@pytest.mark.usefixtures("cpu_default_device")  # traced for the CPU on a GPU machine too
@pytest.mark.parametrize("factory", [
    lambda: optax4bit.adamw_4bit(1e-3, implementation="cpu"),
    lambda: optax4bit.sgdm_4bit(1e-2, implementation="cpu"),
    lambda: optax4bit.adamw_8bit(1e-3, implementation="cpu"),
    # quantize_state runs the kernel's codecs under "auto" ("cpu" is for fused steps),
    # in a process that compiles only for the CPU (one engine traced).
    lambda: optax4bit.quantize_state(optax.adam(1e-3), implementation="auto"),
], ids=["adamw_4bit", "sgdm_4bit", "adamw_8bit", "quantize_state auto"])
def test_cpu_kernel_compiled_for_a_gpu_names_implementation(factory, monkeypatch):
  """Compiled for CUDA (exported here, without a GPU), the C++ kernel's calls
  raise optax4bit's error instead of XLA's "No FFI handler registered"."""
  monkeypatch.setattr(optax4bit.dispatch, "installed_platforms", lambda: frozenset({"cpu"}))
  tx = factory()
  params = {"w": jnp.zeros((32, 256))}  # above the smallest quantized leaf
  state = jax.eval_shape(tx.init, params)
  step = jax.jit(lambda g, s: tx.update(g, s, params))
  assert "custom_call @optax4bit_" in step.lower(params, state).as_text()  # the kernel runs
  with pytest.raises(ValueError, match=r"implementation='cpu'.*compiled for 'cuda'"):
    jax.export.export(step, platforms=["cuda"])(params, state)


@pytest.mark.usefixtures("cpu_default_device")
def test_pallas_kernels_compiled_for_a_cpu_name_implementation():
  """Compiled for the CPU, the Pallas (Triton) kernels raise optax4bit's error
  instead of Pallas' "Only interpret mode is supported on CPU backend"."""
  tx = optax4bit.adamw_4bit(1e-3, implementation="pallas")
  params = {"w": jnp.zeros((32, 256))}
  state = tx.init(params)
  with pytest.raises(ValueError, match=r"implementation='pallas'.*compiled for 'cpu'"):
    jax.jit(lambda g, s: tx.update(g, s, params))(params, state)


@pytest.mark.usefixtures("cpu_default_device")
def test_platform_check_outside_a_trace_reads_the_array_devices():
  """Eager kernel calls (an update without jit) are checked by the operand's
  devices and pass it on uncopied."""
  x = jnp.ones((4, 128))
  assert compiled_only_for(x, ("cpu",), "unused") is x
  with pytest.raises(ValueError, match=r"^on 'cpu'$"):
    compiled_only_for(x, ("cuda", "rocm"), "on {platforms}")
