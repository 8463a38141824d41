"""The first update checked against the engine's checkpoint (config on meta, or headers)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from p2pweights.errors import ConfigError
from p2pweights.source.config_checkpoint import config_checkpoint
from p2pweights.source.expected import (
    ExpectedCheckpoint,
    check_finite,
    check_first_update,
    engine_dtype,
    expected_checkpoint,
)
from p2pweights.source.fp8_block import FP8, SCALE_SUFFIX, BlockFp8Format, quantize
from p2pweights.source.inputs import InputSpec, describe_inputs
from p2pweights.testing import (
    hf_checkpoint_names_and_shapes,
    model_config,
    save_safetensors,
    synthetic_weights,
    write_model_dir,
)

pytest.importorskip("transformers")

MODELS = ["qwen3-tiny", "qwen3-moe-tiny", "deepseek-v3-tiny", "deepseek-v3-fp8-tiny"]
BF16 = torch.bfloat16
Specs = dict[str, InputSpec]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    root = tmp_path_factory.mktemp("models")
    return lambda model: write_model_dir(model, root / model)


def _specs(model: str) -> Specs:
    return {n: InputSpec(s, dt) for n, s, dt in hf_checkpoint_names_and_shapes(model)}


def _refused(specs: Specs, expected: ExpectedCheckpoint, **kwargs: torch.dtype) -> str:
    with pytest.raises(ConfigError) as info:
        check_first_update(specs, expected, **kwargs)
    return str(info.value)


@pytest.mark.parametrize("model", MODELS)
def test_the_synthetic_checkpoint_passes(folder, model):
    expected = expected_checkpoint(folder(model))
    assert expected.unchecked is None and "on the meta device" in expected.source
    check_first_update(describe_inputs(synthetic_weights(model, seed=0)), expected)
    names = set(expected.tensors)
    assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in names)
    if model == "qwen3-moe-tiny":
        assert expected.tensors["model.layers.1.mlp.experts.7.gate_proj.weight"].shape == (128, 256)
    if model.startswith("deepseek"):
        assert "model.layers.3.eh_proj.weight" in names  # the MTP layer
        assert "model.layers.3.mlp.experts.7.down_proj.weight" in names


def test_fp8_weights_arrive_in_bf16_or_quantized_with_their_scales(folder):
    model = "deepseek-v3-fp8-tiny"
    expected = expected_checkpoint(folder(model))
    fmt = BlockFp8Format((128, 128))
    quantized = {n for n, t in expected.tensors.items() if t.scale_shape is not None}
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in quantized
    assert "model.layers.3.mlp.shared_experts.down_proj.weight" in quantized  # MTP layer
    for kept in (
        "lm_head.weight",
        "model.layers.3.eh_proj.weight",
        "model.layers.1.mlp.gate.weight",
    ):
        assert kept not in quantized
    assert expected.tensors["model.layers.0.self_attn.o_proj.weight"].scale_shape == (2, 4)
    pair = quantize(torch.randn(256, 512), fmt)  # what p2pweights or a trainer makes
    assert describe_inputs(zip(("w", "w" + SCALE_SUFFIX), pair, strict=True)) == {
        "w": InputSpec((256, 512), FP8),
        "w" + SCALE_SUFFIX: InputSpec((2, 4), torch.float32),
    }
    every, half = _specs(model), _specs(model)
    for index, name in enumerate(sorted(quantized)):
        for specs in [every] + [half] * (index % 2):
            specs[name] = InputSpec(specs[name].shape, FP8)
            specs[name + SCALE_SUFFIX] = InputSpec(
                fmt.scale_shape(specs[name].shape), torch.float32
            )
    check_first_update(every, expected)
    check_first_update(half, expected)


def _o_proj(specs: Specs) -> tuple[str, InputSpec]:
    name = "model.layers.1.self_attn.o_proj.weight"
    return name, specs[name]


def _unknown(specs: Specs, config: dict) -> tuple[str, str]:
    name, spec = _o_proj(specs)
    specs[name + "s"] = spec
    return name + "s", f"did you mean '{name}'"


def _beyond_the_last_layer(specs: Specs, config: dict) -> tuple[str, str]:
    layer = config["num_hidden_layers"] + config.get("num_nextn_predict_layers", 0)
    name = f"model.layers.{layer}.self_attn.o_proj.weight"
    specs[name] = _o_proj(specs)[1]
    return name, f"layer {layer}, which the model does not have"


def _extra_row(specs: Specs, config: dict) -> tuple[str, str]:
    name, spec = _o_proj(specs)
    rows, cols = spec.shape
    specs[name] = InputSpec((rows + 1, cols), spec.dtype)
    return name, f"has shape [{rows + 1}, {cols}], expected [{rows}, {cols}] (1 extra row)"


def _extra_column(specs: Specs, config: dict) -> tuple[str, str]:
    name, spec = _o_proj(specs)
    rows, cols = spec.shape
    specs[name] = InputSpec((rows, cols + 1), spec.dtype)
    return name, f"expected [{rows}, {cols}] (1 extra column)"


def _float32(specs: Specs, config: dict) -> tuple[str, str]:
    name, spec = _o_proj(specs)
    specs[name] = InputSpec(spec.shape, torch.float32)
    return name, "is float32, expected bfloat16"


def _fp8_without_scale(specs: Specs, config: dict) -> tuple[str, str]:
    name, spec = _o_proj(specs)
    specs[name] = InputSpec(spec.shape, FP8)
    if config.get("quantization_config"):
        scales = BlockFp8Format((128, 128)).scale_shape(spec.shape)
        return name, f"without its block scales '{name}{SCALE_SUFFIX}' (float32 {list(scales)})"
    return name, "is float8_e4m3fn, expected bfloat16"


BAD = [_unknown, _beyond_the_last_layer, _extra_row, _extra_column, _float32, _fp8_without_scale]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("mutate", BAD, ids=lambda f: f.__name__.strip("_"))
def test_a_bad_tensor_is_refused_naming_it_and_the_expectation(folder, model, mutate):
    specs = _specs(model)
    name, expectation = mutate(specs, model_config(model))
    message = _refused(specs, expected_checkpoint(folder(model)))
    assert f"'{name}'" in message and expectation in message
    assert message.startswith("1 HF tensor(s) of the first update do not match")


def test_every_problem_is_reported_at_once(folder):
    specs = _specs("qwen3-tiny")
    for index in range(12):
        specs[f"model.bogus{index}.weight"] = InputSpec((1,), BF16)
    message = _refused(specs, expected_checkpoint(folder("qwen3-tiny")))
    assert message.startswith("12 HF tensor(s)") and "and 4 more" in message
    assert message.count("'model.bogus") == 8


def test_block_scales_must_come_with_their_fp8_weight(folder):
    expected = expected_checkpoint(folder("deepseek-v3-fp8-tiny"))
    base = "model.layers.0.self_attn.o_proj.weight"
    scale = base + SCALE_SUFFIX
    specs = _specs("deepseek-v3-fp8-tiny")
    specs[scale] = InputSpec((2, 4), torch.float32)  # the weight is bf16
    assert "send the weight quantized (float8_e4m3fn)" in _refused(specs, expected)
    specs[base] = InputSpec((256, 512), FP8)
    check_first_update(specs, expected)
    specs[scale] = InputSpec((2, 5), torch.bfloat16)
    message = _refused(specs, expected)
    assert f"'{scale}' is bfloat16, expected float32; has shape [2, 5], expected [2, 4]" in message
    del specs[base]
    assert f"'{scale}' came without its weight '{base}'" in _refused(specs, expected)


def test_a_tied_lm_head_may_be_sent_in_the_embedding_shape(folder):
    expected = expected_checkpoint(folder("qwen3-tiny-tied"))
    specs = _specs("qwen3-tiny-tied")
    assert "lm_head.weight" not in specs and expected.missing(specs) == []
    check_first_update(specs, expected)
    specs["lm_head.weight"] = InputSpec((1000, 256), BF16)
    check_first_update(specs, expected)
    specs["lm_head.weight"] = InputSpec((1024, 256), BF16)
    assert "'lm_head.weight' has shape [1024, 256], expected [1000, 256]" in _refused(
        specs, expected
    )
    del specs["lm_head.weight"]
    assert expected_checkpoint(folder("qwen3-tiny")).missing(specs) == ["lm_head.weight"]


def test_float32_kept_tensors_and_engine_dtype(folder, tmp_path):
    expected = expected_checkpoint(folder("deepseek-v3-tiny"))
    specs = _specs("deepseek-v3-tiny")
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    for dtype in (torch.float32, BF16):  # _keep_in_fp32_modules_strict: either is fine
        check_first_update({**specs, bias: InputSpec((8,), dtype)}, expected)
    specs["model.layers.1.self_attn.o_proj.weight"] = InputSpec((256, 256), torch.float16)
    assert "is float16, expected bfloat16" in _refused(specs, expected)
    check_first_update(specs, expected, engine_dtype=torch.float16)  # sglang --dtype float16

    fp32 = expected_checkpoint(
        write_model_dir({**model_config("qwen3-tiny"), "torch_dtype": "float32"}, tmp_path)
    )
    bf16 = _specs("qwen3-tiny")
    assert "is bfloat16, expected float32" in _refused(bf16, fp32)
    check_first_update(bf16, fp32, engine_dtype=engine_dtype("bfloat16"))
    assert engine_dtype("auto") is None and engine_dtype("half") == torch.float16


def _variant(model: str, **changes: object) -> dict:
    return {**model_config(model), **changes}


def test_safetensors_headers_are_read_when_present(tmp_path):
    # The file's shapes differ from what config.json gives: the headers win.
    narrower = _variant("qwen3-tiny", intermediate_size=384)
    folder = write_model_dir("qwen3-tiny", tmp_path)
    save_safetensors(folder, synthetic_weights(narrower, seed=0))
    expected = expected_checkpoint(folder)
    assert expected.source == f"the safetensors headers of {folder} (1 file(s))"
    assert expected.tensors["model.layers.0.mlp.up_proj.weight"].shape == (384, 256)
    check_first_update(describe_inputs(synthetic_weights(narrower, seed=1)), expected)
    message = _refused(_specs("qwen3-tiny"), expected)
    assert (
        "'model.layers.0.mlp.up_proj.weight' has shape [512, 256], expected [384, 256]" in message
    )
    assert message.startswith("6 HF tensor(s)") and "safetensors headers" in message


def test_an_index_is_followed_and_a_missing_shard_falls_back_to_the_config(tmp_path):
    narrower = _variant("qwen3-tiny", intermediate_size=384)
    folder = write_model_dir("qwen3-tiny", tmp_path)
    weights = list(synthetic_weights(narrower, seed=0))
    shards = {"a.safetensors": weights[:10], "b.safetensors": weights[10:]}
    weight_map = {n: file for file, part in shards.items() for n, _ in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    save_safetensors(folder, shards["a.safetensors"], "a.safetensors")
    fallback = expected_checkpoint(folder).source  # b is not there
    assert "on the meta device" in fallback and "1 file(s) model.safetensors.index.json" in fallback
    save_safetensors(folder, shards["b.safetensors"], "b.safetensors")
    expected = expected_checkpoint(folder)
    assert expected.source.endswith("(2 file(s))") and set(expected.tensors) == set(weight_map)
    assert expected.tensors["model.layers.1.mlp.down_proj.weight"].shape == (256, 384)


def test_an_fp8_checkpoints_headers_accept_bf16_or_quantized_weights(folder, tmp_path):
    model = "deepseek-v3-fp8-tiny"
    meta = expected_checkpoint(folder(model))
    stored: list[tuple[str, torch.Tensor]] = []  # shapes and dtypes matter, not values
    for name, shape, dtype in hf_checkpoint_names_and_shapes(model):
        scales = meta.tensors[name].scale_shape
        if scales is not None:
            stored += [
                (name, torch.zeros(shape, dtype=FP8)),
                (name + SCALE_SUFFIX, torch.ones(scales)),
            ]
        else:  # DeepSeek-V3 checkpoints keep the routing bias in float32
            float32 = "correction_bias" in name
            stored.append((name, torch.zeros(shape, dtype=torch.float32 if float32 else dtype)))
    save_safetensors(write_model_dir(model, tmp_path), stored)
    expected = expected_checkpoint(tmp_path)
    assert "safetensors headers" in expected.source
    assert {n: t.scale_shape for n, t in expected.tensors.items()} == {
        n: t.scale_shape for n, t in meta.tensors.items()
    }
    check_first_update(describe_inputs(stored), expected)
    check_first_update(_specs(model), expected)  # bf16 throughout, bias included
    specs = describe_inputs(stored)
    scale = "model.layers.1.self_attn.q_b_proj.weight" + SCALE_SUFFIX
    specs[scale] = InputSpec((9, 2), torch.float32)
    assert f"'{scale}' has shape [9, 2], expected [8, 2]" in _refused(specs, expected)


def test_derivations_are_cached_per_config(folder, tmp_path):
    first = expected_checkpoint(folder("qwen3-tiny"))
    assert expected_checkpoint(folder("qwen3-tiny") / "config.json") is first
    assert expected_checkpoint(write_model_dir("qwen3-tiny", tmp_path)) is first


def test_configs_that_cannot_be_derived_are_let_through_with_a_warning(tmp_path, caplog):
    unknown = write_model_dir({"model_type": "no-such-model"}, tmp_path / "unknown")
    awq = write_model_dir(
        _variant("qwen3-tiny", quantization_config={"quant_method": "awq"}), tmp_path / "awq"
    )
    mixtral = {  # transformers renames block_sparse_moe to mlp and fuses w1/w3
        "model_type": "mixtral", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_local_experts": 2, "vocab_size": 100, "torch_dtype": "bfloat16",
    }  # fmt: skip
    with pytest.raises(ConfigError, match="does not invert"):
        config_checkpoint(mixtral)
    for path, reason in [
        (unknown, "transformers cannot describe"),
        (awq, "quantized ('awq')"),
        (write_model_dir(mixtral, tmp_path / "mixtral"), "does not invert"),
    ]:
        expected = expected_checkpoint(path)
        assert expected.unchecked is not None and reason in expected.unchecked
        with caplog.at_level(logging.WARNING, logger="p2pweights.source.expected"):
            check_first_update({"anything": InputSpec((1,), BF16)}, expected)
        assert reason in caplog.text


def test_a_missing_config_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the engine's model config"):
        expected_checkpoint(tmp_path)


@pytest.mark.parametrize("dtype", [BF16, torch.float16, torch.float32])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_check_finite_refuses_nan_and_inf(dtype, bad):
    tensor = torch.randn(64, 32).to(dtype)
    check_finite("w", tensor)
    tensor[3, 4] = tensor[60, 0] = bad
    with pytest.raises(ConfigError, match=r"'w' holds 2 NaN or Inf value\(s\) among 2048"):
        check_finite("w", tensor)
    with pytest.raises(ConfigError, match="holds 1 NaN"):
        check_finite("w", tensor[:, 4:])  # a strided view


def test_check_finite_on_fp8_and_overflowing_sums():
    weight = torch.randn(256, 256)
    check_finite("fp8", quantize(weight, BlockFp8Format((128, 128)))[0])
    check_finite("e5m2", weight.to(torch.float8_e5m2))
    nan = weight.to(FP8)
    nan.view(torch.uint8)[7, 7] = 0xFF  # e4m3fn's (negative) NaN; it has no Inf
    with pytest.raises(ConfigError, match="'fp8' holds 1 NaN"):
        check_finite("fp8", nan)
    inf = weight.to(torch.float8_e5m2)
    inf[0, 0] = float("inf")
    with pytest.raises(ConfigError, match="holds 1 NaN"):
        check_finite("e5m2", inf)
    check_finite("huge", torch.full((8,), 6.0e4, dtype=torch.float16))  # the sum overflows
    check_finite("ints", torch.arange(10))


def test_a_remote_code_model_type_reads_as_its_architectures():
    from p2pweights.source.config_checkpoint import architecture_model_type

    # Kimi-K2's kind: a remote-code type (sglang registers "kimi_k2" itself once imported,
    # so a name nobody registers stands for it here)
    kimi = {"model_type": "remote_code_only_k2", "architectures": ["DeepseekV3ForCausalLM"]}
    assert architecture_model_type(kimi) == "deepseek_v3"
    assert architecture_model_type({"model_type": "qwen3", "architectures": ["X"]}) is None
    assert architecture_model_type({"model_type": "nope", "architectures": ["Nope"]}) is None


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"\x05\x00",
        (1 << 40).to_bytes(8, "little") + b"{}",
        (9).to_bytes(8, "little") + b"[not json",
    ],
)
def test_an_unreadable_safetensors_file_falls_back_to_the_config(tmp_path, content):
    folder = write_model_dir("qwen3-tiny", tmp_path)
    (folder / "model.safetensors").write_bytes(content)
    source = expected_checkpoint(folder).source
    assert "on the meta device" in source and "safetensors headers" in source
    assert "unreadable" in source and "model.safetensors" in source


def test_a_header_names_each_tensors_dtype_and_shape_without_reading_it(tmp_path):
    from safetensors.torch import save_file

    from p2pweights.source.safetensors_header import read_header

    file = tmp_path / "m.safetensors"
    save_file({"a": torch.zeros(2, 3, dtype=torch.bfloat16), "b": torch.zeros(4)}, str(file))
    assert read_header(file) == {"a": (torch.bfloat16, (2, 3)), "b": (torch.float32, (4,))}
    save_file({"c": torch.zeros(2, dtype=torch.complex64)}, str(file))
    with pytest.raises(ValueError, match=r"c in m.safetensors has dtype C64"):
        read_header(file)
