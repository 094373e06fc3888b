"""The platform an update traced now will run on, for ``implementation="auto"``."""

from __future__ import annotations

import jax

__all__ = ["default_platform"]


def default_platform() -> str:
  """The platform of ``jax.default_device`` where one is set (a device or a
  platform name), else ``jax.default_backend()``: uncommitted arrays, and so
  an update traced inside ``with jax.default_device(jax.devices("cpu")[0])``
  on a GPU machine, run there. ``"gpu"`` for CUDA and ROCm devices, as
  ``jax.default_backend()`` says."""
  device = jax.config.jax_default_device
  if device is None:
    return jax.default_backend()
  if isinstance(device, str):
    device = jax.devices(device)[0]
  return device.platform
