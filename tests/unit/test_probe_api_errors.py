"""The loader probe tells the user's tensor errors from sglang's API not behaving as expected."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("sglang")

from p2pweights.errors import ConfigError
from p2pweights.replica.ranks import RankSpec
from p2pweights.replica.sglang import compat
from p2pweights.replica.sglang.model_replica import ModelReplica
from p2pweights.source.inputs import InputSpec
from p2pweights.testing import write_model_dir

NORM = "model.norm.weight"


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> ModelReplica:
    folder = write_model_dir("qwen3-tiny", tmp_path_factory.mktemp("qwen3-tiny"))
    return ModelReplica(folder, RankSpec.derive(tp_size=1, engine_rank=0), "bfloat16")


@pytest.fixture(autouse=True)
def _unprobed(replica: ModelReplica) -> None:
    replica.probe_cache.clear()
    replica._loader_maps.clear()


def test_a_wrong_shape_is_the_users_tensor_error(replica: ModelReplica) -> None:
    (hidden,) = replica.layouts[NORM].shape
    with pytest.raises(ConfigError) as info:
        replica.loader_map({NORM: InputSpec((hidden + 3,), torch.bfloat16)})
    assert not isinstance(info.value, compat.SglangApiError)
    assert NORM in str(info.value) and "does not fit" in str(info.value)


@pytest.mark.parametrize("raised", [AttributeError, TypeError, ImportError])
def test_an_sglang_loader_that_breaks_its_api_is_reported_as_such(
    replica: ModelReplica, monkeypatch: pytest.MonkeyPatch, raised: type[Exception]
) -> None:
    def loader(*args: Any, **kwargs: Any) -> None:
        raise raised("'ModelRunner' object has no attribute 'weight_loader_v3'")

    norm = dict(replica.model.named_parameters())[NORM]
    monkeypatch.setattr(norm, "weight_loader", loader, raising=False)  # default loader otherwise
    with pytest.raises(compat.SglangApiError) as info:
        replica.loader_map({NORM: InputSpec(replica.layouts[NORM].shape, torch.bfloat16)})
    message = str(info.value)
    low, high = compat.TESTED_SGLANG
    assert compat.SGLANG_VERSION in message
    assert f"{low} to {high}" in message
    assert NORM in message
    assert "weight_loader_v3" in message
    assert "does not fit" not in message
    assert isinstance(info.value.__cause__, raised)
