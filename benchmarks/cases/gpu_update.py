"""Full updates on GPUs against the NCCL broadcast they replace, all in one run.

The trainer (this process) holds an HF model's bf16 tensors on ``cuda:0``; a local
engine process holds its rank's weights on another GPU (``--device cuda:1``), built
and filled by sglang's own model class and loader. Measured side by side:

* ceilings, 4 GiB each: NCCL send/recv and broadcast between two processes, one
  CUDA IPC copy into another process's GPU memory (opened in the trainer's context,
  the transport's own path), a copy within one GPU, pinned device-to-host;
* p2pweights full updates (``WeightSyncSession.update``: replica loaders, control
  plane, engine begin/end) over ``CudaIpcConfig``, staged on the device and in pinned
  host memory, with the stage breakdown of each;
* the baseline: the same HF tensors broadcast by NCCL to a second process that holds
  a real model of the rank on the engine GPU, then that model's own ``load_weights``
  (what sglang's ``update_weights_from_distributed`` runs per update), no HTTP;
* colocated: the engine on the trainer's own GPU (``--parts ... colocated``).

Every engine rank is checked bit-exact by sglang's weight checker (its checksums
against a reference model built by sglang's loader on ``cuda:0``) after several
updates. The machine runs sglang's Python model code; its compiled kernels
(``sgl_kernel``) are absent there and stubbed by ``benchmarks/gpu_stub`` (nothing
may call them: ``stub_calls`` must stay empty). Run on the lent 2 x H200 machine:

    PYTHONPATH=/tmp/site:benchmarks/gpu_stub:src python3 benchmarks/gpu.py update \\
        --models qwen3-4b-shape qwen3-moe-30b-a3b-7-layers --out $OUT/gpu_update.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from harness import named_config

GiB = 2**30

RESULTS: dict[str, Any] = {}
OUT: Path | None = None


def _save() -> None:
    if OUT is not None:
        OUT.write_text(json.dumps(RESULTS, indent=2, default=str))


def _section(name: str, run: Callable[[], Any]) -> None:
    """Run one part; record its result or its error, and go on with the others."""
    started = time.perf_counter()
    try:
        RESULTS[name] = run()
    except Exception as exc:  # a benchmark records what failed and carries on
        RESULTS[name] = {"error": repr(exc), "traceback": traceback.format_exc()[-3000:]}
    RESULTS.setdefault("section_seconds", {})[name] = round(time.perf_counter() - started, 1)
    print(f"== {name}: {json.dumps(RESULTS[name], default=str)[:1500]}", flush=True)
    _save()


def _timed_gpu(fn: Callable[[], None], reps: int = 5) -> float:
    """Median seconds of ``fn`` (after one warm-up), synchronizing every GPU around it."""
    times = []
    for rep in range(reps + 1):
        torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if rep:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


# ---------------------------------------------------------------- ceilings


def local_copies(num_bytes: int, engine_gpu: int) -> dict[str, float]:
    src = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, device="cuda:0")
    same = torch.empty_like(src)
    other = torch.empty(num_bytes, dtype=torch.uint8, device=f"cuda:{engine_gpu}")
    pinned = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    result = {
        "device_copy_same_gpu_gb_s": num_bytes / _timed_gpu(lambda: same.copy_(src)) / 1e9,
        "pinned_device_to_host_gb_s": num_bytes
        / _timed_gpu(lambda: pinned.copy_(src, non_blocking=True))
        / 1e9,
        "pinned_host_to_device_gb_s": num_bytes
        / _timed_gpu(lambda: src.copy_(pinned, non_blocking=True))
        / 1e9,
    }
    if engine_gpu != 0:
        result["one_process_gpu0_to_gpu1_gb_s"] = (
            num_bytes / _timed_gpu(lambda: other.copy_(src)) / 1e9
        )
    return result


def _nccl_ceiling_worker(rank: int, port: int, num_bytes: int, gpus: list[int], queue: Any) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", gpus[rank])
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=device)
    buffer = torch.ones(num_bytes, dtype=torch.uint8, device=device)

    def send_recv() -> None:
        if rank == 0:
            dist.send(buffer, 1)
        else:
            dist.recv(buffer, 0)

    def broadcast() -> None:
        dist.broadcast(buffer, 0)

    out = {}
    for name, fn in (("send_recv", send_recv), ("broadcast", broadcast)):
        dist.barrier()
        out[f"nccl_{name}_gb_s"] = num_bytes / _timed_gpu(fn) / 1e9
    if rank == 1:
        queue.put(out)
    dist.destroy_process_group()


def _spawn_pair(target: Callable[..., None], *args: Any, timeout_s: float = 600) -> Any:
    from p2pweights.local_engine.process import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, *args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    try:
        while True:  # a worker that died (its peer then waits forever) fails the section
            try:
                result = queue.get(timeout=2)
                break
            except Exception:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"workers exited with {dead} or timed out") from None
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return result


def _ipc_engine(conn: Any, num_bytes: int, gpu: int) -> None:
    from p2pweights.transports.cuda_ipc import CudaIpcPublisher

    torch.cuda.set_device(gpu)
    flat = torch.zeros(num_bytes, dtype=torch.uint8, device=f"cuda:{gpu}")
    publisher = CudaIpcPublisher()
    publisher.register({"flat": flat})
    conn.send(publisher.publication({"flat": flat}))
    while (expected := conn.recv()) is not None:
        torch.cuda.synchronize()
        conn.send(int(flat[:: 2**20].sum().item()) == expected)


def ipc_copy(num_bytes: int, engine_gpu: int) -> dict[str, Any]:
    """One CUDA IPC write of ``num_bytes`` through ``CudaIpcTransport`` (the raw ceiling)."""
    from p2pweights.config import CudaIpcConfig
    from p2pweights.transports import Write
    from p2pweights.transports.cuda_ipc import CudaIpcTransport
    from p2pweights.wire.publication import parse_publication

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    engine = ctx.Process(target=_ipc_engine, args=(there, num_bytes, engine_gpu))
    engine.start()
    pub = parse_publication("ipc", 0, {"remote_instance_transfer_engine_info": here.recv()})
    transport = CudaIpcTransport(CudaIpcConfig(device=0))
    src = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, device="cuda:0")
    transport.register(src)
    transport.connect(pub)
    dst = pub.regions["flat"].address
    seconds = _timed_gpu(
        lambda: transport.write(pub, [Write(src.data_ptr(), dst, num_bytes)], 60.0)
    )
    here.send(int(src[:: 2**20].sum().item()))
    exact = here.recv()
    here.send(None)
    engine.join(timeout=60)
    transport.close()
    return {"gb_s": num_bytes / seconds / 1e9, "engine_gpu": engine_gpu, "sampled_equal": exact}


# ---------------------------------------------------------------- models and tensors


def trainer_tensors(config: dict[str, Any], device: str) -> list[tuple[str, torch.Tensor]]:
    from p2pweights.testing import hf_checkpoint_names_and_shapes

    return [
        (name, torch.empty(shape, dtype=torch.bfloat16, device=device))
        for name, shape, _ in hf_checkpoint_names_and_shapes(config)
    ]


def refill(tensors: list[tuple[str, torch.Tensor]], seed: int) -> None:
    """New values in place (what a training step does), drawn on the tensors' device."""
    generator = torch.Generator(device=tensors[0][1].device).manual_seed(seed)
    for name, tensor in tensors:
        tensor.normal_(1.0 if "norm" in name else 0.0, 0.02, generator=generator)


def train_like(
    tensors: list[tuple[str, torch.Tensor]], masters: list[torch.Tensor], lr: float, seed: int
) -> list[torch.Tensor]:
    """A training-like update in place: fp32 master weights (drawn once, by ``refill``)
    each moved by ``lr`` in a random direction (what Adam's first steps do to every
    weight), then cast to the bf16 tensors. Returns the masters for the next call."""
    if not masters:
        refill(tensors, seed=seed)
        return [t.float() for _, t in tensors]
    generator = torch.Generator(device=tensors[0][1].device).manual_seed(seed)
    for (_, tensor), master in zip(tensors, masters, strict=True):
        step = torch.randn(master.shape, generator=generator, device=master.device).sign_()
        master.add_(step, alpha=-lr)
        tensor.copy_(master)
    return masters


def _nbytes(tensors: list[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in tensors)


# ---------------------------------------------------------------- p2pweights updates


def p2pweights_updates(
    model: str,
    engine_gpu: int,
    stagings: list[str],
    num_updates: int,
    verify_every: int,
    buffer_bytes: int,
    replay_modes: tuple[str, ...] = ("on",),
    fused_modes: tuple[str, ...] = ("on",),
    direct_modes: tuple[str, ...] = ("on",),
    batch_modes: tuple[str, ...] = ("on",),
    stage_modes: tuple[str, ...] = ("on",),
    verify_modes: tuple[str, ...] = ("on",),
    delta_modes: tuple[str, ...] = ("off",),
    delta_lr: float = 1e-6,
) -> dict[str, Any]:
    """Updates into a fresh local engine on ``engine_gpu``, one session per combination
    of staging and the switches: replay (``"off"`` sets ``P2PWEIGHTS_LOADER_REPLAY=0``:
    sglang's loaders run every update; ``"ops"`` replays op by op on a GPU too, as before
    copies were batched; ``"foreach"`` batches them without the gathered-copies kernel,
    ``P2PWEIGHTS_COPY_KERNEL=0``), fp8 quantizer (``"off"`` sets ``P2PWEIGHTS_FUSED_FP8=0``:
    torch's math, not the one-pass kernel; only fp8 engines quantize),
    ``CudaIpcConfig.direct`` (off: an engine on the trainer's GPU is staged like any
    other), fp8 quantization in batches (off: one kernel launch per weight) and
    ``SyncConfig.stage_before_pause`` (off: the engine pauses before the inputs are read)
    and ``SyncConfig.verify_writes`` (on: "always", every staged write's digest compared
    with the engine rank's; off: "off"; stages "digest", "engine_digest", "verify_writes")
    and ``SyncConfig.delta`` (on: ``DeltaConfig()``). Where a delta run is asked for, every
    run's tensors change as training steps change them (``train_like``: fp32 masters
    moved by about ``delta_lr`` each, then cast) instead of being drawn afresh, so the
    full and the delta runs send the same updates."""
    from p2pweights import CudaIpcConfig, EngineClient, SyncConfig, Timeouts, WeightSyncSession
    from p2pweights.config import DeltaConfig
    from p2pweights.local_engine import LocalEngine
    from p2pweights.replica.sglang.replay import Replay
    from p2pweights.source import collect
    from p2pweights.verify import verify_engine

    default_batch = collect._BATCH_TENSORS
    batched = Replay._run_on_one_gpu

    config = named_config(model)
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"p2pw-{model}.json"
    path.write_text(json.dumps(config))
    tensors = trainer_tensors(config, "cuda:0")
    num_bytes = _nbytes(tensors)
    out: dict[str, Any] = {"hf_bytes": num_bytes, "num_hf_tensors": len(tensors)}
    started = time.perf_counter()
    engine = LocalEngine(
        str(path),
        tp=1,
        transport="cuda_ipc",
        device=f"cuda:{engine_gpu}",
        seed=0,
        startup_timeout_s=900,
        log_path=Path(os.environ.get("OUT", "/tmp")) / f"engine-{model}-gpu{engine_gpu}.log",
        # the engine digests before every end only where a run verifies (or sends deltas):
        # the digest sits in its pause
        env={"P2PWEIGHTS_WRITE_DIGESTS": "1" if {"on"} & {*verify_modes, *delta_modes} else "0"},
    )
    with engine:
        out["engine_start_s"] = round(time.perf_counter() - started, 1)
        client = EngineClient(engine.url, timeout_s=600)
        runs = [
            (s, r, f, d, b, p, v, dm)
            for s in stagings
            for r in replay_modes
            for f in fused_modes
            for d in direct_modes
            for b in batch_modes
            for p in stage_modes
            for v in verify_modes
            for dm in delta_modes
        ]
        train = "on" in delta_modes
        for index, (staging, mode, fused, direct, batch, staged, verify, dm) in enumerate(runs):
            os.environ["P2PWEIGHTS_LOADER_REPLAY"] = "0" if mode == "off" else "1"
            os.environ["P2PWEIGHTS_COPY_KERNEL"] = "0" if mode == "foreach" else "1"
            Replay._run_on_one_gpu = (  # type: ignore[method-assign]
                Replay._run_in_order if mode == "ops" else batched
            )
            collect._BATCH_TENSORS = default_batch if batch == "on" else 1
            os.environ["P2PWEIGHTS_FUSED_FP8"] = "1" if fused == "on" else "0"
            config_ = SyncConfig(
                transport=CudaIpcConfig(device=0, direct=direct == "on"),
                buffer_bytes=buffer_bytes,
                timeouts=Timeouts(read=600),
                stage_before_pause=staged == "on",
                verify_writes="always" if verify == "on" else "off",
                delta=DeltaConfig() if dm == "on" else None,
            )
            session = WeightSyncSession(config_, staging_device=staging)
            masters: list[torch.Tensor] = []
            session.connect([engine.url])
            rows = []
            for k in range(num_updates):
                if train:  # the same training-like updates for every run
                    masters = train_like(tensors, masters, delta_lr, seed=k)
                else:
                    refill(tensors, seed=1000 * index + k)
                torch.cuda.synchronize()
                report = session.update(tensors)
                row: dict[str, Any] = {
                    "seconds": report.seconds,
                    "bytes": report.bytes_written,
                    "stages": report.stage_seconds,
                    "paused_s": max(getattr(report, "paused_s", {}).values(), default=0.0),
                    "control_calls": getattr(report, "num_control_calls", 0),
                    "control_call_s": getattr(report, "control_call_seconds", 0.0),
                    "calls_by_route_ms": {
                        route: [count, round(seconds * 1e3, 2)]
                        for (_, route), (
                            count,
                            seconds,
                        ) in session._connection.fleet.control_calls().by_route().items()
                    },
                }
                delta = report.delta
                if delta is not None:
                    row["delta"] = {
                        "sent_fraction": delta.fraction,
                        "full_bytes": delta.full_bytes,
                        "delta_slots": delta.num_delta_params,
                        "full_slots": delta.num_full_params,
                        "unchanged_slots": delta.num_unchanged_params,
                        "store_bytes": delta.store_bytes,
                    }
                if k == 0 or k == num_updates - 1 or (verify_every and k % verify_every == 0):
                    t0 = time.perf_counter()
                    mismatches = verify_engine(client, lambda: iter(tensors), device="cuda:0")
                    row["bit_exact"] = all(not names for names in mismatches.values())
                    row["mismatches"] = {r: names[:5] for r, names in mismatches.items() if names}
                    row["verify_s"] = round(time.perf_counter() - t0, 2)
                    torch.cuda.empty_cache()
                rows.append(row)
                print(
                    f"  {model} {staging} replay {mode} fused {fused} direct {direct} "
                    f"batch {batch} staged-before-pause {staged} verify {verify} delta {dm} "
                    f"update {k}: "
                    f"{report.summary()} "
                    f"(engine paused {row['paused_s'] * 1e3:.1f} ms)"
                )
            session.close()
            # the first update probes; with replay the second runs the loaders to confirm
            timed = rows[1 if mode == "off" else 2 :] or rows
            median_s = statistics.median(r["seconds"] for r in timed)
            stages = {
                name: statistics.median(r["stages"].get(name, 0.0) for r in timed)
                for name in timed[0]["stages"]
            }
            key = (
                staging
                + {
                    "on": "",
                    "off": "/no-replay",
                    "ops": "/replay-op-by-op",
                    "foreach": "/replay-foreach",
                }[mode]
            )
            key += "/no-fused" if fused == "off" else ""
            key += "/no-direct" if direct == "off" else ""
            key += "/pause-first" if staged == "off" else ""
            key += "/no-verify" if verify == "off" else ""
            key += "/delta" if dm == "on" else ""
            out[key + ("/no-batch" if batch == "off" else "")] = {
                "median_update_s": median_s,
                "median_paused_s": statistics.median(r["paused_s"] for r in timed),
                "median_control_calls": statistics.median(r["control_calls"] for r in timed),
                "median_control_call_s": statistics.median(r["control_call_s"] for r in timed),
                "update_gb_s": num_bytes / median_s / 1e9,
                "median_stages_s": stages,
                "load_stage_gb_s": num_bytes / stages["load"] / 1e9 if stages.get("load") else None,
                "verified_updates": [i for i, r in enumerate(rows) if "bit_exact" in r],
                "bit_exact_every_verified_update": all(
                    r["bit_exact"] for r in rows if "bit_exact" in r
                ),
                "updates": rows,
            }
        client.close()
    return out


# ---------------------------------------------------------------- NCCL broadcast baseline


def _broadcast_worker(
    rank: int,
    port: int,
    model: str,
    folder: str,
    gpus: list[int],
    num_updates: int,
    queue: Any,
) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", gpus[rank])
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=device)
    tensors = trainer_tensors(named_config(model), str(device))
    refill(tensors, seed=7)
    model_ = None
    if rank == 1:
        from p2pweights.replica.ranks import RankSpec
        from p2pweights.replica.sglang import env as sglang_env
        from p2pweights.replica.sglang.facade import resolved_server_info
        from p2pweights.replica.sglang.reference import load_real_rank_model

        server_info = resolved_server_info(
            {"model_path": folder, "tp_size": 1, "dtype": "bfloat16"}
        )
        spec = RankSpec.from_server_info(server_info, 0)
        model_ = load_real_rank_model(
            server_info["model_path"],
            spec,
            iter(tensors),
            dtype="bfloat16",
            server_args_fields=server_info,
            device=device,
        )
    broadcast_s, total_s = [], []
    for _ in range(num_updates + 1):
        dist.barrier()
        torch.cuda.synchronize()
        started = time.perf_counter()
        if rank == 0:
            work = [dist.broadcast(t, 0, async_op=True) for _, t in tensors]
        else:  # sglang's update_weights_from_distributed: fresh buffers, one broadcast each
            received = [(n, torch.empty_like(t)) for n, t in tensors]
            work = [dist.broadcast(t, 0, async_op=True) for _, t in received]
        for w in work:
            w.wait()
        torch.cuda.synchronize()
        broadcast_s.append(time.perf_counter() - started)
        if rank == 1:
            with sglang_env.rank_scope(spec), torch.no_grad():
                model_.load_weights(iter(received))  # type: ignore[union-attr]
            torch.cuda.synchronize()
        total_s.append(time.perf_counter() - started)
    if rank == 1:
        queue.put(
            {
                "broadcast_s": statistics.median(broadcast_s[1:]),
                "broadcast_and_load_weights_s": statistics.median(total_s[1:]),
            }
        )
    dist.destroy_process_group()


def nccl_baseline(model: str, engine_gpu: int, num_updates: int) -> dict[str, Any]:
    config = named_config(model)
    folder = Path(os.environ.get("TMPDIR", "/tmp")) / f"p2pw-{model}-bcast"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    out = _spawn_pair(_broadcast_worker, model, str(folder), [0, engine_gpu], num_updates)
    num_bytes = sum(t.numel() * 2 for _, t in trainer_tensors(config, "meta"))
    out["broadcast_gb_s"] = num_bytes / out["broadcast_s"] / 1e9
    out["broadcast_and_load_weights_gb_s"] = num_bytes / out["broadcast_and_load_weights_s"] / 1e9
    return out


# ---------------------------------------------------------------- load_weights floor


def load_weights_floor(model: str, num_updates: int) -> dict[str, Any]:
    """sglang's own ``load_weights`` of the trainer's tensors into the rank's model, all
    on ``cuda:0`` in this one process: no transfer, no HTTP, no pause; the least any
    in-place update of those weights could take (what the issue's pause target is
    measured against)."""
    from p2pweights.replica.ranks import RankSpec
    from p2pweights.replica.sglang import env as sglang_env
    from p2pweights.replica.sglang.facade import resolved_server_info
    from p2pweights.replica.sglang.reference import load_real_rank_model

    config = named_config(model)
    folder = Path(os.environ.get("TMPDIR", "/tmp")) / f"p2pw-{model}-floor"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    tensors = trainer_tensors(config, "cuda:0")
    refill(tensors, seed=11)
    server_info = resolved_server_info(
        {"model_path": str(folder), "tp_size": 1, "dtype": "bfloat16"}
    )
    spec = RankSpec.from_server_info(server_info, 0)
    model_ = load_real_rank_model(
        server_info["model_path"],
        spec,
        iter(tensors),
        dtype="bfloat16",
        server_args_fields=server_info,
        device=torch.device("cuda", 0),
    )
    times = []
    for k in range(num_updates + 1):
        refill(tensors, seed=12 + k)
        torch.cuda.synchronize()
        started = time.perf_counter()
        with sglang_env.rank_scope(spec), torch.no_grad():
            model_.load_weights(iter(tensors))  # type: ignore[union-attr]
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    num_bytes = _nbytes(tensors)
    del model_
    torch.cuda.empty_cache()
    median_s = statistics.median(times[1:])
    return {"load_weights_s": median_s, "all_s": times, "gb_s": num_bytes / median_s / 1e9}


# ---------------------------------------------------------------- main


def _stub_calls() -> Any:
    module = sys.modules.get("sgl_kernel")
    site = sys.modules.get("sitecustomize")
    return {
        "sgl_kernel": "not imported"
        if module is None
        else {"stub": getattr(module, "STUB", False), "calls": getattr(module, "CALLS", None)},
        "sitecustomize_patched": getattr(site, "PATCHED", None),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", default=["qwen3-4b-shape"])
    parser.add_argument("--gib", type=float, default=4.0, help="bytes of the ceiling copies")
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--verify-every", type=int, default=2)
    parser.add_argument("--buffer-mib", type=int, default=512)
    parser.add_argument("--stagings", nargs="+", default=["cuda:0", "cpu"])
    for switch, off in (
        (
            "replay",
            "sglang's loaders every update; ops: replayed op by op; foreach: batched "
            "without the gathered-copies kernel",
        ),
        ("fused", "torch's fp8 math instead of the kernel"),
        ("direct", "CudaIpcConfig(direct=False): a colocated engine is staged"),
        ("batch", "one fp8 kernel launch per weight"),
        ("stage-before-pause", "engines pause before the inputs are read"),
        ("verify", "SyncConfig(verify_writes='off'); on: 'always'"),
    ):
        parser.add_argument(
            f"--{switch}",
            nargs="+",
            default=["on"],
            choices=["on", "off", "ops", "foreach"] if switch == "replay" else ["on", "off"],
            help=f"modes to run side by side (off: {off})",
        )
    parser.add_argument(
        "--delta",
        nargs="+",
        default=["off"],
        choices=["on", "off"],
        help="SyncConfig(delta=DeltaConfig()) runs beside full ones (on); every run's tensors "
        "then change as training steps change them. A colocated engine is loaded directly "
        "(no staging, no delta): use --direct off",
    )
    parser.add_argument("--delta-lr", type=float, default=1e-6)
    parser.add_argument(
        "--parts",
        nargs="+",
        default=["updates", "baseline"],
        choices=["updates", "baseline", "colocated", "floor"],
        help="per model: p2pweights updates, the NCCL baseline, updates into an engine on "
        "cuda:0, the engine model's own load_weights of the same tensors in one process",
    )
    parser.add_argument("--skip-ceilings", action="store_true")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every part asked for; the results so far are saved to ``--out`` after each."""
    global OUT
    OUT = Path(args.out)
    engine_gpu = 1 if torch.cuda.device_count() > 1 else 0
    num_bytes = int(args.gib * GiB)
    RESULTS["machine"] = {
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "engine_gpu": engine_gpu,
        "args": {k: v for k, v in vars(args).items() if k not in ("entry", "command")},
    }
    if not args.skip_ceilings:
        _section("local_copies", lambda: local_copies(num_bytes, engine_gpu))
        _section("ipc_copy", lambda: ipc_copy(num_bytes, engine_gpu))
        if engine_gpu:
            _section("ipc_copy_colocated", lambda: ipc_copy(num_bytes, 0))
            _section(
                "nccl",
                lambda: _spawn_pair(_nccl_ceiling_worker, num_bytes, [0, engine_gpu]),
            )
    for model in args.models:
        if "updates" in args.parts:
            _section(
                f"update/{model}",
                lambda model=model: p2pweights_updates(
                    model,
                    engine_gpu,
                    args.stagings,
                    args.updates,
                    args.verify_every,
                    args.buffer_mib * 2**20,
                    tuple(args.replay),
                    tuple(args.fused),
                    tuple(args.direct),
                    tuple(args.batch),
                    tuple(args.stage_before_pause),
                    tuple(args.verify),
                    tuple(args.delta),
                    args.delta_lr,
                ),
            )
        if engine_gpu and "baseline" in args.parts:
            _section(
                f"nccl_baseline/{model}", lambda model=model: nccl_baseline(model, engine_gpu, 3)
            )
        if "colocated" in args.parts:
            _section(
                f"colocated/{model}",
                lambda model=model: p2pweights_updates(
                    model,
                    0,
                    ["cuda:0"],
                    args.updates,
                    args.verify_every,
                    args.buffer_mib * 2**20,
                    direct_modes=tuple(args.direct),
                    stage_modes=tuple(args.stage_before_pause),
                    verify_modes=tuple(args.verify),
                    delta_modes=tuple(args.delta),
                    delta_lr=args.delta_lr,
                ),
            )
        if "floor" in args.parts:
            _section(f"floor/{model}", lambda model=model: load_weights_floor(model, args.updates))
    RESULTS["sgl_kernel"] = _stub_calls()
    print(json.dumps(RESULTS, indent=2, default=str)[-6000:])
    return RESULTS
