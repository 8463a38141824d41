"""The processes integration tests fork from the warm server (``_procs``) behave as the ones
they stand for: an engine answers from its own session and log, and on a GPU host a forked
process can still use CUDA (the server must not have initialized it)."""

from __future__ import annotations

import os
import queue

import pytest
import torch
from _procs import ForkedEngine, warm_context

from p2pweights.engines.client import EngineClient

pytestmark = pytest.mark.integration


def _uses_cuda(out) -> None:
    out.put(float(torch.ones(4, device="cuda").sum()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_process_forked_from_the_warm_server_can_use_cuda():
    ctx = warm_context()
    out = ctx.Queue()
    child = ctx.Process(target=_uses_cuda, args=(out,))
    child.start()
    try:
        assert out.get(timeout=120) == 4.0
    except queue.Empty:
        pytest.fail(f"the forked process gave no answer (exit code {child.exitcode})")
    finally:
        child.join(30)
    assert child.exitcode == 0


def test_a_forked_engine_serves_in_a_session_of_its_own_and_logs_to_its_file(model_dir):
    pytest.importorskip("mooncake.engine")  # the engine's transport (the GPU machine lacks it)
    engine = ForkedEngine(model_dir("qwen3-tiny"), tp=1, seed=3)
    with engine:
        assert os.getsid(engine.pid) == engine.pid != os.getsid(0)
        client = EngineClient(engine.url)
        try:
            assert client.server_info()["tp_size"] == 1
        finally:
            client.close()
    assert engine.pid is None
    assert "ready on" in engine.log_tail()
    with pytest.raises(ValueError, match="logs to a file"):
        ForkedEngine(model_dir("qwen3-tiny"), stream_log=True).start()
