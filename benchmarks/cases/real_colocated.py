"""A real sglang server on the trainer's GPU: how long one update keeps it from serving,
p2pweights against sglang's own ``update_weights_from_tensor`` of the same tensors.

One sglang 0.5.23 server per (model, path) on cuda:0 (CUDA graphs captured at start, Triton
attention), the trainer's bf16 tensors on the same GPU. Side by side, update by update:

* ``p2pweights``: ``session.update(tensors)`` over the path (``mooncake``: the server's own
  Mooncake publication, device staging; ``nixl``: the p2pweights plugin; ``cuda_ipc``:
  the plugin's CUDA IPC publication), reporting ``paused_s`` (pause answered to resume
  answered) and the whole update;
* ``update_weights_from_tensor``: what verl's and slime's colocated modes call, over
  HTTP with the tensors shared by CUDA IPC handles (``MultiprocessingSerializer``, as
  slime does), inside the pause / begin / end / continue session sglang 0.5.23 requires
  for it; the wall time of those five calls is its pause. On the ``cuda_ipc`` and
  ``nixl`` paths the server runs the p2pweights plugin, whose hooks also run in this
  session (a digest of every weight before its end, two short PUTs), so there the
  baseline carries that cost too; the ``mooncake`` path's server runs no plugin and is
  the clean baseline (run it beside the others: ``--paths mooncake cuda_ipc``).

Needs the GPU relay's packages (scripts/gpu_sglang/device.sh stage3 runs it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from harness import ROOT, hf_bytes, named_config

sys.path.insert(0, str(ROOT / "tests" / "real_sglang"))

PATHS = {
    "mooncake": {"nixl": False, "mooncake": True},
    "nixl": {"nixl": True, "mooncake": False},
    "cuda_ipc": {"nixl": False, "mooncake": False, "cuda_ipc": True},
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", default=["qwen3-tiny", "qwen3-4b-shape"])
    parser.add_argument(
        "--paths", nargs="+", default=["cuda_ipc", "mooncake", "nixl"], choices=list(PATHS)
    )
    parser.add_argument("--updates", type=int, default=4, help="per method; the first is a warm-up")


def _tensors(config: dict[str, Any], seed: int) -> list[tuple[str, torch.Tensor]]:
    from p2pweights.testing import synthetic_weights

    return [(n, t.to("cuda:0")) for n, t in synthetic_weights(config, seed, dtype=torch.bfloat16)]


def _sglang_update(url: str, tensors: list[tuple[str, torch.Tensor]], version: str) -> float:
    """sglang's own colocated update, timed from the pause to the resume: 0.5.23 accepts
    ``update_weights_from_tensor`` only inside a weight-update session (it answers "must run
    between begin_weight_update() and end_weight_update()" otherwise, seen on the H100), so
    a caller on it pauses, begins, sends, ends and resumes, and all five keep the engine
    from serving."""
    from sglang.srt.utils import MultiprocessingSerializer

    def post(route: str, body: dict[str, Any]) -> dict[str, Any]:
        answer = httpx.post(f"{url}{route}", json=body, timeout=600)
        answer.raise_for_status()
        payload = answer.json() if answer.content else {}
        if isinstance(payload, dict) and payload.get("success") is False:
            raise RuntimeError(f"{route} failed: {payload}")
        return payload if isinstance(payload, dict) else {}

    started = time.perf_counter()
    post("/pause_generation", {"mode": "retract"})  # as p2pweights pauses by default
    try:
        post("/begin_weight_update", {"selector": "all"})
        try:
            post(
                "/update_weights_from_tensor",
                {
                    "serialized_named_tensors": [
                        MultiprocessingSerializer.serialize(tensors, output_str=True)
                    ],
                    "flush_cache": True,
                    "weight_version": version,
                },
            )
        finally:  # a failed update still ends the session, so the next method can begin
            post("/end_weight_update", {})
    finally:
        post("/continue_generation", {"torch_empty_cache": False})
    return time.perf_counter() - started


def one(model: str, path: str, updates: int) -> dict[str, Any]:
    from _server import RealServer

    from p2pweights import CudaIpcConfig, MooncakeConfig, NixlConfig, SyncConfig, WeightSyncSession
    from p2pweights.testing import save_safetensors, synthetic_weights, write_model_dir

    config = named_config(model)
    with tempfile.TemporaryDirectory() as folder_name:
        folder = write_model_dir(config, Path(folder_name))
        save_safetensors(folder, synthetic_weights(config, seed=0, dtype=torch.bfloat16))
        mem = "0.05" if hf_bytes(config) < 2**30 else "0.35"
        server = RealServer(
            folder,
            tp=1,
            log_path=Path(folder_name) / "server.log",
            cuda_graphs=True,
            model_args=("--mem-fraction-static", mem),
            **PATHS[path],
        )
        server.start()
        try:
            server.wait_ready()
            transport = {
                "mooncake": MooncakeConfig(protocol="tcp"),
                "nixl": NixlConfig(backend="UCX"),
                "cuda_ipc": CudaIpcConfig(device=0),
            }[path]
            ours: list[dict[str, float]] = []
            theirs: list[float] = []
            with WeightSyncSession(
                SyncConfig(transport=transport), staging_device="cuda:0"
            ) as session:
                session.connect([server.url])
                for step in range(updates):
                    tensors = _tensors(config, seed=100 + step)
                    torch.cuda.synchronize()
                    # alternate which goes first, so neither always meets a warm engine
                    order = ("p2pweights", "sglang") if step % 2 == 0 else ("sglang", "p2pweights")
                    for method in order:
                        if method == "p2pweights":
                            report = session.update(tensors)
                            ours.append(
                                {
                                    "paused_s": report.engines[server.url].paused_s or 0.0,
                                    "update_s": report.seconds,
                                }
                            )
                        else:
                            theirs.append(_sglang_update(server.url, tensors, f"sglang-{step}"))
                    del tensors
            assert len(server.generate([5, 17, 99], 4)) == 4
        finally:
            server.stop()

    def med(values: list[float]) -> float:
        return round(statistics.median(values[1:] or values), 4)

    paused, update, sglang_s = (
        med([o["paused_s"] for o in ours]),
        med([o["update_s"] for o in ours]),
        med(theirs),
    )
    return {
        "model": model,
        "path": path,
        "bytes": hf_bytes(config),
        "p2pweights_paused_s": paused,
        "p2pweights_update_s": update,
        "update_weights_from_tensor_s": sglang_s,
        "paused_ratio": round(sglang_s / paused, 2) if paused else None,
        "raw": {"p2pweights": ours, "update_weights_from_tensor": theirs},
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0), "cases": []}
    for model in args.models:
        for path in args.paths:
            try:
                case = one(model, path, args.updates)
            except Exception as exc:  # a case that cannot run says why; the others still run
                case = {"model": model, "path": path, "error": repr(exc)[:2000]}
            print(case, flush=True)
            results["cases"].append(case)
    return results
