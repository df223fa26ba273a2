"""A shape-only stand-in for a GPU on a CPU machine: the ``meta`` device.

A worker whose model is moved to ``meta`` runs its real code paths without values, and any tensor
that reaches the model without having been moved to the model's device raises, exactly as a CPU
tensor meeting a CUDA one does ("Tensor on device cpu is not on the expected device meta").
Inside :class:`HostCrossings`, crossing from the stand-in back to the host (``.cpu()``,
``.to("cpu")``, ``.item()``, ``float()``, ``.tolist()``) is allowed and yields zeros of the
right shape: a meta tensor has a shape and no values. What comes back from such a run is
therefore checked for where it lives and its shape, never for its values.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

META = torch.device("meta")
_TO_HOST = {torch.Tensor.cpu, torch.Tensor.to}
_VALUES = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__float__, torch.Tensor.__int__,
           torch.Tensor.__bool__}


def _targets_host(args, kwargs) -> bool:
    """Whether a ``Tensor.to`` call moves to the CPU (device as argument or keyword)."""
    for value in (*args[1:], kwargs.get("device")):
        if isinstance(value, (str, torch.device)) and torch.device(value).type == "cpu":
            return True
    return False


class HostCrossings(TorchFunctionMode):
    """Meta tensors that cross to the host become zeros there (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if tensor is not None and tensor.is_meta:
            if func is torch.Tensor.cpu or (func is torch.Tensor.to and _targets_host(args, kwargs)):
                return torch.zeros(tensor.shape, dtype=kwargs.get("dtype", tensor.dtype))
            if func in _VALUES:
                return func(torch.zeros(tensor.shape, dtype=tensor.dtype), *args[1:], **kwargs)
        return func(*args, **kwargs)
