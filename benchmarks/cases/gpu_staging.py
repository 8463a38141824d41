"""Where to stage on a GPU host: device memory vs pinned host memory, NIXL (UCX) writes
into another process's GPU memory, through p2pweights' own staging pipeline.

For each staging location, the same 1 GiB of parameters (16 x 64 MiB) goes through
``TransferExecutor`` (two staging buffers, one writer thread per engine rank) into an engine process
whose weights are GPU tensors published by ``NixlPublisher``; the engine checks every
byte after every update. The ceiling is the same bytes as one NIXL write from device
memory. Needs a CUDA host and the ``nixl`` package; run on the lent H200 machine:

    python benchmarks/gpu.py staging --out benchmarks/results/gpu_staging.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from typing import Any

import torch

NUM_PARAMS = 16
URL = "http://gpu-engine"


def _source(num_bytes: int, seed: int, device: str) -> dict[str, torch.Tensor]:
    step = num_bytes // NUM_PARAMS
    g = torch.Generator(device=device).manual_seed(seed)
    return {
        f"layers.{i}.weight": torch.randint(
            0, 256, (step,), dtype=torch.uint8, device=device, generator=g
        )
        for i in range(NUM_PARAMS)
    }


def _engine(conn, num_bytes: int, gpu: int) -> None:
    from p2pweights.transports.nixl import NixlPublisher

    torch.cuda.set_device(gpu)
    flat = torch.zeros(num_bytes, dtype=torch.uint8, device=f"cuda:{gpu}")
    step = num_bytes // NUM_PARAMS
    params = {
        f"layers.{i}.weight": flat[i * step : (i + 1) * step].view(torch.bfloat16)
        for i in range(NUM_PARAMS)
    }
    publisher = NixlPublisher(backend="UCX", engine_rank=0)
    publisher.register(params)
    conn.send(publisher.publication(params))
    while (seed := conn.recv()) is not None:
        expected = _source(num_bytes, seed, f"cuda:{gpu}")
        torch.cuda.synchronize()
        conn.send(all(torch.equal(params[k].view(torch.uint8), v) for k, v in expected.items()))
    publisher.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--buffer-mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    from p2pweights.config import NixlConfig
    from p2pweights.plan.byte_plan import build_byte_plan
    from p2pweights.testing.loaders import FnLoader
    from p2pweights.transfer.executor import TransferExecutor
    from p2pweights.transports import Write
    from p2pweights.transports.nixl import NixlTransport
    from p2pweights.wire.publication import parse_publication

    num_bytes = int(args.gib * 2**30) // NUM_PARAMS * NUM_PARAMS
    engine_gpu = 1 if torch.cuda.device_count() > 1 else 0

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    engine = ctx.Process(target=_engine, args=(there, num_bytes, engine_gpu))
    engine.start()
    pub = parse_publication(URL, 0, {"remote_instance_transfer_engine_info": here.recv()})
    transport = NixlTransport(NixlConfig(backend="UCX"))
    transport.connect(pub)
    results: dict[str, object] = {
        "device": torch.cuda.get_device_name(0),
        "num_gpus": torch.cuda.device_count(),
        "engine_gpu": engine_gpu,
        "bytes": num_bytes,
        "buffer_bytes": args.buffer_mib * 2**20,
    }

    def load(key, inputs, views):
        for name, tensor in inputs:
            views[name].copy_(tensor)

    names = sorted(pub.regions)
    plan = build_byte_plan(
        {"r": [(frozenset({n}), (n,)) for n in names]},
        {"r": {n: pub.regions[n].num_bytes for n in names}},
        {"r": [pub]},
        args.buffer_mib * 2**20,
    )
    for staging in ("cuda:0", "cpu"):
        executor = TransferExecutor(transport, torch.device(staging), 60.0)
        executor.connect([pub])
        executor.reserve(plan.buffer_bytes)
        times, load_s, wait_s, ok = [], [], [], []
        for rep in range(args.reps + 1):
            source = _source(num_bytes, rep, "cuda:0")
            torch.cuda.synchronize()
            started = time.perf_counter()
            ready = ((plan.group("r", i), [(n, source[n])]) for i, n in enumerate(names))
            stats = executor.run(plan, ready, {"r": FnLoader("r", load)})
            stats.raise_if_failed()
            elapsed = time.perf_counter() - started
            here.send(rep)
            ok.append(here.recv())
            if rep > 0:  # the first is a warm-up
                times.append(elapsed)
                load_s.append(stats.load_s)
                wait_s.append(stats.wait_s)
        executor.disconnect()
        median = statistics.median(times)
        results[staging] = {
            "median_s": median,
            "gb_per_s": num_bytes / median / 1e9,
            "load_s": statistics.median(load_s),
            "wait_s": statistics.median(wait_s),
            "bit_exact_every_update": all(ok),
        }
        print(staging, results[staging], flush=True)

    # ceiling: the same bytes as one write from one registered device buffer
    flat = torch.empty(num_bytes, dtype=torch.uint8, device="cuda:0")
    transport.register(flat)
    first = pub.regions["layers.0.weight"].address
    times = []
    for _ in range(args.reps):
        started = time.perf_counter()
        transport.write(pub, [Write(flat.data_ptr(), first, num_bytes)], 60.0)
        times.append(time.perf_counter() - started)
    median = statistics.median(times)
    results["ceiling_one_write_from_device"] = {
        "median_s": median,
        "gb_per_s": num_bytes / median / 1e9,
    }
    print("ceiling", results["ceiling_one_write_from_device"], flush=True)
    here.send(None)
    engine.join(timeout=60)
    transport.close()
    print(json.dumps(results, indent=2))
    return results
