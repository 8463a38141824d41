"""verl 0.9.1 (PyPI) drives p2pweights: two actor ranks write two replicas, three updates.

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

``ActorRolloutRefWorker`` itself needs verl's full training stack (datasets, FSDP
engines), so ``_update_weights`` and ``_execute_checkpoint_engine`` below repeat those
few lines; the registry, the config dataclass, the import hook and the manager's base
class are verl's own. Only the Ray layer is a double: actor ranks are real processes (a
gloo group, as verl's actor ranks form a torch.distributed world) reached over pipes,
``ray.get`` collects their answers (raising a rank's error, as Ray does), and the
replicas are the sglang servers' addresses plus a record of the calls the manager makes
on them. The engines are local engines (sglang's model code on the CPU) written over
Mooncake TCP, checked bit-exact against sglang's own loading for each rank.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import sys
from types import SimpleNamespace

import pytest
import torch
from _bit_exact import assert_bit_exact, seed_weights
from verl.checkpoint_engine import CheckpointEngineRegistry
from verl.utils.import_utils import import_external_libs, load_class_from_fqn
from verl.workers.config import CheckpointEngineConfig
from verl.workers.rollout.replica import RolloutMode

from p2pweights import P2PWeightsError
from p2pweights.engines.client import EngineClient
from p2pweights.testing import synthetic_weights

pytestmark = pytest.mark.integration

MANAGER_CLASS = "p2pweights.integrations.verl.P2PWeightsCheckpointManager"
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
        self.folder, self.seed = folder, 0

    def get_per_tensor_param(self):
        weights = synthetic_weights(self.folder, seed=self.seed, dtype=torch.bfloat16)
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


def _actor_rank(rank: int, world_size: int, init_file: str, conn, folder: str) -> None:
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
    while (command := conn.recv()) is not None:
        name, args, kwargs = command
        try:
            if name == "train":  # update_actor: the weights change
                worker.actor.engine.seed = args[0]
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


# -- the Ray layer's double ------------------------------------------------------------------


class _Answer:
    """An ObjectRef: one rank's answer, read from its pipe by ``_Ray.get``."""

    def __init__(self, conn):
        self.conn = conn


class _Ray:
    errors: list[Exception] = []
    answers: list = []  # the last call's answers, every rank's

    @staticmethod
    def get(refs):
        answers = []
        for ref in refs:
            assert ref.conn.poll(ANSWER_WAIT_S), "an actor rank did not answer"
            answers.append(ref.conn.recv())
        _Ray.answers = [value for ok, value in answers if ok]
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

    def train(self, seed):
        return _Ray.get(self._send("train", [(seed,)] * self.world_size, [{}] * self.world_size))


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


@pytest.fixture
def verl_actors(tmp_path, monkeypatch):
    """``verl_actors(folder, engines)``: (manager, actor worker group, replicas) over two
    actor-rank processes, stopped after the test."""
    ctx = mp.get_context("spawn")
    started = []

    def make(folder, engines):
        pipes = [ctx.Pipe() for _ in range(2)]
        for rank, (_, child) in enumerate(pipes):
            process = ctx.Process(
                target=_actor_rank,
                args=(rank, 2, str(tmp_path / "dist-init"), child, str(folder)),
            )
            process.start()
            started.append((process, pipes[rank][0]))
        group = _ActorWorkerGroup([parent for parent, _ in pipes])
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
    model_dir, start_engines, verl_actors
):
    folder = model_dir("qwen3-tiny")
    engines = start_engines(folder, [2, 1], seed=0)
    manager, actors, replicas = verl_actors(folder, engines)
    steps = (1, 2, 3)
    for step in steps:
        actors.train(seed=20 + step)
        metrics = manager.update_weights(step)
        assert metrics["p2pweights/bytes"] > 0
        per_target = _bytes_per_engine_rank(_Ray.answers)
        _report_step(step, metrics, per_target, folder)
        # each engine rank takes its own shard; verl's nixl / mooncake / nccl backends hand
        # every rollout worker the whole model (the TP 1 engine's one rank takes about that)
        model_bytes = sum(t.nbytes for _, t in seed_weights(folder, 20 + step))
        tp2 = [b for (url, _), b in per_target.items() if url == engines[0].url]
        assert len(tp2) == 2 and all(b < model_bytes for b in tp2)
    for engine in engines:
        client = EngineClient(engine.url)
        assert client.weight_version() == str(steps[-1])
        client.close()
    for replica in replicas:  # nothing paused, aborted or released behind p2pweights' back
        assert replica.calls == [("set_global_steps", step) for step in steps]
    assert_bit_exact(engines, folder, 20 + steps[-1])


def _bytes_per_engine_rank(answers) -> dict[tuple[str, int], float]:
    found = {}
    for metrics in answers:
        for key, value in metrics.items():
            if key.startswith("target:"):
                url, rank = key.removeprefix("target:").rsplit("#", 1)
                found[(url, int(rank))] = value
    return found


def _report_step(step, metrics, per_target, folder) -> None:
    """One line per update (``pytest -s``): the numbers docs/integrations/verl.md quotes."""
    model_bytes = sum(t.nbytes for _, t in seed_weights(folder, 0))
    ranks = ", ".join(f"{url}#{rank}: {int(b)}" for (url, rank), b in sorted(per_target.items()))
    print(
        f"verl step {step}: {metrics['p2pweights/seconds']:.3f} s, "
        f"{int(metrics['p2pweights/bytes'])} bytes written; per engine rank {ranks}; "
        f"model {model_bytes} bytes (bf16, what verl's own backends send each rollout worker)"
    )


def test_a_dead_engine_fails_send_weights_on_every_actor_rank(
    model_dir, start_engines, verl_actors
):
    folder = model_dir("qwen3-tiny")
    healthy, doomed = start_engines(folder, [1, 1], seed=0)
    manager, actors, replicas = verl_actors(folder, [healthy, doomed])
    actors.train(seed=31)
    manager.update_weights(1)
    doomed.stop()
    actors.train(seed=32)
    with pytest.raises(P2PWeightsError, match=doomed.url):
        manager.update_weights(2)
    assert len(_Ray.errors) == 2  # both actor ranks' send_weights raised
    assert all(doomed.url in str(error) for error in _Ray.errors)
    client = EngineClient(healthy.url)
    assert client.weight_version() == "1"  # refused before the healthy engine was touched
    client.close()
    assert all(("set_global_steps", 2) not in replica.calls for replica in replicas)
