"""Every cache of user-keyed data stops growing at its documented bound."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from p2pweights.bounded_cache import LruCache
from p2pweights.source import expected


def test_an_lru_cache_keeps_the_most_recently_used() -> None:
    cache: LruCache[str, int] = LruCache(2)
    cache["a"], cache["b"] = 1, 2
    assert cache.get("a") == 1  # a is now the most recent
    cache["c"] = 3
    assert sorted(cache) == ["a", "c"]
    assert len(cache) == 2
    with pytest.raises(ValueError):
        LruCache(0)


def test_expected_checkpoints_are_kept_for_a_bounded_number_of_configs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(expected, "_derive", lambda *args: object())
    monkeypatch.setattr(expected, "_CACHE", LruCache(expected.CACHE_SIZE))
    for index in range(expected.CACHE_SIZE + 5):
        folder = tmp_path / str(index)
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"index": index}))
        expected.expected_checkpoint(folder)
    assert len(expected._CACHE) == expected.CACHE_SIZE


def test_the_module_cache_is_bounded() -> None:
    assert isinstance(expected._CACHE, LruCache)
    assert expected._CACHE.maxsize == expected.CACHE_SIZE


def test_the_sglang_check_keeps_a_bounded_number_of_symbol_sets() -> None:
    pytest.importorskip("sglang")
    from p2pweights.replica.sglang import compat

    symbol = compat.REQUIRED[0]
    for index in range(compat.CHECKS_KEPT + 4):
        compat.check_sglang((symbol,) * (index + 1))
    assert compat.check_sglang.cache_info().currsize == compat.CHECKS_KEPT


def test_server_args_names_are_kept_per_class_up_to_a_bound() -> None:
    pytest.importorskip("sglang")
    import dataclasses

    from p2pweights.replica.sglang import env as sglang_env

    for index in range(sglang_env.ARGS_CLASSES_KEPT + 3):
        cls = dataclasses.make_dataclass(f"Args{index}", [("model_path", str)])
        assert sglang_env._server_args_names(cls) == frozenset({"model_path"})
    assert sglang_env._server_args_names.cache_info().currsize == sglang_env.ARGS_CLASSES_KEPT


def test_the_fused_fp8_capability_cache_is_bounded() -> None:
    from p2pweights.source import fp8_fused

    assert fp8_fused._capable.cache_parameters()["maxsize"] == fp8_fused.DEVICES_KEPT


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Any:
    pytest.importorskip("sglang")
    from p2pweights.replica.ranks import RankSpec
    from p2pweights.replica.sglang.model_replica import ModelReplica
    from p2pweights.testing import write_model_dir

    folder = write_model_dir("qwen3-tiny", tmp_path_factory.mktemp("qwen3-tiny"))
    return ModelReplica(folder, RankSpec.derive(tp_size=1, engine_rank=0), "bfloat16")


def test_a_replicas_probe_caches_stop_at_their_bounds(
    replica: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from p2pweights.replica.sglang import model_replica
    from p2pweights.source.inputs import InputSpec

    monkeypatch.setattr(replica, "probe_cache", LruCache(3))
    monkeypatch.setattr(replica, "_loader_maps", LruCache(2))
    names = [
        f"model.layers.0.{part}.weight"
        for part in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm")
    ] + ["model.norm.weight", "model.layers.0.self_attn.k_norm.weight"]
    for count in range(1, len(names) + 1):
        inputs = {}
        for name in names[:count]:
            inputs[name] = InputSpec(replica.layouts[name].shape, torch.bfloat16)
        replica.loader_map(inputs)
    assert len(replica.probe_cache) == 3
    assert len(replica._loader_maps) == 2
    assert model_replica.PROBES_KEPT >= 200_000  # above any checkpoint's tensor count
    assert model_replica.LOADER_MAPS_KEPT >= 2


def test_a_new_replica_has_bounded_caches(replica: Any) -> None:
    from p2pweights.replica.sglang import model_replica

    assert isinstance(replica.probe_cache, LruCache)
    assert replica.probe_cache.maxsize == model_replica.PROBES_KEPT
    assert isinstance(replica._loader_maps, LruCache)
    assert replica._loader_maps.maxsize == model_replica.LOADER_MAPS_KEPT
