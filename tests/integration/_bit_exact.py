"""The bit-exact check integration tests share: engines against sglang's own loading.

``assert_bit_exact(engines, folder, seed)``: every rank of every local engine holds what
sglang's loader makes of ``seed_weights(folder, seed)`` (its weight checker's checksums,
parameters and persistent buffers, against a reference model of that rank).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from p2pweights.engines.client import EngineClient
from p2pweights.local_engine import LocalEngine
from p2pweights.testing import synthetic_weights
from p2pweights.verify import verify_engine


def seed_weights(folder: Path, seed: int) -> list[tuple[str, torch.Tensor]]:
    """The bf16 HF tensors a trainer sends in these tests (a ``--seed`` engine's kind)."""
    return list(synthetic_weights(folder, seed=seed, dtype=torch.bfloat16))


def assert_bit_exact(engines: Iterable[LocalEngine], folder: Path, seed: int) -> None:
    for engine in engines:
        client = EngineClient(engine.url)
        try:
            mismatches = verify_engine(client, lambda: seed_weights(folder, seed))
        finally:
            client.close()
        assert mismatches == {r: [] for r in range(engine.tp)}, f"{engine.url}: {mismatches}"
