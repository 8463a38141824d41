"""Delta payloads: encoding what changed, applying it on the engine side, refusing bad ones."""

from __future__ import annotations

import pytest
import torch

from p2pweights.engine_side.delta_apply import DeltaReceiver, apply
from p2pweights.errors import TransferError
from p2pweights.wire.delta import (
    ENTRY_HEADER_BYTES,
    HEADER_BYTES,
    PayloadHeader,
    encode,
    entry_bytes,
    pack_header,
    pack_payload,
    read_header,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1).view(torch.uint8)


def _params(device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "b.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16).to(device),
        "a.bias": torch.randn(100, generator=g).to(device),  # float32
        "c.fp8": torch.randint(0, 255, (4096,), dtype=torch.uint8, generator=g).to(device),
    }


def _changed(params: dict[str, torch.Tensor], fraction: float, seed: int = 1):
    """A copy with about ``fraction`` of each parameter's elements moved a little."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in params.items():
        new = p.clone()
        mask = (torch.rand(p.shape, generator=g) < fraction).to(p.device)
        if p.dtype == torch.uint8:
            new[mask] = new[mask] + 1
        else:
            new[mask] = (new[mask].float() * 1.01 + 1e-3).to(p.dtype)
        out[name] = new
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_encode_then_apply_is_bit_exact(device):
    old = _params(device)
    new = _changed(old, 0.05)
    names = sorted(old)
    entries = []
    for index, name in enumerate(names):
        entry = encode(
            _bytes(old[name]), _bytes(new[name]), old[name].element_size(), param_index=index
        )
        assert entry is not None, name
        entries.append(entry)
    payload = torch.zeros(1 << 16, dtype=torch.uint8, device=device)
    size = pack_payload(entries, sequence=7, base_sequence=3, out=payload)
    engine = {name: t.clone() for name, t in old.items()}
    applied = apply(payload, engine, last_sequence=3)
    assert applied is not None and applied.sequence == 7 and applied.payload_bytes == size
    assert applied.num_elements == sum(e.count for e in entries)
    for name in names:
        assert torch.equal(_bytes(engine[name]), _bytes(new[name])), name


def test_encode_counts_whole_elements_and_sizes():
    old = torch.zeros(1000, dtype=torch.bfloat16)
    new = old.clone()
    new[[3, 500, 999]] = 1.0
    entry = encode(_bytes(old), _bytes(new), 2)
    assert entry is not None
    assert entry.indices.tolist() == [3, 500, 999]
    assert entry.num_bytes == entry_bytes(3, 2) == ENTRY_HEADER_BYTES + 16 + 16
    # a size not of whole 8-byte words is compared element by element
    odd_old = torch.zeros(1001, dtype=torch.bfloat16)
    odd_new = odd_old.clone()
    odd_new[[0, 7, 1000]] = 2.0
    odd = encode(_bytes(odd_old), _bytes(odd_new), 2)
    assert odd is not None and odd.indices.tolist() == [0, 7, 1000]
    # nothing changed: an empty entry (nothing to send)
    same = encode(_bytes(old), _bytes(old), 2)
    assert same is not None and same.count == 0


def test_encode_returns_none_where_full_bytes_are_smaller():
    old = torch.zeros(64, dtype=torch.bfloat16)  # 128 bytes
    new = old.clone()
    new[:20] = 1.0  # 20 changes: 32 + 80 + 48 = 160 bytes > 128
    assert encode(_bytes(old), _bytes(new), 2) is None
    big_old = torch.zeros(10_000, dtype=torch.bfloat16)
    big_new = big_old.clone()
    big_new[:2000] = 1.0  # 20 % changed: smaller than full, but above a 10 % cap
    assert encode(_bytes(big_old), _bytes(big_new), 2) is not None
    assert encode(_bytes(big_old), _bytes(big_new), 2, max_fraction=0.1) is None


def test_no_payload_is_nothing_to_apply():
    payload = torch.zeros(256, dtype=torch.uint8)
    assert read_header(payload) is None
    assert apply(payload, _params("cpu")) is None


def _one_entry_payload(old, new, *, sequence=5, base=4, name="b.weight"):
    names = sorted(old)
    entry = encode(
        _bytes(old[name]),
        _bytes(new[name]),
        old[name].element_size(),
        param_index=names.index(name),
    )
    payload = torch.zeros(8192, dtype=torch.uint8)
    pack_payload([entry], sequence, base, payload)
    return payload


def test_refuses_an_update_already_taken_or_of_other_bytes():
    old = _params("cpu")
    new = _changed(old, 0.05)
    payload = _one_entry_payload(old, new, sequence=5, base=4)
    engine = {n: t.clone() for n, t in old.items()}
    with pytest.raises(TransferError, match="already took update 5"):
        apply(payload, engine, last_sequence=5)
    with pytest.raises(
        TransferError, match=r"changes the bytes of update 4.*holds those of update 2"
    ):
        apply(payload, engine, last_sequence=2)
    for name in old:  # nothing written
        assert torch.equal(engine[name], old[name])


def test_refuses_writes_outside_a_parameter_before_writing_any():
    old = _params("cpu")
    new = _changed(old, 0.05)
    payload = _one_entry_payload(old, new)
    # corrupt the last index of the entry to point past the parameter's end
    count = int(payload[HEADER_BYTES + 8 : HEADER_BYTES + 16].view(torch.int64))
    indices = payload[HEADER_BYTES + ENTRY_HEADER_BYTES :].view(torch.int32)
    indices[count - 1] = 64 * 32
    engine = {n: t.clone() for n, t in old.items()}
    with pytest.raises(TransferError, match=r"'b.weight'.*outside its 2048 elements"):
        apply(payload, engine, last_sequence=4)
    assert torch.equal(engine["b.weight"], old["b.weight"])


def test_refuses_an_entry_for_another_size_or_beyond_the_region():
    old = _params("cpu")
    new = _changed(old, 0.05)
    payload = _one_entry_payload(old, new)
    smaller = dict(old, **{"b.weight": torch.zeros(32, 32, dtype=torch.bfloat16)})
    with pytest.raises(TransferError, match=r"'b.weight'.*4096 bytes.*holds 2048"):
        apply(payload, smaller, last_sequence=4)
    with pytest.raises(TransferError, match="does not fit"):
        apply(payload[:200], old, last_sequence=4)
    with pytest.raises(TransferError, match="parameter index 1 of 1"):
        apply(payload, {"a.bias": old["a.bias"]}, last_sequence=4)
    with pytest.raises(TransferError, match=r"1 entries.*publishes 0 parameters"):
        apply(payload, {}, last_sequence=4)


def test_receiver_takes_a_payload_once_and_a_full_header_only_records():
    old = _params("cpu")
    new = _changed(old, 0.05)
    engine = {n: t.clone() for n, t in old.items()}
    receiver = DeltaReceiver("engine http://x rank 0")
    scratch = torch.zeros(8192, dtype=torch.uint8)
    pack_header(PayloadHeader(4, 0, 0, HEADER_BYTES), scratch)  # a full update: no entries
    assert receiver.take(scratch, engine).num_entries == 0
    assert receiver.sequence == 4 and read_header(scratch) is None  # cleared once taken
    scratch.copy_(_one_entry_payload(old, new, sequence=5, base=4))
    assert receiver.take(scratch, engine).sequence == 5
    assert torch.equal(engine["b.weight"], new["b.weight"])
    assert receiver.take(scratch, engine) is None  # cleared: never applied twice
    # a delta on bytes it does not hold: refused, cleared, and later deltas need a full one
    scratch.copy_(_one_entry_payload(old, new, sequence=9, base=8))
    with pytest.raises(TransferError, match="engine http://x rank 0"):
        receiver.take(scratch, engine)
    assert receiver.sequence == 0 and read_header(scratch) is None
