"""Re-pointing a parameter at other memory while its Python object stays the same."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["parameter_like", "meta_like", "repoint"]


def parameter_like(
    param: torch.nn.Parameter, data: torch.Tensor, attributes: dict[str, Any] | None = None
) -> torch.nn.Parameter:
    """A Parameter of ``param``'s own class over ``data``, with ``param``'s attributes.

    The class matters: sglang's ``BasevLLMParameter`` subclasses (fp8 weights and block
    scales) carry the loader methods, and ``swap_tensors`` swaps classes too.
    """
    new = torch.Tensor._make_subclass(type(param), data, param.requires_grad)
    new.__dict__.update(param.__dict__ if attributes is None else attributes)
    return new


def meta_like(tensor: torch.Tensor) -> torch.Tensor:
    """Storage-less tensor of ``tensor``'s shape, stride and dtype."""
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")


def repoint(param: torch.nn.Parameter, data: torch.Tensor) -> torch.nn.Parameter:
    """Make ``param`` hold ``data``; returns the object that now holds the old tensor.

    Every reference to ``param`` (the module, loader closures, tied modules) sees
    ``data``; swapping again with the returned object undoes it.
    """
    other = parameter_like(param, data)
    torch.utils.swap_tensors(param, other)
    return other
