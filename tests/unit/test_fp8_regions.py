"""Quantizing only the blocks a sender's loaders read (``fp8_regions``, ``quantize(box=)``).

A TP rank reads a slice of each fp8 weight and of its scales; once its loads replay
from checked recordings, the views those recordings read give a box of blocks, and
only those are quantized. Blocks are quantized independently, so the box's bytes equal
the whole weight's there.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from p2pweights.plan.stream import UpdateSource
from p2pweights.source.checkpoint_format import QuantizeToBlockFp8
from p2pweights.source.fp8_block import BlockFp8Format, partial, quantize, quantize_many
from p2pweights.source.fp8_regions import block_box
from p2pweights.source.inputs import InputSpec

BLOCK = (64, 64)


@pytest.mark.parametrize(
    ("weight_reads", "scale_reads", "box"),
    [
        ([(128 * 256, (128, 256), (256, 1))], [], (2, 4, 0, 4)),  # rows 128..256: TP rank 1
        ([(128, (256, 128), (256, 1))], [], (0, 4, 2, 4)),  # columns 128..256
        ([(128, (256, 128), (256, 1))], [(1, (4, 1), (4, 1))], (0, 4, 1, 4)),  # + scale col 1
        ([(0, (256, 256), (256, 1))], [], None),  # everything: no box
        ([(64, (8,), (2,))], [], None),  # every other column: not a rectangle
        ([], [], None),  # nothing read
    ],
)
def test_the_box_holds_every_block_read(weight_reads, scale_reads, box) -> None:
    assert block_box((256, 256), BLOCK, weight_reads, scale_reads) == box


def test_stacked_weights_get_no_box() -> None:
    assert block_box((2, 256, 256), BLOCK, [(0, (64, 64), (256, 1))], []) is None


@pytest.mark.parametrize("shape", [(256, 192), (200, 100)])  # whole and partial edge blocks
def test_a_box_quantizes_its_blocks_as_the_whole_weight_does(shape) -> None:
    fmt = BlockFp8Format(BLOCK)
    weight = torch.randn(shape).bfloat16()
    q, scale = quantize(weight, fmt)
    box = (1, 4, 1, 2)
    q_box, scale_box = quantize(weight, fmt, box)
    rows, cols = slice(64, 256), slice(64, 128)
    assert torch.equal(q_box[rows, cols].view(torch.uint8), q[rows, cols].view(torch.uint8))
    assert torch.equal(scale_box[1:4, 1:2], scale[1:4, 1:2])
    assert partial(q_box) and partial(scale_box) and not partial(q)
    with pytest.raises(ValueError, match="outside"):
        quantize(weight, fmt, (0, 9, 0, 1))


def test_quantize_many_takes_each_weights_box() -> None:
    fmt = BlockFp8Format(BLOCK)
    weights = [torch.randn(128, 128).bfloat16() for _ in range(3)]
    got = quantize_many(weights, fmt, [None, (1, 2, 0, 2), (0, 1, 1, 2)])
    for weight, (q, scale), box in zip(
        weights, got, [None, (1, 2, 0, 2), (0, 1, 1, 2)], strict=True
    ):
        want_q, want_scale = quantize(weight, fmt)
        r0, r1, c0, c1 = box or (0, 2, 0, 2)
        rows, cols = slice(r0 * 64, r1 * 64), slice(c0 * 64, c1 * 64)
        assert torch.equal(q[rows, cols].view(torch.uint8), want_q[rows, cols].view(torch.uint8))
        assert torch.equal(scale[r0:r1, c0:c1], want_scale[r0:r1, c0:c1])
        assert partial(q) == (box is not None)


def _source() -> UpdateSource:
    fmt = QuantizeToBlockFp8(BlockFp8Format(BLOCK), frozenset({"w", "v"}))
    known = {"w": InputSpec((256, 256), torch.bfloat16), "v": InputSpec((256, 256), torch.bfloat16)}
    groups = {
        "rank0": [["w", "w_scale_inv"], ["v", "v_scale_inv"]],
        "rank1": [["w", "w_scale_inv"]],
    }
    return UpdateSource(known, groups, {"rank0": fmt, "rank1": fmt})


def _rows(first: int, count: int) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    return [(first * 256, (count, 256), (256, 1))]


def test_regions_need_every_load_of_a_weight_replayed() -> None:
    source = _source()
    reads = {
        "rank0": {"w": _rows(0, 64), "w_scale_inv": [], "v": _rows(0, 64), "v_scale_inv": []},
        "rank1": {"w": _rows(64, 64), "w_scale_inv": []},
    }
    source.use_regions(reads)
    fmt = source._formats["rank0"]
    assert source._formats["rank1"] is fmt  # one format per lane
    assert fmt.regions == {"w": (0, 2, 0, 4), "v": (0, 1, 0, 4)}  # union of both ranks' rows
    assert source.regions == 2
    reads["rank1"]["w"] = None  # rank 1's loader of w runs again
    source.use_regions(reads)
    assert source._formats["rank0"].regions == {"v": (0, 1, 0, 4)}
    source.use_regions({})  # after a failed update: everything whole
    assert source._formats["rank0"].regions == {} and source.regions == 0


def test_a_loader_that_runs_gets_whole_inputs() -> None:
    """A load that is not replayed (another composition, replay off) runs the loader,
    which may read outside the box: partial inputs are quantized whole first, and the
    bytes are those of inputs quantized whole from the start."""
    import tempfile
    from pathlib import Path

    from p2pweights.replica.registry import replica_for
    from p2pweights.source.inputs import describe_inputs
    from p2pweights.testing import model_config, synthetic_weights, write_model_dir

    config = model_config("deepseek-v3-fp8-tiny")
    folder = write_model_dir(config, Path(tempfile.mkdtemp()) / "fp8")
    handle = replica_for({"model_path": str(folder), "tp_size": 2}, 1)
    handle.replica._replays.clear()  # process-wide: no recording of an earlier test
    weights = dict(synthetic_weights(folder, seed=1, dtype=torch.bfloat16))
    specs = describe_inputs(list(weights.items()))
    fmt = handle.checkpoint_format(specs)
    name = next(n for n in sorted(fmt.names) if "experts" in n)
    groups = handle.groups(fmt.engine_specs(specs))

    def load(box) -> dict[str, torch.Tensor]:
        boxed = dataclasses.replace(fmt, regions={name: box} if box else {})
        inputs = dict(c for n, w in weights.items() for c in boxed.convert(n, w))
        assert partial(inputs[name]) == (box is not None)
        views = {
            p: torch.zeros(layout.num_bytes, dtype=torch.uint8)
            for p, layout in handle.layouts.items()
        }
        for group in groups:
            handle.load_into(
                [(n, inputs[n]) for n in sorted(group.hf_names)],
                {p: views[p] for p in group.param_names},
            )
        assert not partial(inputs[name])  # completed before the loader ran
        return views

    whole, boxed = load(None), load((0, 1, 0, 1))  # one block of the weight quantized
    assert all(torch.equal(whole[p], boxed[p]) for p in whole)


def test_input_reads_come_only_from_confirmed_recordings() -> None:
    """Recorded (first load): the loader still runs, so no reads are given; confirmed
    (second load): each input's views; ``replays_changed`` moves with each."""
    import tempfile
    from pathlib import Path

    from p2pweights.replica.registry import replica_for
    from p2pweights.source.inputs import describe_inputs
    from p2pweights.testing import model_config, synthetic_weights, write_model_dir

    folder = write_model_dir(model_config("qwen3-tiny"), Path(tempfile.mkdtemp()) / "qwen3")
    handle = replica_for({"model_path": str(folder), "tp_size": 2}, 1)
    handle.replica._replays.clear()
    weights = dict(synthetic_weights(folder, seed=1))
    group = handle.groups(describe_inputs(list(weights.items())))[-1]
    inputs = sorted((n, weights[n]) for n in group.hf_names)
    views = {
        p: torch.empty(handle.layouts[p].num_bytes, dtype=torch.uint8) for p in group.param_names
    }
    changed = handle.replays_changed
    handle.load_into(inputs, views)
    assert handle.replays_changed > changed
    assert all(handle.input_reads()[n] is None for n, _ in inputs)
    changed = handle.replays_changed
    handle.load_into(inputs, views)  # the loader runs once more and confirms
    assert handle.replays_changed > changed
    reads = handle.input_reads()
    assert all(reads[n] for n, _ in inputs)  # views of each input, as (offset, shape, stride)
