"""Named quantizer recipes: which quantizer stores each optimizer moment.

``"default"`` is this library's recipe; ``"paper"`` is the one of Li, Chen and
Zhu (NeurIPS 2023). Both use 4 bits and the same memory: 0.5 byte of codes per
element and moment, one float32 scale per 128 elements of the first moment,
and rank-1 scales (one float32 per row and per column) for the second moment.

* ``"paper"``: first moment ``B128/DE``, second moment ``Rank-1/Linear``,
  both rounded to the nearest entry.
* ``"default"``: first moment ``B128/NF`` (the 4-bit normal-float map) with
  stochastic rounding; second moment ``Rank-1/SqrtLinear`` (``sqrt(v)`` coded
  with the linear map: entries ``((i + 1) / 16)**2`` of the scale, down to
  1/256 of it), nearest rounding.

Why the default differs (benchmarks/history/log-to-2026-11.md, "Training quality"): where
the moments of a tensor span a wide range inside its rows and columns, the
paper's recipe loses in two ways. ``Rank-1/Linear`` decodes every second
moment below 1/16 of its scale to 1/16 of it, so those elements take steps
up to several times too small; ``SqrtLinear`` reaches 16 times lower and
keeps ``Linear``'s even spacing in ``sqrt(v)``, the quantity Adam divides by.
A first moment rounded to the nearest entry stops moving when the EMA's
change per step is below half the gap between entries (the step is rounded
away); stochastic rounding keeps its expectation exact, and the normal-float
map spends its entries where a block's values are.

Which one to use (benchmarks/history/2026-11-27-issue-40.md): the default
for full-batch and low-noise training, where every first moment rounded to
the nearest entry stalls (least squares: 1.30x float32 Adam's loss at step
300 with the default, 4.4x with the paper's). With minibatch gradients the
EMA moves every step, nearest rounding does not stall it, and stochastic
rounding only adds noise to each step's direction: on a 3 x 192 byte LM at
lr 3e-3 without clipping the paper's recipe ends +2.1% above float32 AdamW
against the default's +3.6%, on a 4 x 384 prose LM -0.38% against +0.04%
(on the benchmark's four other LMs the two are level). For minibatch training
of transformers, compare
``recipe="paper"`` with the default on a short run.
(In 0.1.0 the default's second moment was ``Rank-1/SqrtDE-0``, +5.2% on
that LM; ``second_moment="Rank-1/SqrtDE-0"`` still selects it.)

Example:
  >>> import optax4bit
  >>> optax4bit.recipes.RECIPES["paper"].first_moment.name
  'B128/DE'
  >>> optax4bit.recipes.resolve("default", first_moment="B128/DE").second_moment.name
  'Rank-1/SqrtLinear'
"""

from optax4bit._recipes import RECIPES, Recipe, resolve

__all__ = ["Recipe", "RECIPES", "resolve"]
