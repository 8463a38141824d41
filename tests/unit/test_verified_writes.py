"""Verified writes against fake engines that record digests as the local engine and the
plugin do (``p2pweights.engine_side.steps``): a byte changed after the writes fails the update
and leaves that engine torn and paused, abort keeps it so, the next update converges.

The fakes are test_session_sequence's (sglang's update rules, a fake transport that
copies bytes); only the engine's digest record is added here."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from test_session_sequence import (  # the fake engines, client, replica and transport
    FakeClient,
    FakeEngine,
    FakeHandle,
    FakeTransport,
    _holds,
    _tensors,
)

from p2pweights import SyncConfig, TrainerTopology, TransferError, WeightSyncSession
from p2pweights import sync_connection as connection_module
from p2pweights import update_attempt as update_attempt_module
from p2pweights.engine_side.steps import RankSide
from p2pweights.engines import fleet as fleet_module
from p2pweights.engines.update_state import UPDATING_PREFIX
from p2pweights.errors import EngineError
from p2pweights.plan import prepare as prepare_module
from p2pweights.wire.digest import SCHEME
from p2pweights.wire.publication import end_records


@dataclass
class DigestEngine(FakeEngine):
    """A fake engine whose rank records digests around its update session."""

    side: RankSide | None = None
    scheme: str = SCHEME
    """The digest scheme the engine says it records with (another release's: not ours)."""
    corrupt_at_end: str | None = None
    """A parameter one byte of which changes after the writes, before the digest (one-shot)."""
    record: dict | None = None

    def begin(self) -> None:
        super().begin()
        self.side = self.side or RankSide(0, write_digests=True)
        self.record = self.side.after_begin() | {"weight_version": self.version}

    def end(self) -> None:
        if self.open and self.corrupt_at_end is not None:
            self.memory[self.corrupt_at_end][100] ^= 1
            self.corrupt_at_end = None
        if self.open:
            assert self.side is not None
            self.record = self.side.before_end(self.memory) | {"weight_version": self.version}
        super().end()


class DigestClient(FakeClient):
    def server_info(self):
        return {
            **super().server_info(),
            "p2pweights_write_digests": True,
            "p2pweights_digest_scheme": self.engine.scheme,
        }

    def write_digests(self, rank, runner="target", bootstrap_port=None):
        return self.engine.call("digests", lambda: dict(self.engine.record or {}))


class CarryingClient(DigestClient):
    """Answers its end with the rank's record, as the local engine does; ``stuck`` keeps
    answering with the first record that had digests (an engine that stopped renewing it)."""

    stuck: dict | None = None

    def end_weight_update(self):
        super().end_weight_update()
        record = dict(self.engine.record or {})
        if getattr(self.engine, "stuck", False):
            CarryingClient.stuck = CarryingClient.stuck or record
            record = CarryingClient.stuck
        return end_records([{"rank": 0, "runner": "target", "record": record}])


@pytest.fixture
def engines(monkeypatch):
    engines: dict[str, FakeEngine] = {}

    def client_for(url, **kwargs):
        engine = engines.setdefault(url, DigestEngine(url))
        if not isinstance(engine, DigestEngine):
            return FakeClient(engine)
        return (CarryingClient if url.startswith("http://carry") else DigestClient)(engine)

    monkeypatch.setattr(fleet_module, "EngineClient", client_for)
    monkeypatch.setattr(connection_module, "replica_for", lambda *a: FakeHandle())
    monkeypatch.setattr(
        connection_module, "create_transport", lambda config: FakeTransport(engines)
    )
    monkeypatch.setattr(
        update_attempt_module, "check_against_checkpoints", lambda specs, expected: None
    )
    monkeypatch.setattr(prepare_module, "config_path", lambda info, path: Path("/x/config.json"))
    monkeypatch.setattr(prepare_module, "expected_checkpoint", lambda folder: None)
    monkeypatch.setattr(fleet_module, "check_sglang_version", lambda *a: None)
    return engines


CONFIG = SyncConfig(buffer_bytes="1MiB")


def test_verified_by_default_and_the_report_says_what_it_cost(engines):
    assert SyncConfig().verify_writes == "auto"
    with WeightSyncSession(CONFIG) as session:
        session.connect(["http://e0"])
        report = session.update(_tensors(5))
    engine = engines["http://e0"]
    # read twice: when the session's first update opened (its number) and after the end
    assert engine.events.count("digests") == 2 and _holds(engine, 5) and engine.running
    assert {"digest", "verify_writes", "engine_digest"} <= report.stage_seconds.keys()


def test_a_byte_changed_after_the_writes_fails_the_update_and_leaves_that_engine_torn(engines):
    bad = engines.setdefault("http://bad", DigestEngine("http://bad", corrupt_at_end="o"))
    good = engines.setdefault("http://good", DigestEngine("http://good"))
    with WeightSyncSession(CONFIG) as session:
        session.connect(["http://bad", "http://good"])
        with pytest.raises(TransferError, match=r"engine http://bad rank 0: 1 of 2 .*'o'"):
            session.update(_tensors(3))
        assert bad.paused and bad.version == f"{UPDATING_PREFIX}1" and not bad.open
        report = session.abort()
        assert report.left_paused == ["http://bad"]
        assert bad.paused and bad.version == f"{UPDATING_PREFIX}1"
        assert good.running and good.version == "1" and _holds(good, 3)
        session.update(_tensors(4))  # the retry rewrites it whole, verifies and resumes it
    assert bad.running and _holds(bad, 4) and bad.version == good.version
    assert bad.violations == [] and good.violations == []


def test_records_carried_by_the_end_answer_are_compared_without_a_read(engines):
    """The local engine answers its end with every rank's record: the trainer that ended
    the session reads none after it (only once the first update's sessions opened, to
    learn the records' numbers), and a byte changed after the writes still fails it."""
    carry = engines.setdefault("http://carry", DigestEngine("http://carry"))
    with WeightSyncSession(CONFIG) as session:
        session.connect(["http://carry"])
        report = session.update(_tensors(5))
        assert report.engines["http://carry"].verified_by == ("write_digests",)
        carry.corrupt_at_end = "o"
        with pytest.raises(TransferError, match=r"engine http://carry rank 0: 1 of 2 .*'o'"):
            session.update(_tensors(6))
        session.abort()
        session.update(_tensors(7))
    assert carry.events.count("digests") == 1 and carry.running and _holds(carry, 7)


def test_a_carried_record_of_an_earlier_end_is_never_compared(engines, monkeypatch):
    """A record in the end answer is held to the same rule as one read: taken after this
    update's writes (its number grown since the last one compared), else the update fails."""
    carry = engines.setdefault("http://carry", DigestEngine("http://carry"))
    monkeypatch.setattr(CarryingClient, "stuck", None)
    carry.stuck = True  # every end answers with the first end's record, digests and all
    with WeightSyncSession(CONFIG) as session:
        session.connect(["http://carry"])
        session.update(_tensors(1))
        with pytest.raises(TransferError, match=r"stale write digests \(record 1, last read 1\)"):
            session.update(_tensors(1))


def test_a_carried_record_counts_for_the_end_that_carried_it_only(engines):
    """Records carried by an end answer are dropped when the next session begins and
    when the next end is asked: an end without records (sglang's) is read, never
    compared with the last end's records."""
    carry = engines.setdefault("http://carry", DigestEngine("http://carry"))
    with WeightSyncSession(CONFIG) as session:
        session.connect(["http://carry"])
        session.update(_tensors(1))
        (engine,) = session._connection.fleet.engines
        assert engine.update.end_records  # what the last end carried
        reads = carry.events.count("digests")
        engine.client.end_weight_update = lambda: (  # type: ignore[method-assign]
            DigestClient.end_weight_update(engine.client) or {}
        )
        session.update(_tensors(2))
        assert carry.events.count("digests") == reads + 1  # read, not the old carried one
        assert engine.update.end_records == {} and _holds(carry, 2)


def test_a_digest_that_cannot_be_hashed_fails_the_update_and_leaves_the_engine_torn(
    engines, monkeypatch
):
    """The sender hashes its digests on a thread of its own while the engines end: a
    failure there fails the verify step, the engine stays paused and torn through
    ``abort()``, and the next update repairs it."""
    from p2pweights.verification.staged import StagedDigests

    engine = engines.setdefault("http://e0", DigestEngine("http://e0"))
    original = StagedDigests.into

    def broken(self, out):
        raise RuntimeError("the device went away")

    with WeightSyncSession(CONFIG) as session:
        session.connect(["http://e0"])
        session.update(_tensors(1))
        monkeypatch.setattr(StagedDigests, "into", broken)
        with pytest.raises(RuntimeError, match="the device went away"):
            session.update(_tensors(2))
        report = session.abort()
        assert report.left_paused == ["http://e0"]
        assert engine.paused and engine.version == f"{UPDATING_PREFIX}2"
        monkeypatch.setattr(StagedDigests, "into", original)
        repaired = session.update(_tensors(3))
    assert engine.running and _holds(engine, 3) and engine.version == repaired.version


@pytest.mark.parametrize(
    ("listed", "says"),
    [
        ({"rank": 0}, "not a list but dict"),
        (["x"], "entry 0 is str, not an object"),
        ([{"rank": "0", "runner": "target", "record": {}}], "rank '0' is not an int >= 0"),
        ([{"rank": True, "runner": "target", "record": {}}], "rank 'True' is not an int"),
        ([{"rank": -1, "runner": "target", "record": {}}], "rank '-1' is not an int >= 0"),
        ([{"rank": 0, "runner": 3, "record": {}}], "runner int and record dict, expected"),
        ([{"rank": 0, "runner": "target", "record": []}], "runner str and record list"),
        (
            [{"rank": 0, "runner": "target", "record": {"digests": {"p": "x" * 10**5}}}] * 2,
            "rank 0 runner 'target' appears twice",
        ),
    ],
)
def test_records_of_the_wrong_shape_in_an_end_answer_are_refused(listed, says):
    with pytest.raises(ValueError, match=re.escape(says)) as refused:
        end_records(listed)
    assert len(str(refused.value)) < 200  # never the records themselves


def test_digests_of_an_earlier_end_are_never_compared(engines):
    engine = engines.setdefault("http://e0", DigestEngine("http://e0"))
    with WeightSyncSession(CONFIG) as session:
        session.connect(["http://e0"])
        session.update(_tensors(1))
        # the next end records nothing (its before-end step did not run): the record the
        # session reads is the one begin cleared, whatever the bytes hold
        original_end = engine.end
        engine.end = lambda: FakeEngine.end(engine)  # type: ignore[method-assign]
        with pytest.raises(TransferError, match="no write digests for this update"):
            session.update(_tensors(1))
        engine.end = original_end  # type: ignore[method-assign]
        session.update(_tensors(2))
    assert engine.running and _holds(engine, 2)


def test_digests_made_another_way_are_refused_not_compared(engines):
    """An engine on a release whose digest is defined otherwise (before the scheme was
    recorded: the lane sums that could not see reordered bytes) fails the update with
    the reason, not with every parameter reported wrong."""
    engine = engines.setdefault("http://old", DigestEngine("http://old"))
    original_end = engine.end

    def end_of_an_older_release() -> None:
        original_end()
        assert engine.record is not None
        engine.record.pop("digest_scheme")

    engine.end = end_of_an_older_release  # type: ignore[method-assign]
    with WeightSyncSession(CONFIG) as session:
        session.connect(["http://old"])
        refused = r"made another way \('lanes16-v1'; .*one p2pweights release"
        with pytest.raises(TransferError, match=refused):
            session.update(_tensors(2))


def test_an_engine_of_another_digest_scheme_is_not_verified_and_refused_on_always(engines):
    """Told at connect (before, every update was written, failed its check and left the
    engine torn): under "auto" it is reported unverified, saying why; "always" refuses it."""
    engine = engines.setdefault("http://old", DigestEngine("http://old", scheme="lanes16-v1"))
    with WeightSyncSession(CONFIG) as session:
        session.connect(["http://old"])
        report = session.update(_tensors(2))
    assert engine.running and _holds(engine, 2) and "digests" not in engine.events
    assert report.engines["http://old"].verified_by == ()
    assert "made another way ('lanes16-v1'" in (
        report.engines["http://old"].unverified_reason or ""
    )
    with (
        WeightSyncSession(SyncConfig(buffer_bytes="1MiB", verify_writes="always")) as session,
        pytest.raises(EngineError, match=r"http://old: .*made another way"),
    ):
        session.connect(["http://old"])


def test_engines_without_digests_are_skipped_on_auto_and_refused_on_always(engines, caplog):
    caplog.set_level(logging.INFO, logger="p2pweights.verification.check")
    plain = engines.setdefault("http://plain", FakeEngine("http://plain"))
    with WeightSyncSession(CONFIG) as session:
        session.connect(["http://plain"])
        report = session.update(_tensors(2))
    assert _holds(plain, 2) and "digest" not in report.stage_seconds
    assert "records no write digests" in caplog.text
    always = SyncConfig(buffer_bytes="1MiB", verify_writes="always")
    with (
        WeightSyncSession(always) as session,
        pytest.raises(
            EngineError, match="http://plain: its writes cannot be verified: it records no"
        ),
    ):
        session.connect(["http://plain"])
    assert plain.running


def test_off_reads_no_digests(engines):
    engine = engines.setdefault("http://e0", DigestEngine("http://e0", corrupt_at_end="qkv"))
    with WeightSyncSession(SyncConfig(buffer_bytes="1MiB", verify_writes="off")) as session:
        session.connect(["http://e0"])
        session.update(_tensors(2))  # the changed byte goes unnoticed
    assert "digests" not in engine.events and engine.running


def test_another_rank_failing_the_check_leaves_every_checked_engine_torn(engines):
    # rank 0 of two: its own comparisons pass, but another rank's failed (it wrote other
    # engine ranks); rank 0 cannot know which engines those were
    steps: list[bool] = []

    def agree(ok: bool) -> bool:
        steps.append(ok)
        # the input kinds (whole, streamed), prepare, open, write, close, verify_writes
        return ok and len(steps) != 7

    config = SyncConfig(buffer_bytes="1MiB")
    two = TrainerTopology(rank=0, num_ranks=2)
    a = engines.setdefault("http://a", DigestEngine("http://a"))
    b = engines.setdefault("http://b", DigestEngine("http://b"))
    with WeightSyncSession(config, topology=two, agree=agree) as session:
        session.connect(["http://a", "http://b"])
        with pytest.raises(TransferError, match="another trainer rank failed the 'verify_writes'"):
            session.update(_tensors(6))
        assert steps == [True, False] + [True] * 5  # the kinds: whole, not streamed
        report = session.abort()
        assert sorted(report.left_paused) == ["http://a", "http://b"]
        session.update(_tensors(7))  # every rank passes: both resumed
    assert a.running and b.running and _holds(a, 7)  # b is the other rank's to write


def test_the_senders_sums_are_settled_before_any_engine_ends_its_session(engines, monkeypatch):
    """A direct load's sums still run when its copies are done; they must be taken before
    an engine ends its session (its postprocess may rewrite weights in place) and before a
    failed update may unmap its memory: every run settles them as it finishes."""
    from p2pweights.verification.staged import StagedDigests

    engine = engines.setdefault("http://e0", DigestEngine("http://e0"))
    open_at_settle: list[bool] = []
    original = StagedDigests.settle

    def settle(self):
        open_at_settle.append(engine.open)
        original(self)

    monkeypatch.setattr(StagedDigests, "settle", settle)
    with WeightSyncSession(CONFIG) as session:
        session.connect(["http://e0"])
        session.update(_tensors(1))
    assert open_at_settle == [True]
    assert engine.running and _holds(engine, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_direct_loads_sums_run_after_its_copies_on_a_stream_of_their_own():
    """``StagedDigests.add`` (what a direct load left in an engine's memory): the sums read
    what the copies queued before them wrote, on a stream of their own, so that waiting
    for the copies does not wait for the sums; ``settle`` waits for them."""
    from p2pweights.verification.staged import StagedDigests
    from p2pweights.wire.digest import digest

    source = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, device="cuda")
    target = torch.zeros_like(source)
    current = torch.cuda.current_stream()
    torch.cuda._sleep(100_000_000)  # the copy below stays queued behind this
    target.copy_(source)
    staged = StagedDigests()
    staged.add([("w", target, [("http://e0", 0, "main")])])
    assert torch.cuda.current_stream() == current
    assert [stream for _, stream in staged._done] != [current]
    staged.settle()
    assert all(done.query() for done, _ in staged._done)
    found: dict = {}
    staged.into(found)
    assert found == {("http://e0", 0, "main"): {"w": digest(source)}}


@dataclass
class UnrenewedEngine(DigestEngine):
    """Records as the sglang plugin does (no weight version in them); once ``frozen``, its
    PUTs stop reaching the bootstrap server, which keeps serving the last record."""

    frozen: bool = False

    def begin(self) -> None:
        kept = self.record
        super().begin()
        self.record = kept if self.frozen else _without_version(self.record)

    def end(self) -> None:
        kept = self.record
        super().end()
        self.record = kept if self.frozen else _without_version(self.record)


def _without_version(record: dict | None) -> dict | None:
    return None if record is None else {k: v for k, v in record.items() if k != "weight_version"}


def test_the_first_record_a_session_reads_is_not_taken_on_its_number_alone(engines):
    """A new session knows no record number yet: a record an earlier session's update left
    (same bytes, no weight version in it), still served because the engine's PUTs stopped,
    must not pass for this update's (issue 39 item 9)."""
    engine = engines.setdefault("http://e0", UnrenewedEngine("http://e0"))
    with WeightSyncSession(CONFIG) as session:
        session.connect(["http://e0"])
        session.update(_tensors(1))
    engine.frozen = True
    with WeightSyncSession(CONFIG) as session:
        session.connect(["http://e0"])
        with pytest.raises(TransferError, match=r"stale write digests"):
            session.update(_tensors(1))
