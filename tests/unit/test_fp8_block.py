"""Sender-side block-fp8 quantization: the checkpoint format fp8 engines load."""

from __future__ import annotations

import pytest
import torch

from p2pweights.errors import ConfigError
from p2pweights.source.fp8_block import FP8, BlockFp8Format, dequantize, quantize


def _weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=generator) * 0.02).bfloat16()


def _reference(weight: torch.Tensor, bn: int, bk: int, ue8m0: bool):
    """Block by block, the plain way (no padding tricks)."""
    rows, cols = weight.shape
    q = torch.empty(rows, cols, dtype=FP8)
    scales = torch.empty(-(-rows // bn), -(-cols // bk))
    for i in range(0, rows, bn):
        for j in range(0, cols, bk):
            block = weight[i : i + bn, j : j + bk].float()
            scale = block.abs().max().clamp(min=1e-4) / 448.0
            if ue8m0:
                scale = torch.exp2(torch.ceil(torch.log2(scale)))
            q[i : i + bn, j : j + bk] = (block * (1.0 / scale)).clamp(-448, 448).to(FP8)
            scales[i // bn, j // bk] = scale
    return q, scales


@pytest.mark.parametrize("block", [(128, 128), (64, 64), (128, 64)])
@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("shape", [(256, 512), (300, 200), (64, 7)])
def test_matches_the_block_by_block_reference(block, ue8m0, shape) -> None:
    weight = _weight(*shape)
    fmt = BlockFp8Format(block, ue8m0=ue8m0)
    q, scale_inv = quantize(weight, fmt)
    want_q, want_scale = _reference(weight, *block, ue8m0)
    assert q.dtype == FP8 and scale_inv.dtype == torch.float32
    assert q.shape == weight.shape and scale_inv.shape == fmt.scale_shape(shape)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scale_inv, want_scale)


def test_ue8m0_128_equals_sglangs_own_quantizer() -> None:
    """sglang's per_block_cast_to_fp8 (DeepGEMM's format) is the ue8m0 [128, 128] case."""
    fp8_utils = pytest.importorskip("sglang.srt.layers.quantization.fp8_utils")
    weight = _weight(300, 520, seed=3)
    q, scale_inv = quantize(weight, BlockFp8Format((128, 128), ue8m0=True))
    want_q, want_scale = fp8_utils.per_block_cast_to_fp8(weight)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scale_inv, want_scale)


def test_round_trip_error_is_within_fp8_precision() -> None:
    weight = _weight(256, 384, seed=5)
    fmt = BlockFp8Format((64, 64))
    error = (dequantize(*quantize(weight, fmt), fmt) - weight.float()).abs()
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of the block maximum
    assert error.max() <= weight.float().abs().max() / 16


def test_zero_blocks_and_leading_dims() -> None:
    weight = torch.zeros(2, 128, 128, dtype=torch.bfloat16)
    q, scale_inv = quantize(weight, BlockFp8Format((128, 128)))
    assert q.shape == (2, 128, 128) and scale_inv.shape == (2, 1, 1)
    assert torch.all(q.float() == 0)
    assert torch.equal(scale_inv, torch.full((2, 1, 1), 1e-4) / 448.0)


def test_formats_from_quantization_config() -> None:
    deepseek = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    assert BlockFp8Format.from_quantization_config(deepseek) == BlockFp8Format((128, 128))
    ue8m0 = {**deepseek, "weight_block_size": [64, 64], "scale_fmt": "ue8m0"}
    assert BlockFp8Format.from_quantization_config(ue8m0) == BlockFp8Format((64, 64), True)
    assert BlockFp8Format.from_quantization_config(None) is None
    assert BlockFp8Format.from_quantization_config({"quant_method": "awq"}) is None
    assert BlockFp8Format.from_quantization_config({"quant_method": "fp8"}) is None  # per tensor
    with pytest.raises(ConfigError, match="weight_block_size"):
        BlockFp8Format.from_quantization_config({**deepseek, "weight_block_size": [128]})
    with pytest.raises(ConfigError, match="e5m2"):
        BlockFp8Format.from_quantization_config({**deepseek, "fmt": "e5m2"})
    with pytest.raises(ConfigError, match="quantize takes"):
        quantize(torch.zeros(4, 4, dtype=FP8), BlockFp8Format((2, 2)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_quantizing_on_the_gpu_gives_the_cpu_bytes() -> None:
    """The sender quantizes on the tensor's own device; the bytes must not depend on it."""
    for block in ((128, 128), (64, 64)):
        for ue8m0 in (False, True):
            fmt = BlockFp8Format(block, ue8m0=ue8m0)
            weight = _weight(300, 520, seed=11)
            q, scale_inv = quantize(weight, fmt)
            q_gpu, scale_gpu = quantize(weight.cuda(), fmt)
            assert torch.equal(q_gpu.cpu().view(torch.uint8), q.view(torch.uint8))
            assert torch.equal(scale_gpu.cpu(), scale_inv)
