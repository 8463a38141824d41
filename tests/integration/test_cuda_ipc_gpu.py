"""Full updates into a GPU engine over CUDA IPC, bit-exact by sglang's checker (GPU hosts).

The engine process holds its ranks' weights on the last GPU (``--device cuda:N``);
this process is the trainer, with its HF tensors on ``cuda:0`` and its staging buffers
on the device or in pinned host memory. After each of several updates every engine
rank's checksums (sglang's ``WeightChecker``) must equal those of a reference model
sglang's own loader builds from the same tensors. Skipped where no GPU is (CI); the
refusals of the transport are tested on the CPU in tests/unit/test_cuda_ipc.py. On a
CPU host, an engine asked to publish over CUDA IPC must fail to start, saying why.
"""

from __future__ import annotations

import pytest
import torch

from p2pweights import CudaIpcConfig, SyncConfig, WeightSyncSession
from p2pweights.errors import EngineError
from p2pweights.local_engine import LocalEngine
from p2pweights.testing import synthetic_weights
from p2pweights.verify import EngineClient, verify_engine

pytestmark = pytest.mark.integration

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _updates_verified(session, engine, folder, seeds) -> list:
    """One update per seed from tensors on cuda:0, each checked bit-exact on every rank."""
    client = EngineClient(engine.url)
    reports = []
    try:
        for seed in seeds:
            tensors = [
                (name, t.to("cuda:0"))
                for name, t in synthetic_weights(folder / "config.json", seed=seed)
            ]
            reports.append(session.update(tensors))
            mismatches = verify_engine(client, tensors.__iter__, device="cuda:0")
            assert mismatches == {r: [] for r in range(engine.tp)}, f"update from seed {seed}"
    finally:
        client.close()
    return reports


@needs_gpu
@pytest.mark.parametrize("staging", ["cuda:0", "cpu"])
@pytest.mark.parametrize("model", ["qwen3-tiny", "qwen3-moe-tiny", "deepseek-v3-fp8-tiny"])
def test_updates_land_bit_exact_in_a_gpu_engine(model_dir, model: str, staging: str) -> None:
    folder = model_dir(model)
    engine_device = f"cuda:{torch.cuda.device_count() - 1}"
    with LocalEngine(folder, tp=2, transport="cuda_ipc", device=engine_device) as engine:
        config = SyncConfig(transport=CudaIpcConfig(device=0), buffer_bytes="1MiB")
        with WeightSyncSession(config, staging_device=staging) as session:
            session.connect([engine.url])
            for report in _updates_verified(session, engine, folder, (11, 12, 13)):
                assert report.bytes_written > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a host without a GPU")
def test_a_cpu_engine_cannot_publish_over_cuda_ipc(model_dir) -> None:
    engine = LocalEngine(model_dir("qwen3-tiny"), tp=1, transport="cuda_ipc")
    with pytest.raises(EngineError) as caught, engine:
        pass
    assert "CUDA IPC shares GPU memory only" in str(caught.value)


@needs_gpu
@pytest.mark.parametrize("direct", [True, False])
def test_an_engine_on_the_trainers_gpu_is_loaded_directly(model_dir, direct: bool) -> None:
    """Colocated: the loaders write the engine's memory themselves (no staging copy, no
    IPC write), bit-exact; ``CudaIpcConfig(direct=False)`` stages it like any other."""
    folder = model_dir("qwen3-moe-tiny")
    with LocalEngine(folder, tp=2, transport="cuda_ipc", device="cuda:0") as engine:
        config = SyncConfig(transport=CudaIpcConfig(device=0, direct=direct), buffer_bytes="1MiB")
        with WeightSyncSession(config, staging_device="cuda:0") as session:
            session.connect([engine.url])
            _updates_verified(session, engine, folder, (21, 22, 23))
            transport = (
                session._connection.executor.transport
            )  # what the transport mapped for loads
            mapped = [view for view in transport._direct.values() if view is not None]
            assert bool(mapped) is direct
