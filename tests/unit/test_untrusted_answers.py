"""Engine answers are untrusted input (issue 28, item 4): every address, length, count and
flag an engine publishes, and every number of a delta payload an engine rank reads from
its scratch region, is checked before it is used, and refused with our own errors."""

from __future__ import annotations

import struct
import time

import pytest
import torch

from p2pweights.config import DeltaConfig
from p2pweights.delta.sender import DeltaSender, FullHeaders
from p2pweights.engine_side import delta_apply as apply_module
from p2pweights.engine_side.delta_apply import DeltaReceiver, apply
from p2pweights.engine_side.delta_scratch import SCRATCH_NAME, scratch_bytes
from p2pweights.engine_side.steps import RankSide
from p2pweights.errors import ConfigError, EngineError, TransferError
from p2pweights.wire.delta import ENTRY_HEADER_BYTES, HEADER_BYTES, PayloadHeader, pack_header
from p2pweights.wire.publication import RankPublication, WeightRegion, parse_publication

URL = "http://engine-a:30000"


def _mooncake(table: dict[str, object], **fields: object) -> dict[str, object]:
    info = {"backend": "mooncake", "session_id": "10.0.0.5:1234", "weights_info_dict": table}
    return {"rank": 2, "remote_instance_transfer_engine_info": {**info, **fields}}


# --- what an engine publishes --------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ([-4096, 16, 2], "address"),
        ([4096, -16, 2], "numel"),
        ([4096, 16, -2], "element_size"),
        ([4096, 16, 3], "element_size"),
        ([4096, 16, 0], "element_size"),
        ([2**64 - 16, 16, 2], "64-bit"),  # runs past the end of the address space
        ([4096.7, 16, 2], "address"),  # int() would have truncated it
        ([True, 16, 2], "address"),
        (["4096", "16", "2"], "address"),
        ("123", "address"),  # a string is a sequence too: "1", "2", "3" before
        ([4096, 16], "address"),
        ([4096, 16, 2, -1], "gpu_id"),
    ],
)
def test_a_weight_entry_out_of_range_or_of_another_type_is_refused(entry, says) -> None:
    with pytest.raises(EngineError, match=rf"engine {URL} rank 2: malformed.*'w'.*{says}"):
        parse_publication(URL, 2, _mooncake({"w": entry}))


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"epoch": -1}, "epoch"),
        ({"epoch": "3"}, "epoch"),
        ({"live": "false"}, "live"),  # bool("false") is True
        ({"write_digests": 1}, "write_digests"),
        ({"session_id": {"host": "x"}}, "session_id"),
        ({"session_id": None}, "session_id"),
        ({"weights_info_dict": [[1, 2, 2]]}, "weights_info_dict"),
    ],
)
def test_publication_fields_of_the_wrong_type_are_refused(fields, says) -> None:
    with pytest.raises(EngineError, match=rf"engine {URL} rank 2: malformed.*{says}"):
        parse_publication(URL, 2, _mooncake({"w": [4096, 16, 2]}, **fields))


def test_an_answer_for_another_rank_is_refused() -> None:
    body = _mooncake({"w": [4096, 16, 2]})
    body["rank"] = 3
    with pytest.raises(EngineError, match=rf"engine {URL} rank 2: .*rank 3"):
        parse_publication(URL, 2, body)


def test_partly_overlapping_parameters_are_refused_naming_both() -> None:
    table = {"a": [4096, 1024, 2], "b": [4096 + 1024, 1024, 2]}  # b starts inside a
    with pytest.raises(EngineError, match=r"'a'.*'b'.*overlap"):
        parse_publication(URL, 2, _mooncake(table))
    same = {"a": [4096, 1024, 2], "b": [4096, 1024, 2]}  # one tensor under two names
    assert parse_publication(URL, 2, _mooncake(same)).regions["b"].num_bytes == 2048
    empty = {"a": [4096, 1024, 2], "b": [4100, 0, 2]}  # an empty parameter has no bytes
    assert parse_publication(URL, 2, _mooncake(empty)).regions["b"].num_bytes == 0


def test_a_scratch_region_too_small_for_a_header_is_refused() -> None:
    table = {"w": [4096, 16, 2], SCRATCH_NAME: [65536, 16, 1]}  # 16 bytes, header takes 64
    with pytest.raises(EngineError, match=rf"rank 2: .*{SCRATCH_NAME}.*16 bytes.*{HEADER_BYTES}"):
        parse_publication(URL, 2, _mooncake(table))


def test_a_scratch_region_over_a_weight_is_refused() -> None:
    table = {"w": [4096, 1024, 2], SCRATCH_NAME: [4096, 4096, 1]}  # even exactly over it
    with pytest.raises(EngineError, match="overlap") as caught:
        parse_publication(URL, 2, _mooncake(table))
    assert SCRATCH_NAME in str(caught.value) and "'w'" in str(caught.value)


# --- the sender's delta headers -------------------------------------------------------


def _with_scratch(num_bytes: int) -> RankPublication:
    """A publication built past the parser (a fake engine, a transport's own): the sender
    checks the scratch region again before it writes a header there."""
    regions = {"w": WeightRegion(4096, 2048), SCRATCH_NAME: WeightRegion(1 << 20, num_bytes)}
    return RankPublication(URL, 0, "mooncake", regions, session_id="10.0.0.5:1234")


def test_no_header_is_written_into_a_scratch_region_it_does_not_fit() -> None:
    runner = (URL, 0, "target")
    small = {runner: _with_scratch(16)}
    assert FullHeaders(small).max_headers == 0
    assert FullHeaders(small).headers() == {}
    run = DeltaSender(DeltaConfig()).begin(small)
    assert run.headers() == {}
    fits = {runner: _with_scratch(HEADER_BYTES)}
    assert list(FullHeaders(fits).headers()) == [runner]


# --- the engine side: a payload read from the scratch region --------------------------


def _params() -> dict[str, torch.Tensor]:
    return {"a": torch.zeros(64, dtype=torch.bfloat16), "b": torch.zeros(32, dtype=torch.float32)}


def _payload(
    *entries: tuple[int, int, int, int, int], payload_bytes: int | None = None, base: int = 4
) -> torch.Tensor:
    """A header (update 5 on ``base``) and raw entry headers, as an engine rank reads them."""
    scratch = torch.zeros(4096, dtype=torch.uint8)
    offset = HEADER_BYTES
    for entry in entries:
        raw = struct.pack("<iiqqq", *entry)
        scratch[offset : offset + ENTRY_HEADER_BYTES] = torch.frombuffer(
            bytearray(raw), dtype=torch.uint8
        )
        offset += ENTRY_HEADER_BYTES
    total = offset if payload_bytes is None else payload_bytes
    pack_header(PayloadHeader(5, base, len(entries), total), scratch)
    return scratch


def test_a_huge_entry_count_with_empty_entries_is_refused_without_reading_them(monkeypatch):
    """Entry size 0 and a count of 2**62: the loop read the same entry header 2**62 times
    inside end_weight_update. Now the count is bounded by the bytes that can hold it."""
    reads = []
    real = apply_module.read_entry_header

    def counted(payload: torch.Tensor, offset: int):
        reads.append(offset)
        if len(reads) > 100:
            raise RuntimeError("still reading entry headers: the apply loop spins")
        return real(payload, offset)

    monkeypatch.setattr(apply_module, "read_entry_header", counted)
    scratch = _payload((0, 2, 0, 128, 0), payload_bytes=HEADER_BYTES + ENTRY_HEADER_BYTES)
    scratch[24:32].view(torch.int64)[0] = 2**62  # the header's num_entries
    params = _params()
    started = time.perf_counter()
    with pytest.raises(TransferError, match=r"engine rank 1.*entries"):
        apply(scratch, params, last_sequence=4, where="engine rank 1")
    assert time.perf_counter() - started < 1.0 and len(reads) <= 1


@pytest.mark.parametrize(
    "entry",
    [
        (0, 2, 0, 128, -96),  # negative: the next entry before the payload, struct.error
        (0, 2, 0, 128, -32),  # negative: the next entry inside the payload's header
        (0, 2, 0, 128, 0),  # size 0: the next entry is this one again
        (0, 2, 0, 128, 40),  # not a multiple of 16: the next entry's views are misaligned
        (0, 2, 2**40, 128, 2**62),  # a size past the payload
    ],
)
def test_an_entry_size_that_cannot_be_is_refused_with_our_error(entry) -> None:
    scratch = _payload(entry, entry, payload_bytes=HEADER_BYTES + 2 * ENTRY_HEADER_BYTES)
    params = _params()
    with pytest.raises(TransferError, match="engine rank 1"):
        apply(scratch, params, last_sequence=4, where="engine rank 1")
    assert all(torch.equal(t, torch.zeros_like(t)) for t in params.values())


def test_a_bad_payload_fails_the_rank_s_update_with_our_error_and_is_cleared() -> None:
    """On the engine: the before-end step records a TransferError (the trainer's write check
    fails the update on it), the parameters keep their bytes, the payload is cleared."""
    entry = (0, 2, 0, 128, -96)
    scratch = _payload(entry, entry, payload_bytes=HEADER_BYTES + 2 * ENTRY_HEADER_BYTES, base=0)
    params = _params()
    side = RankSide(1, write_digests=True)
    side.after_begin()
    record = side.before_end({**params, SCRATCH_NAME: scratch})
    assert record["error"].startswith("TransferError: engine rank 1 (target)")
    assert record["digests"] is None
    assert all(torch.equal(t, torch.zeros_like(t)) for t in params.values())
    assert DeltaReceiver().take(scratch, params) is None  # cleared


def test_a_scratch_region_too_small_for_a_header_is_never_created(monkeypatch) -> None:
    monkeypatch.setenv("P2PWEIGHTS_DELTA_SCRATCH", "16")
    with pytest.raises(ConfigError, match=r"P2PWEIGHTS_DELTA_SCRATCH.*16.*64"):
        scratch_bytes(1 << 20)
    monkeypatch.delenv("P2PWEIGHTS_DELTA_SCRATCH")
    assert scratch_bytes(400) == 0  # 1/8 of a tiny rank's weights: 48 bytes, no header fits
    assert scratch_bytes(1 << 20) == (1 << 20) // 8
