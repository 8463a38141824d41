"""Seeded fuzzing of what comes from engines and senders (issue 28, item 4).

Publications (``parse_publication``, then the CUDA IPC segment checks) and delta payloads
(the engine-side ``apply``) are mutated at random from well-formed ones. Every case must
either give something in bounds or raise our error type (``EngineError`` /
``TransportError`` for publications, ``TransferError`` for payloads), never anything
else; a refused payload leaves the parameters as they were, and no case touches bytes
outside the parameters (canaries around them). A failing case prints its seed.
"""

from __future__ import annotations

import base64
import copy
import random
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from p2pweights.engine_side.delta_apply import DeltaReceiver, apply
from p2pweights.errors import EngineError, TransferError, TransportError
from p2pweights.transports.cuda_ipc import check_mapped, check_segments
from p2pweights.wire.delta import HEADER_BYTES, SCRATCH_NAME, encode, pack_payload
from p2pweights.wire.publication import RankPublication, parse_publication

URL = "http://fuzz:30000"
RANK = 1
NUM_PUBLICATION_CASES = 3000
NUM_PAYLOAD_CASES = 3000

_JUNK: list[Any] = [
    -1,
    0,
    1,
    3,
    16,
    64,
    2**31 - 1,
    2**31,
    2**63 - 1,
    2**63,
    2**64 - 1,
    2**64,
    -(2**63),
    3.5,
    1e300,
    True,
    False,
    None,
    "",
    "12",
    "mooncake",
    "nixl",
    "cuda_ipc",
    "%%%",
    [],
    [1],
    [1, 2],
    [4096, 8, 2],
    {},
    {"a": 1},
]


def _junk(rng: random.Random) -> Any:
    if rng.random() < 0.4:
        return rng.choice([rng.randrange(-(2**65), 2**65), rng.randrange(0, 1 << 20)])
    return copy.deepcopy(rng.choice(_JUNK))


# --- publications ---------------------------------------------------------------------


def _handle(i: int) -> str:
    return base64.b64encode(bytes([i]) * 64).decode()


def _table(rng: random.Random, gpu: bool) -> dict[str, list[int]]:
    address = 0x10000
    table = {}
    for name in ("a", "b", "c"):
        numel, size = rng.choice([(64, 2), (32, 4), (128, 1)])
        table[name] = [address, numel, size] + ([0] if gpu else [])
        address += numel * size + rng.choice([0, 256])
    table[SCRATCH_NAME] = [address, 4096, 1] + ([0] if gpu else [])
    return table


def _well_formed(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["mooncake-pair", "mooncake", "nixl", "cuda_ipc"])
    table = _table(rng, gpu=kind in ("nixl", "cuda_ipc"))
    if kind == "mooncake-pair":
        return {"rank": RANK, "remote_instance_transfer_engine_info": ["10.0.0.1:1", table]}
    info: dict[str, Any] = {"backend": kind.split("-")[0], "weights_info_dict": table}
    info |= {"live": True, "epoch": 2, "write_digests": True}
    if kind == "mooncake":
        info["session_id"] = "10.0.0.1:1"
    elif kind == "nixl":
        info |= {"agent_name": "agent", "agent_metadata": "bWV0YQ==", "mem_type": "VRAM"}
    else:
        end = max(a + n * s for a, n, s, _ in table.values())
        info |= {"agent_name": "ipc", "host_id": "h/b"}
        info["segments"] = [
            {"address": 0x10000, "num_bytes": end - 0x10000, "gpu_id": 0, "handle": _handle(1)}
            | {"offset": 0x200}
        ]
    return {"rank": RANK, "remote_instance_transfer_engine_info": info}


def _containers(value: Any, found: list[Any]) -> list[Any]:
    if isinstance(value, dict | list):
        found.append(value)
        for child in value.values() if isinstance(value, dict) else value:
            _containers(child, found)
    return found


def _mutate_publication(rng: random.Random, body: dict[str, Any]) -> None:
    for _ in range(rng.randint(1, 3)):
        container = rng.choice(_containers(body, []))
        keys = list(container) if isinstance(container, dict) else list(range(len(container)))
        action = rng.random()
        if keys and action < 0.6:
            container[rng.choice(keys)] = _junk(rng)
        elif keys and action < 0.75 and isinstance(container, dict):
            del container[rng.choice(keys)]
        elif isinstance(container, dict):  # a parameter near the others: overlaps likely
            base = rng.randrange(0x10000 - 64, 0x10000 + 1024)
            container[f"x{rng.randrange(4)}"] = [base, rng.randrange(0, 512), rng.choice([1, 2])]
        else:
            container.append(_junk(rng))


def _check_in_bounds(pub: RankPublication) -> None:
    """What a parsed publication guarantees to the sender."""
    assert pub.engine_rank == RANK and isinstance(pub.epoch, int) and pub.epoch >= 0
    assert isinstance(pub.live, bool) and isinstance(pub.write_digests, bool)
    spans = []
    for name, region in pub.regions.items():
        assert type(region.address) is int and type(region.num_bytes) is int, name
        assert region.address >= 0 and region.num_bytes >= 0 and region.end <= 2**64, name
        assert region.gpu_id is None or (type(region.gpu_id) is int and region.gpu_id >= 0)
        if region.num_bytes:
            spans.append((region.address, region.end, name))
    scratch = pub.regions.get(SCRATCH_NAME)
    assert scratch is None or scratch.num_bytes >= HEADER_BYTES
    spans.sort()
    for i, (start, end, name) in enumerate(spans):
        for other_start, other_end, other in spans[i + 1 :]:
            if other_start >= end:
                break
            assert (start, end) == (other_start, other_end), (name, other)
            assert SCRATCH_NAME not in (name, other)
    for segment in pub.segments:
        assert len(segment.handle) == 64 and segment.offset >= 0
        assert segment.address >= 0 and segment.end <= 2**64


def _run_publication_case(seed: int) -> None:
    rng = random.Random(seed)
    body = _well_formed(rng)
    if seed % 10:  # one case in ten stays well formed: it must parse
        _mutate_publication(rng, body)
    try:
        pub = parse_publication(URL, RANK, body)
    except EngineError as exc:
        assert f"engine {URL} rank {RANK}" in str(exc)
        assert seed % 10, "a well-formed publication was refused"
        return
    _check_in_bounds(pub)
    if pub.backend == "cuda_ipc":
        try:
            check_segments(pub)
        except TransportError:
            return
        spans = {s.handle: s.offset + s.num_bytes for s in pub.segments}
        check_mapped(pub, spans)  # the allocations as large as published: passes


def _each(cases: int, run: Callable[[int], None]) -> None:
    for seed in range(cases):
        try:
            run(seed)
        except Exception as exc:  # name the case: rerun it alone with its seed
            raise AssertionError(f"fuzz case seed={seed}: {type(exc).__name__}: {exc}") from exc


def test_fuzzed_publications_parse_in_bounds_or_raise_our_error() -> None:
    started = time.perf_counter()
    _each(NUM_PUBLICATION_CASES, _run_publication_case)
    assert time.perf_counter() - started < 30


# --- delta payloads on the engine side ------------------------------------------------

_CANARY = 0xA5
_SHAPES = {"a.w": (torch.bfloat16, 96), "b.w": (torch.float32, 40), "c.w": (torch.uint8, 300)}


def _arena() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The parameters as views of one buffer, with canary bytes before, between, after."""
    arena = torch.full((4096,), _CANARY, dtype=torch.uint8)
    params, offset = {}, 64
    for name, (dtype, numel) in _SHAPES.items():
        num_bytes = numel * torch.empty((), dtype=dtype).element_size()
        params[name] = arena[offset : offset + num_bytes].view(dtype)
        params[name].zero_()
        offset += -(-num_bytes // 64) * 64 + 64
    return arena, params


def _canaries_intact(arena: torch.Tensor, params: dict[str, torch.Tensor]) -> bool:
    spans = sorted(
        (t.data_ptr() - arena.data_ptr(), t.numel() * t.element_size()) for t in params.values()
    )
    gaps, start = [], 0
    for offset, num_bytes in spans:
        gaps.append(arena[start:offset])
        start = offset + num_bytes
    gaps.append(arena[start:])
    return all(bool(gap.eq(_CANARY).all()) for gap in gaps)


def _payload(rng: random.Random, params: dict[str, torch.Tensor]) -> torch.Tensor:
    """A well-formed payload (update 5 on update 4) changing a few elements of each."""
    names = sorted(params)
    entries = []
    for index, name in enumerate(names):
        old = params[name].view(torch.uint8)
        new = old.clone()
        for _ in range(rng.randint(1, 6)):
            new[rng.randrange(new.numel())] ^= rng.randrange(1, 256)
        entry = encode(old, new, params[name].element_size(), param_index=index)
        if entry is not None:
            entries.append(entry)
    scratch = torch.zeros(2048, dtype=torch.uint8)
    pack_payload(entries, 5, 4, scratch)
    return scratch


def _field(rng: random.Random, scratch: torch.Tensor, offset: int, width: int) -> None:
    value = _junk(rng)
    if not isinstance(value, int) or isinstance(value, bool):
        value = rng.randrange(-(2**40), 2**40)
    value %= 2 ** (8 * width)
    scratch[offset : offset + width] = torch.tensor(list(value.to_bytes(width, "little")))


def _mutate_payload(rng: random.Random, scratch: torch.Tensor) -> None:
    used = int(scratch[32:40].view(torch.int64))
    for _ in range(rng.randint(1, 3)):
        action = rng.random()
        if action < 0.3:  # a header field: sequence, base, num_entries, payload_bytes
            _field(rng, scratch, rng.choice([8, 16, 24, 32]), 8)
        elif action < 0.7:  # a field of the first entry header, or of one further on
            entry = HEADER_BYTES + rng.choice([0, 0, 16 * rng.randrange(max(1, used // 16))])
            offset, width = rng.choice([(0, 4), (4, 4), (8, 8), (16, 8), (24, 8)])
            _field(rng, scratch, min(entry, 2048 - 32) + offset, width)
        else:  # any bytes of the payload
            for _ in range(rng.randint(1, 8)):
                scratch[rng.randrange(min(max(used, 65), 2048))] = rng.randrange(256)


def _run_payload_case(seed: int) -> None:
    rng = random.Random(seed)
    arena, params = _arena()
    scratch = _payload(rng, params)
    if seed % 10:
        _mutate_payload(rng, scratch)
    before = arena.clone()
    started = time.perf_counter()
    try:
        if seed % 3:
            apply(scratch, params, last_sequence=4, where="engine rank 1")
        else:
            receiver = DeltaReceiver("engine rank 1")
            receiver.sequence = 4
            receiver.take(scratch, params)
    except TransferError as exc:
        assert "engine rank 1" in str(exc)
        assert seed % 10, "a well-formed payload was refused"
        assert torch.equal(arena, before), "a refused payload changed bytes"
    assert time.perf_counter() - started < 1.0, "the apply took too long"
    assert _canaries_intact(arena, params), "bytes outside the parameters changed"


def test_fuzzed_delta_payloads_apply_in_bounds_or_raise_our_error() -> None:
    started = time.perf_counter()
    _each(NUM_PAYLOAD_CASES, _run_payload_case)
    assert time.perf_counter() - started < 30


@pytest.mark.parametrize("seed", [0, 10, 20])
def test_a_well_formed_payload_is_applied(seed: int) -> None:
    """The fuzzer's base case: unmutated payloads apply (so mutations are what fail)."""
    rng = random.Random(seed)
    arena, params = _arena()
    scratch = _payload(rng, params)
    applied = apply(scratch, params, last_sequence=4)
    assert applied is not None and applied.num_entries == len(params)
    assert _canaries_intact(arena, params)
