"""p2pweights' WeightTransferProtocol driven by miles' own WeightUpdater, into local engines.

miles' ``protocol.py``, ``updater.py`` and ``sync_session.py`` run as they are, from
tests/fixtures/miles-protocol (ORIGIN.md: Proximal-Labs/miles ``44f6bec`` for
``protocol.py``, sii-avalanche/miles ``4d412b5`` for the other two; both forks of
radixark/miles after PR 2752). ``_miles_main.STUBS`` lists what is stubbed and why:
Megatron's gathers and HF conversion, its global args and parallel state, miles' HTTP
pool. miles' own ``get_weight_transfer_protocol`` loads p2pweights' factory from
``--custom-weight-transfer-protocol-path``; the transport comes from
``P2PWEIGHTS_MILES_TRANSPORT`` / ``P2PWEIGHTS_MILES_HOSTNAME``, as the docs say.

The trainer ranks are separate processes (gloo). After every update each engine rank
must be bit-exact with sglang's own loading of the same checkpoint and show miles'
weight version.
"""

from __future__ import annotations

import os
import time
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

MILES_PROTOCOL = ("Proximal-Labs/miles", "44f6bec349099f9b797de561af84be530c4c1a12")
MILES_UPDATER = ("sii-avalanche/miles", "4d412b5aca323b49cd414dadb10d7ae1742ec637")
BUCKET_BYTES = 256 * 2**10  # below the staging buffer's 1 MiB floor: miles accepts it


def _stage_of(name: str, num_stages: int) -> int:
    if num_stages == 1:
        return 0
    return 0 if name.startswith(("model.embed_tokens.", "model.layers.0.")) else 1


def _trainer(
    rank, world, num_stages, port, engines, folder, seeds, out, gos, counts=True, variant=None
) -> None:
    """One miles trainer rank; ``counts=False``: miles passes no engine GPU counts (every
    rank sends, for the benchmark of that choice); ``variant``: whose ``protocol.py``."""
    os.environ["P2PWEIGHTS_MILES_TRANSPORT"] = "mooncake-tcp"
    os.environ["P2PWEIGHTS_MILES_HOSTNAME"] = "127.0.0.1"
    dist_init = f"tcp://127.0.0.1:{port}"
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=dist_init, rank=rank, world_size=world)
    import _miles_main

    updater_module = _miles_main.load(variant or "proximal-44f6bec")
    stage = rank // (world // num_stages)
    model: dict[str, torch.Tensor] = {}
    args = Namespace(
        custom_weight_transfer_protocol_path="p2pweights.integrations.miles_protocol.build_protocol",
        update_weight_transfer_mode="external",
        colocate=False,
        update_weight_buffer_size=BUCKET_BYTES,
        p2p_transfer_timeout=10.0,
        pause_generation_mode="retract",
        check_lora_weight_equal=False,
    )
    updater = updater_module.WeightUpdater(
        args,
        [],
        weights_getter=lambda: model,
        model_name="qwen3",
        quantization_config=None,
        iterator_factory=_miles_main.HfWeightIterator,
        parallel_state=_miles_main.ParallelState(pp=_miles_main.GroupInfo(stage, num_stages)),
        is_lora=False,
    )
    clients = [_miles_main.SGLangApiClient(url) for url, _ in engines]
    updater.connect_rollout_engines(
        clients,
        engine_gpu_counts=[tp for _, tp in engines] if counts else None,
        engine_gpu_offsets=[sum(tp for _, tp in engines[:i]) for i in range(len(engines))],
    )
    protocol = updater.protocol
    try:
        for index, seed in enumerate(seeds):
            model.clear()
            model.update(
                (name, tensor)
                for name, tensor in synthetic_weights(folder, seed=seed, dtype=torch.bfloat16)
                if _stage_of(name, num_stages) == stage
            )
            started = time.perf_counter()
            updater.update_weights()
            wall_s = time.perf_counter() - started
            info = (type(protocol).__name__, protocol.is_sender, updater.weight_version, wall_s)
            iterator = updater._hf_weight_iterator
            out.put((index, rank, info, updater.pop_metrics(), iterator.materialized))
            gos[index].wait(timeout=240)  # the test checks the engines in between
    finally:
        protocol.close()
        dist.destroy_process_group()


def _run(folder, engines, *, world, num_stages, seeds, check, counts=True, variant=None):
    ctx = warm_context()
    out = ctx.Queue()
    gos = [ctx.Event() for _ in seeds]
    layout = [(e.url, e.tp) for e in engines]
    args = (world, num_stages, free_port(), layout, str(folder), seeds, out, gos)
    trainers = [
        ctx.Process(
            target=_trainer, args=(rank, *args), kwargs={"counts": counts, "variant": variant}
        )
        for rank in range(world)
    ]
    run_in_lockstep(trainers, out, gos, check)


@pytest.fixture(params=["proximal-44f6bec", "radixark-78669cf9"])
def variant(request) -> str:
    """Whose ``protocol.py`` miles' updater loads p2pweights through (ORIGIN.md): the
    factory that loads ``--custom-weight-transfer-protocol-path`` before any mode, or
    radixark's ``external`` mode through ``resolve_external_protocol_target``."""
    import _miles_main

    if not _miles_main.available(request.param):
        pytest.skip(
            f"miles' own files for {request.param} are not in "
            "tests/fixtures/miles-protocol/upstream (ORIGIN.md says where to get them)"
        )
    return request.param


@pytest.fixture
def engines(model_dir, shared_engines, variant):
    folder = model_dir("qwen3-tiny")
    return folder, shared_engines(folder, [2, 1], seed=0), variant


def _assert_updated(results, engines, folder, seed, version, senders):
    for _, rank, (kind, is_sender, weight_version, _), metrics, materialized in results:
        assert kind == "P2PWeightsProtocol"
        assert weight_version == version
        assert is_sender == (rank in senders), rank
        assert (materialized > 0) == is_sender  # only senders convert
        assert (metrics.get("perf/update_weights_p2pweights_seconds", 0) > 0) == is_sender
    assert_bit_exact(engines, folder, seed)
    for engine in engines:
        assert EngineClient(engine.url).weight_version() == str(version)


@pytest.mark.slow
def test_miles_updater_drives_four_ranks_one_idle_into_tp2_and_tp1_bit_exact(engines):
    """One pipeline stage of four ranks, three engine ranks: ranks 0-2 send (each writes
    its share), rank 3 joins miles' loop but converts and sends nothing. Two updates."""
    folder, started, variant = engines
    seeds = [63, 64]

    def check(index, results):
        _assert_updated(results, started, folder, seeds[index], index + 1, senders={0, 1, 2})

    _run(folder, started, world=4, num_stages=1, seeds=seeds, check=check, variant=variant)


def test_miles_updater_drives_two_pipeline_stages_bit_exact(engines):
    """Two pipeline stages of one rank each (miles' gather_pp=False placement): each
    stage writes its own parameters to every engine rank. Two updates."""
    folder, started, variant = engines
    seeds = [71, 72]

    def check(index, results):
        _assert_updated(results, started, folder, seeds[index], index + 1, senders={0, 1})

    _run(folder, started, world=2, num_stages=2, seeds=seeds, check=check, variant=variant)
