"""A trainer's tensors as the engine's checkpoint holds them (fp8 engines: quantized).

Local engines start from, and the bit-exact reference loads, the checkpoint an
engine of that config would be started from. For a block-fp8 config that is the
trainer's bf16 tensors quantized exactly as p2pweights quantizes them on the sender
(``convert``), so "what the engine holds after an update" and "what sglang's loader
makes of that checkpoint" are compared byte for byte.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch

__all__ = ["engine_checkpoint"]


def engine_checkpoint(
    model_path: str | os.PathLike[str], tensors: Iterable[tuple[str, torch.Tensor]]
) -> list[tuple[str, torch.Tensor]]:
    """``tensors`` (trainer format) converted into the checkpoint format of ``model_path``."""
    pairs = list(tensors)
    folder = Path(model_path)
    config = json.loads((folder / "config.json").read_text())
    if not config.get("quantization_config"):
        return pairs
    from p2pweights.replica.registry import replica_for
    from p2pweights.source.checkpoint_format import unify
    from p2pweights.source.inputs import describe_inputs

    # One TP-1 rank loads every weight (all experts), so it names every quantized one;
    # a same-model MTP draft's loader names those of the MTP layer.
    specs = describe_inputs(pairs)
    base = {"model_path": str(folder), "tp_size": 1}
    formats = {"target": replica_for(base, 0).checkpoint_format(specs)}
    if config.get("num_nextn_predict_layers"):
        draft = replica_for({**base, "speculative_algorithm": "NEXTN"}, 0, role="draft")
        formats["draft"] = draft.checkpoint_format(specs)
    fmt = unify(formats)["target"]
    return [converted for name, tensor in pairs for converted in fmt.convert(name, tensor)]
