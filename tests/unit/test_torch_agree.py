"""torch_agree over a real gloo group of two processes: any False makes everyone False."""

from __future__ import annotations

import multiprocessing as mp

from p2pweights.local_engine import free_port


def _rank(rank: int, port: int, votes: list[bool], out) -> None:
    import torch.distributed as dist

    from p2pweights.adapters import torch_agree

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    agree = torch_agree()
    out.put((rank, [agree(v) for v in votes[rank::2]]))
    dist.destroy_process_group()


def test_all_ranks_learn_any_failure():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    votes = [True, True, True, False, False, True]  # pairs: (T,T) (T,F) (F,T)
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, votes, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert results == {0: [True, False, False], 1: [True, False, False]}
