"""One session updates one model: engines whose configs describe different models are
refused at connect, naming both engines and what differs (before, the first update
failed with dozens of mismatching tensors and never said why)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from p2pweights.errors import ConfigError
from p2pweights.plan.prepare import check_one_model
from p2pweights.testing import model_config


@dataclass
class _Endpoint:
    model_path: str | None = None


@dataclass
class _Engine:
    url: str
    server_info: dict
    endpoint: _Endpoint


def _engine(tmp_path: Path, url: str, config: dict, folder: str) -> _Engine:
    where = tmp_path / folder
    where.mkdir(exist_ok=True)
    (where / "config.json").write_text(json.dumps(config))
    return _Engine(url, {"model_path": str(where)}, _Endpoint())


def test_engines_of_one_model_pass_whatever_their_paths_and_dtypes(tmp_path):
    config = model_config("qwen3-tiny")
    other_copy = {**config, "torch_dtype": "float16", "_name_or_path": "elsewhere"}
    check_one_model(
        [
            _engine(tmp_path, "http://a", config, "a"),
            _engine(tmp_path, "http://b", other_copy, "b"),
            _engine(tmp_path, "http://c", config, "a"),
        ]
    )


def test_engines_of_different_models_are_refused_naming_both_and_what_differs(tmp_path):
    small = model_config("qwen3-tiny")
    moe = model_config("qwen3-moe-tiny")
    engines = [
        _engine(tmp_path, "http://a", small, "small"),
        _engine(tmp_path, "http://b", small, "small"),
        _engine(tmp_path, "http://c", moe, "moe"),
    ]
    with pytest.raises(ConfigError) as caught:
        check_one_model(engines)
    message = str(caught.value)
    assert "serve different models" in message
    assert "http://a" in message and "http://c" in message
    assert "Qwen3ForCausalLM" in message and "Qwen3MoeForCausalLM" in message
    assert "a session per model" in message


def test_a_different_shape_of_one_architecture_is_refused(tmp_path):
    config = model_config("qwen3-tiny")
    deeper = {**config, "num_hidden_layers": config["num_hidden_layers"] + 2}
    with pytest.raises(ConfigError, match=r"num_hidden_layers"):
        check_one_model(
            [_engine(tmp_path, "http://a", config, "a"), _engine(tmp_path, "http://b", deeper, "b")]
        )
