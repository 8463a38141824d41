"""The executor and the byte plan with an in-process fake transport (unit level only).

The fake copies bytes with ctypes.memmove from the staging buffer into tensors
standing for engine memory, so these tests check the byte plan, buffer reuse,
the one-writer-per-engine-rank rule and failure reporting. Real transports between
processes are tested in tests/integration.
"""

from __future__ import annotations

import ctypes
import threading
import time

import pytest
import torch

from p2pweights.errors import LayoutMismatchError, TransferError
from p2pweights.plan.byte_plan import ALIGNMENT_BYTES, aligned, build_byte_plan
from p2pweights.testing.loaders import FnLoader
from p2pweights.transfer.executor import RunHooks, TransferExecutor
from p2pweights.transports.base import Transport, Write
from p2pweights.wire.digest import digest
from p2pweights.wire.publication import RankPublication, WeightRegion


class CopyingTransport(Transport):
    """Copies in-process; records which thread wrote to which engine."""

    name = "fake"

    def __init__(self, delay_s: float = 0.0, fail_on: str | None = None):
        self.delay_s = delay_s
        self.fail_on = fail_on
        self.registered: list[int] = []
        self.unregistered: list[int] = []
        self.threads: dict[tuple[str, int], set[str]] = {}
        self.calls: list[tuple[str, str, list[int]]] = []
        self.writes: list[Write] = []
        self.lock = threading.Lock()

    def register(self, buffer: torch.Tensor) -> None:
        self.registered.append(buffer.data_ptr())

    def unregister(self, buffer: torch.Tensor) -> None:
        self.registered.remove(buffer.data_ptr())
        self.unregistered.append(buffer.data_ptr())

    def connect(self, target: RankPublication) -> None:
        pass

    def write(self, target, writes, timeout_s):
        with self.lock:
            key = (target.engine_url, target.engine_rank)
            self.threads.setdefault(key, set()).add(threading.current_thread().name)
            self.calls.append((target.role, target.session_id, [w.dst_address for w in writes]))
            self.writes.extend(writes)
        time.sleep(self.delay_s)
        if self.fail_on == target.engine_url:
            raise TransferError(f"engine {target.engine_url} rank {target.engine_rank}: status -1")
        for w in writes:
            ctypes.memmove(w.dst_address, w.src_address, w.num_bytes)

    def close(self) -> None:
        pass


def _engine(
    url: str, rank: int, params: dict[str, torch.Tensor], role: str = "target"
) -> RankPublication:
    regions = {
        n: WeightRegion(t.data_ptr(), t.numel() * t.element_size()) for n, t in params.items()
    }
    return RankPublication(url, rank, "fake", regions, session_id=f"{role}-peer", role=role)


def _params(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"p{i}": torch.randn(300 + 17 * i, generator=g).to(torch.bfloat16) for i in range(12)}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _run(transport, buffer_bytes, source, targets, timeout_s=5.0, loads=None, hooks=None):
    """One group per parameter (each fed by the HF tensor of the same name), one replica."""
    plan = build_byte_plan(
        {"replica": [(frozenset({n}), (n,)) for n in source]},
        {"replica": {n: _nbytes(t) for n, t in source.items()}},
        {"replica": targets},
        buffer_bytes,
    )
    executor = TransferExecutor(transport, torch.device("cpu"), timeout_s)
    executor.connect(targets)
    executor.reserve(plan.buffer_bytes)
    calls = [] if loads is None else loads

    def load(key, inputs, views):
        calls.append((key, [name for name, _ in inputs]))
        for name, value in inputs:
            views[name].copy_(value.view(torch.uint8))

    ready = ((plan.group("replica", i), [(n, source[n])]) for i, n in enumerate(source))
    loaders = {"replica": FnLoader("replica", load)}
    return executor, executor.run(plan, ready, loaders, *([] if hooks is None else [hooks]))


def test_bytes_land_bit_exact_across_flushes_and_targets():
    transport = CopyingTransport(delay_s=0.01)
    loads: list = []
    source = _params(0)
    engines = [{n: torch.zeros_like(t) for n, t in source.items()} for _ in range(2)]
    targets = [_engine("http://a", 0, engines[0]), _engine("http://b", 0, engines[1])]
    # a buffer holding about two parameters forces many flushes and buffer reuse
    executor, result = _run(transport, 2 * aligned(600), source, targets, loads=loads)
    for engine in engines:
        for name, value in source.items():
            assert torch.equal(engine[name].view(torch.uint8), value.view(torch.uint8)), name
    assert result.num_flushes > 2 and not result.failures
    # each group loaded once for both targets, in one call per flushed buffer
    assert sorted(n for _, names in loads for n in names) == sorted(source)
    assert len(loads) == result.num_flushes
    assert result.bytes_written == 2 * sum(_nbytes(t) for t in source.values())
    assert len(transport.registered) == 2  # both buffers registered once
    executor.close()


def test_one_writer_thread_per_engine_rank():
    transport = CopyingTransport()
    source = _params(1)
    sinks = {
        key: {n: torch.zeros_like(t) for n, t in source.items()}
        for key in (("http://a", 0), ("http://a", 1), ("http://b", 0))
    }
    targets = [_engine(url, rank, sinks[(url, rank)]) for url, rank in sinks]
    executor, _ = _run(transport, aligned(1000), source, targets)
    assert all(len(threads) == 1 for threads in transport.threads.values())
    assert len({next(iter(t)) for t in transport.threads.values()}) == 3
    executor.close()


def test_failed_write_fails_its_engine_rank_naming_it_and_the_others_get_every_byte():
    source = _params(2)
    sinks = [{n: torch.zeros_like(t) for n, t in source.items()} for _ in range(2)]
    targets = [_engine(u, 3, sink) for u, sink in zip(("http://a", "http://b"), sinks, strict=True)]
    executor, result = _run(CopyingTransport(fail_on="http://b"), 2 * aligned(700), source, targets)
    assert result.complete("http://a") and not result.complete("http://b")
    for name, value in source.items():
        assert torch.equal(sinks[0][name].view(torch.uint8), value.view(torch.uint8))
    with pytest.raises(TransferError, match=r"engine http://b rank 3 parameters p0, p1"):
        result.raise_if_failed()
    executor.close()


def test_once_every_engine_rank_failed_the_update_stops_reading_its_input():
    source = _params(4)
    sink = {n: torch.zeros_like(t) for n, t in source.items()}
    targets = [_engine("http://dead", 0, sink)]
    transport = CopyingTransport(fail_on="http://dead")
    plan = build_byte_plan(
        {"replica": [(frozenset({n}), (n,)) for n in source]},
        {"replica": {n: _nbytes(t) for n, t in source.items()}},
        {"replica": targets},
        aligned(700),  # about one parameter per buffer: a flush (and a write) per group
    )
    executor = TransferExecutor(transport, torch.device("cpu"), 5.0)
    executor.connect(targets)
    executor.reserve(plan.buffer_bytes)
    consumed = []

    def streamed():
        for i, name in enumerate(source):
            consumed.append(name)
            yield plan.group("replica", i), [(name, source[name])]

    def load(key, inputs, views):
        for name, value in inputs:
            views[name].copy_(value.view(torch.uint8))

    with pytest.raises(TransferError, match=r"every engine rank .* http://dead rank 0"):
        executor.run(plan, streamed(), {"replica": FnLoader("replica", load)})
    assert len(consumed) <= 4 < len(source)  # stopped a few groups after the first failure
    executor.close()


def test_a_failed_registration_of_the_second_buffer_leaves_neither_registered():
    class SecondRegistrationFails(CopyingTransport):
        def register(self, buffer):
            if self.registered:
                raise TransferError("register_memory failed (injected)")
            super().register(buffer)

    transport = SecondRegistrationFails()
    executor = TransferExecutor(transport, torch.device("cpu"), 5.0)
    with pytest.raises(TransferError, match="injected"):
        executor.reserve(1 << 16)
    assert transport.registered == [] and len(transport.unregistered) == 1
    assert executor.buffer_bytes == 0


_KEEP_ALIVE: list[object] = []  # the late write lands after its test ended; keep its memory


def test_late_write_fails_the_update():
    source = _params(3)
    sink = {n: torch.zeros_like(t) for n, t in source.items()}
    _KEEP_ALIVE.append(sink)
    targets = [_engine("http://a", 0, sink)]
    executor, result = _run(CopyingTransport(delay_s=1.5), 1 << 20, source, targets, timeout_s=0.3)
    _KEEP_ALIVE.append(executor)
    with pytest.raises(TransferError, match=r"http://a rank 0.*still running after"):
        result.raise_if_failed()


def test_plan_refuses_to_write_outside_published_region():
    small = {"p0": torch.zeros(10, dtype=torch.bfloat16)}
    target = _engine("http://a", 1, small)
    with pytest.raises(LayoutMismatchError, match=r"http://a rank 1 parameter 'p0'.*outside"):
        build_byte_plan({"r": [(frozenset({"x"}), ("p0",))]}, {"r": {"p0": 40}}, {"r": [target]}, 1)
    with pytest.raises(LayoutMismatchError, match=r"did not publish parameter 'zz'"):
        build_byte_plan({"r": [(frozenset({"x"}), ("zz",))]}, {"r": {"zz": 20}}, {"r": [target]}, 1)


def test_plan_slots_are_aligned_and_buffers_hold_the_largest_group():
    sizes = {"a": 10, "b": ALIGNMENT_BYTES + 1, "c": 3 * ALIGNMENT_BYTES}
    plan = build_byte_plan(
        {"r": [(frozenset({"x", "y"}), ("a", "b")), (frozenset({"z"}), ("c",))]},
        {"r": sizes},
        {"r": []},
        ALIGNMENT_BYTES,
    )
    first = plan.group("r", 0)
    assert [(s.param, s.offset) for s in first.slots] == [("a", 0), ("b", ALIGNMENT_BYTES)]
    assert first.block_bytes == 3 * ALIGNMENT_BYTES
    assert plan.buffer_bytes == 3 * ALIGNMENT_BYTES  # grown past the configured size


def test_writes_carry_the_gpu_each_region_was_published_on():
    """A NIXL VRAM write names the engine's GPU: it comes from the publication's gpu_id."""
    source = _params(5)
    sink = {n: torch.zeros_like(t) for n, t in source.items()}
    pub = _engine("http://a", 0, sink)
    gpus = {name: 3 + i % 2 for i, name in enumerate(sink)}
    regions = {
        n: WeightRegion(r.address, r.num_bytes, gpu_id=gpus[n]) for n, r in pub.regions.items()
    }
    pub = RankPublication("http://a", 0, "fake", regions, session_id="peer")
    transport = CopyingTransport()
    executor, result = _run(transport, aligned(2000), source, [pub])
    assert not result.failures
    seen = {(w.dst_address, w.dst_device) for w in transport.writes}
    assert seen == {(regions[n].address, gpus[n]) for n in sink}
    executor.close()


def test_a_draft_is_written_through_its_own_publication_on_its_rank_writer():
    """A rank's target and its speculative draft are published with their own transport
    handles: each batch goes through the publication whose regions the plan checked."""
    source = _params(4)
    target = {n: torch.zeros_like(t) for n, t in source.items()}
    draft = {n: torch.zeros_like(t) for n, t in source.items()}
    transport = CopyingTransport()
    pubs = [_engine("http://a", 0, target), _engine("http://a", 0, draft, role="draft")]
    executor, result = _run(transport, 1 << 20, source, pubs)
    for role, peer, addresses in transport.calls:
        assert peer == f"{role}-peer"
        sink = target if role == "target" else draft
        assert set(addresses) == {t.data_ptr() for t in sink.values()}
    for sink in (target, draft):
        for name, value in source.items():
            assert torch.equal(sink[name].view(torch.uint8), value.view(torch.uint8))
    assert len(transport.threads) == 1  # one writer for the rank, both runners
    assert result.bytes_written == 2 * sum(_nbytes(t) for t in source.values())
    executor.close()


def test_growing_buffers_deregisters_the_old_ones():
    transport = CopyingTransport()
    executor = TransferExecutor(transport, torch.device("cpu"), 1.0)
    executor.reserve(1 << 20)
    first = list(transport.registered)
    executor.reserve(2 << 20)  # the allocator may hand the new pair the old addresses
    assert sorted(transport.unregistered) == sorted(first) and len(transport.registered) == 2
    executor.close()
    assert transport.registered == []


class MappingTransport(CopyingTransport):
    """Maps engine ``direct_url``'s memory for plain copies, as CUDA IPC does for an
    engine on the trainer's own GPU; every other engine is written through staging."""

    def __init__(self, direct_url: str, memory: dict[str, torch.Tensor]):
        super().__init__()
        self.direct_url = direct_url
        self.memory = [t.view(torch.uint8) for t in memory.values()]
        self.views: list[tuple[int, int]] = []

    def direct_view(self, target, address, num_bytes):
        if target.engine_url != self.direct_url:
            return None
        for region in self.memory:
            start = region.data_ptr()
            if start <= address and address + num_bytes <= start + region.numel():
                self.views.append((address, num_bytes))
                return region[address - start : address - start + num_bytes]
        raise TransferError(f"{num_bytes} bytes at {address:#x} are outside what was published")


def test_a_mapped_engine_is_loaded_directly_and_the_others_through_staging():
    source = _params(3)
    mapped = {n: torch.zeros_like(t) for n, t in source.items()}
    remote = {n: torch.zeros_like(t) for n, t in source.items()}
    transport = MappingTransport("http://mapped", mapped)
    targets = [_engine("http://mapped", 0, mapped), _engine("http://remote", 0, remote)]
    loads: list = []
    _, result = _run(transport, 3 * aligned(600), source, targets, loads=loads)
    for engine in (mapped, remote):
        for name, value in source.items():
            assert torch.equal(engine[name].view(torch.uint8), value.view(torch.uint8)), name
    # the mapped engine got no write, only loads into its memory; the other only writes
    written_to = {session for _, session, _ in transport.calls}
    assert all(url == "http://remote" for url, _ in transport.threads)
    assert written_to == {"target-peer"}
    assert len(transport.views) == len(source)
    everything = sum(_nbytes(t) for t in source.values())
    assert result.bytes_by_target == {
        ("http://mapped", 0): everything,
        ("http://remote", 0): everything,
    }
    # every group loaded once per destination: once staged, once straight into the engine
    loaded = sorted(n for _, names in loads for n in names)
    assert loaded == sorted(list(source) * 2)


def test_direct_loads_are_digested_for_the_write_check_as_staged_slots_are():
    """A direct load stages nothing: the digest the engine's is compared with is of the
    bytes the loaders left where this rank mapped each parameter (a wrong mapping shows
    as the engine's own parameter differing)."""
    source = _params(3)
    mapped = {n: torch.zeros_like(t) for n, t in source.items()}
    remote = {n: torch.zeros_like(t) for n, t in source.items()}
    transport = MappingTransport("http://mapped", mapped)
    targets = [_engine("http://mapped", 0, mapped), _engine("http://remote", 0, remote)]
    hooks = RunHooks(digest_staged=True)
    _, result = _run(transport, 3 * aligned(600), source, targets, hooks=hooks)
    expected = {name: digest(value) for name, value in source.items()}
    assert result.digests == {
        ("http://mapped", 0, "target"): expected,
        ("http://remote", 0, "target"): expected,
    }


def test_direct_loads_are_bounded_by_the_buffer_size():
    """A direct load's replay check allocates scratch of its size: at most a buffer's."""
    source = _params(4)
    mapped = {n: torch.zeros_like(t) for n, t in source.items()}
    transport = MappingTransport("http://mapped", mapped)
    loads: list = []
    buffer_bytes = 2 * aligned(600)
    _, result = _run(
        transport, buffer_bytes, source, [_engine("http://mapped", 0, mapped)], loads=loads
    )
    assert transport.calls == []  # nothing staged, nothing written
    assert len(loads) > 2
    for _, names in loads:
        assert sum(aligned(_nbytes(source[n])) for n in names) <= buffer_bytes
    for name, value in source.items():
        assert torch.equal(mapped[name].view(torch.uint8), value.view(torch.uint8)), name
    assert result.bytes_written == sum(_nbytes(t) for t in source.values())


def test_a_refused_direct_view_fails_its_engine_rank_alone():
    """As a failed write does: that rank gets nothing more, the others everything."""
    source = _params(5)
    mapped = {n: torch.zeros_like(t) for n, t in source.items()}
    remote = {n: torch.zeros_like(t) for n, t in source.items()}
    transport = MappingTransport("http://mapped", {"p0": mapped["p0"]})  # maps p0 alone
    targets = [_engine("http://mapped", 0, mapped), _engine("http://remote", 0, remote)]
    loads: list = []
    _, result = _run(transport, 4096, source, targets, loads=loads)
    assert list(result.failures) == [("http://mapped", 0)]
    assert "outside what was published" in str(result.failures[("http://mapped", 0)])
    assert result.complete("http://remote") and not result.complete("http://mapped")
    for name, value in source.items():
        assert torch.equal(remote[name].view(torch.uint8), value.view(torch.uint8)), name
    assert all(not t.any() for t in mapped.values())  # not even p0: its rank had failed


def test_a_write_whose_writer_was_closed_mid_run_fails_its_rank_as_a_transfer_error():
    """A queued write cancelled by its writer's close (a reconnect or close under a run)
    fails its engine rank with a TransferError naming it, not a bare CancelledError, and
    a flush after the close is refused the same way (issue 28, item 3)."""
    source = _params(5)
    sink = {n: torch.zeros_like(t) for n, t in source.items()}
    targets = [_engine("http://a", 0, sink)]
    transport = CopyingTransport(delay_s=0.3)
    closer = threading.Timer(0.1, lambda: executor.disconnect())
    loads: list = []

    def load(key, inputs, views):
        if len(loads) == 1:  # the second flush: its batch queues behind the first's
            closer.start()
        loads.append(key)
        for name, value in inputs:
            views[name].copy_(value.view(torch.uint8))

    plan = build_byte_plan(
        {"replica": [(frozenset({n}), (n,)) for n in source]},
        {"replica": {n: _nbytes(t) for n, t in source.items()}},
        {"replica": targets},
        4 * aligned(600),
    )
    executor = TransferExecutor(transport, torch.device("cpu"), 5.0)
    executor.connect(targets)
    executor.reserve(plan.buffer_bytes)
    ready = ((plan.group("replica", i), [(n, source[n])]) for i, n in enumerate(source))
    with pytest.raises(TransferError, match=r"http://a rank 0 .*writer was closed"):
        executor.run(plan, ready, {"replica": FnLoader("replica", load)}).raise_if_failed()
    closer.join()
    executor.close()


def test_landed_flags_follow_staged_writes_and_direct_loads():
    """``RunHooks.flag_landed``: each parameter's flag (``wire.landed``) is set once its
    writes returned (staged: behind the next flush's writes) or its direct load's copies
    finished; the last flush's staged parameters are left to the engine's end."""
    from p2pweights.wire.landed import LANDED_NAME, flag_names

    source = _params(3)
    ends = {}
    targets = []
    for url in ("http://mapped", "http://remote"):
        memory = {n: torch.zeros_like(t) for n, t in source.items()}
        flags = torch.zeros(64, dtype=torch.uint8)
        ends[url] = (memory, flags)
        target = _engine(url, 0, memory)
        target.regions[LANDED_NAME] = WeightRegion(flags.data_ptr(), 64)
        targets.append(target)
    transport = MappingTransport(
        "http://mapped", {**ends["http://mapped"][0], "f": ends["http://mapped"][1]}
    )
    hooks = RunHooks(flag_landed=frozenset({"http://mapped", "http://remote"}))
    _, result = _run(transport, 3 * aligned(600), source, targets, hooks=hooks)
    assert result.failures == {}
    names = flag_names(source)
    for url, (_, flags) in ends.items():
        flagged = {names[i] for i in range(len(names)) if flags[i]}
        if url == "http://mapped":  # every direct load flags its parameters
            assert flagged == set(source)
        else:  # every flush but the last
            assert set(source) - {"p9", "p10", "p11"} <= flagged < set(source)
        assert not flags[len(names) :].any()
    unflagged = _run(transport, 3 * aligned(600), source, targets)[1]
    assert unflagged.failures == {}


def test_direct_loads_queued_before_the_engines_open_land_where_the_new_plan_says():
    """The first open may return a moved plan (the engine published its weights afresh):
    every direct load, queued before it or after, goes to the new addresses, none into
    the memory the old plan named (freed by the engine; issue 39 item 2)."""
    source = _params(6)
    old = {n: torch.zeros_like(t) for n, t in source.items()}
    new = {n: torch.zeros_like(t) for n, t in source.items()}
    both = {**{f"old.{n}": t for n, t in old.items()}, **{f"new.{n}": t for n, t in new.items()}}
    transport = MappingTransport("http://mapped", both)
    buffer_bytes = 2 * aligned(600)  # direct loads flush every two parameters
    moved = build_byte_plan(
        {"replica": [(frozenset({n}), (n,)) for n in source]},
        {"replica": {n: _nbytes(t) for n, t in source.items()}},
        {"replica": [_engine("http://mapped", 0, new)]},
        buffer_bytes,
    )
    hooks = RunHooks(before_writes=lambda: moved)
    _, result = _run(
        transport, buffer_bytes, source, [_engine("http://mapped", 0, old)], hooks=hooks
    )
    assert not result.failures
    assert all(not t.any() for t in old.values()), "a load landed in the old (freed) memory"
    for name, value in source.items():
        assert torch.equal(new[name].view(torch.uint8), value.view(torch.uint8)), name


@pytest.mark.parametrize("paused_before", [False, True], ids=["staged-first", "paused-first"])
def test_the_first_buffer_is_hashed_before_the_engines_open(
    paused_before: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With staging before the pause, the first buffer is loaded while the engines still
    generate; its weight-checker hashes and write digests are taken then too, before
    ``before_writes`` pauses and opens them, so they cost the pause nothing. Later
    buffers are hashed while their writes run (the engines are open by then), as is
    every buffer where the engines were paused before the run (``paused_before``):
    hashing first would only hold back the writes inside the pause."""
    from p2pweights.replica.sglang import facade
    from p2pweights.transfer import executor as executor_module
    from p2pweights.verification.checksums import StagedChecksums

    source = _params(7)
    engine = {n: torch.zeros_like(t) for n, t in source.items()}
    target = _engine("http://e", 0, engine)
    checksums = StagedChecksums({"http://e": "cpu"})
    digested: list[str] = []
    digest_spans = executor_module._Run._digest

    def spy(self, buffer, placed):  # type: ignore[no-untyped-def]
        digested.extend(slot.param for p in placed for slot in p.group.slots)
        return digest_spans(self, buffer, placed)

    monkeypatch.setattr(executor_module._Run, "_digest", spy)
    seen: dict[str, object] = {}

    def opening() -> None:
        seen["hashed"] = set(checksums.found.get(("http://e", 0, "target"), {}))
        seen["digested"] = set(digested)
        seen["written"] = [t.any().item() for t in engine.values()]

    hooks = RunHooks(
        before_writes=opening,
        checksums=checksums,
        digest_staged=True,
        paused_before=paused_before,
    )
    buffer_bytes = 4 * aligned(_nbytes(source["p11"]))  # 4 KiB: p0-p4 (768 B each) first
    _, result = _run(CopyingTransport(), buffer_bytes, source, [target], hooks=hooks)
    assert not result.failures and result.num_flushes == 3
    first = set() if paused_before else {f"p{i}" for i in range(5)}
    assert seen["hashed"] == first, "the first buffer is hashed before the engines open"
    assert seen["digested"] == first, "and digested"
    assert not any(seen["written"]), "nothing reaches an engine before it opens"
    assert sorted(digested) == sorted(source), "each slot digested once"
    expected = {n: facade.weights_checker_hash(t.view(torch.uint8)) for n, t in source.items()}
    assert result.checksums == {("http://e", 0, "target"): expected}
    assert result.digests == {("http://e", 0, "target"): {n: digest(t) for n, t in source.items()}}
