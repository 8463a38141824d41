"""Two trainer processes share the engine ranks: each target has exactly one writer.

Both trainer ranks hold the same HF weights (as after a Megatron all-gather). The
plan gives each one engine rank of a TP 2 engine; trainer rank 0 drives the
engine's update session and ``agree`` (an all-reduce of ok flags, here over a
multiprocessing barrier) keeps rank 1's writes inside it.
"""

from __future__ import annotations

import pytest
import torch
from _bit_exact import assert_bit_exact, engine_mismatches, next_version
from _procs import warm_context

from p2pweights.engines.client import EngineClient
from p2pweights.testing import synthetic_weights

pytestmark = pytest.mark.integration


def _agree_over(barrier, flags, rank):
    def agree(ok: bool) -> bool:
        flags[rank] = int(ok)
        barrier.wait(timeout=120)
        everyone = all(flags)
        barrier.wait(timeout=120)  # nobody overwrites a flag before all have read them
        return everyone

    return agree


def _trainer(rank: int, url: str, folder: str, barrier, flags, results, seeds) -> None:
    from p2pweights import MooncakeConfig, SyncConfig, TrainerTopology, WeightSyncSession
    from p2pweights.source import fp8_fused

    fp8_fused.poison_unset = True  # blocks left out of a box are NaN: a read of one shows

    config = SyncConfig(transport=MooncakeConfig(protocol="tcp"), buffer_bytes="1MiB")
    agree = _agree_over(barrier, flags, rank)
    topology = TrainerTopology(rank=rank, num_ranks=2)
    with WeightSyncSession(config, topology=topology, agree=agree) as session:
        session.connect([url])
        for seed in seeds:
            weights = list(synthetic_weights(folder, seed=seed, dtype=torch.bfloat16))
            report = session.update(weights)
            regions = (
                session._connection.prepared.source.regions
                if session._connection.prepared is not None
                else 0
            )
            results.put((rank, seed, report.version, sorted(report.bytes_by_target), regions))


def _run_trainers(url: str, folder, seeds: tuple[int, ...], timeout_s: float) -> list[tuple]:
    """Two trainer processes updating ``url`` with each seed's weights; their reports,
    sorted: (rank, seed, version, targets written, fp8 weights quantized in boxes)."""
    ctx = warm_context()
    barrier, flags, results = ctx.Barrier(2), ctx.Array("i", 2), ctx.Queue()
    trainers = [
        ctx.Process(target=_trainer, args=(r, url, str(folder), barrier, flags, results, seeds))
        for r in range(2)
    ]
    for p in trainers:
        p.start()
    for p in trainers:
        p.join(timeout=timeout_s)
    assert [p.exitcode for p in trainers] == [0, 0]
    return sorted(results.get(timeout=5) for _ in range(2 * len(seeds)))


def test_two_trainer_ranks_split_the_engine_ranks(model_dir, shared_engines):
    folder = model_dir("qwen3-tiny")
    (engine,) = shared_engines(folder, [2], seed=0)
    first = next_version([engine.url])
    reports = _run_trainers(engine.url, folder, (21, 22), timeout_s=300)
    # each trainer rank wrote exactly one engine rank, the two together both ranks, every update
    written = {seed: [] for seed in (21, 22)}
    for _rank, seed, version, targets, _regions in reports:
        assert len(targets) == 1
        written[seed] += targets
        assert version == str(first + {21: 0, 22: 1}[seed])
    for targets in written.values():
        assert sorted(targets) == [(engine.url, 0), (engine.url, 1)]
    assert EngineClient(engine.url).weight_version() == str(first + 1)
    mismatches = engine_mismatches(
        engine.url, lambda: list(synthetic_weights(folder, seed=22, dtype=torch.bfloat16))
    )
    assert mismatches == {0: [], 1: []}


def test_fp8_senders_quantize_only_what_their_rank_reads(model_dir, start_engines):
    """A TP 2 fp8 engine without expert parallelism, one trainer rank per engine rank:
    each rank's loaders read half of every expert weight. From the third update on (the
    first records the loaders' copies, the second confirms them) each sender quantizes
    only the blocks those copies read (the others NaN here); every rank stays bit-exact
    with sglang's loader fed the whole quantized checkpoint."""
    folder = model_dir("deepseek-v3-fp8-tiny")
    (engine,) = start_engines(folder, [2], seed=0)
    reports = _run_trainers(engine.url, folder, (31, 32, 33, 34), timeout_s=600)
    regions = {(rank, seed): count for rank, seed, _, _, count in reports}
    for rank in (0, 1):
        assert regions[(rank, 31)] == 0  # recorded: nothing known yet
        assert regions[(rank, 33)] > 0 and regions[(rank, 34)] == regions[(rank, 33)]
    assert_bit_exact([engine], folder, 34)
