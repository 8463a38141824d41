"""The bit-exact check integration tests share: engines against sglang's own loading.

``assert_bit_exact(engines, folder, seed)``: every rank of every local engine holds what
sglang's loader makes of ``seed_weights(folder, seed)`` (its weight checker's checksums,
parameters and persistent buffers, against a reference model of that rank).

``engine_mismatches`` also guards the engine pool (``shared_engines``): a check that finds
an engine holding the very tensors an earlier test last found there fails, since it would
pass whether or not this test's update wrote anything (each test writes seeds of its own).

``engine_mismatches(url, hf_tensors)`` is ``p2pweights.verify.verify_engine`` with the
reference side memoised for the test session: building a real sglang model of a rank and
loading it is most of a check's time, and the same checkpoint is checked at the same layout
many times (each update of a matrix case, each transport). The cache key is what decides
the reference's checksums: the content digest of the HF tensors, the digest of the model's
config.json, the engine's resolved server args (less what names this one process: host,
ports, paths, its update state), the rank and the runner role. Another checkpoint, config
or layout misses.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from p2pweights.engines.client import EngineClient
from p2pweights.local_engine import LocalEngine
from p2pweights.replica.registry import config_path
from p2pweights.testing import synthetic_weights
from p2pweights.verify import compare, engine_checksums, expected_checksums

# server_info fields that name one process or its moment, not the layout it serves
_PROCESS_FIELDS = frozenset(
    {
        "host",
        "port",
        "model_path",
        "tokenizer_path",
        "served_model_name",
        "random_seed",
        "weight_version",
        "p2pweights_engine_state",
        "dist_init_addr",
        "log_requests",
    }
)

_expected: dict[tuple[str, ...], dict[str, str]] = {}
stats = {"hits": 0, "misses": 0}
_last_found: dict[tuple[str, str], tuple[str, str]] = {}
"""(engine URL, runner role) -> (tensors' digest, test) of the last check that matched."""


def seed_weights(folder: Path, seed: int) -> list[tuple[str, torch.Tensor]]:
    """The bf16 HF tensors a trainer sends in these tests (a ``--seed`` engine's kind)."""
    return list(synthetic_weights(folder, seed=seed, dtype=torch.bfloat16))


def tensors_digest(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over every (name, dtype, shape, bytes), in order."""
    digest = hashlib.sha256()
    for name, tensor in tensors:
        flat = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(flat.numpy().tobytes())
    return digest.hexdigest()


def _layout_key(server_info: dict[str, Any], model_path: str | None) -> tuple[str, str]:
    config = config_path(server_info, model_path).read_bytes()
    fields = {k: v for k, v in server_info.items() if k not in _PROCESS_FIELDS and "port" not in k}
    return (
        hashlib.sha256(config).hexdigest(),
        hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest(),
    )


def engine_mismatches(
    url: str,
    hf_tensors: Callable[[], Iterable[tuple[str, torch.Tensor]]],
    *,
    role: str = "target",
    skip: frozenset[str] = frozenset(),
    model_path: str | None = None,
) -> dict[int, list[str]]:
    """Engine rank -> mismatching tensor names, as ``verify_engine`` answers (memoised)."""
    tensors = list(hf_tensors())
    client = EngineClient(url)
    try:
        server_info = client.server_info()
        actual = engine_checksums(client, role)
    finally:
        client.close()
    base = (tensors_digest(tensors), *_layout_key(server_info, model_path), role)
    result = {}
    for rank, checksums in enumerate(actual):
        key = (*base, str(rank))
        if key in _expected:
            stats["hits"] += 1
        else:
            stats["misses"] += 1
            _expected[key] = expected_checksums(
                server_info, rank, lambda: tensors, model_path, role
            )
        result[rank] = [n for n in compare(_expected[key], checksums) if n not in skip]
    if not any(result.values()):
        _note_match(url, role, base[0])
    return result


def _note_match(url: str, role: str, digest: str) -> None:
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    before = _last_found.get((url, role))
    _last_found[(url, role)] = (digest, test)
    if before is not None and before[0] == digest and before[1] != test:
        raise AssertionError(
            f"{url} ({role}) holds the tensors {before[1]} last found there: this check "
            "passes whatever this test wrote; write seeds no earlier test wrote to this engine"
        )


def next_version(urls: Iterable[str]) -> int:
    """The version a new session's first update gives engines that may have served earlier
    tests (``shared_engines``): one past the largest numeric version they hold, else 1."""
    versions = [0]
    for url in urls:
        client = EngineClient(url)
        try:
            version = client.weight_version()
        finally:
            client.close()
        if version.isdigit():
            versions.append(int(version))
    return max(versions) + 1


def assert_bit_exact(engines: Iterable[LocalEngine], folder: Path, seed: int) -> None:
    for engine in engines:
        mismatches = engine_mismatches(engine.url, lambda: seed_weights(folder, seed))
        assert mismatches == {r: [] for r in range(engine.tp)}, f"{engine.url}: {mismatches}"
