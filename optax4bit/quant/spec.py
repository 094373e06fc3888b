"""`QuantSpec`: which normalization and which mapping a quantizer uses."""

from __future__ import annotations

import dataclasses
import re
from typing import Literal, Optional, Union

Normalization = Literal["tensor", "block", "rank1"]
Mapping = Literal["DE", "DE-0", "Linear", "NF", "SqrtDE-0", "SqrtLinear"]

MAPPINGS = ("DE", "DE-0", "Linear", "NF", "SqrtDE-0", "SqrtLinear")
NORMALIZATIONS = ("tensor", "block", "rank1")
SUPPORTED_BITS = (4, 8)
# Maps that exclude zero exist for the non-negative second moment only.
UNSIGNED_ONLY_MAPPINGS = ("DE-0", "Linear", "SqrtDE-0", "SqrtLinear")
# The normal-float map is built for signed, roughly Gaussian blocks (first moments).
SIGNED_ONLY_MAPPINGS = ("NF",)
# Maps defined for 4 bits only.
FOUR_BIT_ONLY_MAPPINGS = ("NF", "SqrtDE-0", "SqrtLinear")
# 1-D tensors have no rank-1 structure; the paper falls back to B128 for them.
RANK1_FALLBACK_BLOCK = 128

_NAME_RE = re.compile(r"^(?P<norm>Tensor|Rank-1|B(?P<block>\d+))/(?P<map>DE-0|DE|Linear|NF|SqrtDE-0|SqrtLinear)$")


def _is_power_of_two(n: int) -> bool:
  return n > 0 and (n & (n - 1)) == 0


@dataclasses.dataclass(frozen=True)
class QuantSpec:
  """How a tensor is quantized: a normalization followed by a mapping.

  A spec is frozen and hashable, so it can live in pytree aux data and in
  ``jax.jit`` static arguments.

  Attributes:
    normalization: ``"tensor"`` (one scale), ``"block"`` (max over blocks of
      ``block_size`` consecutive elements of the last axis) or ``"rank1"``
      (one max vector per axis; 1-D tensors fall back to ``B128``).
    mapping: ``"DE"`` (dynamic exponent), ``"DE-0"`` (unsigned DE without
      zero), ``"Linear"`` (unsigned ``(i + 1) / 2**bits``, no zero), ``"NF"``
      (signed 4-bit normal float: quantiles of a normal distribution) or
      ``"SqrtDE-0"`` (unsigned, 4 bits: ``sqrt(x)`` coded with ``DE-0``, so
      entries are the squares of ``DE-0``'s, down to about 1e-5 of the scale)
      or ``"SqrtLinear"`` (unsigned, 4 bits: ``sqrt(x)`` coded with ``Linear``,
      entries ``((i + 1) / 16)**2``, down to 1/256 of the scale).
    bits: 4 or 8.
    signed: whether the table covers [-1, 1] (first moments) or [0, 1].
    block_size: block length for ``"block"``; ignored otherwise.
    stochastic: round stochastically between the two neighbouring table
      entries (unbiased) instead of to the nearest entry; needs a PRNG key.
    stall_only: with ``stochastic``, round stochastically only the elements
      whose nearest code is the code they had before (where an EMA that moves
      by less than half a gap would stall at its old code), and the others
      to the nearest entry: stochastic rounding's lack of bias where nearest
      rounding stalls, without its variance where it does not. Needs the
      stored codes (an optimizer's state); `optax4bit.quantize`, which has
      none, rounds every element stochastically.

  Example:
    >>> import optax4bit
    >>> spec = optax4bit.QuantSpec.parse("B128/DE")
    >>> spec.normalization, spec.block_size, spec.signed
    ('block', 128, True)
    >>> optax4bit.QuantSpec.parse("Rank-1/Linear").name
    'Rank-1/Linear'
  """

  normalization: Normalization
  mapping: Mapping
  bits: int = 4
  signed: bool = False
  block_size: int = 0
  stochastic: bool = False
  stall_only: bool = False

  def __post_init__(self):
    if self.normalization not in NORMALIZATIONS:
      raise ValueError(
          f"normalization must be one of {NORMALIZATIONS}, got {self.normalization!r}.")
    if self.mapping not in MAPPINGS:
      raise ValueError(f"mapping must be one of {MAPPINGS}, got {self.mapping!r}.")
    if isinstance(self.bits, bool) or self.bits not in SUPPORTED_BITS:
      raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {self.bits!r}.")
    if not isinstance(self.signed, bool):
      raise ValueError(f"signed must be a bool, got {self.signed!r}.")
    if self.signed and self.mapping in UNSIGNED_ONLY_MAPPINGS:
      raise ValueError(
          f"mapping {self.mapping!r} excludes zero and exists only unsigned "
          "(for non-negative tensors such as Adam's second moment); "
          "use signed=False or mapping='DE' for signed tensors.")
    if not self.signed and self.mapping in SIGNED_ONLY_MAPPINGS:
      raise ValueError(
          f"mapping {self.mapping!r} exists only signed (for first moments); use "
          "signed=True, or mapping='DE-0', 'SqrtDE-0' or 'SqrtLinear' for non-negative tensors.")
    if self.bits != 4 and self.mapping in FOUR_BIT_ONLY_MAPPINGS:
      raise ValueError(f"mapping {self.mapping!r} exists for 4 bits only, got bits={self.bits}.")
    if self.normalization == "block":
      if (isinstance(self.block_size, bool) or not isinstance(self.block_size, int)
          or not _is_power_of_two(self.block_size)):
        raise ValueError(
            "block_size must be a positive power of two for block normalization, "
            f"got {self.block_size!r}.")
    elif self.block_size != 0:
      raise ValueError(
          f"block_size is only meaningful for block normalization, got "
          f"block_size={self.block_size!r} with normalization={self.normalization!r}.")
    if not isinstance(self.stochastic, bool):
      raise ValueError(f"stochastic must be a bool, got {self.stochastic!r}.")
    if not isinstance(self.stall_only, bool):
      raise ValueError(f"stall_only must be a bool, got {self.stall_only!r}.")
    if self.stall_only and not self.stochastic:
      raise ValueError("stall_only=True chooses where rounding is stochastic and needs "
                       "stochastic=True.")

  @classmethod
  def parse(
      cls,
      name: str,
      *,
      bits: int = 4,
      signed: Optional[bool] = None,
      stochastic: bool = False,
      stall_only: bool = False,
  ) -> "QuantSpec":
    """Builds a spec from a paper-style name such as ``"B128/DE"``.

    Args:
      name: ``NORM/MAP`` with NORM one of ``Tensor``, ``Rank-1``, ``B<k>``
        (k a power of two) and MAP one of ``DE``, ``DE-0``, ``Linear``, ``NF``,
        ``SqrtDE-0``, ``SqrtLinear``.
      bits: 4 or 8.
      signed: defaults to ``True`` for ``DE`` and ``NF`` and ``False`` for the
        zero-free maps ``DE-0``, ``Linear``, ``SqrtDE-0`` and ``SqrtLinear``.
      stochastic: stochastic rounding.
      stall_only: stochastic rounding only where nearest rounding would keep
        the stored code (see the class docstring).

    Returns:
      The spec.

    Raises:
      ValueError: for an unknown name or an invalid combination.
    """
    if not isinstance(name, str):
      raise ValueError(f"a quantizer name must be a str such as 'B128/DE', got {name!r}.")
    match = _NAME_RE.match(name.strip())
    if match is None:
      raise ValueError(
          f"unknown quantizer name {name!r}: expected 'NORM/MAP' with NORM in "
          "'Tensor', 'Rank-1', 'B<block size>' and MAP in 'DE', 'DE-0', 'Linear', 'NF', "
          "'SqrtDE-0', 'SqrtLinear' "
          "(e.g. 'B128/DE', 'Rank-1/Linear').")
    mapping = match["map"]
    if signed is None:
      signed = mapping not in UNSIGNED_ONLY_MAPPINGS
    if match["block"] is not None:
      block = int(match["block"])
      if not _is_power_of_two(block):
        raise ValueError(
            f"block size in {name!r} must be a positive power of two, got {block}.")
      return cls("block", mapping, bits, signed, block, stochastic, stall_only)
    norm = "tensor" if match["norm"] == "Tensor" else "rank1"
    return cls(norm, mapping, bits, signed, 0, stochastic, stall_only)

  @property
  def name(self) -> str:
    """The paper-style name, e.g. ``"B128/DE"`` (bits and sign not included)."""
    norm = {"tensor": "Tensor", "rank1": "Rank-1"}.get(
        self.normalization, f"B{self.block_size}")
    return f"{norm}/{self.mapping}"

  def replace(self, **changes) -> "QuantSpec":
    """Returns a copy with some fields changed (validated again)."""
    return dataclasses.replace(self, **changes)

  def __str__(self) -> str:
    extras = [f"{self.bits}-bit", "signed" if self.signed else "unsigned"]
    if self.stall_only:
      extras.append("stochastic where stalled")
    elif self.stochastic:
      extras.append("stochastic")
    return f"{self.name} ({', '.join(extras)})"


SpecLike = Union[str, QuantSpec]


def as_spec(spec: SpecLike, *, argname: str = "spec", signed: Optional[bool] = None,
            bits: Optional[int] = None) -> QuantSpec:
  """Turns a name or a spec into a `QuantSpec`.

  Names are parsed with the given ``signed``/``bits``; an explicit `QuantSpec`
  is returned as is, except that a spec whose sign contradicts ``signed``
  raises, naming ``argname``.
  """
  if isinstance(spec, QuantSpec):
    if signed is not None and spec.signed != signed:
      kind = "a signed" if signed else "an unsigned (non-negative)"
      raise ValueError(f"{argname} quantizes {kind} tensor, but the given spec "
                       f"{spec} has signed={spec.signed}.")
    if bits is not None and spec.bits != bits:
      raise ValueError(f"{argname} must be a {bits}-bit spec, got {spec}.")
    return spec
  if isinstance(spec, str):
    try:
      return QuantSpec.parse(spec, signed=signed, bits=4 if bits is None else bits)
    except ValueError as e:
      raise ValueError(f"{argname}: {e}") from None
  raise ValueError(f"{argname} must be a quantizer name such as 'B128/DE' or a "
                   f"QuantSpec, got {spec!r}.")
