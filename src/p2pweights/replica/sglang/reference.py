"""The reference side of bit-exact checks: sglang's own loading of one engine rank.

Not on the update path: the local engine loads its ranks with these, and
verification builds the expected model with them. ``load_real_rank_model`` is what
an engine's loader runs at start-up; ``begin_update`` / ``end_update`` are what
sglang's ``WeightUpdater`` runs when an update session opens and closes.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from p2pweights.replica.ranks import RankSpec
from p2pweights.replica.sglang.env import (
    build_role_model,
    ensure_server_args,
    in_context,
    rank_scope,
    replica_context,
    role_scope,
    server_args_for,
)

if TYPE_CHECKING:
    from torch import nn

__all__ = ["load_real_rank_model", "reference_checksums", "begin_update", "end_update"]


def load_real_rank_model(
    model_path: str | os.PathLike[str],
    spec: RankSpec,
    hf_tensors: Iterable[tuple[str, torch.Tensor]],
    dtype: str | torch.dtype = "auto",
    server_args_fields: Mapping[str, Any] | None = None,
    device: torch.device | str = "cpu",
    role: str = "target",
) -> nn.Module:
    """The reference: a real model of ``spec``'s rank as the engine holds it after start-up.

    Built on ``device`` for ``role`` (the target, or a same-model speculative draft)
    and filled by sglang's own ``DefaultModelLoader.load_weights_and_postprocess``
    (``model.load_weights`` then each quant method's ``process_weights_after_loading``),
    exactly what the engine's loader runs at start-up.
    """
    from p2pweights.replica.sglang.compat import check_sglang

    check_sglang()
    # an engine's own model: published process-wide, as the engine's process does
    ensure_server_args(server_args_for(model_path, dtype, server_args_fields))
    return _build_and_load(spec, hf_tensors, device, role)


def reference_checksums(
    model_path: str | os.PathLike[str],
    spec: RankSpec,
    hf_tensors: Iterable[tuple[str, torch.Tensor]],
    dtype: str | torch.dtype = "auto",
    server_args_fields: Mapping[str, Any] | None = None,
    device: torch.device | str = "cpu",
    role: str = "target",
) -> dict[str, Any] | None:
    """sglang's ``WeightChecker`` checksum answer for the model ``load_real_rank_model``
    would give, built, loaded and hashed in a runtime context of its own: unlike
    there, the calling process's sglang configuration (a trainer's, a colocated
    engine's) is left as it was."""
    from sglang.srt.utils.weight_checker import WeightChecker

    from p2pweights.replica.sglang.compat import check_sglang

    check_sglang()
    context = replica_context(server_args_for(model_path, dtype, server_args_fields))
    with in_context(context):
        model = _build_and_load(spec, hf_tensors, device, role)
        with rank_scope(spec):
            answer: dict[str, Any] | None = WeightChecker(get_model=lambda: model).handle(
                "checksum", role=role
            )
    return answer


def _build_and_load(
    spec: RankSpec,
    hf_tensors: Iterable[tuple[str, torch.Tensor]],
    device: torch.device | str,
    role: str,
) -> nn.Module:
    """Build ``role``'s model of ``spec``'s rank for the active server args and load it
    with sglang's ``load_weights_and_postprocess``."""
    from sglang.srt.model_loader.loader import DefaultModelLoader
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    model_config, model = build_role_model(spec, device, role)
    with rank_scope(spec), role_scope(role), set_default_torch_dtype(model_config.dtype):
        DefaultModelLoader.load_weights_and_postprocess(
            model, iter(hf_tensors), torch.device(device)
        )
    return model


def begin_update(model: nn.Module, spec: RankSpec, device: torch.device | str = "cpu") -> None:
    """What sglang's ``begin_weight_update`` does: undo in-place repacking before loading."""
    from sglang.srt.model_loader.loader import DefaultModelLoader

    with rank_scope(spec):
        DefaultModelLoader.restore_weights_before_loading(model, torch.device(device))


def end_update(
    model: nn.Module, spec: RankSpec, run_post_load: bool, device: torch.device | str = "cpu"
) -> None:
    """What sglang's ``end_weight_update`` does.

    ``run_post_load`` is True when no ``load_weights`` ran in the session (direct
    writes): the model's ``post_load_weights`` then recomputes derived weights.
    """
    from sglang.srt.model_loader.loader import DefaultModelLoader, post_load_weights

    with rank_scope(spec):
        if run_post_load:
            post_load_weights(model)
        DefaultModelLoader.postprocess_weights(model, torch.device(device))
