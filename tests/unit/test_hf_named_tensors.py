"""hf_named_tensors gives what save_pretrained writes: names, dtypes and bytes, tied weights once.

Plain transformers models of the shipped tiny configs (dense, tied, MoE with fused
experts), bucketed down to one conversion unit per bucket, and the same models
sharded with FSDP2 over two gloo ranks.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch
from safetensors.torch import load_file

from p2pweights.adapters import hf_named_tensors
from p2pweights.adapters.hf import _buckets, _conversion_units, _reverse_transforms
from p2pweights.local_engine import free_port
from p2pweights.testing import model_config


def _model(name: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(**model_config(name))
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)


def _saved(model, folder) -> dict[str, torch.Tensor]:
    model.save_pretrained(folder)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def _assert_same(ours: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> None:
    assert sorted(ours) == sorted(saved)
    for name, tensor in saved.items():
        assert ours[name].dtype == tensor.dtype, name
        assert torch.equal(ours[name], tensor), name


@pytest.mark.parametrize("model_name", ["qwen3-tiny", "qwen3-tiny-tied", "qwen3-moe-tiny"])
@pytest.mark.parametrize("bucket_bytes", [1, "1MiB", "1GiB"])
def test_checkpoint_names_and_bytes_as_save_pretrained_writes_them(
    model_name, bucket_bytes, tmp_path
):
    model = _model(model_name)
    ours = dict(hf_named_tensors(model, bucket_bytes=bucket_bytes))
    _assert_same(ours, _saved(model, tmp_path))
    if model_name == "qwen3-moe-tiny":  # fused in memory, one tensor per expert here
        assert "model.layers.0.mlp.experts.7.gate_proj.weight" in ours
        assert not any(name.endswith("gate_up_proj") for name in ours)
    if model_name == "qwen3-tiny-tied":
        assert "lm_head.weight" not in ours


def test_fused_experts_stay_in_one_bucket_and_order_is_the_state_dicts():
    model = _model("qwen3-moe-tiny")
    names = list(model.state_dict())
    units = _conversion_units(names, _reverse_transforms(model))
    assert [n for unit in units for n in unit] == names
    fused = [unit for unit in units if any("experts" in n for n in unit)]
    assert all(len(unit) == 1 for unit in fused)  # each fused tensor reverts on its own


@pytest.mark.parametrize(
    ("sizes", "limit", "expected"),
    [
        ([1, 1, 1], 2, [["a", "b"], ["c"]]),
        ([3, 1, 1], 2, [["a"], ["b", "c"]]),  # a unit larger than the limit is a bucket alone
        ([1, 1, 1], 1, [["a"], ["b"], ["c"]]),
        ([1, 1, 1], 10, [["a", "b", "c"]]),
    ],
)
def test_buckets(sizes, limit, expected):
    names = ["a", "b", "c"]
    sized = dict(zip(names, sizes, strict=True))
    assert list(_buckets([[n] for n in names], sized, limit)) == expected


def test_dtype_casts_floating_tensors_before_gathering(tmp_path):
    model = _model("qwen3-tiny", dtype=torch.float32)
    ours = dict(hf_named_tensors(model, dtype=torch.bfloat16))
    assert {t.dtype for t in ours.values()} == {torch.bfloat16}
    saved = _saved(model.to(torch.bfloat16), tmp_path)
    _assert_same(ours, saved)


@pytest.mark.parametrize("model_name", ["qwen3-tiny", "qwen3-tiny-tied", "qwen3-moe-tiny"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_specs_say_what_will_be_yielded_without_gathering(model_name, dtype):
    """A first update plans from specs() and then streams: they must agree, names, shapes
    and dtypes, fused experts reverted to per-expert checkpoint tensors included."""
    model = _model(model_name, dtype=torch.float32)
    pairs = hf_named_tensors(model, dtype=dtype)
    specs = pairs.specs()
    assert {n: (tuple(t.shape), t.dtype) for n, t in pairs} == specs
    assert all(dtype is None or d == dtype for _, d in specs.values())


def _fsdp_rank(rank: int, port: int, model_name: str, out) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model = _model(model_name)
        expected = dict(hf_named_tensors(model))  # before sharding
        mesh = init_device_mesh("cpu", (2,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        sharded = type(next(model.parameters())).__name__
        # owned=False: the gathered path (the default hands each rank its own shards)
        ours = dict(hf_named_tensors(model, bucket_bytes="256KiB", owned=False))
        same = sorted(ours) == sorted(expected) and all(
            ours[n].dtype == t.dtype and torch.equal(ours[n], t) for n, t in expected.items()
        )
        out.put((rank, sharded, same, len(ours)))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("model_name", ["qwen3-tiny-tied", "qwen3-moe-tiny"])
def test_fsdp2_sharded_models_give_the_full_tensors_on_every_rank(model_name):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_fsdp_rank, args=(r, port, model_name, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=180) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert [r[:3] for r in results] == [(0, "DTensor", True), (1, "DTensor", True)]


@pytest.mark.parametrize("model_name", ["qwen3-tiny", "qwen3-moe-tiny"])
@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_yielded_tensors_stay_unchanged_while_later_buckets_are_made(model_name, dtype):
    """update()'s contract (issue 28 item 2): nothing the adapter does for a later bucket
    writes into a tensor it already yielded, so none fails the input check at the end."""
    from p2pweights.source.receipts import Receipts

    receipts = Receipts()
    pairs = list(
        receipts.recording(hf_named_tensors(_model(model_name), bucket_bytes=1, dtype=dtype))
    )
    receipts.check_all(pairs)
