"""The write digest: equal bytes give equal digests (CPU, GPU, batched or not), and
any changed, missing, shifted or reordered word changes it."""

from __future__ import annotations

import textwrap

import pytest
import torch
from _interpreted import assert_prints_ok

from p2pweights.wire.digest import LANES, SMALL_BYTES, digest, digests, hex_digests, span_sums


def _bytes(num_bytes: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=generator)


SIZES = [1, 7, 8, 9, 127, 128, 129, 1000, SMALL_BYTES - 1, SMALL_BYTES, SMALL_BYTES + 13]


@pytest.mark.parametrize("num_bytes", SIZES)
def test_equal_bytes_equal_digests_whatever_the_dtype(num_bytes):
    data = _bytes(num_bytes)
    assert digest(data) == digest(data.clone())
    if num_bytes % 2 == 0:
        assert digest(data.view(torch.bfloat16)) == digest(data)


@pytest.mark.parametrize("num_bytes", SIZES)
def test_any_changed_word_changes_it(num_bytes):
    data = _bytes(num_bytes)
    before = digest(data)
    for where in {0, num_bytes // 2, num_bytes - 1}:
        changed = data.clone()
        changed[where] ^= 0x40
        assert digest(changed) != before, where


def test_a_missing_write_changes_it():
    data = _bytes(4096)
    stale = data.clone()
    stale[1024:2048] = 0  # those bytes never arrived
    assert digest(stale) != digest(data)


@pytest.mark.parametrize("shift", [1, 8, 8 * LANES, 256])
def test_a_shifted_write_changes_it(shift):
    data = _bytes(8192)
    shifted = torch.zeros_like(data)
    shifted[shift:] = data[:-shift]
    assert digest(shifted) != digest(data)


def test_a_partial_write_changes_it():
    new, old = _bytes(100_000, seed=1), _bytes(100_000, seed=2)
    partial = old.clone()
    partial[:65536] = new[:65536]
    assert digest(partial) != digest(new)


def test_two_words_cannot_cancel_across_lanes():
    data = torch.zeros(LANES * 8 * 4, dtype=torch.uint8)
    words = data.view(torch.int64)
    moved = data.clone()
    moved.view(torch.int64)[0] += 5  # +5 in lane 0, -5 in lane 1: the sum of all is unchanged
    moved.view(torch.int64)[1] -= 5
    assert digest(moved) != digest(data)
    assert words.sum() == moved.view(torch.int64).sum()


def _bf16(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(torch.bfloat16)


def _swapped(tensor: torch.Tensor, first: slice, second: slice) -> torch.Tensor:
    """``tensor`` (flat view of its bytes) with two equal-sized byte ranges exchanged."""
    out = tensor.clone()
    data, source = out.view(-1).view(torch.uint8), tensor.view(-1).view(torch.uint8)
    data[first], data[second] = source[second], source[first]
    return out


def _halves_swapped(fused: torch.Tensor) -> torch.Tensor:
    """gate and up of a fused ``gate_up_proj`` (rows ``[gate; up]``) in the wrong order."""
    half = fused.shape[0] // 2
    return torch.cat([fused[half:], fused[:half]])


def _experts_swapped(experts: torch.Tensor) -> torch.Tensor:
    """Two experts of a fused expert tensor (experts, rows, cols) exchanged."""
    out = experts.clone()
    out[[1, 5]] = experts[[5, 1]]
    return out


KIB = 1024
REORDERED = {
    # the errors a wrong shard id, expert map or offset makes: every byte arrives, in
    # the wrong place (lane sums of the words alone cannot see any of them)
    "gate_up halves swapped": lambda: (f := _bf16((512, 256)), _halves_swapped(f)),
    "two experts swapped": lambda: (e := _bf16((8, 64, 128), seed=1), _experts_swapped(e)),
    "two 64 KiB slices swapped": lambda: (
        t := _bf16((1024, 512), seed=2),
        _swapped(t, slice(0, 64 * KIB), slice(256 * KIB, 320 * KIB)),
    ),
    "two 128-byte rows swapped": lambda: (
        t := _bf16((64, 64), seed=3),
        _swapped(t, slice(128 * 3, 128 * 4), slice(128 * 9, 128 * 10)),
    ),
    "two words 16 apart swapped": lambda: (
        t := _bf16((64, 64), seed=4),
        _swapped(t, slice(8 * 5, 8 * 6), slice(8 * 21, 8 * 22)),
    ),
}


@pytest.mark.parametrize("case", REORDERED)
def test_reordered_bytes_change_it(case):
    right, wrong = REORDERED[case]()
    assert not torch.equal(right, wrong)
    assert sorted(right.view(-1).tolist()) == sorted(wrong.view(-1).tolist())  # same values
    assert digest(wrong) != digest(right)


@pytest.mark.parametrize("case", REORDERED)
def test_reordered_bytes_change_it_in_a_batch_of_small_regions(case):
    right, wrong = REORDERED[case]()
    small = {"a": torch.arange(100, dtype=torch.int16), "b": right[:8].clone()}
    if right.numel() * right.element_size() < SMALL_BYTES:
        assert digests({**small, "x": wrong})["x"] != digests({**small, "x": right})["x"]


def test_same_words_at_another_length_differ():
    assert digest(torch.zeros(8, dtype=torch.uint8)) != digest(torch.zeros(16, dtype=torch.uint8))


def test_batched_and_one_by_one_agree_and_unaligned_views_work():
    base = _bytes(3 * SMALL_BYTES + 7)
    regions = {
        "small": base[:1000],
        "odd": base[1001:1014],  # not 8-aligned
        "large": base[5 : 5 + SMALL_BYTES + 77],  # large and not 8-aligned
        "floats": torch.arange(33, dtype=torch.float32),
    }
    together = digests(regions)
    assert together == {name: digest(t) for name, t in regions.items()}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("num_bytes", SIZES)
def test_cpu_and_gpu_agree(num_bytes):
    data = _bytes(num_bytes)
    assert digest(data.cuda()) == digest(data)
    regions = {"a": data, "b": data[: num_bytes // 2 + 1]}
    assert digests({n: t.cuda() for n, t in regions.items()}) == digests(regions)


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
        ),
    ],
)
def test_spans_of_a_buffer_digest_as_their_views(device):
    """A sender digests a staging buffer's slots by (offset, length): the same digests as
    views of them, for aligned and unaligned slots, empty ones, and again once the
    address table is kept (a second update's call), after the bytes changed."""
    buffer = _bytes(3 * SMALL_BYTES + 4099).to(device)
    spans = {
        "first": (0, 1000),
        "odd": (1001, 13),  # not 8-aligned: torch
        "large": (2048, SMALL_BYTES + 77),
        "empty": (4096, 0),
        "tail": (2 * SMALL_BYTES + 8, SMALL_BYTES + 4091),
    }
    for _ in range(2):
        views = {name: buffer[o : o + n] for name, (o, n) in spans.items()}
        assert hex_digests(span_sums(buffer, spans)) == digests(views)
        buffer[2048 + 9] += 1  # the next update's bytes, at the same addresses


def _reference(data: torch.Tensor) -> str:
    """The definition, word by word in Python integers: word ``i`` (little-endian, a short
    tail zero-padded) into lane ``i % LANES``, plain and times ``i // LANES + 1``, sums
    wrapped to int64, then hashed."""
    import numpy as np

    from p2pweights.wire.digest import lanes_hex

    raw = bytes(data.numpy().tobytes())
    raw += bytes(-len(raw) % 8)
    words = [int(w) for w in np.frombuffer(raw, dtype="<u8")]
    plain = [sum(words[lane::LANES]) % 2**64 for lane in range(LANES)]
    weighted = [
        sum((row + 1) * w for row, w in enumerate(words[lane::LANES])) % 2**64
        for lane in range(LANES)
    ]
    signed = [v - 2**64 if v >= 2**63 else v for v in plain + weighted]
    return lanes_hex(torch.tensor(signed, dtype=torch.int64), len(data))


@pytest.mark.parametrize(
    "num_bytes", [*SIZES, 8 * LANES * 64 * 3, 8 * LANES * 64 * 3 + 8 * 5 + 3, 3_000_017]
)
@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
        ),
    ],
)
def test_digests_follow_the_definition(num_bytes, device):
    data = _bytes(num_bytes, seed=num_bytes)
    assert digest(data.to(device)) == _reference(data)


_INTERPRETED = textwrap.dedent(
    """
    import os
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from p2pweights.wire import digest as d, lanes_kernel
    from p2pweights.wire.lanes_kernel import CHUNK_WORDS, kernel_lanes

    lanes_kernel._PROGRAMS, lanes_kernel._MAX_BLOCKS = PROGRAMS, MAX_BLOCKS

    generator = torch.Generator().manual_seed(3)
    owner = torch.randint(0, 256, (3 * CHUNK_WORDS * 8 + 4096,), dtype=torch.uint8,
                          generator=generator)
    cases = [  # (byte offset into owner: 8-aligned, length): tails of 0 to 7 bytes,
               # one word, one chunk, one word past it, several chunks
        (0, 1), (8, 7), (16, 8), (24, 9), (32, 10), (40, 11), (48, 12), (56, 14),
        (64, 127), (256, 128), (512, 1000),
        (8, CHUNK_WORDS * 8), (4096, CHUNK_WORDS * 8 + 8), (0, CHUNK_WORDS * 8 * 2 + 13),
        (1024, 3 * CHUNK_WORDS * 8),
    ]
    regions = [owner[offset : offset + length] for offset, length in cases]
    sums = kernel_lanes([r.data_ptr() for r in regions], [r.numel() for r in regions],
                        torch.device("cpu"))
    expected = [d._lanes(r) if r.numel() >= d._ROW_BYTES else
                d._batched_lanes({"r": r})[0] for r in regions]
    same = [torch.equal(s, e) for s, e in zip(sums, expected)]
    blocks = lanes_kernel._chunk_blocks([r.numel() for r in regions])
    print("ok" if all(same) and blocks == BLOCKS else f"differ: {same}, {blocks} blocks")
    """
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "programs, max_blocks, blocks",
    [(1024, 1024, 256), (1, 512, 512)],
    ids=["4 MiB chunks", "8 MiB chunks"],
)
def test_the_kernel_sums_what_torch_sums_under_the_interpreter(programs, max_blocks, blocks):
    """The one-launch kernel's lane sums equal the torch path's for tails of every
    length, chunk edges and regions of several chunks, in the chunks of a few GB and in
    the longer ones of many (here forced by a lower program count; on a GPU:
    ``test_cpu_and_gpu_agree``, ``test_digests_follow_the_definition`` and
    ``test_many_gb_are_summed_in_longer_chunks_alike`` run it)."""
    settings = f"PROGRAMS, MAX_BLOCKS, BLOCKS = {programs}, {max_blocks}, {blocks}\n"
    assert_prints_ok(settings + _INTERPRETED)


def test_chunks_grow_with_the_bytes_to_sum():
    """4 MiB chunks up to about 1,024 of them (a 1 GB rank: a few hundred programs), then
    doubled up to 16 MiB (an 8 GB rank in 8 MiB chunks, 16 GB in 16)."""
    from p2pweights.wire.lanes_kernel import _chunk_blocks

    gib = 1 << 30
    assert _chunk_blocks([gib]) == 256
    assert _chunk_blocks([gib] * 4) == 256
    assert _chunk_blocks([gib] * 4 + [8]) == 512
    assert _chunk_blocks([8 * gib]) == 512
    assert _chunk_blocks([16 * gib]) == 1024
    assert _chunk_blocks([64 * gib]) == 1024


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_many_gb_are_summed_in_longer_chunks_alike():
    """Regions of 6 GiB in all (8 MiB chunks): the kernel's sums equal torch's."""
    from p2pweights.wire import lanes_kernel
    from p2pweights.wire.digest import _lanes

    owner = torch.randint(-(2**62), 2**62, (6 << 27,), dtype=torch.int64, device="cuda")
    flat = owner.view(torch.uint8)
    regions = [flat[: 4 << 30], flat[(4 << 30) + 8 : (6 << 30) - 3]]
    sizes = [r.numel() for r in regions]
    assert lanes_kernel._chunk_blocks(sizes) == 512
    sums = lanes_kernel.kernel_lanes([r.data_ptr() for r in regions], sizes, owner.device)
    assert sums is not None
    for got, region in zip(sums, regions, strict=True):
        assert torch.equal(got, _lanes(region))


def test_a_failing_kernel_gives_way_to_torch_with_one_warning(monkeypatch, caplog):
    """A kernel that fails to compile or launch: the same digests through torch, and the
    kernel is not tried again in this process."""
    from p2pweights.wire import lanes_kernel

    def broken(*args, **kwargs):
        raise RuntimeError("no such kernel")

    class Launcher:
        def __getitem__(self, grid):
            return broken

    monkeypatch.setattr(lanes_kernel, "_broken", [])
    monkeypatch.setattr(lanes_kernel, "_kernel", lambda: Launcher())
    monkeypatch.setattr(lanes_kernel, "usable", lambda device: not lanes_kernel._broken)
    regions = {"a": _bytes(4096), "b": _bytes(SMALL_BYTES + 9, seed=1)}
    expected = {name: _reference(data) for name, data in regions.items()}
    with caplog.at_level("WARNING"):
        assert digests(regions) == expected
        assert digests(regions) == expected
    assert lanes_kernel._broken == ["RuntimeError: no such kernel"]
    assert caplog.text.count("the digest kernel failed") == 1


def test_the_kernel_can_be_turned_off(monkeypatch):
    from p2pweights.wire import lanes_kernel

    monkeypatch.setattr(lanes_kernel, "_broken", [])
    monkeypatch.setattr(lanes_kernel, "_kernel", lambda: object())
    monkeypatch.setenv("P2PWEIGHTS_DIGEST_KERNEL", "0")
    assert not lanes_kernel.usable(torch.device("cuda", 0))
    monkeypatch.setenv("P2PWEIGHTS_DIGEST_KERNEL", "1")
    assert lanes_kernel.usable(torch.device("cuda", 0))
    assert not lanes_kernel.usable(torch.device("cpu"))
