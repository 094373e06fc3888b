"""Named quantizer recipes: which quantizer stores each optimizer moment.

``"default"`` is this library's recipe; ``"paper"`` is the one of Li, Chen and
Zhu (NeurIPS 2023). Both use 4 bits and the same memory: 0.5 byte of codes per
element and moment, one float32 scale per 128 elements of the first moment,
and rank-1 scales (one float32 per row and per column) for the second moment.

* ``"paper"``: first moment ``B128/DE``, second moment ``Rank-1/Linear``,
  both rounded to the nearest entry.
* ``"default"``: first moment ``B128/NF`` (the 4-bit normal-float map),
  rounded stochastically where rounding to the nearest entry would keep the
  code it had (``stall_only=True``, "the stall rule") and to the nearest entry
  elsewhere; second moment ``Rank-1/SqrtLinear`` (``sqrt(v)`` coded with the
  linear map: entries ``((i + 1) / 16)**2`` of the scale, down to 1/256 of
  it), rounded stochastically.

Why the default differs (benchmarks/history/log-to-2026-11.md, "Training
quality", and benchmarks/history/2026-11-27-issue-40.md): an EMA rounded to
the nearest entry stops moving when its change per step is below half the
gap between entries, since each step is rounded away. Adam's second moment
(``b2 = 0.999``) changes by about 0.1% per step against gaps of 12% or more
at 4 bits, so rounded to nearest it stays where it was, and with it the step
size; the first moment stalls the same way where the gradient is exact
(full-batch training). Stochastic rounding keeps each moment's expectation
exact. The first moment needs it only where it would stall: elsewhere nearest
rounding moves it as far as it should, without the draw's noise (issue 50;
benchmarks/history/2026-11-29-issue-50.md). ``Rank-1/Linear`` also decodes
every second moment below 1/16 of its scale to 1/16 of it, so those elements
take steps up to several times too small; ``SqrtLinear`` reaches 16 times lower and keeps ``Linear``'s even
spacing in ``sqrt(v)``, the quantity Adam divides by, and the normal-float
map spends its entries where a block's values are.

Measured (paired against float32 AdamW, benchmarks/RESULTS.md): least
squares 1.24x float32 Adam's loss at step 300 with the default, 4.4x with the
paper's; the teacher MLP 0.92x and 6.1x. Validation loss of byte LMs, mean
paired gap over 6 seeds: a 3 x 192 stdlib LM at lr 3e-3 without clipping
+0.20 +- 0.12% (the paper's +1.61 +- 0.51%), a Flax NNX 2 x 192 LM on the
Python docs' English +0.48 +- 0.10% (+1.27 +- 0.21%), a 2 x 96 prose LM
-0.17 +- 0.08% (+0.10 +- 0.29%); on all seven of the benchmark's LMs, -0.34% to
+0.48%. With the first moment rounded stochastically
everywhere (the default until issue 50) the same runs gave +0.58, +0.53 and
-0.06%; the stall rule is the default because it is the one within 0.5% on
all three, at least squares and the MLP no worse (1.24x, 0.97x before).
Where the paper's recipe is ahead on a language model, it is for one of two
reasons: its stalled second moment makes the steps 1.3x float32
Adam's, which float32 AdamW with larger steps gains from too (a 4 x 128 byte
LM: paper -1.29%); or its first moment is rounded to nearest (a 4 x 384 prose
LM, where it led the old default by 0.50 points and leads this one by 0.11 +- 0.17),
which full-batch training cannot afford. Earlier defaults:
``first_moment=QuantSpec.parse("B128/NF", stochastic=True)`` (until issue 50),
``second_moment="Rank-1/SqrtDE-0"`` (0.1.0, rounded to the nearest entry).

Example:
  >>> import optax4bit
  >>> optax4bit.recipes.RECIPES["paper"].first_moment.name
  'B128/DE'
  >>> optax4bit.recipes.resolve("default", first_moment="B128/DE").second_moment
  QuantSpec(normalization='rank1', mapping='SqrtLinear', bits=4, signed=False, block_size=0, stochastic=True)
"""

from optax4bit._recipes import RECIPES, Recipe, resolve

__all__ = ["Recipe", "RECIPES", "resolve"]
