"""Speculative decoding at connect: which engines have a draft runner p2pweights updates.

A same-model EAGLE / MTP draft (``--speculative-algorithm EAGLE`` or ``NEXTN``, no
separate draft checkpoint) is a second model runner on every engine rank, built from
the model's own checkpoint (its MTP layer). An update must reach it too: each runner
receives every weight its own loader loads. sglang reloads a draft under the
target's MoE backends, and one draft runner loads one MTP layer, so engines whose
draft cannot be reproduced that way are refused here, naming the server arg.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from p2pweights.errors import EngineError

__all__ = ["has_model_draft"]

_SAME_MODEL_DRAFTS = frozenset({"EAGLE", "NEXTN"})
"""sglang resolves NEXTN to EAGLE; both load the draft from the model's own MTP layer."""
_NO_DRAFT_MODEL = frozenset({"NGRAM"})
"""Drafts from a token cache: no weights to update."""


def has_model_draft(url: str, server_info: Mapping[str, Any]) -> bool:
    """Whether the engine runs a same-model draft to update; raise if it runs one we cannot."""
    algorithm = server_info.get("speculative_algorithm")
    if algorithm is None or str(algorithm).upper() in ("NONE", ""):
        return False
    algorithm = str(algorithm).upper()
    if algorithm in _NO_DRAFT_MODEL:
        return False

    def refuse(arg: str, why: str) -> EngineError:
        return EngineError(
            f"engine {url}: server arg {arg}={server_info.get(arg)!r}: {why}; p2pweights "
            "updates only a same-model EAGLE / MTP draft (one MTP layer, the model's own "
            "checkpoint, the target's MoE backends)"
        )

    if algorithm not in _SAME_MODEL_DRAFTS:
        raise refuse("speculative_algorithm", "its draft is a separate model")
    if server_info.get("enable_multi_layer_eagle"):
        raise refuse("enable_multi_layer_eagle", "multi-layer EAGLE runs one runner per layer")
    draft_path = server_info.get("speculative_draft_model_path")
    if draft_path not in (None, "", server_info.get("model_path")):
        raise refuse("speculative_draft_model_path", "the draft is a separate checkpoint")
    for arg, target_arg in (
        ("speculative_moe_runner_backend", "moe_runner_backend"),
        ("speculative_moe_a2a_backend", "moe_a2a_backend"),
    ):
        draft_backend = server_info.get(arg)
        if draft_backend not in (None, server_info.get(target_arg)):
            raise refuse(
                arg,
                f"differs from {target_arg}={server_info.get(target_arg)!r}, and sglang "
                "reloads the draft under the target's",
            )
    if server_info.get("moe_a2a_backend") == "flashinfer_megamoe":
        raise refuse("moe_a2a_backend", "the draft then runs a different a2a backend")
    return True
