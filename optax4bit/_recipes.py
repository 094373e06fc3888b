"""The quantizer recipes as data: which quantizer stores each optimizer
moment (`RECIPES`), and `resolve`. Documented, and re-exported, by the
public `optax4bit.recipes`; kept below the engine and the backends so that
they can read it."""

from __future__ import annotations

from typing import NamedTuple, Optional

from optax4bit.quant.spec import QuantSpec, SpecLike, as_spec

__all__ = ["Recipe", "RECIPES", "resolve"]


class Recipe(NamedTuple):
  """The quantizers of an optimizer's first and second moments."""
  first_moment: QuantSpec
  second_moment: QuantSpec


RECIPES = {
    "default": Recipe(
        first_moment=QuantSpec("block", "NF", 4, signed=True, block_size=128, stochastic=True,
                               stall_only=True),
        second_moment=QuantSpec("rank1", "SqrtLinear", 4, signed=False, stochastic=True)),
    "paper": Recipe(
        first_moment=QuantSpec.parse("B128/DE"),
        second_moment=QuantSpec.parse("Rank-1/Linear")),
}


def resolve(recipe: str, first_moment: Optional[SpecLike] = None,
            second_moment: Optional[SpecLike] = None) -> Recipe:
  """The quantizers of ``recipe``, each replaced by an explicit argument.

  Args:
    recipe: a key of `RECIPES` (``"default"`` or ``"paper"``).
    first_moment: if given, a signed quantizer name or `QuantSpec` that
      overrides the recipe's.
    second_moment: if given, an unsigned quantizer that overrides the
      recipe's.

  Returns:
    A `Recipe` of validated specs.

  Example:
    >>> import optax4bit
    >>> optax4bit.recipes.resolve("paper").second_moment.name
    'Rank-1/Linear'
    >>> optax4bit.recipes.resolve("default", first_moment="B128/DE").first_moment.name
    'B128/DE'
  """
  if not isinstance(recipe, str) or recipe not in RECIPES:
    raise ValueError(f"recipe must be one of {tuple(RECIPES)}, got {recipe!r}.")
  chosen = RECIPES[recipe]
  return Recipe(
      chosen.first_moment if first_moment is None else
      as_spec(first_moment, argname="first_moment", signed=True),
      chosen.second_moment if second_moment is None else
      as_spec(second_moment, argname="second_moment", signed=False))
