"""Bit-exact checks of a replica against sglang's own loading, for tests and demos.

Two comparisons, both against ``load_real_rank_model`` (a real CPU model of the
rank filled by sglang's loader and start-up postprocess, the reference):

* staged bytes: every probe group staged through ``ModelReplica.load_into`` into
  flat uint8 buffers equals the reference's parameter bytes (``stage_all``);
* engine path: a real model of the rank holding *other* weights goes through what
  an update session does when p2pweights writes into it: ``begin_update``, the
  staged bytes copied over its parameters, ``end_update(run_post_load=True)``.
  Its whole state (``model_state``: parameters, persistent buffers and derived
  tensors such as MLA's ``w_kc`` / ``w_vc``) must then equal the reference's.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from p2pweights.replica.ranks import RankSpec
from p2pweights.replica.sglang.env import shared_with_target
from p2pweights.replica.sglang.reference import begin_update, end_update, load_real_rank_model

if TYPE_CHECKING:
    from torch import nn

    from p2pweights.replica.sglang.model_replica import ModelReplica
    from p2pweights.replica.sglang.probe import LoaderMap

__all__ = ["as_bytes", "stage_all", "model_state", "engine_path_model", "state_mismatches"]

_FILL = 0xA5

# sglang's weight checker skips these buffers (recomputed caches, never loaded);
# the same list as sglang.srt.utils.weight_checker._NON_PERSISTENT_BUFFER_PATTERNS.
_NON_PERSISTENT_PATTERNS = (
    "cos_sin_cache",
    "cos_cache",
    "sin_cache",
    "inv_freq",
    "freqs_cis",
    "expert_mask_gpu",
)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes a tensor spans in memory order, as a flat uint8 tensor."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def stage_all(
    replica: ModelReplica,
    loader_map: LoaderMap,
    hf: Sequence[tuple[str, torch.Tensor]],
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Stage every group of ``loader_map`` through ``replica.load_into``, one buffer per group.

    The buffers are on ``device`` (host memory, or a GPU's as device staging does).

    Returns parameter name -> its staged bytes. Buffers start filled with 0xA5 so a
    byte the loader does not write shows up as a mismatch.
    """
    by_name = dict(hf)
    staged: dict[str, torch.Tensor] = {}
    for group in loader_map.groups:
        sizes = [replica.layouts[p].num_bytes for p in group.param_names]
        staging = torch.full((sum(sizes),), _FILL, dtype=torch.uint8, device=device)
        destinations, offset = {}, 0
        for param, size in zip(group.param_names, sizes, strict=True):
            destinations[param] = staging[offset : offset + size]
            offset += size
        replica.load_into([(name, by_name[name]) for name in sorted(group.hf_names)], destinations)
        if staged.keys() & destinations.keys():
            raise AssertionError(f"groups overlap on {sorted(staged.keys() & destinations)}")
        staged.update(destinations)
    return staged


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What an engine's weight check covers, plus derived tensors held as attributes.

    Parameters and buffers (sglang's non-persistent caches left out, as its
    ``WeightChecker`` does), and plain tensor attributes of modules such as MLA's
    ``w_kc`` / ``w_vc`` / ``w_scale_k``, which ``post_load_weights`` derives.
    """
    state: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        state[name] = param.data
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for name, buffer in module.named_buffers(recurse=False):
            full = prefix + name
            if buffer is None or name in module._non_persistent_buffers_set:
                continue
            if any(pattern in full for pattern in _NON_PERSISTENT_PATTERNS):
                continue
            state[full] = buffer
        for name, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                state.setdefault(prefix + name, value)
    return state


def engine_path_model(
    model_path: str | os.PathLike[str],
    spec: RankSpec,
    previous: Iterable[tuple[str, torch.Tensor]],
    staged: Mapping[str, torch.Tensor],
    server_args_fields: Mapping[str, Any] | None = None,
    role: str = "target",
    device: torch.device | str = "cpu",
) -> nn.Module:
    """A real rank model loaded with ``previous``, then updated the way p2pweights does.

    ``begin_update`` (restore to the reload layout), ``staged`` bytes copied over
    every parameter (those sglang's own check skips, such as an fp8 attention's
    k/v scales, keep their values when nothing stages them), then
    ``end_update(run_post_load=True)`` (sglang recomputes derived weights and reruns
    its postprocess).
    """
    model = load_real_rank_model(
        model_path, spec, previous, server_args_fields=server_args_fields, role=role, device=device
    )
    begin_update(model, spec, device)
    params = dict(model.named_parameters())
    optional = {name for name, p in params.items() if getattr(p, "_skip_weight_check", False)}
    if role == "draft":  # its embedding and head are the target's in the engine
        optional |= shared_with_target(model)
    missing = sorted(set(params) - set(staged) - optional)
    if missing:
        raise AssertionError(f"no staged bytes for parameters {missing}")
    with torch.no_grad():
        for name, param in params.items():
            if name not in staged:
                continue
            target = param.data
            if not target.is_contiguous():
                raise AssertionError(f"{name} is not contiguous; compare through as_strided")
            target.view(-1).view(torch.uint8).copy_(staged[name].to(target.device))
    end_update(model, spec, run_post_load=True, device=device)
    return model


def state_mismatches(actual: nn.Module, expected: nn.Module) -> list[str]:
    """Names whose bytes, shape or dtype differ between two models' ``model_state``."""
    got, want = model_state(actual), model_state(expected)
    problems = [f"missing {name}" for name in sorted(want.keys() - got.keys())]
    problems += [f"unexpected {name}" for name in sorted(got.keys() - want.keys())]
    for name in sorted(want.keys() & got.keys()):
        a, b = got[name], want[name]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(as_bytes(a), as_bytes(b)):
            problems.append(f"differs {name}")
    return problems
