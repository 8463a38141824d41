"""p2pweights changes no process-wide state another thread of a trainer could see.

Each test holds one of p2pweights' scoped changes open in this thread, then looks at
the global from another thread: it must be unchanged there (or behave as the
original), and after the block nothing differs.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch


def in_other_thread(probe: Callable[[], Any]) -> Any:
    """What ``probe()`` returns (or raises, as ``("raised", type name)``) in a new thread."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(outcome(probe)))
    thread.start()
    thread.join()
    return result[0]


def outcome(call: Callable[[], Any]) -> Any:
    try:
        return ("returned", call())
    except Exception as exc:
        return ("raised", type(exc).__name__)


# -- sglang modules patched while a replica is built or loads ---------------------------------


def test_the_rope_platform_flags_are_unchanged_for_other_threads() -> None:
    pytest.importorskip("sglang")
    from sglang.srt.layers.rotary_embedding import base, rope_variant
    from sglang.srt.utils import is_cuda

    from p2pweights.replica.sglang import env as sglang_env

    if is_cuda():
        pytest.skip("nothing is patched on a CUDA host")
    saved_flag, saved_get_device = base._is_cpu, rope_variant.get_device
    expected = (bool(saved_flag), outcome(saved_get_device))

    with sglang_env._rope_without_forward_kernel("meta"):
        assert bool(base._is_cpu) is True
        assert rope_variant.get_device() == "meta"
        seen = in_other_thread(lambda: (bool(base._is_cpu), outcome(rope_variant.get_device)))
    assert seen == ("returned", expected)
    assert base._is_cpu is saved_flag
    assert rope_variant.get_device is saved_get_device


def test_the_rope_flags_come_back_on_error() -> None:
    pytest.importorskip("sglang")
    from sglang.srt.layers.rotary_embedding import base, rope_variant

    from p2pweights.replica.sglang import env as sglang_env

    saved_flag, saved_get_device = base._is_cpu, rope_variant.get_device
    with pytest.raises(KeyError), sglang_env._rope_without_forward_kernel("meta"):
        raise KeyError("a failed build")
    assert base._is_cpu is saved_flag
    assert rope_variant.get_device is saved_get_device


def test_inline_loads_leave_other_threads_loading_async() -> None:
    pytest.importorskip("sglang")
    from sglang.srt.model_loader import utils
    from sglang.srt.models.deepseek_common import deepseek_weight_loader

    from p2pweights.replica.sglang.replay import inline_loads

    original = utils.should_async_load
    host = torch.zeros(2)
    assert original(host) is True

    def both() -> tuple[bool, bool]:
        return utils.should_async_load(host), deepseek_weight_loader.should_async_load(host)

    with inline_loads():
        assert both() == (False, False)
        seen = in_other_thread(both)
    assert seen == ("returned", (True, True))
    assert utils.should_async_load is original
    assert deepseek_weight_loader.should_async_load is original


# -- the local engine's stand-ins for CUDA calls on a host without a GPU ----------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="nothing is patched on a CUDA host")
def test_chunks_stay_on_host_only_in_the_checking_thread() -> None:
    pytest.importorskip("sglang")
    from p2pweights.local_engine import ranks

    tensor = torch.zeros(2)
    original, had_own = torch.Tensor.cuda, "cuda" in vars(torch.Tensor)
    expected = outcome(lambda: original(tensor))
    assert expected[0] == "raised"  # no GPU here

    with ranks._chunks_stay_on_host():
        assert tensor.cuda() is tensor
        seen = in_other_thread(lambda: outcome(lambda: tensor.cuda()))
    assert seen == ("returned", expected)
    assert torch.Tensor.cuda is original
    assert ("cuda" in vars(torch.Tensor)) == had_own


@pytest.mark.skipif(torch.cuda.is_available(), reason="nothing is patched on a CUDA host")
def test_no_cuda_sync_only_in_the_calling_thread() -> None:
    pytest.importorskip("sglang")
    from p2pweights.local_engine import ranks

    saved = torch.cuda.synchronize, torch.cuda.empty_cache
    expected = outcome(saved[0])
    assert expected[0] == "raised"  # no GPU here

    with ranks._no_cuda_sync():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        seen = in_other_thread(lambda: outcome(torch.cuda.synchronize))
    assert seen == ("returned", expected)
    assert (torch.cuda.synchronize, torch.cuda.empty_cache) == saved


# -- NIXL: the bindings' config class while an agent is created -------------------------------


def test_nixl_configs_made_by_other_threads_keep_their_delay() -> None:
    nixl_api = pytest.importorskip("nixl._api")
    import sys

    from p2pweights.transports import nixl as nixl_transport

    bindings = sys.modules[nixl_api.nixl_agent.__module__].nixlBind
    original = bindings.nixlAgentConfig

    def made_elsewhere() -> Any:
        config = bindings.nixlAgentConfig()
        config.pthrDelay = 0
        return config.pthrDelay

    with nixl_transport._waiting_progress_thread(nixl_api.nixl_agent):
        assert made_elsewhere() == nixl_transport._PROGRESS_WAIT_US
        seen = in_other_thread(made_elsewhere)
    assert seen == ("returned", 0)
    assert bindings.nixlAgentConfig is original


# -- the garbage collector while a checkpoint is derived --------------------------------------


def test_deriving_a_checkpoint_leaves_the_collector_on(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from p2pweights.source import expected

    assert gc.isenabled()
    seen = []

    def from_config(*args: Any) -> Any:
        seen.append((gc.isenabled(), in_other_thread(gc.isenabled)))
        return None

    monkeypatch.setattr(expected, "_from_config", from_config)
    expected._derive({}, tmp_path / "config.json", [], "")
    assert seen == [(True, ("returned", True))]
    assert gc.isenabled()


# -- verification builds its reference model in a context of its own -------------------------


# ~15 s: sglang's model registry, then a real CPU model of one rank
@pytest.mark.integration
def test_verification_leaves_the_process_sglang_config_alone(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pytest.importorskip("sglang")
    from sglang.srt import runtime_context

    from p2pweights import verify
    from p2pweights.replica.ranks import RankSpec
    from p2pweights.replica.sglang import env as sglang_env
    from p2pweights.replica.sglang import facade
    from p2pweights.testing import synthetic_weights, write_model_dir

    folder = write_model_dir("qwen3-tiny", tmp_path / "qwen3-tiny")
    info = {"model_path": str(folder), "tp_size": 2, "dtype": "bfloat16"}

    def weights() -> Any:
        return synthetic_weights("qwen3-tiny", seed=1, dtype=torch.bfloat16)

    saved = runtime_context.snapshot_context()
    runtime_context.reset_context()  # nothing published, as in a trainer
    monkeypatch.setattr(sglang_env, "_published_key", None)
    try:
        expected = verify.expected_checksums(info, 1, weights, model_path=str(folder))
        with pytest.raises(ValueError, match="not set"):
            runtime_context.get_server_args()
        # the same checksums as the reference an engine process publishes for
        spec = RankSpec.from_server_info(info, 1)
        model = facade.load_real_rank_model(folder, spec, weights(), "bfloat16", info)
        checker = facade.weight_checker(lambda: model, spec)
        with facade.rank_scope(spec):
            published = checker.handle("checksum", role="target")["checksums"]
    finally:
        runtime_context.restore_context(saved)
    assert expected == published
