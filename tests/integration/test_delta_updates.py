"""Delta updates between real processes: local engines over real Mooncake and NIXL,
sglang's own model code, every update checked bit-exact against sglang's own
``load_weights`` of the same tensors (and by the engines' write digests).

The trainer's tensors change as an optimizer step changes them: fp32 master weights
moved a little, cast to bf16, so a few percent of the bf16 values differ per update.
Most tests send deltas whatever they cost (``DeltaConfig(mode="always")``); one checks
that what ``mode="auto"`` decides lands bit-exact too, on an engine other tests used (the
engines come from the run's pool: a session's first update is full whatever they held).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from _bit_exact import engine_mismatches, seed_weights
from _procs import ForkedEngine

from p2pweights import MooncakeConfig, NixlConfig, SyncConfig, TransferError, WeightSyncSession
from p2pweights.config import DeltaConfig
from p2pweights.delta.policy import DeltaPolicy
from p2pweights.local_engine import LocalEngine

pytestmark = pytest.mark.integration

TRANSPORTS = {
    "mooncake": MooncakeConfig(protocol="tcp", local_hostname="127.0.0.1"),
    "nixl": NixlConfig(backend="UCX"),
}


class _Trainer:
    """fp32 master weights; each ``step`` moves them as a small optimizer step does and
    returns the bf16 tensors a trainer sends."""

    def __init__(self, folder: Path, seed: int) -> None:
        self.master = {name: t.float() for name, t in seed_weights(folder, seed)}
        self.generator = torch.Generator().manual_seed(seed)

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [(name, t.to(torch.bfloat16)) for name, t in self.master.items()]

    def step(self, lr: float = 1e-6) -> list[tuple[str, torch.Tensor]]:
        for t in self.master.values():  # Adam's first steps move each weight by about lr
            noise = torch.randn(t.shape, generator=self.generator)
            t.add_(torch.sign(noise), alpha=-lr)
        return self.tensors()


def _bit_exact(engines: list[LocalEngine], tensors: list[tuple[str, torch.Tensor]]) -> None:
    for engine in engines:
        assert engine_mismatches(engine.url, lambda: tensors) == {r: [] for r in range(engine.tp)}


def _sent(report, engine: LocalEngine) -> int:
    return sum(n for (url, _), n in report.bytes_by_target.items() if url == engine.url)


ALWAYS = DeltaConfig(mode="always")


@pytest.mark.parametrize("kind", list(TRANSPORTS))
def test_deltas_over_several_updates_are_bit_exact(kind, model_dir, shared_engines):
    folder = model_dir("qwen3-tiny")
    (engine,) = shared_engines(folder, [2], transport=kind, seed=0)
    config = SyncConfig(transport=TRANSPORTS[kind], buffer_bytes="1MiB", delta=ALWAYS)
    trainer = _Trainer(folder, seed=101)
    with WeightSyncSession(config) as session:
        session.connect([engine.url])
        full = _sent(session.update(trainer.tensors()), engine)  # nothing to compare with
        _bit_exact([engine], trainer.tensors())
        for _ in range(3):
            tensors = trainer.step()
            report = session.update(tensors)
            assert 0 < _sent(report, engine) < full / 4, (_sent(report, engine), full)
            assert report.delta is not None and report.delta.num_delta_params > 0
            assert report.delta.sent_bytes == _sent(report, engine) < report.delta.full_bytes
            assert report.engines[engine.url].verified_by == ("write_digests",)
            assert "as deltas" in report.summary() and " 0.00 GB/s" not in report.summary()
            _bit_exact([engine], tensors)


def test_a_failed_update_is_followed_by_a_full_one(model_dir, shared_engines):
    """A byte changed in the engine after the writes fails the update (write digests);
    the next update must not send a delta against bytes the engine does not hold."""
    folder = model_dir("qwen3-tiny")
    (engine,) = shared_engines(folder, [1], transport="mooncake", seed=0)
    config = SyncConfig(transport=TRANSPORTS["mooncake"], buffer_bytes="1MiB", delta=ALWAYS)
    trainer = _Trainer(folder, seed=103)
    param = "model.layers.1.mlp.down_proj.weight"
    with WeightSyncSession(config) as session:
        session.connect([engine.url])
        full = _sent(session.update(trainer.tensors()), engine)
        assert _sent(session.update(trainer.step()), engine) < full / 4
        answer = httpx.post(
            f"{engine.url}/p2pweights/corrupt_at_end", json={"rank": 0, "param": param}
        )
        assert answer.status_code == 200
        with pytest.raises(TransferError, match=param):
            session.update(trainer.step())
        tensors = trainer.step()
        report = session.update(tensors)
        assert _sent(report, engine) >= full  # written whole (and its header)
        _bit_exact([engine], tensors)
        assert _sent(session.update(trainer.step()), engine) < full / 4  # deltas again


def test_an_engine_restarted_between_updates_gets_full_writes(
    model_dir, shared_engines, start_engines
):
    """The restarted engine has another shard layout than the kept one: ranks sharing a
    layout share staged bytes, and take a slot as a delta only together."""
    folder = model_dir("qwen3-tiny")
    (restarted,) = start_engines(folder, [1], transport="nixl", seed=0, wait=False)
    (kept,) = shared_engines(folder, [2], transport="nixl", seed=0)
    restarted.wait_ready()
    config = SyncConfig(transport=TRANSPORTS["nixl"], buffer_bytes="1MiB", delta=ALWAYS)
    trainer = _Trainer(folder, seed=104)
    with WeightSyncSession(config) as session:
        session.connect([kept.url, restarted.url])
        first = session.update(trainer.tensors())
        full, full_restarted = _sent(first, kept), _sent(first, restarted)
        session.update(trainer.step())
        restarted.stop()
        again = ForkedEngine(folder, tp=1, transport="nixl", seed=0, port=restarted.port)
        start_engines.started.append(again)
        again.start().wait_ready()
        assert again.url == restarted.url
        session.connect([kept.url, again.url])
        tensors = trainer.step()
        report = session.update(tensors)
        assert _sent(report, kept) < full / 4
        assert _sent(report, again) >= full_restarted  # seed weights: a delta would be wrong
        _bit_exact([kept, again], tensors)


class _FullOnceMeasured(DeltaPolicy):
    """Full predicted faster as soon as a delta was measured; a probe every 2 full updates
    (real costs on this machine would make the test depend on its load)."""

    def __init__(self, mode, **kwargs):
        super().__init__(mode, probe_after=2, **kwargs)

    def predict(self):
        return None if super().predict() is None else (1.0, 0.5)


def test_auto_sends_in_full_without_a_copy_and_probes_deltas_bit_exact(
    model_dir, shared_engines, monkeypatch
):
    """Every kind of update auto makes against a real engine, each checked bit-exact: the
    first (full, a copy kept), a delta measuring its cost, full without a copy (the
    engine's next delta would be refused against it), full keeping a copy, the probe."""
    monkeypatch.setattr("p2pweights.delta.sender.DeltaPolicy", _FullOnceMeasured)
    folder = model_dir("qwen3-tiny")
    (engine,) = shared_engines(folder, [2], transport="mooncake", seed=0)
    config = SyncConfig(transport=TRANSPORTS["mooncake"], buffer_bytes="1MiB", delta=DeltaConfig())
    trainer = _Trainer(folder, seed=102)
    seen = []
    with WeightSyncSession(config) as session:
        session.connect([engine.url])
        tensors = trainer.tensors()
        for _ in range(6):
            report = session.update(tensors)
            _bit_exact([engine], tensors)
            assert report.delta is not None
            decision = session._last_attempt.last_run.delta.decision
            seen.append((decision.mode, decision.keep_copy))
            said = "as a delta" if decision.mode == "delta" else "in full"
            assert said in report.delta.decision and said in report.summary()
            if decision.mode == "delta":
                assert 0 < report.delta.sent_bytes < report.delta.full_bytes / 4
            else:
                assert report.delta.num_delta_params == 0
                assert report.delta.sent_bytes >= report.delta.full_bytes
            tensors = trainer.step()
    assert seen == [
        ("full", True),
        ("delta", True),
        ("full", False),
        ("full", True),
        ("delta", True),
        ("full", False),
    ]
