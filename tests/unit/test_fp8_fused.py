"""When ``quantize`` takes the fused Triton kernel, and its scale math on the CPU.

The kernel's fp8 bytes are compared with torch's on a GPU
(tests/integration/test_fp8_fused_gpu.py). Here: which weights take it, the switch
that turns it off, and, under Triton's interpreter, that the kernel's scales (block
maxima, the 1e-4 floor, the division, ue8m0 rounding, NaN and inf) equal torch's bit
for bit (a NaN scale only as NaN: numpy keeps NaN payloads a GPU does not). The
interpreter's own fp8 cast is not the GPU's (it turned 125.5 into 64 and 168 into
176, where e4m3 rounds to 128 and 160), so its fp8 bytes are not compared here.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from _interpreted import assert_prints_ok

from p2pweights.source import fp8_block, fp8_fused
from p2pweights.source.fp8_block import BlockFp8Format, quantize


def test_cpu_weights_never_take_the_kernel() -> None:
    assert not fp8_fused.available(torch.zeros(4, 4))


@pytest.fixture
def capable(monkeypatch):
    """A GPU the kernel compiles for, and the kernel, as far as ``usable`` asks."""
    monkeypatch.setattr(fp8_fused, "_capable", lambda device: True)
    monkeypatch.setattr(fp8_fused, "_kernel", lambda: object())
    monkeypatch.setattr(fp8_fused, "_broken", [])


GPU = torch.device("cuda", 0)


def test_the_switch_turns_it_off(monkeypatch, capable) -> None:
    assert fp8_fused.usable(GPU, (256, 256), (128, 128))
    monkeypatch.setenv("P2PWEIGHTS_FUSED_FP8", "0")
    assert not fp8_fused.usable(GPU, (256, 256), (128, 128))


def test_gpus_older_than_ada_and_rocm_keep_torch(monkeypatch, capable) -> None:
    """Triton casts to e4m3 only from compute capability 8.9 (an A100 cannot compile it)."""
    monkeypatch.setattr(fp8_fused, "_capable", lambda device: False)
    assert not fp8_fused.usable(GPU, (256, 256), (128, 128))
    monkeypatch.setattr(fp8_fused, "_capable", lambda device: True)
    monkeypatch.setattr(fp8_fused.torch.version, "hip", "6.2")
    assert not fp8_fused.usable(GPU, (256, 256), (128, 128))


def test_blocks_and_grids_one_launch_cannot_take_keep_torch(capable) -> None:
    assert fp8_fused.usable(GPU, (65535 * 128, 7168), (128, 128))
    assert not fp8_fused.usable(GPU, (65536 * 128, 7168), (128, 128))  # grid rows
    assert not fp8_fused.usable(GPU, (7, 65536 * 2), (1, 2))  # grid columns
    assert not fp8_fused.usable(GPU, (1024, 1024), (512, 512))  # block too large


def test_subclasses_keep_torchs_dispatch(capable) -> None:
    class Wrapped(torch.Tensor):
        pass

    assert not fp8_fused.available(torch.zeros(4, 4).as_subclass(Wrapped))


def test_a_kernel_that_fails_gives_way_to_torch_for_good(monkeypatch, capable, caplog) -> None:
    def fails(weight, block, ue8m0, box=None):
        raise RuntimeError("PTX compile failed")

    monkeypatch.setattr(fp8_fused, "quantize_fused", fails)
    monkeypatch.setattr(fp8_fused, "available", lambda weight, block: not fp8_fused._broken)
    weight = torch.randn(256, 256).bfloat16()
    q, scale = quantize(weight, BlockFp8Format((128, 128)))  # torch's, after the failure
    monkeypatch.setenv("P2PWEIGHTS_FUSED_FP8", "0")
    want_q, want_scale = quantize(weight, BlockFp8Format((128, 128)))
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scale, want_scale)
    assert not fp8_fused.usable(GPU, (256, 256), (128, 128))
    assert "PTX compile failed" in caplog.text


def test_out_of_memory_is_not_the_kernels_fault(monkeypatch, capable) -> None:
    def no_memory(weight, block, ue8m0, box=None):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(fp8_fused, "quantize_fused", no_memory)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        fp8_fused.quantize_or_none(torch.zeros(4, 4), (2, 2), False)
    assert fp8_fused.usable(GPU, (256, 256), (128, 128))  # still on for the next weight


def test_vectors_keep_torchs_refusal(capable) -> None:
    assert not fp8_fused.usable(GPU, (4096,), (128, 128))


def test_no_triton_no_kernel(monkeypatch, capable) -> None:
    monkeypatch.setattr(fp8_fused, "_kernel", lambda: None)
    assert not fp8_fused.usable(GPU, (256, 256), (128, 128))
    with pytest.raises(RuntimeError, match="needs Triton"):
        fp8_fused.quantize_fused(torch.zeros(2, 2), (1, 1), False)


@pytest.mark.parametrize(
    ("dtype", "fused"),
    [(torch.bfloat16, True), (torch.float16, True), (torch.float32, True), (torch.float64, False)],
)
def test_which_dtypes_take_it(monkeypatch, capable, dtype, fused) -> None:
    """float64 stays on torch: its math runs in float64 there, not float32."""
    calls = []

    def fake(weight, block, ue8m0, box=None):
        calls.append((block, ue8m0))
        return "fused"

    def on_a_gpu(weight, block):  # the CPU weight stands for a CUDA one of its dtype
        return fp8_fused.usable(GPU, tuple(weight.shape), block, weight.dtype)

    monkeypatch.setattr(fp8_fused, "available", on_a_gpu)
    monkeypatch.setattr(fp8_fused, "quantize_fused", fake)
    result = quantize(torch.zeros(128, 128, dtype=dtype), BlockFp8Format((64, 32), ue8m0=True))
    assert (result == "fused") is fused
    assert calls == ([((64, 32), True)] if fused else [])


_INTERPRETED = textwrap.dedent(
    """
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from p2pweights.source.fp8_block import BlockFp8Format, quantize
    from p2pweights.source.fp8_fused import quantize_batch, quantize_fused as fused

    torch.manual_seed(0)
    weight = torch.randn(2, 130, 200) * 0.02
    weight[0, :64, :64] = 0.0
    weight[0, 70, 70] = float("inf")
    weight[1, 129, 199] = float("nan")
    weight[1, :64, 128:] *= 1e-30
    failures = []
    for block, ue8m0, dtype in [
        ((64, 64), False, torch.bfloat16),
        ((64, 64), True, torch.float32),
        ((96, 80), True, torch.bfloat16),
    ]:
        w = weight.to(dtype)
        _, scale = fused(w, block, ue8m0)
        _, want_scale = quantize(w, BlockFp8Format(block, ue8m0=ue8m0))
        same_bits = scale.view(torch.int32) == want_scale.view(torch.int32)
        if not (same_bits | (scale.isnan() & want_scale.isnan())).all():
            failures.append(f"scales differ for {block} ue8m0={ue8m0} {dtype}")
    # one launch for separate tensors (addresses from a table): each as alone
    alone = [fused(w, (64, 64), True) for w in weight.bfloat16()]
    batch = quantize_batch(list(weight.bfloat16()), (64, 64), True)
    for (q, scale), (want_q, want_scale) in zip(batch, alone):
        if not torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)):
            failures.append("a batch's fp8 bytes differ from the weight's alone")
        if not torch.equal(scale.nan_to_num(), want_scale.nan_to_num()):
            failures.append("a batch's scales differ from the weight's alone")
    # a box of blocks (a TP rank's slice): its scales as the whole weight's there
    _, boxed = fused(weight[1].bfloat16(), (64, 64), False, (1, 3, 1, 4))
    _, whole = quantize(weight[1].bfloat16(), BlockFp8Format((64, 64)))
    if not torch.equal(boxed[1:3, 1:4].nan_to_num(), whole[1:3, 1:4].nan_to_num()):
        failures.append("a box's scales differ from the whole weight's")
    print("\\n".join(failures) or "ok")
    sys.exit(1 if failures else 0)
    """
)


@pytest.mark.slow
def test_kernel_scales_equal_torchs_under_the_interpreter() -> None:
    assert_prints_ok(_INTERPRETED)


@pytest.mark.parametrize(("setting", "fused"), [(None, True), ("1", True), ("0", False)])
def test_the_switch_turns_the_kernel_off(monkeypatch, setting, fused) -> None:
    """``P2PWEIGHTS_FUSED_FP8=0`` sends every weight to torch's quantizer, on a GPU where
    the kernel would run (stood in for: capable device, compiled kernel)."""
    monkeypatch.setattr(fp8_fused, "_capable", lambda device: True)
    monkeypatch.setattr(fp8_fused, "_kernel", lambda: object())
    if setting is None:
        monkeypatch.delenv("P2PWEIGHTS_FUSED_FP8", raising=False)
    else:
        monkeypatch.setenv("P2PWEIGHTS_FUSED_FP8", setting)
    device = torch.device("cuda", 0)
    assert fp8_fused.usable(device, (256, 512), (128, 128), torch.bfloat16) is fused


def test_quantize_many_batches_weights_of_one_shape(monkeypatch, capable) -> None:
    """Same shape, dtype and strides share a launch; the rest go alone; the bits are
    ``quantize``'s. (The CPU weights stand for CUDA ones; the fake batch quantizes each
    with torch, as the kernel's batch gives the same bits: checked on the GPU.)"""
    batches = []

    def batch(weights, block, ue8m0, box=None):
        batches.append([tuple(w.shape) for w in weights])
        return [fp8_block.quantize(w, BlockFp8Format(block, ue8m0)) for w in weights]

    monkeypatch.setattr(fp8_fused, "available", lambda weight, block: weight.dim() == 2)
    monkeypatch.setattr(fp8_fused, "quantize_batch_or_none", batch)
    monkeypatch.setattr(fp8_fused, "quantize_or_none", lambda weight, block, ue8m0, box=None: None)
    weights = [torch.randn(64, 32), torch.randn(32, 64), torch.randn(64, 32), torch.randn(2, 4, 4)]
    weights.append(torch.randn(32, 64).t())  # (64, 32) with other strides
    fmt = BlockFp8Format((16, 16))
    got = fp8_block.quantize_many(weights, fmt)
    assert batches == [[(64, 32), (64, 32)]]
    for weight, (q, scale) in zip(weights, got, strict=True):
        want_q, want_scale = quantize(weight, fmt)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(scale, want_scale)


def test_a_failed_batch_gives_way_to_torch(monkeypatch, capable) -> None:
    monkeypatch.setattr(fp8_fused, "available", lambda weight, block: not fp8_fused._broken)
    monkeypatch.setattr(fp8_fused, "quantize_batch", _raises)
    weights = [torch.randn(32, 32).bfloat16() for _ in range(3)]
    got = fp8_block.quantize_many(weights, BlockFp8Format((16, 16)))
    assert fp8_fused._broken and "no kernel image" in fp8_fused._broken[0]
    for weight, (q, _) in zip(weights, got, strict=True):
        assert torch.equal(
            q.view(torch.uint8), quantize(weight, BlockFp8Format((16, 16)))[0].view(torch.uint8)
        )


def test_a_batch_takes_alike_weights_only() -> None:
    with pytest.raises(ValueError, match="one shape, dtype, device and strides"):
        fp8_fused.quantize_batch([torch.zeros(4, 4), torch.zeros(4, 8)], (2, 2), False)


def _raises(weights, block, ue8m0, box=None):
    raise RuntimeError("no kernel image is available for execution")
