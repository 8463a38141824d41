"""``WeightSyncSession.from_torch_distributed`` builds each rank's ``TrainerTopology`` from
the process group (two gloo ranks in separate processes): one sender group, two pipeline
stages given as arguments, and the same through the deprecated ``SyncConfig`` fields."""

from __future__ import annotations

import multiprocessing as mp
import warnings

from p2pweights import SyncConfig, TrainerTopology
from p2pweights.local_engine import free_port


def _rank(rank: int, port: int, out) -> None:
    import torch.distributed as dist

    from p2pweights import WeightSyncSession

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    topologies = []
    with WeightSyncSession.from_torch_distributed(SyncConfig()) as session:
        topologies.append(session.topology)
    staged = WeightSyncSession.from_torch_distributed(
        SyncConfig(), pipeline_stage=rank, num_pipeline_stages=2
    )
    with staged:
        topologies.append(staged.topology)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = SyncConfig(pipeline_stage=rank, num_pipeline_stages=2)
    with WeightSyncSession.from_torch_distributed(old) as session:
        topologies.append(session.topology)
    deprecated = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    out.put((rank, topologies, len(deprecated)))
    dist.destroy_process_group()


def test_from_torch_distributed_builds_each_ranks_topology():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(
        (rank, (topologies, warned))
        for rank, topologies, warned in (out.get(timeout=120) for _ in procs)
    )
    for p in procs:
        p.join(timeout=60)
    for rank in range(2):
        topologies, warned = results[rank]
        assert topologies[0] == TrainerTopology(rank=rank, num_ranks=2)
        stage = TrainerTopology(rank=0, num_ranks=1, pipeline_stage=rank, num_pipeline_stages=2)
        assert topologies[1] == stage
        assert topologies[2] == stage and warned == 1  # the old fields: same, with a warning
