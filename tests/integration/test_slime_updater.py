"""p2pweights' slime updater, driven by slime's own ``UpdateWeightFromDistributed``.

Written against THUDM/slime ``624b824a898ab0ec1fcb4d373004c7f3852bf515``. slime's
``update_weight_from_distributed.py`` runs as it is, from tests/fixtures/slime/upstream
(ORIGIN.md says how to get it; the test skips while it is missing): its
``update_weights`` (rank 0 pauses and flushes every engine, every rank runs
``_send_weights``, rank 0 resumes them), its chunk iterators and bucketing by
``--update-weight-buffer-size``. ``install`` runs as ``--custom-megatron-init-path``
runs it, and the updater class is then chosen by ``_choose_updater``, which repeats
``MegatronTrainRayActor.init``'s lines (``actor.py`` L152-L175): the actor module itself
imports Megatron-LM, ``torch_memory_saver``, transformers and slime's Ray layer, which a
CPU host does not run.

``STUBS`` lists what stands in for what needs Megatron, Ray or a GPU. The trainer ranks
are separate processes (a gloo group): DP 2, TP = PP = EP = 1, so rank 0 is the only
source rank. p2pweights' own pause and resume calls raise in them (slime pauses). After
every update each engine shows slime's ``weight_version`` and runs again; after the last,
every engine rank is bit-exact with sglang's own loading.
"""

from __future__ import annotations

import importlib.util
import sys
from argparse import Namespace
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
from _bit_exact import assert_bit_exact
from _procs import warm_context

from p2pweights.engines.client import EngineClient
from p2pweights.local_engine import free_port
from p2pweights.testing import synthetic_weights

SLIME_COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"
UPSTREAM = Path(__file__).parent.parent / "fixtures" / "slime" / "upstream"
UPDATER_FILE = "slime/backends/megatron_utils/update_weight/update_weight_from_distributed.py"

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not (UPSTREAM / UPDATER_FILE).exists(),
        reason=f"slime's {UPDATER_FILE} is not under tests/fixtures/slime/upstream "
        "(not committed; tests/fixtures/slime/ORIGIN.md says how to get it)",
    ),
]

BUCKET_BYTES = 256 * 2**10  # --update-weight-buffer-size: a dozen chunks or more
STUBS = {
    "megatron.core.mpu": "parallel state: DP = world size, TP = PP = EP = 1",
    "slime...update_weight.common": "all_gather_param is the identity (TP 1); "
    "named_params_and_buffers yields the trainer's weights under HF names",
    "slime...megatron_to_hf.convert_to_hf": "the identity (the names are HF's already)",
    "slime.utils.distributed_utils.get_gloo_group": "the default (gloo) group",
    "slime.utils.accelerator, slime.utils.http_utils": "unused on this path",
    "ray": "ray.get of the engine actors' answers (each .remote() answers at once)",
    "SGLangEngine actors": "pause_generation / flush_cache / continue_generation / get_url "
    "as slime's SGLangEngine sends them, over HTTP to the local engine",
}


# -- a trainer rank: a separate process --------------------------------------------------------


def _module(name: str, **attributes) -> ModuleType:
    module = ModuleType(name)
    module.__dict__.update(attributes)
    module.__path__ = []  # a package, so relative imports resolve
    sys.modules[name] = module
    return module


class _Model:
    """The trainer's weights after the last step (what Megatron's params would convert to)."""

    def __init__(self, folder: str):
        self.folder, self.seed = folder, 0


def _stand_in(rank: int, world: int) -> None:
    """``STUBS``, installed in ``sys.modules`` before slime's file is loaded."""
    import torch.distributed as dist

    mpu = SimpleNamespace(
        get_data_parallel_rank=lambda with_context_parallel=False: rank,
        get_tensor_model_parallel_rank=lambda: 0,
        get_pipeline_model_parallel_rank=lambda: 0,
        get_pipeline_model_parallel_world_size=lambda: 1,
        get_expert_model_parallel_world_size=lambda: 1,
        get_expert_model_parallel_group=lambda: None,
    )
    _module("megatron")
    _module("megatron.core", mpu=mpu)
    _module("ray", get=lambda refs: list(refs), ObjectRef=object)
    _module("ray.actor", ActorHandle=object)
    _module("slime")
    _module("slime.utils", accelerator=SimpleNamespace(current_device=lambda: "cpu"))
    _module("slime.utils.distributed_utils", get_gloo_group=lambda: None, init_process_group=None)
    _module("slime.utils.http_utils", _wrap_ipv6=lambda host: host)
    _module("slime.backends")
    _module(
        "slime.backends.megatron_utils.megatron_to_hf",
        convert_to_hf=lambda args, model_name, name, param, quantization_config: [(name, param)],
    )
    _module("slime.backends.megatron_utils")
    sys.modules["slime.backends.megatron_utils"].megatron_to_hf = sys.modules[
        "slime.backends.megatron_utils.megatron_to_hf"
    ]

    def named_params_and_buffers(args, model):
        yield from synthetic_weights(model.folder, seed=model.seed, dtype=torch.bfloat16)

    _module("slime.backends.megatron_utils.update_weight")
    _module(
        "slime.backends.megatron_utils.update_weight.common",
        all_gather_param=lambda name, param: param,
        named_params_and_buffers=named_params_and_buffers,
    )
    assert dist.get_world_size() == world


def _load_slime() -> ModuleType:
    """slime's own ``update_weight_from_distributed.py``, and the actor module's global
    that ``MegatronTrainRayActor.init`` reads (``actor.py`` imports it so)."""
    name = "slime.backends.megatron_utils.update_weight.update_weight_from_distributed"
    spec = importlib.util.spec_from_file_location(name, UPSTREAM / UPDATER_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return _module(
        "slime.backends.megatron_utils.actor",
        UpdateWeightFromDistributed=module.UpdateWeightFromDistributed,
    )


def _choose_updater(args: Namespace, actor: ModuleType) -> type:
    """``MegatronTrainRayActor.init`` at 624b824a8, L152-L175 (the disk and tensor
    updaters are not loaded here)."""
    if args.update_weight_mode == "delta":
        raise AssertionError("UpdateWeightFromDiskDelta")
    if args.update_weight_transport == "disk":
        raise AssertionError("UpdateWeightFromDisk")
    if args.colocate:
        raise AssertionError("UpdateWeightFromTensor")
    assert args.update_weight_mode == "full"
    assert args.update_weight_transport == "nccl"
    return actor.UpdateWeightFromDistributed


class _Remote:
    def __init__(self, call):
        self.remote = call


class _SGLangEngine:
    """slime's ``SGLangEngine`` actor, node 0: what its methods send to the server."""

    def __init__(self, url: str):
        import httpx

        def post(route):
            return lambda: httpx.post(f"{url}/{route}", json={}, timeout=60).raise_for_status()

        self.pause_generation = _Remote(post("pause_generation"))
        self.continue_generation = _Remote(post("continue_generation"))
        self.flush_cache = _Remote(
            lambda: httpx.get(f"{url}/flush_cache", timeout=60).raise_for_status()
        )
        self.get_url = _Remote(lambda: url)


def _forbid_pausing() -> None:
    """slime pauses and resumes: a pause or resume by p2pweights fails the update."""

    def refused(self, *args, **kwargs):
        raise AssertionError(f"p2pweights paused or resumed {self.url} under slime")

    EngineClient.pause_generation = refused  # type: ignore[method-assign]
    EngineClient.continue_generation = refused  # type: ignore[method-assign]


def _trainer(rank, world, port, urls, folder, seeds, out) -> None:
    import torch.distributed as dist

    from p2pweights import MooncakeConfig, SyncConfig

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        _stand_in(rank, world)
        actor = _load_slime()
        _forbid_pausing()
        args = Namespace(
            update_weight_mode="full",
            update_weight_transport="nccl",
            colocate=False,
            update_weight_buffer_size=BUCKET_BYTES,
        )
        # --custom-megatron-init-path: inside init(args), before the updater is chosen
        from p2pweights.integrations.slime import install

        install(args, config=SyncConfig(transport=MooncakeConfig(protocol="tcp")))
        cls = _choose_updater(args, actor)
        model = _Model(folder)
        updater = cls(
            args, model, weights_getter=None, model_name="qwen3", quantization_config=None
        )
        updater.weight_version = 0  # update_weight_start_version
        engines = [_SGLangEngine(url) for url in urls]
        # MegatronTrainRayActor.update_weights: connect when there are new engines, barrier
        updater.connect_rollout_engines(
            engines,
            None,
            engine_gpu_counts=None,
            engine_gpu_offsets=None,
            engine_parallel_configs=None,
        )
        dist.barrier()
        for seed in seeds:
            model.seed = seed
            updater.update_weights()
            out.put((rank, updater.weight_version, updater.pop_metrics()))
    except BaseException as exc:
        out.put((rank, "error", repr(exc)))
        raise
    finally:
        dist.destroy_process_group()


# -- the test ------------------------------------------------------------------------------------


def test_slimes_own_updater_writes_through_p2pweights_bit_exact(model_dir, shared_engines):
    folder = model_dir("qwen3-tiny")
    engines = shared_engines(folder, [2, 1], seed=0)
    urls = [engine.url for engine in engines]
    seeds = [44, 45, 46]
    ctx = warm_context()
    out = ctx.Queue()
    port = free_port()
    ranks = [
        ctx.Process(
            target=_trainer, args=(rank, 2, port, urls, str(folder), seeds, out), daemon=True
        )
        for rank in range(2)
    ]
    for process in ranks:
        process.start()
    answers = []
    while len(answers) < 2 * len(seeds):
        answers.append(out.get(timeout=900))
        assert answers[-1][1] != "error", answers[-1]
    for process in ranks:
        process.join(timeout=120)
    versions = sorted((rank, version) for rank, version, _ in answers)
    assert versions == [(r, v) for r in range(2) for v in (1, 2, 3)]
    sent = [m for rank, _, m in answers if rank == 0]
    assert all(m["perf/update_weights_p2pweights_bytes"] > 0 for m in sent)  # the source rank
    assert all(m == {} for rank, _, m in answers if rank == 1)  # DP rank 1 only gathers
    for engine in engines:
        client = EngineClient(engine.url)
        assert client.weight_version() == "3"
        assert client.engine_state() == {"paused": False, "update_open": False}
        client.close()
    assert_bit_exact(engines, folder, seeds[-1])
