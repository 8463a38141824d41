"""The HF tensors of one update: checked against the first update, grouped as the loaders need them.

Parameters that share HF inputs (``qkv_proj`` from q, k and v; a tied embedding and
lm head) form one group, and a group is loaded only when all its inputs arrived. A
tensor is held only until every group that reads it has been loaded.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from p2pweights.errors import ConfigError

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class InputSpec:
    """What the first update sent under one HF name; later updates must send the same."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class ParamGroup:
    """Parameters loaded together, and the HF names they are loaded from.

    The replica's loader probe makes them: HF names whose parameters overlap (q, k
    and v of one fused ``qkv_proj``) form one group, staged by one loader call.
    """

    hf_names: frozenset[str]
    param_names: tuple[str, ...]
    """In the replica's parameter order."""


def describe_inputs(tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, InputSpec]:
    """Name -> shape and dtype; rejects duplicate names and non-tensors up front."""
    specs: dict[str, InputSpec] = {}
    for name, tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError(
                f"HF tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor"
            )
        if name in specs:
            raise ConfigError(f"HF tensor {name!r} was given twice in one update")
        specs[name] = InputSpec(tuple(tensor.shape), tensor.dtype)
    return specs


def described_inputs(named_tensors: object) -> dict[str, InputSpec] | None:
    """What an iterator says it will yield, if it says (a ``specs()`` method returning
    name -> (shape, dtype), as ``hf_named_tensors`` does), without consuming it; None
    when it does not say or cannot (the caller then reads the input whole)."""
    specs = getattr(named_tensors, "specs", None)
    if not callable(specs):
        return None
    try:
        found = {name: InputSpec(tuple(shape), dtype) for name, (shape, dtype) in specs().items()}
        wrong = [name for name, spec in found.items() if not isinstance(spec.dtype, torch.dtype)]
        if wrong:
            raise TypeError(f"specs() gave HF tensor {wrong[0]!r} a dtype that is no torch.dtype")
    except Exception:  # only an optimisation: the input is read whole instead
        logger.warning("the update's specs() failed; reading the input whole", exc_info=True)
        return None
    return found


def check_input(name: str, tensor: torch.Tensor, known: Mapping[str, InputSpec]) -> None:
    """Raise ``ConfigError`` unless ``tensor`` matches what the first update sent as ``name``."""
    if not isinstance(tensor, torch.Tensor):
        raise ConfigError(f"HF tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
    spec = known.get(name)
    if spec is None:
        raise ConfigError(
            f"HF tensor {name!r} was not part of the first update; the HF-name-to-parameter "
            f"mapping is probed once, so every update must send the same names"
        )
    if tensor.dtype != spec.dtype:
        raise ConfigError(
            f"HF tensor {name!r} is {tensor.dtype}, the first update sent {spec.dtype}"
        )
    if tuple(tensor.shape) != spec.shape:
        raise ConfigError(
            f"HF tensor {name!r} has shape {tuple(tensor.shape)}, "
            f"the first update sent {spec.shape}"
        )
