"""A replayed load's copies in one Triton launch per step (``gathered_copies``).

Which copies the kernel takes (rows of contiguous columns, one dtype) and in what unit,
how a replay on a GPU sorts a step's copies, and that a kernel which fails gives way to
``_foreach_copy_`` with the same bytes, here on the CPU; under Triton's interpreter, that
the kernel moves exactly the bytes ``copy_`` moves (slow). On a GPU the same is checked
through whole replays of sglang's loaders (tests/unit/test_loader_replay.py, GPU cases).
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from _interpreted import assert_prints_ok

from p2pweights.replica.sglang import gathered_copies
from p2pweights.replica.sglang.gathered_copies import Shape2d, as_rows


@pytest.mark.parametrize(
    ("shape", "src_stride", "dst_stride", "expected"),
    [
        ((4, 8), (8, 1), (8, 1), Shape2d(1, 32, 32, 32)),  # a whole tensor: one run
        ((2, 8), (8, 1), (8, 1), Shape2d(1, 16, 16, 16)),  # a row slice (TP over dim 0)
        ((4, 2), (8, 1), (2, 1), Shape2d(4, 2, 8, 2)),  # a column slice (TP over dim 1)
        ((3, 4, 8), (64, 8, 1), (32, 8, 1), Shape2d(3, 32, 64, 32)),  # experts' row slices
        ((1, 4, 1, 8), (0, 8, 5, 1), (0, 8, 9, 1), Shape2d(1, 32, 32, 32)),  # size-one dims
        ((8, 4), (1, 8), (4, 1), None),  # a transpose
        ((4, 8), (16, 2), (8, 1), None),  # every other column
        ((2, 3, 4), (24, 8, 1), (12, 4, 1), Shape2d(6, 4, 8, 4)),  # rows of rows, evenly
        ((2, 3, 4), (30, 8, 1), (12, 4, 1), None),  # rows of rows with a gap: three levels
    ],
)
def test_which_copies_are_rows_of_contiguous_columns(shape, src_stride, dst_stride, expected):
    assert as_rows(shape, src_stride, dst_stride) == expected


def test_copies_move_in_the_widest_unit_every_offset_and_stride_allows() -> None:
    def unit(src_offset: int, cols: int, itemsize: int) -> int:
        copy = gathered_copies._Described(
            0, src_offset, 1, 0, Shape2d(2, cols, cols, cols), itemsize
        )
        return copy.unit()

    assert unit(0, 4096, 2) == 8  # bf16 rows, aligned: int64
    assert unit(2, 4096, 2) == 2  # one bf16 element in
    assert unit(0, 3, 4) == 4  # three float32 columns
    assert unit(5, 64, 1) == 1  # fp8 at an odd byte


def _step(count: int):
    from p2pweights.replica.sglang.replay import _Copy, _View

    copies = [
        _Copy(_View("w", 16 * k, (2, 8), (8, 1)), _View(k % 2, 8 * k, (2, 8), (8, 1)))
        for k in range(count)
    ]
    inputs = [torch.randn(64 * count).view(-1) for _ in range(2)]
    targets = {"w": torch.zeros(16 * count)}
    return copies, inputs, targets


def test_steps_with_enough_copies_take_the_kernel() -> None:
    from p2pweights.replica.sglang.replay import _plan

    many = gathered_copies.MIN_COPIES
    copies, inputs, targets = _step(many)
    plan = _plan(copies, inputs, targets, ["w"], kernel=True)
    assert plan.gathered is not None and plan.gathered_indices == list(range(many))
    assert _plan(copies, inputs, targets, ["w"], kernel=False).dense == [list(range(many))]
    few_copies, inputs, targets = _step(many - 1)
    few = _plan(few_copies, inputs, targets, ["w"], kernel=True)
    assert few.gathered is None and few.dense == [list(range(many - 1))]


def test_a_failed_kernel_gives_way_to_foreach_with_the_same_bytes(monkeypatch, caplog) -> None:
    """A CPU tensor stands in for a GPU one: Triton refuses it, as a kernel that cannot
    compile or launch would fail; the copies still land, and the kernel is given up on."""
    from p2pweights.replica.sglang.replay import Replay

    pytest.importorskip("triton")
    monkeypatch.setattr(gathered_copies, "available", lambda device: not gathered_copies._broken)
    monkeypatch.setattr(gathered_copies, "_broken", [])
    copies, inputs, targets = _step(gathered_copies.MIN_COPIES)
    replay = Replay(list(copies), {"w": torch.float32})
    replay._run_on_one_gpu(inputs, targets)
    expected = torch.zeros_like(targets["w"])
    for c in copies:
        c.dst.of(expected).copy_(c.src.of(inputs[c.src.owner]))
    assert torch.equal(targets["w"], expected)
    assert gathered_copies._broken and "copies go one by one" in caplog.text


_INTERPRETED = textwrap.dedent(
    """
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from p2pweights.replica.sglang.gathered_copies import GatheredCopies, as_rows

    torch.manual_seed(0)
    src = torch.randn(32768)
    dst = torch.zeros(65536)
    raw_src, raw_dst = src.view(torch.uint8), dst.view(torch.uint8)
    cases = [  # (dtype, src offset, shape, src stride, dst offset, dst stride), in elements
        (torch.float32, 0, (4, 64), (64, 1), 0, (64, 1)),  # flat, int64 units
        (torch.float32, 3, (5, 7), (100, 1), 2000, (7, 1)),  # rows, float32 units
        (torch.bfloat16, 9, (3, 5), (11, 1), 8001, (5, 1)),  # rows, bf16 units
        (torch.uint8, 1, (2, 33), (40, 1), 24581, (33, 1)),  # rows, bytes
        (torch.bfloat16, 8, (40000,), (1,), 40000, (1,)),  # flat, three chunks of int64
    ]
    copies, expected = [], raw_dst.clone()
    for dtype, s_off, shape, s_stride, d_off, d_stride in cases:
        item = torch.empty(0, dtype=dtype).element_size()
        rows = as_rows(shape, s_stride, d_stride)
        copies.append((0, s_off * item, 1, d_off * item, rows, item))
        s = raw_src.view(dtype).as_strided(shape, s_stride, s_off)
        expected.view(dtype).as_strided(shape, d_stride, d_off).copy_(s)
    gathered = GatheredCopies(copies, torch.device("cpu"))
    left = gathered.run([src.data_ptr(), dst.data_ptr()])
    ok = left == [] and torch.equal(raw_dst, expected)
    # an owner off its launch's unit: that launch's copies are left to the caller
    flat = GatheredCopies([copies[0], copies[1]], torch.device("cpu"))
    before = raw_dst.clone()
    left = flat.run([src.data_ptr() + 4, dst.data_ptr()])
    ok = ok and left == [0] and torch.equal(raw_dst[:1024], before[:1024])
    print("ok" if ok else f"differ (left {left})")
    """
)


@pytest.mark.slow
def test_the_kernel_moves_the_bytes_copy_moves_under_the_interpreter() -> None:
    assert_prints_ok(_INTERPRETED)
