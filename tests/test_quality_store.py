"""benchmarks/quality.py's committed run store (benchmarks/results/quality_runs/):
a run is written there compactly (no per-step training losses) and read back
before training, only under the same cache key; and the issue-50 LM family's
corpus and Flax NNX model."""

from __future__ import annotations

import json
import os

import pytest
from conftest import benchmark_script


@pytest.fixture(scope="module")
def quality():
  return benchmark_script("quality")


def _run(key: dict, steps: int = 3) -> dict:
  return {"steps": list(range(steps)), "metrics": {"loss": [1.0 / (i + 1) for i in range(steps)]},
          "params": 10, "state_bytes": 20, "state_bytes_per_param": 2.0, "wall_s": 1.5,
          "train_loss": [0.5] * 1000, "cache_key": key}


def test_a_stored_run_reads_back_under_its_key_only(quality, tmp_path):
  key = quality.canonical_key({"problem": "p", "seed": 0, "training": {"steps": 3}})
  stem = str(tmp_path / "p" / "adamw_steps3_seed0")
  quality.store_run(stem, _run(key))
  assert os.listdir(tmp_path / "p") == ["adamw_steps3_seed0.json"]
  back = quality.load_stored_run(stem, key)
  assert back["metrics"] == {"loss": [1.0, 0.5, 1.0 / 3]} and back["state_bytes_per_param"] == 2.0
  assert "train_loss" not in back  # the report does not read it
  assert os.path.getsize(stem + ".json") < 1000
  assert quality.load_stored_run(stem, {**key, "seed": 1}) is None
  assert quality.load_stored_run(str(tmp_path / "p" / "absent"), key) is None


def test_a_large_run_is_gzipped_and_replaces_the_plain_file(quality, tmp_path):
  key = quality.canonical_key({"problem": "p"})
  stem = str(tmp_path / "r")
  quality.store_run(stem, _run(key))
  quality.store_run(stem, _run(key, steps=3000))
  assert sorted(os.listdir(tmp_path)) == ["r.json.gz"]
  assert len(quality.load_stored_run(stem, key)["metrics"]["loss"]) == 3000


def test_a_stored_run_is_not_trained_again(quality, tmp_path, monkeypatch):
  monkeypatch.setattr(quality, "RUN_STORE", str(tmp_path))
  monkeypatch.chdir(tmp_path)  # the local cache runs/bench/quality/ is empty here
  problem = quality.PROBLEMS["lsq"]
  t = quality.training_for(problem, 5)
  trained = quality.run_problem_variant(problem, t, "adamw", 0, None, fresh=False)
  assert not trained["cached"] and len(trained["metrics"]["loss"]) == 6
  stem = quality.stored_run_path("lsq", "adamw", 5, 0)
  with open(stem + ".json") as f:
    assert json.load(f)["cache_key"]["variant"] == "adamw"
  (tmp_path / "runs").rename(tmp_path / "elsewhere")  # a fresh machine: no local cache

  def no_training(*args, **kwargs):
    raise AssertionError("trained again")

  monkeypatch.setattr(quality.C, "run_cached", no_training)
  again = quality.run_problem_variant(problem, t, "adamw", 0, None, fresh=False)
  assert again["cached"] and again["metrics"] == trained["metrics"]


def test_the_docs_corpus_splits_by_topic(quality):
  train, val, info = quality.load_docs_corpus()
  assert info["train_bytes"] == len(train) and info["val_bytes"] == len(val)
  assert info["train_files"] > 5 * info["val_files"] > 0
  assert (train == 0).sum() == info["train_files"] and (val == 0).sum() == info["val_files"]
  assert quality.load_docs_corpus()[2] == info  # deterministic


def test_the_nnx_lm_has_flax_3d_attention_kernels(quality):
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  problem = quality.PROBLEMS["lm_docs_nnx_issue50"]
  assert problem.settings["model"] == "nnx_mha" and problem.settings["corpus"] == "docs"
  s = quality.lm_settings(problem.training, 0,
                         dict(problem.settings, d_model=16, seq_len=8, num_layers=1))
  model = nnx.eval_shape(lambda: quality.make_lm_model(s, problem.settings))
  attn = model.blocks[0].attn
  assert attn.query.kernel.shape == (16, 4, 4) and attn.out.kernel.shape == (4, 4, 16)
  # Only trainable arrays (no RNG state) are split off for the optimizer.
  assert all(jnp.issubdtype(x.dtype, jnp.floating) for x in jax.tree.leaves(nnx.state(model)))
  tokens = jnp.arange(16, dtype=jnp.int32).reshape(2, 8)
  # The same model on the tokens and on the tokens with their last byte
  # changed (built and run in one compiled call: built eagerly it takes seconds).
  logits = jax.jit(lambda x: quality.make_lm_model(s, problem.settings)(x))(
      jnp.concatenate([tokens, tokens.at[:, -1].set(200)]))
  assert logits.shape == (4, 8, 256)
  # Causal: changing the last byte leaves the earlier positions' logits alone.
  assert jnp.allclose(logits[:2, :-1], logits[2:, :-1]) and not jnp.allclose(logits[:2], logits[2:])


def test_the_stall_candidates_and_the_keys_of_stall_free_specs(quality):
  # A spec without the stall rule keys as before QuantSpec had stall_only, so
  # stored runs stay valid across that library change.
  old_default = quality.variant_quantizers("adamw_4bit_m_nf_sr")
  assert "stall_only" not in old_default["first_moment"] + old_default["second_moment"]
  if quality.variant_unavailable("adamw_4bit_mv_stall"):
    pytest.skip("this optax4bit has no stall_only rounding")
  m_only = quality.candidate_specs("adamw_4bit_m_stall")
  assert set(m_only) == {"first_moment"} and m_only["first_moment"].stall_only
  both = quality.candidate_specs("adamw_4bit_mv_stall")
  assert all(s.stochastic and s.stall_only for s in both.values())
  assert both["second_moment"].name == "Rank-1/SqrtLinear"
  assert "stall_only=True" in quality.variant_quantizers("adamw_4bit_m_stall")["first_moment"]
  # Issue 50 made the rule on m the default: the candidate is the default.
  assert quality.variant_quantizers("adamw_4bit_m_stall") == quality.variant_quantizers(
      "adamw_4bit")


def test_factoring_over_the_two_largest_axes_transposes_3d_leaves_only(quality):
  """Issue 50, item 4: Adam through the wrapper is Adam (elementwise: any
  layout gives the same update); its state holds q/k/v-like (d, heads,
  head_dim) kernels as (heads, d, head_dim), out-like (heads, head_dim, d)
  and 2-D leaves as they are."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  params = {"qkv": jnp.zeros((192, 4, 48)), "out": jnp.zeros((4, 48, 192)),
            "mlp": jnp.zeros((192, 768))}
  grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(p.size + p.shape[0]), p.shape),
                       params)
  wrapped = quality.factored_over_two_largest_axes(optax.adam(1e-2))
  state = wrapped.init(params)
  assert {k: v.shape for k, v in state[0].mu.items()} == {
      "qkv": (4, 192, 48), "out": (4, 48, 192), "mlp": (192, 768)}
  updates, _ = wrapped.update(grads, state, params)
  reference, _ = optax.adam(1e-2).update(grads, optax.adam(1e-2).init(params), params)
  for k in params:
    np.testing.assert_array_equal(updates[k], reference[k])
  tx = quality.make_optimizer(quality.FACTOR_LARGEST2, quality.Training(steps=10,
                                                                        learning_rate=1e-3), 0)
  factored = tx.init(params)
  rows = [x.shape for x in jax.tree.leaves(factored) if getattr(x, "shape", ()) == (4, 192, 1)]
  assert rows, "the q/k/v-like kernel is not factored over (192, 48)"


def test_factor_with_embeddings_unfactored_keeps_their_second_moment_rank1(quality):
  """The screening variant of issue 50: nnx.Embed tables (``embed``, ``pos``)
  get the default's rank-1 4-bit `v`, every other matrix Factor's factors."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from optax4bit.quant.array import QuantizedArray  # pylint: disable=import-outside-toplevel
  params = {"embed": {"embedding": jnp.zeros((256, 192))},
            "pos": {"embedding": jnp.zeros((128, 192))},
            "blocks": {"fc1": {"kernel": jnp.zeros((192, 768))}}}
  assert quality.factored_leaves(params, ("embed", "pos")) == {
      "embed": {"embedding": False}, "pos": {"embedding": False},
      "blocks": {"fc1": {"kernel": True}}}
  tx = quality.make_optimizer("adamw_4bit_factor_embeddings_unfactored",
                              quality.Training(steps=10, learning_rate=1e-3), 0)
  state = tx.init(params)
  rank1 = [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, QuantizedArray))
           if isinstance(x, QuantizedArray) and x.spec.normalization == "rank1"]
  assert sorted(x.shape for x in rank1) == [(128, 192), (256, 192)]
  factors = [x.shape for x in jax.tree.leaves(state) if getattr(x, "shape", ()) == (192, 1)]
  assert factors, "the MLP kernel's second moment is not factored"
