"""The context one engine rank's before-end steps share (``engine_side.steps``).

Its own module so that both the steps' sequence (``steps``) and the steps that live
beside what they act on (``delta_scratch.apply_delta``) import it from below.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["BeforeEnd"]


@dataclass
class BeforeEnd:
    """What the before-end steps of one engine rank's runner see, and what they publish."""

    engine_rank: int
    role: str
    """The model runner: "target", or "draft"."""
    params: Mapping[str, torch.Tensor]
    """Published parameter name -> its tensor, where the writers wrote it."""
    update: int
    """This runner's update-session number (1 for the first ``begin``)."""
    write_digests: bool = True
    """The engine digests its weights for the trainers (``P2PWEIGHTS_WRITE_DIGESTS``)."""
    early: dict[str, str] = field(default_factory=dict)
    """Digests taken while the session was open, of parameters whose writes the sender
    said had landed (``engine_side.landed``)."""
    record: dict[str, Any] = field(default_factory=dict)
    """What the rank publishes once the steps ran (JSON-serializable)."""
