"""The plain PyTorch guide's trainer (docs/integrations/plain-pytorch.md) runs as written.

The page's first Python block is copied out and launched with torchrun on two CPU ranks
(gloo, FSDP2) against a local TP 2 engine started from the same checkpoint. After its
training steps, every engine rank must be bit-exact with sglang's loader given the
tensors the trainer last sent (which it saves, under checkpoint names).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from p2pweights.engines.client import EngineClient
from p2pweights.local_engine import free_port
from p2pweights.testing import save_safetensors, synthetic_weights, write_model_dir
from p2pweights.verify import verify_engine

pytestmark = pytest.mark.integration

GUIDE = Path(__file__).parents[2] / "docs" / "integrations" / "plain-pytorch.md"


def _first_python_block(page: Path) -> str:
    match = re.search(r"```python\n(.*?)```", page.read_text(), re.DOTALL)
    assert match, f"no python block in {page}"
    return match.group(1)


def test_the_plain_pytorch_guide_trains_and_keeps_the_engine_bit_exact(start_engines, tmp_path):
    folder = write_model_dir("qwen3-tiny", tmp_path / "model")
    start = list(synthetic_weights(folder, seed=3, dtype=torch.bfloat16))
    save_safetensors(folder, start)
    (engine,) = start_engines(folder, [2], weights=folder, seed=None)
    script = tmp_path / "train.py"
    script.write_text(_first_python_block(GUIDE))
    saved = tmp_path / "last-update.safetensors"
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"),
        *("--master-port", str(free_port())),
        *(str(script), "--model", str(folder), "--engine", engine.url),
        *("--protocol", "tcp", "--steps", "2", "--save", str(saved)),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(command, capture_output=True, text=True, timeout=420, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert "step 1: loss" in run.stdout
    last = load_file(saved)
    assert sorted(last) == sorted(name for name, _ in start)  # checkpoint names
    assert any(not torch.equal(last[n], t) for n, t in start)  # training changed the weights
    client = EngineClient(engine.url)
    try:
        assert client.weight_version() == "2"
        assert verify_engine(client, lambda: list(last.items())) == {0: [], 1: []}
    finally:
        client.close()
