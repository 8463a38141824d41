"""verl 0.9.1 (PyPI) drives p2pweights: two actor ranks write two replicas, three updates,
under verl's own ``CheckpointEngineManager`` (config keys alone) and under
``P2PWeightsCheckpointManager``.

Written against verl 0.9.1 as published on PyPI (``verl-0.9.1-py3-none-any.whl``, which
names no git commit; its ``verl/checkpoint_engine/base.py`` is pinned by ``VERL_BASE_SHA256``,
the hash the wheel's RECORD lists, and checked below).

The calls, in verl 0.9.1's order:

* each actor rank builds its checkpoint engine as ``ActorRolloutRefWorker.init_model``
  does (``verl/workers/engine_workers.py``, "4. build checkpoint engine"): verl's
  ``import_external_libs(custom_backend_module)``, then ``CheckpointEngineRegistry.new(
  backend, is_master=rank == 0, bucket_size=..., **engine_kwargs[backend])``;
* the trainer loads the manager as ``RayPPOTrainer.init_workers`` /
  ``SeparateRayPPOTrainer.init_workers`` do (``load_class_from_fqn`` of
  ``rollout.checkpoint_manager_class``, built with ``config``, ``actor_wg``,
  ``replicas``) and calls ``checkpoint_manager.update_weights(global_steps)`` after each
  training step;
* the manager dispatches ``execute_checkpoint_engine`` (``Dispatch.DP_COMPUTE``) and
  ``update_weights`` (``Dispatch.ONE_TO_ALL``) to the actor ranks; on each,
  ``ActorRolloutRefWorker.update_weights`` for a mode other than "naive" and
  "delta_sharded" runs ``per_tensor_param, _ = self.actor.engine.get_per_tensor_param()``
  and ``await self.checkpoint_engine.send_weights(per_tensor_param, global_steps=...)``.

* under verl's own manager (no ``checkpoint_manager_class``, as ``RayPPOTrainer.init_workers``
  then imports ``verl.checkpoint_engine.CheckpointEngineManager``) its real
  ``update_weights`` runs: abort the replicas, release their KV cache, ``prepare`` /
  ``build_topology`` / ``init_process_group`` on the actor ranks and rollout workers, the
  actors' ``update_weights`` beside the rollout workers' (verl's own
  ``CheckpointEngineWorker.update_weights`` and ``execute_checkpoint_engine``, called on a
  stand-in for the worker), ``finalize``, resume the KV cache, resume generation.

``ActorRolloutRefWorker`` itself needs verl's full training stack (datasets, FSDP
engines), so ``_update_weights`` and ``_execute_checkpoint_engine`` below repeat those
few lines; the registry, the config dataclass, the import hook and the manager's base
class are verl's own. Only the Ray layer is a double: actor ranks are real processes (a
gloo group, as verl's actor ranks form a torch.distributed world) reached over pipes,
``ray.get`` collects their answers (raising a rank's error, as Ray does), and the
replicas are the sglang servers' addresses plus a record of the calls the manager makes
on them. The engines are local engines (sglang's model code on the CPU) written over
Mooncake TCP, checked bit-exact against sglang's own loading for each rank.

Doubles under verl's own manager, each standing in for what needs Ray or a GPU:
``ray.get`` and ``RayWorkerGroup`` in ``verl.checkpoint_engine.base`` (the rollout
workers' group, whose calls run verl's ``CheckpointEngineWorker`` methods in threads,
beside the actor ranks, as Ray runs them at once); the replicas' ``abort_all_requests``,
``release_kv_cache``, ``resume_kv_cache`` and ``resume_generation`` (verl's
``SGLangReplica`` calls sglang's ``pause_generation(mode="abort")``,
``release_memory_occupation``, ``resume_memory_occupation`` + ``flush_cache`` and
``continue_generation``; here the pause, flush and resume go to the local engine over
HTTP, the memory calls are only recorded: a CPU engine has no KV cache to release);
the rollout worker's server adapter (verl's ``ServerAdapter.update_weights`` over an
empty stream: verl's own ``get_named_tensor_buckets``, then ``flush_cache`` and
``set_global_steps`` on the TP-leader); and, in each actor rank, ``ray.util.list_named_actors``,
``ray.get_actor`` and ``ray.get`` as ``discover_engine_urls`` uses them (verl's
``sglang_server_<replica>_0`` actors and their ``get_server_address``).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import itertools
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from _bit_exact import assert_bit_exact, seed_weights
from _procs import warm_context
from verl.checkpoint_engine import CheckpointEngineManager, CheckpointEngineRegistry
from verl.checkpoint_engine import base as verl_base
from verl.checkpoint_engine.base import CheckpointEngineWorker
from verl.utils.import_utils import import_external_libs, load_class_from_fqn
from verl.workers.config import CheckpointEngineConfig
from verl.workers.rollout.replica import RolloutMode
from verl.workers.rollout.sglang_rollout.utils import get_named_tensor_buckets

from p2pweights import P2PWeightsError
from p2pweights.engines.client import EngineClient
from p2pweights.integrations.verl import merge_metrics
from p2pweights.testing import synthetic_weights

pytestmark = pytest.mark.integration

MANAGER_CLASS = "p2pweights.integrations.verl.P2PWeightsCheckpointManager"
VERL_BASE_SHA256 = "l7URMaV3CJIAe3-wcmSiZX_oMlWwhZJ6zQjJUqVoL2Q"
"""verl 0.9.1's ``verl/checkpoint_engine/base.py`` (urlsafe base64, as in the wheel's RECORD):
the manager order these tests drive."""
ANSWER_WAIT_S = 600  # a hang guard only: an actor rank that never answers fails the test


def _checkpoint_engine_config() -> CheckpointEngineConfig:
    """``actor_rollout_ref.rollout.checkpoint_engine`` as a user sets it."""
    return CheckpointEngineConfig(
        backend="p2pweights",
        update_weights_bucket_megabytes=1,
        custom_backend_module="p2pweights.integrations.verl",
        engine_kwargs={"p2pweights": {"transport": {"kind": "mooncake", "protocol": "tcp"}}},
    )


# -- an actor rank: a separate process -------------------------------------------------------


class _TrainingEngine:
    """``self.actor.engine``: its weights after the last training step, handed over as a
    bare generator of full HF-named tensors, like verl's FSDP engine's
    ``get_per_tensor_param``."""

    def __init__(self, folder: str):
        self.folder, self.seed, self.drop_one = folder, 0, False

    def get_per_tensor_param(self):
        weights = synthetic_weights(self.folder, seed=self.seed, dtype=torch.bfloat16)
        if self.drop_one:
            weights = itertools.islice(weights, 1, None)
        return ((name, tensor) for name, tensor in weights), None


async def _update_weights(worker, global_steps=None, mode="auto"):
    """``ActorRolloutRefWorker.update_weights`` (verl/workers/engine_workers.py), its
    checkpoint-engine branch."""
    effective_mode = mode if mode != "auto" else worker.config.rollout.checkpoint_engine.backend
    assert effective_mode not in ("naive", "delta_sharded")
    per_tensor_param, _ = worker.actor.engine.get_per_tensor_param()
    metrics = await worker.checkpoint_engine.send_weights(
        per_tensor_param, global_steps=global_steps
    )
    return metrics or {}


def _execute_checkpoint_engine(worker, method, *args, **kwargs):
    """``ActorRolloutRefWorker.execute_checkpoint_engine``."""
    return getattr(worker.checkpoint_engine, method)(*args, **kwargs)


def _actor_rank(
    rank: int, world_size: int, init_file: str, conn, folder: str, servers: dict | None
) -> None:
    """``servers``: verl's named sglang server actors (name -> (host, port)), under verl's
    own manager; there p2pweights must neither pause nor resume an engine."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    # ActorRolloutRefWorker.init_model, "4. build checkpoint engine"
    checkpoint_engine_config = _checkpoint_engine_config()
    backend = checkpoint_engine_config.backend
    bucket_size = checkpoint_engine_config.update_weights_bucket_megabytes << 20
    engine_kwargs = checkpoint_engine_config.engine_kwargs.get(backend, {})
    import_external_libs(checkpoint_engine_config.custom_backend_module or None)
    checkpoint_engine = CheckpointEngineRegistry.new(
        backend, is_master=(dist.get_rank() == 0), bucket_size=bucket_size, **engine_kwargs
    )
    worker = SimpleNamespace(
        config=SimpleNamespace(rollout=SimpleNamespace(checkpoint_engine=checkpoint_engine_config)),
        actor=SimpleNamespace(engine=_TrainingEngine(folder)),
        checkpoint_engine=checkpoint_engine,
    )
    _record_bytes_per_engine_rank()
    if servers is not None:
        _stand_in_for_named_actors(servers)
        _forbid_pausing()
    while (command := conn.recv()) is not None:
        name, args, kwargs = command
        try:
            if name == "train":  # update_actor: the weights change
                worker.actor.engine.seed, worker.actor.engine.drop_one = args
                result = None
            elif name == "execute_checkpoint_engine":
                result = _execute_checkpoint_engine(worker, *args, **kwargs)
            else:
                result = asyncio.run(_update_weights(worker, *args, **kwargs))
            conn.send((True, result))
        except Exception as exc:
            conn.send((False, exc))
    checkpoint_engine.close()
    dist.destroy_process_group()


def _record_bytes_per_engine_rank() -> None:
    """Add each engine rank's bytes to this actor rank's metrics (``target:<url>#<rank>``),
    for the numbers on docs/integrations/verl.md; the manager's merge drops these keys."""
    from p2pweights.integrations import verl as verl_integration

    rank_metrics = verl_integration._rank_metrics

    def with_targets(report):
        metrics = rank_metrics(report)
        for (url, engine_rank), num_bytes in report.bytes_by_target.items():
            metrics[f"target:{url}#{engine_rank}"] = float(num_bytes)
        return metrics

    verl_integration._rank_metrics = with_targets


def _stand_in_for_named_actors(servers: dict) -> None:
    """Ray's named actors in this actor rank, as ``discover_engine_urls`` reads them."""
    from p2pweights.integrations import verl as verl_integration

    def get_actor(name):
        address = servers[name]
        return SimpleNamespace(get_server_address=SimpleNamespace(remote=lambda: address))

    verl_integration.ray = SimpleNamespace(  # type: ignore[assignment]
        util=SimpleNamespace(list_named_actors=lambda: list(servers)),
        get_actor=get_actor,
        get=list,
    )


def _forbid_pausing() -> None:
    """Under verl's manager verl pauses and resumes: a pause or resume by p2pweights fails."""

    def refused(self, *args, **kwargs):
        raise AssertionError(f"p2pweights paused or resumed {self.url} under verl's manager")

    EngineClient.pause_generation = refused  # type: ignore[method-assign]
    EngineClient.continue_generation = refused  # type: ignore[method-assign]


# -- the Ray layer's double ------------------------------------------------------------------


class _Answer:
    """An ObjectRef: one rank's answer, read from its pipe by ``_Ray.get``."""

    def __init__(self, conn):
        self.conn = conn

    def result(self) -> tuple[bool, object]:
        assert self.conn.poll(ANSWER_WAIT_S), "an actor rank did not answer"
        return self.conn.recv()


class _Running:
    """An ObjectRef of a rollout worker's call, running in a thread of this process."""

    pool = ThreadPoolExecutor(max_workers=8)

    def __init__(self, call, *args, **kwargs):
        self.future = self.pool.submit(call, *args, **kwargs)

    def result(self) -> tuple[bool, object]:
        try:
            return True, self.future.result(timeout=ANSWER_WAIT_S)
        except Exception as exc:
            return False, exc


class _Ray:
    errors: list[Exception] = []
    answers: list = []  # the last call's answers, every rank's
    sent: list = []  # the actor ranks' metrics of the last update

    @staticmethod
    def get(refs):
        answers = [ref.result() for ref in refs]
        _Ray.answers = [value for ok, value in answers if ok]
        sent = [v for v in _Ray.answers if isinstance(v, dict) and "p2pweights/bytes" in v]
        if sent:  # the actor ranks' send_weights metrics (verl's manager calls finalize after)
            _Ray.sent = sent
        _Ray.errors = [value for ok, value in answers if not ok]
        if _Ray.errors:
            raise _Ray.errors[0]  # Ray raises the failed task's error (as a RayTaskError)
        return [value for _, value in answers]


class _ActorWorkerGroup:
    """The actor ``RayWorkerGroup``: verl's dispatch modes, over pipes to the ranks."""

    def __init__(self, conns):
        self.conns, self.world_size = conns, len(conns)

    def _send(self, name, per_rank_args, kwargs_per_rank):
        for conn, args, kwargs in zip(self.conns, per_rank_args, kwargs_per_rank, strict=True):
            conn.send((name, args, kwargs))
        return [_Answer(conn) for conn in self.conns]

    def execute_checkpoint_engine(self, method, *args, **kwargs):  # Dispatch.DP_COMPUTE
        ranks = range(self.world_size)
        return self._send(
            "execute_checkpoint_engine",
            [(method[r], *(arg[r] for arg in args)) for r in ranks],
            [{k: v[r] for k, v in kwargs.items()} for r in ranks],
        )

    def update_weights(self, global_steps=None, mode="auto"):  # Dispatch.ONE_TO_ALL
        return self._send(
            "update_weights",
            [()] * self.world_size,
            [{"global_steps": global_steps, "mode": mode}] * self.world_size,
        )

    def train(self, seed, drop_one=False):
        args = [(seed, drop_one)] * self.world_size
        return _Ray.get(self._send("train", args, [{}] * self.world_size))


class _Replica:
    """A standalone sglang ``RolloutReplica``: its server's address, and what it was asked."""

    rollout_mode = RolloutMode.STANDALONE

    def __init__(self, rank: int, url: str):
        self.replica_rank, self.calls = rank, []
        self.server_address = url.removeprefix("http://")

        async def set_global_steps(steps):
            self.calls.append(("set_global_steps", steps))

        self.server_handle = SimpleNamespace(
            set_global_steps=SimpleNamespace(remote=set_global_steps)
        )

    def __getattr__(self, name):  # abort_all_requests, release_kv_cache, sleep, ...
        async def call(**kwargs):
            self.calls.append((name,))

        return call


class _ServerAdapter:
    """verl's sglang ``ServerAdapter`` beside one engine rank, its ``update_weights`` for
    a full update: the received stream in buckets (verl's ``get_named_tensor_buckets``),
    each loaded over CUDA IPC (none arrive here), then on the TP leader ``flush_cache`` and
    the server actor's ``set_global_steps``."""

    def __init__(self, replica, leader: bool, bucket_bytes: int):
        self.replica, self.leader, self.bucket_bytes = replica, leader, bucket_bytes

    async def update_weights(self, weights, global_steps=None, wire_format="named_tensors"):
        assert wire_format == "named_tensors"
        buckets = [b async for b in get_named_tensor_buckets(weights, self.bucket_bytes)]
        assert buckets == [], "p2pweights' rollout half received weights"
        if self.leader:
            self.replica.call("flush_cache", lambda client: client.flush_cache())
            self.replica.calls.append(("set_global_steps", global_steps))


class _RolloutWorker:
    """verl's ``CheckpointEngineWorker`` beside one engine rank: its checkpoint engine built
    as its ``__init__`` builds it; its methods are verl's own (see ``_RolloutWorkerGroup``)."""

    def __init__(self, replica, local_rank: int):
        config = _checkpoint_engine_config()
        backend = config.backend
        bucket_size = config.update_weights_bucket_megabytes << 20
        engine_kwargs = config.engine_kwargs.get(backend, {})
        import_external_libs(config.custom_backend_module or None)
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            backend, bucket_size=bucket_size, **engine_kwargs
        )
        self.server_adapter = _ServerAdapter(replica, local_rank == 0, bucket_size)


class _RolloutWorkerGroup:
    """The ``RayWorkerGroup(worker_handles=...)`` verl's manager makes of every replica's
    workers: each call runs verl's ``CheckpointEngineWorker`` method on the worker."""

    def __init__(self, worker_handles, ray_cls_with_init=None):
        self.workers, self.world_size = worker_handles, len(worker_handles)

    def execute_checkpoint_engine(self, method, *args, **kwargs):  # Dispatch.DP_COMPUTE
        return [
            _Running(
                CheckpointEngineWorker.execute_checkpoint_engine,
                worker,
                method[r],
                *(arg[r] for arg in args),
                **{k: v[r] for k, v in kwargs.items()},
            )
            for r, worker in enumerate(self.workers)
        ]

    def update_weights(self, global_steps=None):  # Dispatch.ONE_TO_ALL, not blocking
        return [
            _Running(asyncio.run, CheckpointEngineWorker.update_weights(w, global_steps))
            for w in self.workers
        ]


class _StandaloneReplica:
    """verl's standalone ``SGLangReplica``: its server's address, its rollout workers, and
    what the manager asks of it; pause, flush and resume reach the engine over HTTP."""

    rollout_mode = RolloutMode.STANDALONE

    def __init__(self, rank: int, engine, tp: int):
        self.replica_rank, self.url, self.calls = rank, engine.url, []
        self.server_address = engine.url.removeprefix("http://")
        self.workers = [_RolloutWorker(self, local_rank) for local_rank in range(tp)]

    def call(self, name, action=None):
        client = EngineClient(self.url)
        try:
            if action is not None:
                action(client)
            self.calls.append((name, client.engine_state()["paused"]))
        finally:
            client.close()

    async def abort_all_requests(self, reject_request=False):
        self.call("abort_all_requests", lambda client: client.pause_generation("abort"))

    async def release_kv_cache(self):
        self.call("release_kv_cache")

    async def resume_kv_cache(self):
        self.call("resume_kv_cache", lambda client: client.flush_cache())

    async def resume_generation(self):
        self.call("resume_generation", lambda client: client.continue_generation())


@pytest.fixture
def verl_actors(tmp_path, monkeypatch):
    """``verl_actors(folder, engines)``: (manager, actor worker group, replicas) over two
    actor-rank processes, stopped after the test."""
    ctx = warm_context()
    started = []

    def make(folder, engines, stock: bool = False, tps=None):
        """``stock``: verl's own manager (``tps``: each engine's TP size)."""
        servers = None
        if stock:
            servers = {
                f"sglang_server_{i}_0": (
                    e.url.removeprefix("http://").rsplit(":", 1)[0],
                    int(e.url.rsplit(":", 1)[1]),
                )
                for i, e in enumerate(engines)
            }
        pipes = [ctx.Pipe() for _ in range(2)]
        for rank, (_, child) in enumerate(pipes):
            process = ctx.Process(
                target=_actor_rank,
                args=(rank, 2, str(tmp_path / "dist-init"), child, str(folder), servers),
            )
            process.start()
            child.close()  # a rank that dies is then an EOF here, not a wait
            started.append((process, pipes[rank][0]))
        group = _ActorWorkerGroup([parent for parent, _ in pipes])
        if stock:
            replicas = [
                _StandaloneReplica(i, e, tp)
                for i, (e, tp) in enumerate(zip(engines, tps, strict=True))
            ]
            monkeypatch.setattr(verl_base, "ray", _Ray)
            monkeypatch.setattr(verl_base, "RayWorkerGroup", _RolloutWorkerGroup)
            # RayPPOTrainer.init_workers without checkpoint_manager_class
            manager = CheckpointEngineManager(
                config=_checkpoint_engine_config(), actor_wg=group, replicas=replicas
            )
            return manager, group, replicas
        replicas = [_Replica(i, engine.url) for i, engine in enumerate(engines)]
        manager_cls = load_class_from_fqn(MANAGER_CLASS, "CheckpointEngineManager")
        monkeypatch.setattr(sys.modules[manager_cls.__module__], "ray", _Ray)
        manager = manager_cls(config=_checkpoint_engine_config(), actor_wg=group, replicas=replicas)
        return manager, group, replicas

    yield make
    for _process, conn in started:
        conn.send(None)
    for process, _conn in started:
        process.join(timeout=60)
        if process.exitcode is None:
            process.kill()


def test_verl_updates_two_replicas_from_two_actor_ranks_bit_exact(
    model_dir, shared_engines, verl_actors
):
    folder = model_dir("qwen3-tiny")
    engines = shared_engines(folder, [2, 1], seed=0)
    manager, actors, replicas = verl_actors(folder, engines)
    steps = (1, 2, 3)
    for step in steps:
        actors.train(seed=60 + step)  # seeds no other test writes to these pooled engines
        started = time.perf_counter()
        metrics = manager.update_weights(step)
        wall_s = time.perf_counter() - started
        assert metrics["p2pweights/bytes"] > 0
        per_target = _bytes_per_engine_rank(_Ray.sent)
        _report_step(step, metrics, per_target, folder, wall_s=wall_s)
        # each engine rank takes its own shard; verl's nixl / mooncake / nccl backends hand
        # every rollout worker the whole model (the TP 1 engine's one rank takes about that)
        model_bytes = sum(t.nbytes for _, t in seed_weights(folder, 60 + step))
        tp2 = [b for (url, _), b in per_target.items() if url == engines[0].url]
        assert len(tp2) == 2 and all(b < model_bytes for b in tp2)
    for engine in engines:
        client = EngineClient(engine.url)
        assert client.weight_version() == str(steps[-1])
        client.close()
    for replica in replicas:  # nothing paused, aborted or released behind p2pweights' back
        assert replica.calls == [("set_global_steps", step) for step in steps]
    assert_bit_exact(engines, folder, 60 + steps[-1])


def test_the_verl_written_against_is_installed():
    digest = hashlib.sha256(Path(verl_base.__file__).read_bytes()).digest()
    assert base64.urlsafe_b64encode(digest).rstrip(b"=").decode() == VERL_BASE_SHA256


def test_verls_own_manager_drives_it_by_config_keys_alone_bit_exact(
    model_dir, shared_engines, verl_actors
):
    folder = model_dir("qwen3-tiny")
    tps = [2, 1]
    engines = shared_engines(folder, tps, seed=0)
    manager, actors, replicas = verl_actors(folder, engines, stock=True, tps=tps)
    assert type(manager) is CheckpointEngineManager
    steps = (1, 2, 3)
    for step in steps:
        actors.train(seed=23 + step)  # seeds of its own: the engines may be the test above's
        started = time.perf_counter()
        metrics = manager.update_weights(step)
        wall_s = time.perf_counter() - started
        # verl keeps one actor rank's metrics (dict.update over the ranks' answers)
        assert metrics["p2pweights/bytes"] > 0
        merged = merge_metrics(_Ray.sent)
        per_target = _bytes_per_engine_rank(_Ray.sent)
        _report_step(step, merged, per_target, folder, "verl's manager", wall_s)
    for engine, replica in zip(engines, replicas, strict=True):
        client = EngineClient(engine.url)
        assert client.weight_version() == str(steps[-1])
        assert client.engine_state() == {"paused": False, "update_open": False}
        client.close()
        # verl's order, each call with the engine's paused state after it: paused by verl's
        # abort before anything else, still paused when the rollout half flushed, resumed
        # by verl last (p2pweights neither paused nor resumed: that raises in the actors)
        assert replica.calls == [
            call
            for step in steps
            for call in (
                ("abort_all_requests", True),
                ("release_kv_cache", True),
                ("flush_cache", True),
                ("set_global_steps", step),
                ("resume_kv_cache", True),
                ("resume_generation", False),
            )
        ]
    assert_bit_exact(engines, folder, 23 + steps[-1])


def _bytes_per_engine_rank(answers) -> dict[tuple[str, int], float]:
    found = {}
    for metrics in answers:
        for key, value in metrics.items():
            if key.startswith("target:"):
                url, rank = key.removeprefix("target:").rsplit("#", 1)
                found[(url, int(rank))] = value
    return found


def _report_step(
    step, metrics, per_target, folder, manager="P2PWeightsCheckpointManager", wall_s=0.0
) -> None:
    """One line per update (``pytest -s``): the numbers docs/integrations/verl.md quotes."""
    model_bytes = sum(t.nbytes for _, t in seed_weights(folder, 0))
    ranks = ", ".join(f"{url}#{rank}: {int(b)}" for (url, rank), b in sorted(per_target.items()))
    print(
        f"verl step {step} ({manager}): update_weights {wall_s:.3f} s wall, p2pweights "
        f"{metrics['p2pweights/seconds']:.3f} s, "
        f"{int(metrics['p2pweights/bytes'])} bytes written; per engine rank {ranks}; "
        f"model {model_bytes} bytes (bf16, what verl's own backends send each rollout worker)"
    )


def test_a_dead_engine_fails_send_weights_on_every_actor_rank(
    model_dir, shared_engines, start_engines, verl_actors
):
    folder = model_dir("qwen3-tiny")
    (doomed,) = start_engines(folder, [1], seed=0, wait=False)  # its own: it is stopped
    (healthy,) = shared_engines(folder, [1], seed=0)
    doomed.wait_ready()
    manager, actors, replicas = verl_actors(folder, [healthy, doomed])
    actors.train(seed=71)
    manager.update_weights(1)
    doomed.stop()
    actors.train(seed=72)
    with pytest.raises(P2PWeightsError, match=doomed.url):
        manager.update_weights(2)
    assert len(_Ray.errors) == 2  # both actor ranks' send_weights raised
    assert all(doomed.url in str(error) for error in _Ray.errors)
    client = EngineClient(healthy.url)
    assert client.weight_version() == "1"  # refused before the healthy engine was touched
    client.close()
    # update 1 wrote the healthy engine whole, and update 2 wrote none of it (a pooled
    # engine may show version "1" from an earlier test: its bytes cannot be these)
    assert_bit_exact([healthy], folder, 71)
    assert all(("set_global_steps", 2) not in replica.calls for replica in replicas)


def test_under_verls_manager_a_failed_update_is_repaired_by_the_next(
    model_dir, shared_engines, verl_actors
):
    folder = model_dir("qwen3-tiny")
    engines = shared_engines(folder, [1], seed=0)
    manager, actors, replicas = verl_actors(folder, engines, stock=True, tps=[1])
    actors.train(seed=81)
    manager.update_weights(1)
    actors.train(seed=82, drop_one=True)  # a tensor missing from the trainer's weights
    with pytest.raises(P2PWeightsError):
        manager.update_weights(2)
    assert len(_Ray.errors) == 2  # both actor ranks' send_weights raised
    client = EngineClient(engines[0].url)
    # verl's manager stops at the failed step: it neither finalizes nor resumes, so the
    # replica stays as its abort left it (as when verl's own backends fail); its rollout
    # half, running beside the actors, still flushed and set global_steps 2
    assert client.engine_state()["paused"]
    assert [name for name, _ in replicas[0].calls[-4:]] == [
        "abort_all_requests",
        "release_kv_cache",
        "flush_cache",
        "set_global_steps",
    ]
    actors.train(seed=83)
    manager.update_weights(3)  # verl aborts again, p2pweights rewrites, verl resumes
    assert client.weight_version() == "3"
    assert client.engine_state() == {"paused": False, "update_open": False}
    client.close()
    assert_bit_exact(engines, folder, 83)
