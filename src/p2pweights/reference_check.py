"""Bit-exact verification: what an engine holds vs what sglang's own loader gives.

The expected side builds a real CPU model of each engine rank with sglang's model
class, fills it with sglang's own ``load_weights`` (and start-up postprocess) from
the same HF tensors, and hashes it with sglang's own ``WeightChecker``; the engine
side asks the engine's ``/weights_checker`` for the same checksums. Parameters and
persistent buffers are both compared, so buffers the engine derives count too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from p2pweights.engines.client import EngineClient
from p2pweights.errors import EngineError
from p2pweights.integrity.checker import checksums_by_rank
from p2pweights.replica.registry import config_path

__all__ = [
    "EngineClient",
    "HfTensors",
    "checksums_by_rank",
    "compare",
    "engine_checksums",
    "expected_checksums",
    "verify_engine",
]

HfTensors = Callable[[], Iterable[tuple[str, torch.Tensor]]]
"""A callable giving the HF tensors afresh each call (the check reads them once per rank)."""


def expected_checksums(
    server_info: Mapping[str, Any],
    engine_rank: int,
    hf_tensors: HfTensors,
    model_path: str | None = None,
    role: str = "target",
    device: torch.device | str = "cpu",
) -> dict[str, str]:
    """sglang's per-tensor checksums for ``engine_rank`` loaded from ``hf_tensors()``.

    ``hf_tensors`` are in the trainer's format; for an fp8 engine they are quantized
    into its checkpoint format first, as the engine's checkpoint would hold them. The
    reference model is built on ``device`` (a GPU for models too large to check on
    the host quickly).
    """
    from p2pweights.replica.engine_checkpoint import engine_checkpoint
    from p2pweights.replica.ranks import RankSpec
    from p2pweights.replica.sglang import facade

    spec = RankSpec.from_server_info(server_info, engine_rank)
    folder = config_path(server_info, model_path).parent
    # built in a runtime context of its own: this process's sglang config stays as it was
    info = facade.reference_checksums(
        folder,
        spec,
        engine_checkpoint(folder, hf_tensors()),
        dtype=server_info.get("dtype", "auto"),
        server_args_fields=server_info,
        device=device,
        role=role,
    )
    if info is None:
        raise EngineError(f"rank {engine_rank}: sglang's WeightChecker returned no checksums")
    return dict(info["checksums"])


def engine_checksums(client: EngineClient, role: str = "target") -> list[dict[str, str]]:
    """The engine's own per-tensor checksums of ``role``'s runner, one dict per rank."""
    return checksums_by_rank(client.url, client.weights_checker("checksum", selector=role))


def compare(expected: Mapping[str, str], actual: Mapping[str, str]) -> list[str]:
    """Names whose checksums differ or that only one side has (empty when bit-exact)."""
    names = sorted(set(expected) | set(actual))
    return [n for n in names if expected.get(n) != actual.get(n)]


def verify_engine(
    client: EngineClient,
    hf_tensors: HfTensors,
    model_path: str | None = None,
    role: str = "target",
    skip: frozenset[str] = frozenset(),
    device: torch.device | str = "cpu",
) -> dict[int, list[str]]:
    """Engine rank -> mismatching tensor names (empty lists when every rank is bit-exact).

    ``role="draft"`` checks the ranks' speculative draft runners; ``skip`` names
    tensors left out (a draft's embedding and head are the target's, checked there).
    ``device`` is where the reference models are built.
    """
    server_info = client.server_info()
    actual = engine_checksums(client, role)
    return {
        rank: [
            name
            for name in compare(
                expected_checksums(server_info, rank, hf_tensors, model_path, role, device),
                checksums,
            )
            if name not in skip
        ]
        for rank, checksums in enumerate(actual)
    }
