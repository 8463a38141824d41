"""Build a local engine's ranks and serve them (the ``p2pweights engine`` command)."""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from p2pweights import logs
from p2pweights.local_engine.ranks import EngineRank
from p2pweights.local_engine.server import create_app
from p2pweights.replica.engine_checkpoint import engine_checkpoint
from p2pweights.replica.ranks import RankSpec
from p2pweights.replica.sglang.facade import resolved_server_info
from p2pweights.source.synthetic import synthetic_weights, write_model_dir

logger = logging.getLogger(__name__)


def model_folder(model: str) -> Path:
    """The absolute folder holding ``config.json`` for ``model`` (a folder, a config.json, or
    any .json): the engine publishes it as ``model_path``, which trainers started in other
    directories read."""
    path = Path(model).resolve()
    if path.is_dir():
        return path
    if path.name == "config.json":
        return path.parent
    return write_model_dir(path, tempfile.mkdtemp(prefix="p2pweights-model-")).resolve()


def read_safetensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of every ``*.safetensors`` file in ``folder``, in file then key order."""
    from safetensors import safe_open

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                yield key, handle.get_tensor(key)


def serve(
    model: str,
    *,
    tp: int,
    port: int,
    host: str = "127.0.0.1",
    transport: str = "mooncake",
    weights: str | None = None,
    seed: int | None = 0,
    dtype: str = "bfloat16",
    server_args: dict[str, Any] | None = None,
    device: str = "cpu",
) -> None:
    import uvicorn

    logs.configure()
    folder = model_folder(model)
    engine_device = torch.device(device)
    if engine_device.type == "cuda":
        if engine_device.index is None:  # "cuda": the current GPU, named
            engine_device = torch.device("cuda", torch.cuda.current_device())
        # sglang's weight checker and loaders use the current device
        torch.cuda.set_device(engine_device)
    torch_dtype = getattr(torch, dtype)
    server_info = resolved_server_info(
        {
            **(server_args or {}),
            "model_path": str(folder),
            "tp_size": tp,
            "dtype": dtype,
            "host": host,
            "port": port,
        }
    )
    # not sglang's: the device its weights are on (sglang's resolved "device" says "cuda"
    # on a host without one), which its weights checker hashes on (verification.checker)
    server_info["p2pweights_engine_device"] = engine_device.type

    def hf_weights() -> Iterator[tuple[str, torch.Tensor]]:
        if weights is not None:
            return read_safetensors(weights)
        synthetic = synthetic_weights(folder, seed=seed or 0, dtype=torch_dtype)
        return iter(engine_checkpoint(folder, synthetic))

    ranks = [
        EngineRank(
            server_info,
            RankSpec.from_server_info(server_info, r),
            hf_weights,
            transport,
            engine_device,
        )
        for r in range(tp)
    ]
    logger.info(
        "local engine: %d rank(s) of %s on %s ready on %s:%d", tp, model, device, host, port
    )
    app = create_app(server_info, ranks)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        for rank in ranks:
            rank.close()
