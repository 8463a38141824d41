"""Two trainer ranks (gloo, CPU) ask each engine's ``/weights_checker`` once per update.

A TP 2 local engine started with ``P2PWEIGHTS_WRITE_DIGESTS=0`` records no write
digests, so its writes are checked by sglang's own ``/weights_checker`` before its end.
Each trainer rank writes one of its engine ranks. The checker hashes every weight of
the engine on each call: one rank asks it and the other gets its answer over the
session's gather. Every trainer process counts the checksum calls its client makes;
per update the two together make one. One byte written wrong through the transport into
engine rank 1 after the writes fails the update on both trainer ranks, each naming the
engine URL, rank 1 and the parameter; after ``abort()`` the next update is verified
and bit-exact.
"""

from __future__ import annotations

from collections import Counter

import pytest
from _bit_exact import assert_bit_exact, seed_weights
from _procs import gloo_session, warm_context

from p2pweights.engines.update_state import UPDATING_PREFIX
from p2pweights.local_engine import free_port

pytestmark = pytest.mark.integration

PARAM = "model.layers.1.post_attention_layernorm.weight"  # replicated: held as sent
STEPS = {"first": 61, "wrong": 62, "again": 63}


def _trainer(rank, size, port, urls, wrong_url, folder, out, gos) -> None:
    import torch
    from _wrong_byte import write_byte

    from p2pweights import update_attempt as update_attempt_module
    from p2pweights.engines.client import EngineClient

    calls: Counter[str] = Counter()
    asked = EngineClient.weights_checker

    def counted(self, action, **options):  # type: ignore[no-untyped-def]
        if action == "checksum":
            calls[self.url] += 1
        return asked(self, action, **options)

    EngineClient.weights_checker = counted  # type: ignore[method-assign]
    checked = update_attempt_module.UpdateAttempt._verify_before_end

    with gloo_session(rank, size, port, urls) as session:
        written = sorted(
            (pub.engine_url, pub.engine_rank)
            for pubs in session._connection.targets.values()
            for pub in pubs
        )
        writes_it = (wrong_url, 1) in written
        for go, (step, seed) in zip(gos, STEPS.items(), strict=True):
            weights = seed_weights(folder, seed)
            if step == "wrong" and writes_it:  # after every rank's writes, before the check
                sent = dict(weights)[PARAM].reshape(-1).view(torch.uint8)
                value = int(sent[0]) ^ 0x01

                def corrupted(self, result, value=value):  # type: ignore[no-untyped-def]
                    write_byte(session, wrong_url, 1, PARAM, value)
                    return checked(self, result)

                update_attempt_module.UpdateAttempt._verify_before_end = corrupted  # type: ignore[method-assign]
            try:
                report = session.update(weights)
                result = {url: report.engines[url].verified_by for url in urls}
            except Exception as exc:
                # what the failure left the engine in, then what abort() says of it
                version = EngineClient(wrong_url).weight_version()
                left_paused = list(session.abort().left_paused)
                result = (type(exc).__name__, str(exc), version, left_paused)
            finally:
                update_attempt_module.UpdateAttempt._verify_before_end = checked  # type: ignore[method-assign]
            out.put((step, rank, written, result, dict(calls)))
            calls.clear()
            go.wait(timeout=300)


def test_two_trainer_ranks_ask_each_checker_once_and_both_fail_on_a_wrong_byte(
    model_dir, shared_engines
):
    folder = model_dir("qwen3-tiny")
    engines = shared_engines(folder, [2], seed=0, env={"P2PWEIGHTS_WRITE_DIGESTS": "0"})
    urls = [e.url for e in engines]
    wrong_url = engines[0].url
    size = 2
    ctx = warm_context()
    out = ctx.Queue()
    gos = [ctx.Event() for _ in STEPS]
    port = free_port()
    trainers = [
        ctx.Process(
            target=_trainer,
            args=(rank, size, port, urls, wrong_url, str(folder), out, gos),
        )
        for rank in range(size)
    ]
    for p in trainers:
        p.start()
    try:
        for go, step in zip(gos, STEPS, strict=True):
            seen = {}
            for _ in range(size):
                got_step, rank, written, result, calls = out.get(timeout=300)
                assert got_step == step
                seen[rank] = (written, result, calls)
            # each trainer rank wrote one engine rank of the engine
            assert sorted(w for written, _, _ in seen.values() for w in written) == [
                (wrong_url, 0),
                (wrong_url, 1),
            ]
            # one checksum call, by the two ranks together
            total = sum((Counter(calls) for _, _, calls in seen.values()), Counter())
            assert total == {url: 1 for url in urls}, (step, seen)
            if step == "wrong":
                for rank, (_, result, _) in seen.items():
                    assert isinstance(result, tuple), (rank, result)
                    kind, message, version, left_paused = result
                    assert kind == "TransferError", message
                    # never resumed with bytes nobody verified: still paused at the marker
                    assert version == f"{UPDATING_PREFIX}2", (rank, version)
                    if rank == 0:  # the leader drives the engines' sessions
                        assert left_paused == [wrong_url], left_paused
                    assert f"engine {wrong_url} rank 1" in message and PARAM in message, message
                    assert "/weights_checker" in message
            else:
                for rank, (_, result, _) in seen.items():
                    assert result == {url: ("weights_checker",) for url in urls}, (rank, result)
            go.set()
    finally:
        for p in trainers:
            p.join(timeout=120 if all(go.is_set() for go in gos) else 5)
            if p.is_alive():  # a failed assertion left it waiting for its next step
                p.kill()
    assert [p.exitcode for p in trainers] == [0, 0]
    assert_bit_exact(engines, folder, STEPS["again"])
