"""Loader replay: a recorded load, repeated on new values, writes what the loader writes.

The recorder is tested on hand-written loaders (what it accepts, what it refuses), then
on sglang's own loaders: a replica loads the HF tensors of one seed (recorded), then of
another (replayed), and the bytes must equal a plain loader run of the second seed.
"""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from p2pweights.replica.registry import replica_for
from p2pweights.replica.sglang.replay import LoadRecorder, replay_key
from p2pweights.source.inputs import describe_inputs
from p2pweights.testing import model_config, synthetic_weights, write_model_dir

Loader = Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], None]


def _record_and_replay(
    loader: Loader, b_dtype: torch.dtype = torch.float32
) -> tuple[LoadRecorder, bool]:
    """Record ``loader`` on one set of values; replay on another; compare with the loader."""
    dtypes = {"w": torch.float32, "b": b_dtype}

    def inputs(seed: int) -> list[tuple[str, torch.Tensor]]:
        g = torch.Generator().manual_seed(seed)
        return [("x", torch.randn(6, 4, generator=g)), ("y", torch.randn(2, 4, generator=g))]

    def views(destinations: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {
            "w": destinations["w"].view(torch.float32).view(8, 4),
            "b": destinations["b"].view(b_dtype),
        }

    recorded = {"w": torch.zeros(128, dtype=torch.uint8), "b": torch.zeros(16, dtype=torch.uint8)}
    first = inputs(1)
    recorder = LoadRecorder(first, recorded, dtypes)
    with recorder:
        loader(dict(first), views(recorded))
    replay = recorder.checked_replay(first, recorded)
    if replay is None:
        return recorder, False
    second = inputs(2)
    replayed = {k: v.clone() for k, v in recorded.items()}
    replay.run(second, replayed)
    expected = {k: v.clone() for k, v in recorded.items()}
    loader(dict(second), views(expected))
    assert all(torch.equal(replayed[k], expected[k]) for k in expected)
    # the way a GPU runs it (steps of disjoint copies, batched), here on the CPU
    batched = {k: v.clone() for k, v in recorded.items()}
    targets = {k: v.view(dtypes[k]) for k, v in batched.items()}
    replay._run_on_one_gpu([t for _, t in second], targets)
    assert all(torch.equal(batched[k], expected[k]) for k in expected)
    return recorder, True


def _narrow_copy_and_pad(x: dict[str, torch.Tensor], p: dict[str, torch.Tensor]) -> None:
    p["w"][:3].copy_(x["x"].narrow(0, 3, 3))  # this rank's shard
    p["w"][3:5].copy_(x["y"])
    p["w"][5:].fill_(0.0)  # padding
    p["b"].zero_()


def _concatenated(x: dict[str, torch.Tensor], p: dict[str, torch.Tensor]) -> None:
    p["w"].copy_(torch.cat([x["x"], x["y"]]))
    p["b"].fill_(1)


def _scaled(x: dict[str, torch.Tensor], p: dict[str, torch.Tensor]) -> None:
    p["w"][:6].copy_(x["x"] * 2)


def _value_dependent(x: dict[str, torch.Tensor], p: dict[str, torch.Tensor]) -> None:
    if x["x"].sum().item() > 0:
        p["w"][:6].copy_(x["x"])


def _added_in_place(x: dict[str, torch.Tensor], p: dict[str, torch.Tensor]) -> None:
    p["w"][:6].copy_(x["x"])
    p["w"][:6].add_(1)


def _concatenated_then_clamped(x: dict[str, torch.Tensor], p: dict[str, torch.Tensor]) -> None:
    both = torch.cat([x["x"], x["y"]])
    both.clamp_(-1, 1)
    p["w"].copy_(both)


def _branch_on_a_concatenation(x: dict[str, torch.Tensor], p: dict[str, torch.Tensor]) -> None:
    both = torch.cat([x["x"], x["y"]])
    if both.abs().max().item() > 100:
        p["w"].fill_(0)
    else:
        p["w"].copy_(both)


def _writes_into_its_input(x: dict[str, torch.Tensor], p: dict[str, torch.Tensor]) -> None:
    x["x"][:2].copy_(x["y"])
    p["w"][:6].copy_(x["x"])


def _overlapping_strided_and_converting(
    x: dict[str, torch.Tensor], p: dict[str, torch.Tensor]
) -> None:
    p["w"][:4].copy_(x["x"][:4])
    p["w"][2:4].copy_(x["y"])  # over part of the copy before: order matters
    p["w"][4:, :2].copy_(x["x"][2:6, 2:])  # strided both sides
    p["w"][4:, 2:].copy_(x["x"][:4, :2])
    p["b"][:4].copy_(x["x"][0])  # float32 into bfloat16


def test_replay_keeps_the_order_of_overlapping_copies_and_converts_dtypes() -> None:
    recorder, replayable = _record_and_replay(_overlapping_strided_and_converting, torch.bfloat16)
    assert replayable, recorder.reason


def test_copies_run_in_steps_of_disjoint_destinations() -> None:
    from p2pweights.replica.sglang.replay import _Copy, _Fill, _steps, _View

    def copy(offset: int, rows: int) -> _Copy:
        return _Copy(_View("w", offset, (rows, 4), (4, 1)), _View(0, 0, (rows, 4), (4, 1)))

    fill = _Fill(_View("b", 0, (4,), (1,)), 0.0)
    first, second, overlapping, elsewhere = copy(0, 2), copy(8, 2), copy(4, 2), copy(16, 1)
    steps = _steps([first, second, overlapping, elsewhere, fill, first])
    assert steps == [[first, second], [overlapping, elsewhere], fill, [first]]


def test_views_copies_fills_and_concatenations_replay() -> None:
    for loader in (_narrow_copy_and_pad, _concatenated):
        recorder, replayable = _record_and_replay(loader)
        assert replayable, recorder.reason


@pytest.mark.parametrize(
    ("loader", "why"),
    [
        (_scaled, "read or wrote an input"),
        (_value_dependent, "read or wrote an input"),
        (_added_in_place, "read or wrote an input or a parameter"),
        (_concatenated_then_clamped, "read or wrote an input or a parameter"),
        (_branch_on_a_concatenation, "read or wrote an input or a parameter"),
        (_writes_into_its_input, "copied somewhere other than a parameter"),
    ],
)
def test_loads_that_compute_on_values_are_not_replayed(loader: Loader, why: str) -> None:
    recorder, replayable = _record_and_replay(loader)
    assert not replayable
    assert why in (recorder.reason or "")


def test_the_key_tells_inputs_apart_by_everything_but_values() -> None:
    a = [("x", torch.zeros(4, 4))]
    dst = {"w": torch.zeros(64, dtype=torch.uint8)}
    assert replay_key(a, dst) == replay_key([("x", torch.ones(4, 4))], dst)
    assert replay_key(a, dst) != replay_key([("x", torch.zeros(4, 4).t())], dst)
    assert replay_key(a, dst) != replay_key([("x", torch.zeros(4, 4, dtype=torch.bfloat16))], dst)
    assert replay_key([("x", 3)], dst) is None


def _stage(model: str, tp: int, ep: int, rank: int, seeds: tuple[int, ...], device="cpu"):
    config = model_config(model)
    folder = write_model_dir(config, Path(tempfile.mkdtemp()) / model)
    handle = replica_for({"model_path": str(folder), "tp_size": tp, "ep_size": ep}, rank)
    if device != "cpu":  # replicas are process-wide: record anew, as this test's GPU path
        handle.replica._replays.clear()
    first = list(synthetic_weights(folder, seed=seeds[0]))
    groups = handle.groups(
        handle.checkpoint_format(describe_inputs(first)).engine_specs(describe_inputs(first))
    )
    fed = {name for group in groups for name in group.hf_names}
    out = []
    for seed in seeds:
        views = {
            name: torch.empty(layout.num_bytes, dtype=torch.uint8, device=device)
            for name, layout in handle.layouts.items()
        }
        inputs = [(n, t.to(device)) for n, t in synthetic_weights(folder, seed=seed) if n in fed]
        handle.load_into(inputs, views)
        out.append(views)
    return handle.replica, out


_LAYOUTS = [
    ("qwen3-tiny", 2, 1, 1),
    ("qwen3-moe-tiny", 2, 2, 1),
    ("glm4-moe-tiny", 2, 1, 0),
    ("deepseek-v3-tiny", 2, 2, 0),  # MLA: q_a and kv_a concatenated; a threaded loader
]
_NEEDS_A_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param("cuda", marks=_NEEDS_A_GPU),  # copies through _foreach_copy_ (few)
        pytest.param("cuda+kernel", marks=_NEEDS_A_GPU),  # every step in one Triton launch
    ],
)
@pytest.mark.parametrize(("model", "tp", "ep", "rank"), _LAYOUTS)
def test_sglang_loaders_replay_bit_exact(
    model: str, tp: int, ep: int, rank: int, device: str, monkeypatch
) -> None:
    from p2pweights.replica.sglang import gathered_copies

    launches: list[None] = []
    kernel = device == "cuda+kernel"
    if device == "cuda":  # every copy through _foreach_copy_
        monkeypatch.setenv("P2PWEIGHTS_COPY_KERNEL", "0")
    if kernel:
        monkeypatch.setattr(gathered_copies, "MIN_COPIES", 1)
        run = gathered_copies.GatheredCopies.run
        monkeypatch.setattr(
            gathered_copies.GatheredCopies,
            "run",
            lambda self, addresses: launches.append(run(self, addresses)),
        )
        device = "cuda"
    # the first load records, the second confirms (the loader runs), the third replays
    replica, (*_, replayed) = _stage(model, tp, ep, rank, (1, 2, 3), device)
    assert bool(launches) == kernel and not gathered_copies._broken
    assert replica.replayed_loads >= 1  # replicas are process-wide: count what this run adds
    before = replica.replayed_loads
    monkeypatch.setenv("P2PWEIGHTS_LOADER_REPLAY", "0")
    plain, (loaded,) = _stage(model, tp, ep, rank, (3,), device)
    assert plain.replayed_loads == before
    assert replayed.keys() == loaded.keys()
    assert [n for n in loaded if not torch.equal(replayed[n], loaded[n])] == []


def _on_a_thread(x: dict[str, torch.Tensor], p: dict[str, torch.Tensor]) -> None:
    worker = threading.Thread(target=lambda: p["w"][:6].copy_(x["x"]))
    worker.start()
    worker.join()


def test_a_write_the_recording_missed_is_caught() -> None:
    """A copy on another thread escapes the dispatch mode; replaying the recording onto
    marker bytes then differs from what the loader wrote, and the loader is kept."""
    recorder, replayable = _record_and_replay(_on_a_thread)
    assert not replayable
    assert "do not reproduce ['w']" in (recorder.reason or "")


def test_a_branch_on_values_outside_aten_is_caught_on_the_next_load() -> None:
    """``.tolist()`` reads values without an aten op; the recording looks sound, but on a
    load with other values it no longer matches the loader, so it is never used."""

    def loader(x: dict[str, torch.Tensor], p: dict[str, torch.Tensor]) -> None:
        if max(x["x"].flatten().tolist()) > 0:
            p["w"][:6].copy_(x["x"])
        else:
            p["w"][:6].fill_(0.0)

    dtypes = {"w": torch.float32}
    recorded = {"w": torch.zeros(128, dtype=torch.uint8)}
    first = [("x", torch.ones(6, 4))]
    recorder = LoadRecorder(first, recorded, dtypes)
    with recorder:
        loader(dict(first), {"w": recorded["w"].view(torch.float32).view(8, 4)})
    replay = recorder.checked_replay(first, recorded)
    assert replay is not None  # the recorded load alone cannot tell
    second = [("x", -torch.ones(6, 4))]
    loaded = {"w": torch.full((128,), 0x5A, dtype=torch.uint8)}  # what ``mark`` leaves
    loader(dict(second), {"w": loaded["w"].view(torch.float32).view(8, 4)})
    assert replay.reproduces(second, loaded) == ["w"]


def test_span_index_finds_holders_and_overlaps_even_where_spans_overlap() -> None:
    from p2pweights.replica.sglang.replay import _SpanIndex

    spans = [((0, 100), 0), ((100, 200), 1), ((150, 160), "p"), ((0, 100), 2), ((300, 400), "q")]
    index = _SpanIndex(spans)
    assert sorted(map(str, index.containing(10, 20))) == ["0", "2"]  # one tensor, two names
    assert sorted(map(str, index.containing(150, 160))) == ["1", "p"]
    assert index.containing(90, 110) == []
    assert sorted(map(str, index.overlapping(90, 110))) == ["0", "1", "2"]
    assert index.overlapping(200, 300) == []
    assert index.overlapping(399, 500) == ["q"]


def test_replay_checks_of_host_staging_fed_from_a_gpu_run_on_that_gpu() -> None:
    """A load from GPU tensors into host staging is checked on the GPU: marker fills and
    compares of gigabytes there, not in host threads and fresh pinned memory."""
    from types import SimpleNamespace

    from p2pweights.replica.sglang.replay import _scratch_device

    gpu, cpu = torch.device("cuda", 1), torch.device("cpu")

    def tensor(device: torch.device) -> object:
        return SimpleNamespace(device=device, is_cuda=device.type == "cuda")

    host_dst = {"w": tensor(cpu)}
    assert _scratch_device([("a", tensor(gpu)), ("b", tensor(gpu))], host_dst) == gpu
    assert _scratch_device([("a", tensor(cpu))], host_dst) == cpu  # a CPU trainer
    mixed = [("a", tensor(gpu)), ("b", tensor(torch.device("cuda", 0)))]
    assert _scratch_device(mixed, host_dst) == cpu  # inputs on two GPUs: stay on the host
    assert _scratch_device([("a", tensor(gpu))], {"w": tensor(gpu)}) == gpu  # device staging
    assert _scratch_device([("a", tensor(gpu))], {}) == cpu  # nothing to check
