"""Fused XLA CPU kernels (C++, ``jax.ffi``) for 4-bit AdamW, AdamW with a
factored second moment (``adamw_4bit_factor``) and SGD with momentum
(``sgdm_4bit``), both recipes, and `optax4bit.adamw_8bit`; and the 4-bit
codecs the jnp engine runs on CPU (`optax4bit.cpu.codec`).

On the CPU backend ``implementation="auto"`` (the default of every optimizer)
runs, on CPUs where it beats the jnp path (`faster_than_jnp`; `isa` names the
ISA path it runs), leaves of two axes or more (stacked layers run as their
rows) quantized with the default recipe (``B128/NF``
stochastic, ``Rank-1/SqrtLinear``), the paper's (``B128/DE``,
``Rank-1/Linear``) or ``adamw_8bit``'s (``B256/DE``, 8 bits) through it;
``implementation="cpu"`` asks for it explicitly and ``"jnp"`` turns it off.
It is built at install time from ``kernels.cc`` when a C++17 compiler is
found; without one optax4bit installs and runs its jnp implementation.
See `optax4bit.cpu.ffi` for the design.

Example:
  >>> import optax4bit.cpu
  >>> optax4bit.cpu.available() or optax4bit.cpu.unavailable_reason() is not None
  True
"""

from optax4bit.cpu.ffi import available, faster_than_jnp, isa, isas, unavailable_reason

__all__ = ["available", "faster_than_jnp", "isa", "isas", "unavailable_reason"]
