"""p2pweights.integrations.verl against verl 0.9.1's real registry, base classes and manager.

Only Ray is stood in for: the manager's actor worker group records the calls verl's
``RayWorkerGroup`` would dispatch, ``ray.get`` returns what it was given, and the
replicas record what the manager asks of them (they would be Ray actors).
"""

from __future__ import annotations

import asyncio
import inspect
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf
from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry
from verl.utils.import_utils import import_external_libs
from verl.workers.config import CheckpointEngineConfig
from verl.workers.rollout.replica import RolloutMode

from p2pweights import ConfigError, MooncakeConfig, NixlConfig, SyncConfig, Timeouts
from p2pweights.integrations import verl as verl_integration
from p2pweights.integrations.verl import (
    BACKEND,
    MANAGER_CLASS,
    P2PWeightsCheckpointEngine,
    P2PWeightsCheckpointManager,
    merge_metrics,
    sync_config,
)

MODULE = "p2pweights.integrations.verl"


# -- the backend -----------------------------------------------------------------------------


def test_importing_the_module_registers_the_backend_in_verls_registry():
    import_external_libs(MODULE)  # what custom_backend_module makes every worker do
    backend = CheckpointEngineRegistry.get(BACKEND)
    assert backend is P2PWeightsCheckpointEngine
    assert issubclass(backend, CheckpointEngine)
    assert not inspect.isabstract(backend)
    assert f"{MODULE}.P2PWeightsCheckpointManager" == MANAGER_CLASS


@pytest.mark.parametrize("is_master", [None, True, False])
def test_the_registry_builds_it_as_actor_and_rollout_workers_do(is_master):
    """Actor ranks pass is_master (verl/workers/engine_workers.py); rollout workers do
    not (CheckpointEngineWorker in verl/checkpoint_engine/base.py)."""
    extra = {} if is_master is None else {"is_master": is_master}
    engine = CheckpointEngineRegistry.new(BACKEND, bucket_size=64 << 20, **extra)
    assert isinstance(engine, P2PWeightsCheckpointEngine)
    assert engine.config == SyncConfig(buffer_bytes=64 << 20)


def test_engine_kwargs_map_to_sync_config_fields():
    # verl hands engine_kwargs[backend] over from its OmegaConf config: nested DictConfigs
    given = OmegaConf.create(
        {
            "p2pweights": {
                "transport": {"kind": "mooncake", "protocol": "tcp", "device_name": "mlx5_0"},
                "pause_mode": "abort",
                "timeouts": {"transfer": 90},
                "verify_with_weight_checker": True,
            }
        }
    )["p2pweights"]
    engine = CheckpointEngineRegistry.new(BACKEND, bucket_size=2048 << 20, **given)
    assert engine.config == SyncConfig(
        transport=MooncakeConfig(protocol="tcp", device_name="mlx5_0"),
        buffer_bytes=2048 << 20,
        pause_mode="abort",
        timeouts=Timeouts(transfer=90),
        verify_with_weight_checker=True,
    )
    nixl = sync_config(256 << 20, {"transport": {"kind": "nixl", "backend": "UCX"}})
    assert nixl.transport == NixlConfig(backend="UCX")


@pytest.mark.parametrize(
    ("bucket_size", "kwargs", "message"),
    [
        (64 << 20, {"bogus": 1}, r"(?s)engine_kwargs\.p2pweights .*bogus"),
        (64 << 20, {"buffer_bytes": "1GiB"}, r"update_weights_bucket_megabytes"),
        (64 << 20, {"num_trainer_ranks": 2}, r"num_trainer_ranks cannot be set"),
        (64 << 20, {"pipeline_stage": 1}, r"one sender group"),
        (64 << 20, {"transport": {"kind": "rdma"}}, r"(?s)engine_kwargs\.p2pweights .*transport"),
        (64 << 20, {"pause_mode": "drop"}, r"pause_mode"),
        (0, {}, r"update_weights_bucket_megabytes -> buffer_bytes=0"),
    ],
)
def test_bad_config_raises_config_error_naming_verls_key(bucket_size, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        CheckpointEngineRegistry.new(BACKEND, bucket_size=bucket_size, **kwargs)


class _NamedActors:
    """``ray`` as ``discover_engine_urls`` uses it: the job's named actors, each server's
    ``get_server_address()``, and ``ray.get`` of what those return."""

    def __init__(self, servers: dict[str, tuple[str, int]]):
        self.servers = servers
        self.util = SimpleNamespace(list_named_actors=lambda: list(servers))

    def get_actor(self, name):
        address = self.servers[name]
        return SimpleNamespace(get_server_address=SimpleNamespace(remote=lambda: address))

    @staticmethod
    def get(refs):
        return list(refs)


def test_actor_rank_0_finds_the_replicas_servers_as_verls_server_adapter_does(monkeypatch):
    servers = {
        "sglang_server_1_0": ("10.0.0.6", 30001),
        "sglang_server_0_0": ("10.0.0.5", 30000),
        "sglang_server_0_1": ("10.0.0.7", 30000),  # node 1 of replica 0: not an HTTP entry
        "sglang_server_reward_0_0": ("10.0.0.8", 30000),
        "sglang_server_10_0": ("fd00::1", 30010),
        "rollout_standalone_0WorkerDict_0:0": ("10.0.0.9", 1),
    }
    monkeypatch.setattr(verl_integration, "ray", _NamedActors(servers))
    master = P2PWeightsCheckpointEngine(bucket_size=64 << 20, is_master=True)
    urls = ["http://10.0.0.5:30000", "http://10.0.0.6:30001", "http://[fd00::1]:30010"]
    assert master.prepare() == {"engine_urls": urls}
    assert P2PWeightsCheckpointEngine(bucket_size=64 << 20).prepare() == {}  # other ranks
    monkeypatch.setattr(verl_integration, "ray", _NamedActors({}))
    with pytest.raises(ConfigError, match="sglang_server_<replica>_0"):
        master.prepare()


def test_build_topology_hands_actor_rank_0s_urls_to_every_actor_rank():
    urls = ["http://a:1", "http://b:2"]
    metadata = [{"engine_urls": urls}, {}, {}, {}, {}]  # 2 actor ranks, then 3 rollout workers
    actors, rollout = P2PWeightsCheckpointEngine.build_topology(2, 3, metadata)
    assert actors == {"engine_urls": [urls, urls]} and rollout == {}
    with pytest.raises(ConfigError, match="found no rollout engine URLs"):
        P2PWeightsCheckpointEngine.build_topology(2, 3, [{}] * 5)


class _Session:
    def __init__(self, config):
        self.config, self.connected = config, []

    def connect(self, urls):
        self.connected.append(urls)


def test_under_verls_manager_the_actor_ranks_connect_once_and_leave_pausing_to_verl(
    monkeypatch,
):
    monkeypatch.setattr(verl_integration, "_new_session", _Session)
    engine = P2PWeightsCheckpointEngine(bucket_size=64 << 20, is_master=True)
    engine.init_process_group(engine_urls=["http://a:1"])
    engine.finalize()
    engine.init_process_group(engine_urls=["http://a:1"])  # the next step: same replicas
    session = engine._session
    assert session.connected == [["http://a:1"]]
    assert session.config.pause_mode == "caller"  # verl aborts and resumes the replicas
    assert session.config.buffer_bytes == 64 << 20
    engine.init_process_group(engine_urls=["http://a:1", "http://b:2"])  # a replica added
    assert session.connected[-1] == ["http://a:1", "http://b:2"]


def test_the_rollout_workers_half_is_empty():
    rollout_worker = P2PWeightsCheckpointEngine(bucket_size=64 << 20)
    assert rollout_worker.prepare() == {}
    rollout_worker.init_process_group()  # build_topology gives rollout workers nothing
    rollout_worker.finalize()

    async def received():
        return [item async for item in rollout_worker.receive_weights(global_steps=1)]

    assert asyncio.run(received()) == []
    assert rollout_worker._session is None  # nothing connected on a rollout worker


def test_a_pause_mode_set_for_p2pweights_is_refused_under_verls_manager(monkeypatch):
    monkeypatch.setattr(verl_integration, "_new_session", _Session)
    engine = P2PWeightsCheckpointEngine(bucket_size=64 << 20, pause_mode="retract")
    with pytest.raises(ConfigError, match="aborts and resumes the replicas itself"):
        engine.init_process_group(engine_urls=["http://a:1"])
    caller = P2PWeightsCheckpointEngine(bucket_size=64 << 20, pause_mode="caller")
    caller.init_process_group(engine_urls=["http://a:1"])  # said outright: fine
    with pytest.raises(ConfigError, match="does not pause the replicas"):
        P2PWeightsCheckpointEngine(bucket_size=64 << 20, pause_mode="caller").connect(["u"])


def test_send_weights_before_connect_is_refused_before_reading_the_weights():
    engine = P2PWeightsCheckpointEngine(bucket_size=64 << 20)
    read = []

    def weights():
        read.append(True)
        yield from ()

    with pytest.raises(ConfigError, match="init_process_group connects it"):
        asyncio.run(engine.send_weights(weights(), global_steps=1))
    assert read == []


# -- the manager -----------------------------------------------------------------------------


class _ActorWorkerGroup:
    """The actor RayWorkerGroup as the manager calls it; each rank answers ``metrics``."""

    def __init__(self, events: list, world_size: int = 2, metrics=None):
        self.events, self.world_size = events, world_size
        self.metrics = metrics or [{}] * world_size

    def execute_checkpoint_engine(self, method, *args, **kwargs):  # Dispatch.DP_COMPUTE
        assert len(method) == self.world_size and all(len(a) == self.world_size for a in args)
        self.events.append(("execute", method[0], [a[0] for a in args]))
        return [None] * self.world_size

    def update_weights(self, global_steps=None, mode="auto"):  # Dispatch.ONE_TO_ALL
        self.events.append(("actor.update_weights", global_steps, mode))
        return list(self.metrics)


class _Replica:
    """A standalone sglang RolloutReplica as the manager sees it."""

    def __init__(self, rank: int, events: list, mode: RolloutMode = RolloutMode.STANDALONE):
        self.replica_rank, self.rollout_mode = rank, mode
        self.server_address = f"10.0.0.{rank}:30000"
        self.events = events

        async def set_global_steps(steps):
            events.append((f"replica{rank}.set_global_steps", steps))

        self.server_handle = SimpleNamespace(
            set_global_steps=SimpleNamespace(remote=set_global_steps)
        )

    def __getattr__(self, name):  # sleep, wake_up, abort_all_requests, release_kv_cache, ...
        async def call(**kwargs):
            self.events.append((f"replica{self.replica_rank}.{name}",))

        return call


def _config(backend: str = BACKEND) -> CheckpointEngineConfig:
    return CheckpointEngineConfig(
        backend=backend,
        custom_backend_module=MODULE,
        engine_kwargs={BACKEND: {"transport": {"kind": "mooncake", "protocol": "tcp"}}},
    )


@pytest.fixture
def events(monkeypatch) -> list:
    monkeypatch.setattr(verl_integration, "ray", SimpleNamespace(get=lambda refs: refs))
    return []


def test_the_manager_connects_once_and_calls_only_the_actor_side(events):
    replicas = [_Replica(0, events), _Replica(1, events)]
    manager = P2PWeightsCheckpointManager(_config(), _ActorWorkerGroup(events), replicas)
    manager.update_weights(global_steps=3)
    manager.update_weights(global_steps=4)
    urls = ["http://10.0.0.0:30000", "http://10.0.0.1:30000"]
    assert events == [
        ("execute", "connect", [urls]),
        ("actor.update_weights", 3, BACKEND),
        ("replica0.set_global_steps", 3),
        ("replica1.set_global_steps", 3),
        ("actor.update_weights", 4, BACKEND),
        ("replica0.set_global_steps", 4),
        ("replica1.set_global_steps", 4),
    ]  # no abort, release or resume: p2pweights pauses and resumes each engine itself


def test_the_manager_reconnects_when_replicas_change(events):
    first = _Replica(0, events)
    manager = P2PWeightsCheckpointManager(_config(), _ActorWorkerGroup(events), [first])
    manager.update_weights()
    manager.add_replicas([_Replica(1, events)])
    manager.update_weights()
    manager.remove_replicas([first])
    manager.update_weights()
    connects = [e[2][0] for e in events if e[0] == "execute"]
    assert connects == [
        ["http://10.0.0.0:30000"],
        ["http://10.0.0.0:30000", "http://10.0.0.1:30000"],
        ["http://10.0.0.1:30000"],
    ]
    assert not any("set_global_steps" in e[0] for e in events)  # no steps given


def test_a_kv_cache_released_by_sleep_comes_back_before_the_update(events):
    manager = P2PWeightsCheckpointManager(
        _config(), _ActorWorkerGroup(events), [_Replica(0, events)]
    )
    manager.sleep_replicas()
    manager.update_weights(global_steps=1)
    manager.update_weights(global_steps=2)
    assert [e[0] for e in events] == [
        "replica0.sleep",
        "replica0.resume_kv_cache",
        "execute",
        "actor.update_weights",
        "replica0.set_global_steps",
        "actor.update_weights",  # awake: nothing to restore
        "replica0.set_global_steps",
    ]


def test_the_manager_works_when_awaited_from_verls_async_trainers(events):
    manager = P2PWeightsCheckpointManager(
        _config(), _ActorWorkerGroup(events), [_Replica(0, events)]
    )

    async def trainer_step():  # FullyAsyncTrainer-style: await checkpoint_manager.update_weights
        return await manager.update_weights(global_steps=7)

    assert asyncio.run(trainer_step()) == {}  # the fake ranks report no metrics
    assert ("actor.update_weights", 7, BACKEND) in events


def test_the_manager_refuses_another_backend(events):
    with pytest.raises(ConfigError, match=r"checkpoint_engine\.backend is 'naive'"):
        P2PWeightsCheckpointManager(_config("naive"), _ActorWorkerGroup(events), [])


@pytest.mark.parametrize("mode", [RolloutMode.HYBRID, RolloutMode.COLOCATED])
def test_the_manager_refuses_replicas_that_release_their_weights(events, mode):
    replicas = [_Replica(0, events), _Replica(1, events, mode)]
    manager = P2PWeightsCheckpointManager(_config(), _ActorWorkerGroup(events), replicas)
    with pytest.raises(ConfigError, match=r"replica 1 \(10\.0\.0\.1:30000\) .*standalone"):
        manager.update_weights(global_steps=1)
    assert events == []  # refused before any actor rank was asked to do anything


def test_the_manager_merges_the_ranks_metrics(events):
    per_rank = [
        {
            "p2pweights/bytes": 3e9,
            "p2pweights/seconds": 2.0,
            "p2pweights/gb_per_s": 1.5,
            "p2pweights/paused_s_max": 2.5,
            "p2pweights/max_engine_rank_bytes": 2e9,
            "p2pweights/engines_verified": 2.0,
            "p2pweights/num_engine_ranks": 2.0,
        },
        {
            "p2pweights/bytes": 1e9,
            "p2pweights/seconds": 1.0,
            "p2pweights/gb_per_s": 1.0,
            "p2pweights/max_engine_rank_bytes": 1e9,
            "p2pweights/engines_verified": 1.0,
            "p2pweights/num_engine_ranks": 1.0,
        },
    ]
    group = _ActorWorkerGroup(events, metrics=per_rank)
    manager = P2PWeightsCheckpointManager(_config(), group, [_Replica(0, events)])
    assert manager.update_weights(global_steps=1) == {
        "p2pweights/bytes": 4e9,
        "p2pweights/seconds": 2.0,
        "p2pweights/gb_per_s": 2.0,
        "p2pweights/paused_s_max": 2.5,
        "p2pweights/max_engine_rank_bytes": 2e9,
        "p2pweights/engines_verified": 1.0,
        "p2pweights/num_engine_ranks": 3.0,
    }
    assert merge_metrics([None, None]) == {}


# -- verl's newer manager's arguments (issue 41 item 4) --------------------------------------


def test_the_manager_takes_a_load_balancer_handle(events):
    balancer = object()
    manager = P2PWeightsCheckpointManager(
        _config(), _ActorWorkerGroup(events), [_Replica(0, events)], load_balancer_handle=balancer
    )
    assert manager.load_balancer is balancer
    manager.update_weights(global_steps=1)
    assert ("actor.update_weights", 1, BACKEND) in events


@pytest.mark.parametrize(
    "fine_grained",
    [SimpleNamespace(enabled=True), {"enabled": True}, OmegaConf.create({"enabled": True})],
)
def test_fine_grained_updates_are_refused_by_name_at_construction(events, fine_grained):
    with pytest.raises(ConfigError, match=r"fine_grained_config.*P2PWeightsCheckpointManager"):
        P2PWeightsCheckpointManager(
            _config(),
            _ActorWorkerGroup(events),
            [_Replica(0, events)],
            fine_grained_config=fine_grained,
            load_balancer_handle=object(),
        )
    assert events == []


def test_fine_grained_config_switched_off_is_accepted(events):
    P2PWeightsCheckpointManager(
        _config(),
        _ActorWorkerGroup(events),
        [_Replica(0, events)],
        fine_grained_config=SimpleNamespace(enabled=False),
    )


def test_update_weights_of_some_replicas_writes_only_theirs(events):
    replicas = [_Replica(0, events), _Replica(1, events), _Replica(2, events)]
    manager = P2PWeightsCheckpointManager(_config(), _ActorWorkerGroup(events), replicas)
    manager.update_weights(global_steps=5, replica_ranks=[2, 0])
    assert events == [
        ("execute", "connect", [["http://10.0.0.0:30000", "http://10.0.0.2:30000"]]),
        ("actor.update_weights", 5, BACKEND),
        ("replica0.set_global_steps", 5),
        ("replica2.set_global_steps", 5),
    ]
    with pytest.raises(ConfigError, match=r"replica_ranks \[7\].*0, 1, 2"):
        manager.update_weights(global_steps=6, replica_ranks=[0, 7])


def test_the_backend_does_not_claim_temporary_process_groups():
    """verl's newer manager asks a backend for prepare_temporary (fine-grained updates) and
    refuses, at construction, one that does not override it: p2pweights does not, so that
    refusal names it there instead of failing mid-training."""
    base = getattr(CheckpointEngine, "prepare_temporary", None)
    assert getattr(P2PWeightsCheckpointEngine, "prepare_temporary", None) is base
