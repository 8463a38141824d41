"""The plugin's CUDA IPC publication in a rank holding a real sglang model on the CPU.

An engine-side process (``_cuda_ipc_plugin_engine.py``) loads the plugin through
sglang's own ``load_plugins()`` with ``SGLANG_PLUGINS=p2pweights_cuda_ipc``, builds the
model with sglang's model code and loader and runs the plugin's hooks. CUDA IPC shares
GPU memory only, so the rank must refuse: logged, the reason published in place of its
weights, nothing raised into sglang. This process reads that from the bootstrap server
as a trainer would. tests/real_sglang runs the GPU case against a real server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from p2pweights.errors import EngineError
from p2pweights.local_engine.process import free_port
from p2pweights.testing import write_model_dir
from p2pweights.wire.publication import parse_publication

pytestmark = pytest.mark.integration

ENGINE_SCRIPT = Path(__file__).with_name("_cuda_ipc_plugin_engine.py")
MARKER = "p2pweights-test:"  # as in ENGINE_SCRIPT
ENTRY_POINT_SITE = Path(__file__).parent.parent / "real_sglang" / "cuda_ipc_entry"
"""The ``p2pweights_cuda_ipc`` entry point, for an installed p2pweights whose metadata
predates it (tests/real_sglang/_server.py explains)."""


def test_a_rank_on_the_cpu_refuses_and_says_why(tmp_path: Path) -> None:
    pytest.importorskip("sglang", reason="the rank runs sglang's model code and plugin loader")
    import importlib.metadata

    folder = write_model_dir("qwen3-tiny", tmp_path / "qwen3-tiny")
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_PLUGINS"}
    found = importlib.metadata.entry_points(group="sglang.srt.plugins")
    if not any(ep.name == "p2pweights_cuda_ipc" for ep in found):
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(ENTRY_POINT_SITE), env.get("PYTHONPATH")])
        )
    process = subprocess.Popen(
        [sys.executable, str(ENGINE_SCRIPT), str(folder), str(free_port())],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert process.stdout is not None and process.stdin is not None
        seen = None
        for line in process.stdout:
            if line.startswith(MARKER):
                seen = json.loads(line[len(MARKER) :])
                break
        if seen is None:
            _, stderr = process.communicate(timeout=30)
            pytest.fail(f"the engine-side process exited before publishing:\n{stderr[-3000:]}")
        assert seen["sources"] == ["p2pweights_cuda_ipc"]  # sglang ran this entry point
        assert seen["backend"] == "cuda_ipc" and seen["published"] is False
        body = httpx.get(f"{seen['url']}/get_transfer_engine_info", params={"rank": 0}).json()
        info = body["remote_instance_transfer_engine_info"]
        assert info["backend"] == "cuda_ipc" and "segments" not in info
        with pytest.raises(EngineError) as refused:
            parse_publication("http://engine-under-test", 0, body)
        message = str(refused.value)
        assert "rank 0 could not publish its weights for cuda_ipc" in message
        assert "shares GPU memory only" in message and "on cpu" in message
        process.stdin.write("done\n")
        process.stdin.flush()
        _, stderr = process.communicate(timeout=60)
        assert process.returncode == 0, stderr[-3000:]
        assert "p2pweights_cuda_ipc: tp rank 0 does not publish its weights" in stderr
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
