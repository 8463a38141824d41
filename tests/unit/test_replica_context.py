"""Replicas run sglang's model code under contexts of their own.

The trainer process may run an sglang engine too (colocated), so building and
using replicas must leave the process's sglang configuration as it was: unset
stays unset, a published one stays published.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("sglang")

from sglang.srt import runtime_context

from p2pweights.replica.ranks import RankSpec
from p2pweights.replica.sglang import env as sglang_env
from p2pweights.replica.sglang.model_replica import ModelReplica
from p2pweights.source.inputs import describe_inputs
from p2pweights.testing import synthetic_weights, write_model_dir
from p2pweights.testing.bitexact import stage_all

QKV = "model.layers.0.self_attn.qkv_proj.weight"


@pytest.fixture
def clean_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Nothing published in this process, as in a trainer; put back afterwards."""
    saved = runtime_context.snapshot_context()
    runtime_context.reset_context()
    monkeypatch.setattr(sglang_env, "_published_key", None)
    try:
        yield
    finally:
        runtime_context.restore_context(saved)


# ~10 s in a fresh process, nearly all of it importing sglang's model registry
@pytest.mark.integration
def test_replicas_leave_the_process_config_alone(clean_process: None, tmp_path: Path) -> None:
    folder = write_model_dir("qwen3-tiny", tmp_path / "qwen3-tiny")
    parallel = runtime_context.get_parallel()

    tp2 = ModelReplica(
        folder, RankSpec.derive(tp_size=2, engine_rank=1), "bfloat16", {"tp_size": 2}
    )
    with pytest.raises(ValueError, match="not set"):
        runtime_context.get_server_args()
    assert runtime_context.get_parallel() is parallel

    # an engine in this process publishes its own config; replicas must not replace it
    sglang_env.ensure_server_args({"model_path": str(folder), "tp_size": 1, "dtype": "float16"})
    published = runtime_context.get_server_args()
    tp4 = ModelReplica(
        folder, RankSpec.derive(tp_size=4, engine_rank=3), "bfloat16", {"tp_size": 4}
    )
    assert runtime_context.get_server_args() is published

    hf = list(synthetic_weights("qwen3-tiny", seed=1))
    for replica in (tp2, tp4):
        staged = stage_all(replica, replica.loader_map(describe_inputs(hf)), hf)
        assert staged[QKV].numel() == replica.layouts[QKV].num_bytes
        assert runtime_context.get_server_args() is published
    assert tp2.layouts[QKV].shape != tp4.layouts[QKV].shape

    # each replica reads its own server args while it loads, the process still its own
    with tp2.loading_scope():
        assert runtime_context.get_server_args().tp_size == 2
        with tp4.loading_scope():
            assert runtime_context.get_server_args().tp_size == 4
        assert runtime_context.get_server_args().tp_size == 2
    assert runtime_context.get_server_args() is published
    assert runtime_context.get_parallel() is parallel
