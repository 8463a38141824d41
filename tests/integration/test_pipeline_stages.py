"""Two pipeline stages of two trainer ranks each update engines of TP 1 and TP 2.

Four trainer processes (gloo, CPU) form one ``torch.distributed`` world; ranks 0-1 are
stage 0 (the embedding and layer 0), ranks 2-3 stage 1 (layer 1, the final norm and the
head), as a Megatron pipeline splits a model. ``WeightSyncSession.from_torch_distributed``
makes each stage a sender group: the stage's two ranks split the three engine ranks and
write only the stage's parameters. After every update each engine rank must be bit-exact
with sglang's loader given the whole checkpoint. Then one rank's tensors fail mid-update
(its generator raises): every rank must raise the same error, and the next update must
converge.
"""

from __future__ import annotations

import pytest
import torch
from _bit_exact import assert_bit_exact, next_version
from _procs import warm_context

from p2pweights.engines.client import EngineClient
from p2pweights.local_engine import free_port
from p2pweights.testing import synthetic_weights

pytestmark = pytest.mark.integration

SEEDS = {"whole": 15, "streamed": 16, "failed": 17, "retry": 18}


def _stage_of(name: str) -> int:
    return 0 if name.startswith(("model.embed_tokens.", "model.layers.0.")) else 1


def _stage_weights(folder, seed, stage):
    for name, tensor in synthetic_weights(folder, seed=seed, dtype=torch.bfloat16):
        if _stage_of(name) == stage:
            yield name, tensor


def _failing(tensors):
    for count, pair in enumerate(tensors):
        if count == 3:
            raise RuntimeError("injected: this trainer rank lost its weights mid-update")
        yield pair


def _trainer(rank: int, port: int, urls: list[str], folder: str, gos, out) -> None:
    import torch.distributed as dist

    from p2pweights import MooncakeConfig, SyncConfig, WeightSyncSession

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    stage = rank // 2
    config = SyncConfig(transport=MooncakeConfig(protocol="tcp"), buffer_bytes="1MiB")
    try:
        with WeightSyncSession.from_torch_distributed(
            config, pipeline_stage=stage, num_pipeline_stages=2
        ) as session:
            session.connect(urls)
            mine = (session.topology.rank, session.topology.num_ranks)
            for go, (step, seed) in zip(gos, SEEDS.items(), strict=True):
                tensors = _stage_weights(folder, seed, stage)  # a generator: streamed
                if step == "whole":
                    tensors = list(tensors)
                if step == "failed" and rank == 3:
                    tensors = _failing(tensors)
                try:
                    report = session.update(tensors)
                    result = sorted(report.bytes_by_target)
                except Exception as exc:
                    result = (type(exc).__name__, str(exc))
                out.put((step, rank, mine, result))
                go.wait(timeout=240)  # the test checks the engines in between
    finally:
        dist.destroy_process_group()


def test_two_stages_of_two_ranks_update_tp1_and_tp2_engines(model_dir, shared_engines):
    folder = model_dir("qwen3-tiny")
    engines = shared_engines(folder, [1, 2], seed=0)
    urls = [e.url for e in engines]
    first = next_version(urls)
    targets = sorted((e.url, r) for e in engines for r in range(e.tp))
    ctx = warm_context()
    out = ctx.Queue()
    gos = [ctx.Event() for _ in SEEDS]
    port = free_port()
    trainers = [
        ctx.Process(target=_trainer, args=(rank, port, urls, str(folder), gos, out))
        for rank in range(4)
    ]
    for p in trainers:
        p.start()
    try:
        for index, (step, seed) in enumerate(SEEDS.items()):
            results = sorted(out.get(timeout=240) for _ in trainers)
            assert [r[0] for r in results] == [step] * 4
            # stage s holds ranks 2s and 2s+1, each the stage's trainer rank 0 or 1 of 2
            assert [r[2] for r in results] == [(0, 2), (1, 2), (0, 2), (1, 2)]
            outcomes = [r[3] for r in results]
            if step == "failed":
                assert len(set(outcomes)) == 1, outcomes  # the same error on every rank
                kind, message = outcomes[0]
                assert kind == "P2PWeightsError"
                assert message.startswith("pipeline stage 1 trainer rank 1 failed the 'write'")
                assert "RuntimeError: injected" in message
            else:
                for stage in (0, 1):  # each stage wrote every engine rank once
                    assert sorted(outcomes[2 * stage] + outcomes[2 * stage + 1]) == targets
                assert_bit_exact(engines, folder, seed)
            gos[index].set()
    finally:
        for p in trainers:
            p.join(timeout=60)
    assert [p.exitcode for p in trainers] == [0, 0, 0, 0]
    for engine in engines:  # the retry completed the version the failed update opened
        assert EngineClient(engine.url).weight_version() == str(first + 2)
