"""The one-pass Triton fp8 quantizer gives torch's bytes on a GPU (GPU hosts only).

``fp8_block.quantize`` takes the fused kernel (``source/fp8_fused.py``) for a CUDA
weight; ``P2PWEIGHTS_FUSED_FP8=0`` takes torch's several-pass math instead. Both must
give the same fp8 bytes and float32 scales for every block size, scale format, dtype,
shape (partial blocks, expert stacks, strided views) and value (zeros, subnormals,
the largest finite values, inf, NaN of either sign). Skipped where no GPU is (CI); the
scale math is checked there under Triton's interpreter (tests/unit/test_fp8_fused.py).
"""

from __future__ import annotations

import pytest
import torch

from p2pweights.source import fp8_fused
from p2pweights.source.fp8_block import BlockFp8Format, quantize, quantize_many

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _both(weight: torch.Tensor, fmt: BlockFp8Format, monkeypatch) -> None:
    assert fp8_fused.available(weight)
    q, scale = quantize(weight, fmt)
    monkeypatch.setenv("P2PWEIGHTS_FUSED_FP8", "0")
    want_q, want_scale = quantize(weight, fmt)
    monkeypatch.delenv("P2PWEIGHTS_FUSED_FP8")
    assert q.shape == want_q.shape and scale.shape == want_scale.shape
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scale.view(torch.int32), want_scale.view(torch.int32))


@pytest.mark.parametrize("block", [(128, 128), (64, 64), (128, 64), (96, 80), (1, 128)])
@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("shape", [(7168, 2048), (300, 200), (4, 130, 257), (1, 5)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fused_equals_torch(block, ue8m0, shape, dtype, monkeypatch) -> None:
    generator = torch.Generator(device="cuda").manual_seed(hash((block, shape)) % 2**31)
    weight = (torch.randn(shape, device="cuda", generator=generator) * 0.02).to(dtype)
    _both(weight, BlockFp8Format(block, ue8m0=ue8m0), monkeypatch)


@pytest.mark.parametrize("ue8m0", [False, True])
def test_fused_equals_torch_on_strided_views(ue8m0, monkeypatch) -> None:
    base = torch.randn(3, 512, 384, device="cuda").bfloat16()
    fmt = BlockFp8Format((128, 128), ue8m0=ue8m0)
    _both(base.transpose(-1, -2), fmt, monkeypatch)  # column-major matrices
    _both(base[:, ::2, 100:], fmt, monkeypatch)  # strided rows, an offset start
    _both(base.transpose(0, 1)[:200], fmt, monkeypatch)  # leading dims not contiguous


@pytest.mark.parametrize("ue8m0", [False, True])
def test_fused_equals_torch_on_special_values(ue8m0, monkeypatch) -> None:
    weight = torch.randn(512, 512, device="cuda") * 0.02
    weight[:128, :128] = 0.0  # amax below the 1e-4 floor
    weight[:128, 128:256] = -0.0
    weight[128:256, :128] *= 1e-38  # float32 subnormal products
    weight[128:256, 128:256] = torch.finfo(torch.bfloat16).max  # the largest values
    weight[256, 0] = float("inf")
    weight[256, 200] = float("-inf")
    weight[384:, 384:] = torch.linspace(-448, 448, 128 * 128, device="cuda").view(128, 128)
    weight[300, 300] = float("nan")
    negative_nan = torch.tensor(-(1 << 22), dtype=torch.int32).view(torch.float32)  # 0xFFC00000
    weight[400, 300] = negative_nan.item()  # another block; float32 keeps its sign
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        _both(weight.to(dtype), BlockFp8Format((128, 128), ue8m0=ue8m0), monkeypatch)
    ties = torch.arange(-512, 512, 0.5, device="cuda").view(16, 128)  # halfway cases
    _both(ties, BlockFp8Format((16, 128), ue8m0=ue8m0), monkeypatch)


def test_float64_takes_the_torch_path() -> None:
    weight = torch.randn(256, 256, device="cuda", dtype=torch.float64)
    q, scale = quantize(weight, BlockFp8Format((128, 128)))
    want_q, want_scale = quantize(weight.cpu(), BlockFp8Format((128, 128)))
    assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scale.cpu(), want_scale)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_fused_equals_torch_on_another_gpu_than_the_current_one(monkeypatch) -> None:
    weight = (torch.randn(300, 700, device="cuda:1") * 0.02).bfloat16()
    assert torch.cuda.current_device() == 0
    _both(weight, BlockFp8Format((128, 128)), monkeypatch)


@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize(
    ("shape", "block"),
    [((2048, 7168), (128, 128)), ((300, 200), (64, 64)), ((3, 130, 257), (128, 64))],
)
def test_a_batch_of_separate_weights_equals_torch(shape, block, ue8m0, monkeypatch) -> None:
    """One launch over separate tensors (a layer's experts), addresses from a table."""
    fmt = BlockFp8Format(block, ue8m0=ue8m0)
    weights = [(torch.randn(shape, device="cuda") * 0.02).bfloat16() for _ in range(5)]
    weights[3][..., 0, 0] = float("nan")
    weights[4].mul_(1e-30)
    batches = []
    real_batch = fp8_fused.quantize_batch

    def counted(ws, b, u, box=None):
        batches.append(len(ws))
        return real_batch(ws, b, u, box)

    monkeypatch.setattr(fp8_fused, "quantize_batch", counted)
    weights.append(weights[0][..., :100, :])  # another shape: quantized alone
    got = quantize_many(weights, fmt)
    assert batches == [5]
    monkeypatch.setenv("P2PWEIGHTS_FUSED_FP8", "0")
    for weight, (q, scale) in zip(weights, got, strict=True):
        want_q, want_scale = quantize(weight, fmt)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(scale.view(torch.int32), want_scale.view(torch.int32))
    assert not fp8_fused._broken  # the kernel ran: no fall-back to torch


@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize(
    ("shape", "box"),
    [((2048, 7168), (1, 2, 0, 56)), ((300, 200), (1, 3, 2, 4)), ((7168, 2048), (0, 56, 15, 16))],
)
def test_a_box_of_blocks_equals_torch_there(shape, box, ue8m0, monkeypatch) -> None:
    """Only a rank's blocks (a TP slice), alone and in a batch, as the whole weight's."""
    fmt = BlockFp8Format((128, 128) if shape[0] > 1000 else (64, 64), ue8m0=ue8m0)
    weights = [(torch.randn(shape, device="cuda") * 0.02).bfloat16() for _ in range(3)]
    alone = quantize(weights[0], fmt, box)
    batch = quantize_many(weights, fmt, [box] * 3)
    monkeypatch.setenv("P2PWEIGHTS_FUSED_FP8", "0")
    r0, r1, c0, c1 = box
    bn, bk = fmt.block
    rows, cols = slice(r0 * bn, r1 * bn), slice(c0 * bk, c1 * bk)
    for weight, (q, scale) in zip(weights, [alone, *batch[1:]], strict=True):
        want_q, want_scale = quantize(weight, fmt)
        assert torch.equal(q[rows, cols].view(torch.uint8), want_q[rows, cols].view(torch.uint8))
        assert torch.equal(
            scale[r0:r1, c0:c1].view(torch.int32), want_scale[r0:r1, c0:c1].view(torch.int32)
        )
    assert torch.equal(
        batch[0][0][rows, cols].view(torch.uint8), alone[0][rows, cols].view(torch.uint8)
    )
    assert not fp8_fused._broken  # the kernel ran: no fall-back to torch
