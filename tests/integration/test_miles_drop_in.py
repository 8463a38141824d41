"""p2pweights.integrations.miles driven as miles drives its updater, into local engines.

The driver is a test double of miles written from radixark/miles at
31f1ca961a94cb860cec3b2dea34ec332bfa8f76 (``_miles_double.py`` says what it keeps and
what it simplifies): its actor runs the ``--custom-megatron-init-path`` hook (here
``install(args, config=...)``), picks the updater class for
``--update-weight-transfer-mode p2p`` and calls ``connect_rollout_engines`` /
``update_weights`` / ``pop_metrics`` as miles' actor does; its bucketed mixin is the base
class of the updater and hands it buckets as miles' gathers do. The trainer ranks are
separate processes (gloo), as miles' Megatron ranks are. After every update each engine
rank must be bit-exact with sglang's own loading of the same checkpoint, its weight
version miles' ``weight_version``.
"""

from __future__ import annotations

import os
import signal
from argparse import Namespace

import pytest
import torch
from _bit_exact import assert_bit_exact
from _lockstep import run_in_lockstep
from _procs import warm_context

from p2pweights.engines.client import EngineClient
from p2pweights.local_engine import free_port
from p2pweights.testing import synthetic_weights

pytestmark = pytest.mark.integration

BUCKET_BYTES = 256 * 2**10  # miles' --update-weight-buffer-size: a dozen buckets or more
KILL_AT_BUCKET = 8  # past the first 1 MiB staging buffer: the engines are open by then


def _install_p2pweights(args: Namespace) -> None:
    """The ``--custom-megatron-init-path`` function: p2pweights with a transport for one
    host (miles' flags fill the rest; buffer_bytes set here wins over the bucket size)."""
    from p2pweights import MooncakeConfig, SyncConfig
    from p2pweights.integrations.miles import install

    install(args, config=SyncConfig(transport=MooncakeConfig(protocol="tcp"), buffer_bytes="1MiB"))


def _stage_of(name: str, num_stages: int) -> int:
    if num_stages == 1:
        return 0
    return 0 if name.startswith(("model.embed_tokens.", "model.layers.0.")) else 1


def _kill_at(pid: int, index: int):
    def on_bucket(bucket: int) -> None:
        if bucket == index:
            os.killpg(pid, signal.SIGKILL)

    return on_bucket


def _trainer(rank, world, num_stages, port, urls, folder, seeds, victim, out, gos) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    import _miles_double

    stage = rank // (world // num_stages)
    _miles_double.register(stage, num_stages)
    model: list[tuple[str, torch.Tensor]] = []
    args = Namespace(
        custom_megatron_init_path=f"{__name__}._install_p2pweights",
        update_weight_transfer_mode="p2p",
        update_weight_buffer_size=BUCKET_BYTES,
        p2p_transfer_timeout=10.0,
        pause_generation_mode="retract",
        verify_with_weight_checker=False,
        on_bucket=None,
    )
    actor = _miles_double.MegatronTrainRayActor(model)
    actor.init(args)
    updater = actor.weight_updater
    engines = [_miles_double.EngineActor(url) for url in urls]
    try:
        for index, seed in enumerate(seeds):
            model[:] = [  # the trained weights, in place (miles' parameters)
                (name, tensor)
                for name, tensor in synthetic_weights(folder, seed=seed, dtype=torch.bfloat16)
                if _stage_of(name, num_stages) == stage
            ]
            if victim is not None and index == len(seeds) - 1 and rank == 0:
                args.on_bucket = _kill_at(victim, KILL_AT_BUCKET)
            info = _miles_double.EnginesAndLock(engines, None, index == 0, [], [])
            try:
                actor.update_weights(info)
                result = ("ok", actor.end_of_train_step())
            except Exception as exc:
                result = (type(exc).__name__, str(exc))
            out.put(
                (
                    index,
                    rank,
                    result,
                    updater.__dict__.pop("calls", []),
                    updater.__dict__.get("miles_engine_calls", []),
                    (updater.session.config.pipeline_stage, updater.session.config.trainer_rank),
                    updater.weight_version,
                )
            )
            gos[index].wait(timeout=240)  # the test checks the engines in between
    finally:
        updater.session.close()
        dist.destroy_process_group()


def _run(folder, engines, *, world, num_stages, seeds, check, victim=None):
    """Start ``world`` trainer processes; after each update, gather their results (by
    rank), call ``check(index, results)`` and let them go on."""
    ctx = warm_context()
    out = ctx.Queue()
    gos = [ctx.Event() for _ in seeds]
    urls = [e.url for e in engines]
    port = free_port()
    args = (world, num_stages, port, urls, str(folder), seeds, victim, out, gos)
    trainers = [ctx.Process(target=_trainer, args=(rank, *args)) for rank in range(world)]
    run_in_lockstep(trainers, out, gos, check)


def _assert_updated(results, engines, folder, seed, version):
    for _, rank, result, calls, miles_engine_calls, _, weight_version in results:
        assert result[0] == "ok", (rank, result)
        assert miles_engine_calls == []  # p2pweights paused and resumed the engines
        assert weight_version == version
        assert calls[-2:] == ["finalize", "finalized"]
        assert [c for c in calls if c.startswith("send")] != []
    metrics = [r[2][1] for r in results]
    assert all(m["perf/update_weights_p2pweights_seconds"] > 0 for m in metrics)
    assert sum(m["perf/update_weights_p2pweights_bytes"] for m in metrics) > 0
    assert_bit_exact(engines, folder, seed)
    for engine in engines:
        assert EngineClient(engine.url).weight_version() == str(version)


def test_one_sender_group_of_two_ranks_streams_miles_buckets_bit_exact(model_dir, shared_engines):
    """Two ranks of one pipeline stage (TP 2 after miles' gathers): dense and expert
    buckets, a first update and a streamed one, into a TP 2 EP 2 engine and a TP 1 one."""
    folder = model_dir("qwen3-moe-tiny")
    engines = shared_engines(folder, [(2, {"ep_size": 2}), 1], seed=0)
    seeds = [33, 34]

    def check(index, results):
        assert [r[5] for r in results] == [(0, 0), (0, 1)]  # one group: trainer ranks 0, 1
        _assert_updated(results, engines, folder, seeds[index], index + 1)

    _run(folder, engines, world=2, num_stages=1, seeds=seeds, check=check)


def test_two_pipeline_stages_each_its_own_sender_group_bit_exact(model_dir, shared_engines):
    folder = model_dir("qwen3-tiny")
    engines = shared_engines(folder, [2], seed=0)
    seeds = [41, 42]

    def check(index, results):
        assert [r[5] for r in results] == [(0, 0), (1, 0)]  # stage 0 and stage 1, alone
        _assert_updated(results, engines, folder, seeds[index], index + 1)

    _run(folder, engines, world=2, num_stages=2, seeds=seeds, check=check)


@pytest.mark.parametrize("world", [1, 2], ids=["one-rank", "two-ranks"])
def test_a_failed_engine_surfaces_from_the_miles_call_running(world, model_dir, start_engines):
    """The engine is killed before bucket 8 of the second update is handed over: the
    update's error names the engine and is raised by that hand-over, a later one or the
    finalize, and no miles call follows it. With two ranks (one sender group) both read
    the update to its end and raise the same error from the finalize."""
    folder = model_dir("qwen3-tiny")
    (victim,) = start_engines(folder, [world], seed=0)
    seeds = [51, 52]

    def check(index, results):
        if index == 0:
            _assert_updated(results, [victim], folder, seeds[0], 1)
            return
        for _, _, (kind, message), calls, _, _, _ in results:
            # a write to it failed, or (had the engine died before the pause) the pause's
            # reachability check; both raised before any miles call returned after it
            assert kind in ("TransferError", "EngineUnreachable"), (message, calls)
            assert victim.url in message
            # the last call logged is the one that raised (it never logged its return)
            last = calls[-1]
            assert last == "finalize" or (
                last.startswith("send ") and int(last[5:]) >= KILL_AT_BUCKET
            ), calls
            assert f"send {KILL_AT_BUCKET}" in calls
        if world > 1:
            assert len({r[2] for r in results}) == 1  # the same error on every rank
            assert all(r[3][-1] == "finalize" for r in results)

    _run(folder, [victim], world=world, num_stages=1, seeds=seeds, victim=victim.pid, check=check)
