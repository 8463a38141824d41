"""The replica stages exactly the bytes sglang's own loader writes, for every rank.

For each tiny model (Qwen2 / Qwen3, tied / untied; 2 kv heads so TP 4 replicates
them; vocabulary 1000 so sglang pads it) and TP 1, 2, 4 (TP 4 `slow`), every rank: stage the
synthetic checkpoint group by group (as the probe groups it) into flat uint8
buffers through ``ModelReplica.load_into``, and compare bit for bit with a real
CPU model of that rank filled by ``load_real_rank_model``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from p2pweights.errors import ConfigError
from p2pweights.replica.ranks import RankSpec
from p2pweights.replica.sglang.model_replica import ModelReplica
from p2pweights.replica.sglang.reference import load_real_rank_model
from p2pweights.source.inputs import InputSpec, describe_inputs
from p2pweights.testing import synthetic_weights, write_model_dir

pytestmark = pytest.mark.integration

MODELS = ["qwen2-tiny", "qwen2-tiny-tied", "qwen3-tiny", "qwen3-tiny-tied"]
# TP 4 (which replicates the 2 kv heads) is `slow` here: every dense family is also staged
# and checked at every rank of TP 4 by default in test_replica_families.py.
RANKS = [
    pytest.param(tp, rank, id=f"tp{tp}-r{rank}", marks=pytest.mark.slow if tp == 4 else ())
    for tp in (1, 2, 4)
    for rank in range(tp)
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: write_model_dir(name, root / name) for name in MODELS}


@pytest.fixture(scope="module")
def weights() -> dict[str, list[tuple[str, torch.Tensor]]]:
    return {name: list(synthetic_weights(name, seed=7)) for name in MODELS}


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize(("tp_size", "rank"), RANKS)
@pytest.mark.parametrize("model", MODELS)
def test_staged_bytes_equal_sglang_loader(
    model: str, tp_size: int, rank: int, model_dirs: dict[str, Path], weights: dict
) -> None:
    spec = RankSpec.from_server_info({"tp_size": tp_size}, rank)
    hf = weights[model]
    replica = ModelReplica(model_dirs[model], spec)
    loader_map = replica.loader_map(describe_inputs(hf))
    real = dict(load_real_rank_model(model_dirs[model], spec, iter(hf)).named_parameters())

    assert set(replica.layouts) == set(real)
    for name, layout in replica.layouts.items():
        assert layout.num_bytes == real[name].nbytes, name
        assert (layout.shape, layout.stride, layout.dtype) == (
            tuple(real[name].shape),
            real[name].stride(),
            real[name].dtype,
        ), name
    assert loader_map.unused == ()
    assert loader_map.unfed_params == ()

    covered: set[str] = set()
    by_name = dict(hf)
    for group in loader_map.groups:
        assert covered.isdisjoint(group.param_names)
        covered.update(group.param_names)
        staging = torch.full(
            (sum(replica.layouts[p].num_bytes for p in group.param_names),), 0xA5, dtype=torch.uint8
        )
        destinations, offset = {}, 0
        for param in group.param_names:
            size = replica.layouts[param].num_bytes
            destinations[param] = staging[offset : offset + size]
            offset += size
        replica.load_into([(name, by_name[name]) for name in sorted(group.hf_names)], destinations)
        for param, dest in destinations.items():
            assert torch.equal(dest, _as_bytes(real[param])), f"{model} tp{tp_size} r{rank} {param}"
    assert covered == set(real)
    # the replica holds no storage after staging
    assert all(p.device.type == "meta" for p in replica.model.parameters())


def test_fused_and_tied_groups(model_dirs: dict[str, Path], weights: dict) -> None:
    replica = ModelReplica(model_dirs["qwen3-tiny-tied"], RankSpec.derive(tp_size=2, engine_rank=1))
    specs = describe_inputs(weights["qwen3-tiny-tied"])
    # a tied lm_head and a rotary buffer a trainer may send anyway feed nothing
    extra = {
        "lm_head.weight": InputSpec((1000, 256), torch.bfloat16),
        "model.layers.0.self_attn.rotary_emb.inv_freq": InputSpec((16,), torch.float32),
    }
    loader_map = replica.loader_map({**specs, **extra})
    assert set(loader_map.unused) == set(extra)
    qkv = loader_map.group_of_param("model.layers.1.self_attn.qkv_proj.weight")
    assert qkv.hf_names == {f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv"}
    gate_up = loader_map.group_of_param("model.layers.0.mlp.gate_up_proj.weight")
    assert gate_up.hf_names == {
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
    }
    assert loader_map.params_of("model.embed_tokens.weight") == {"model.embed_tokens.weight"}


# Shapes this rank's loader cannot place. sglang's loaders narrow the input for
# their rank without checking its full size, so an input that is too small can
# still fit a low rank; a session probes every target rank before the first write.
@pytest.mark.parametrize(
    ("name", "shape", "target"),
    [
        (  # one kv head short: rank 1's kv head is missing
            "model.layers.0.self_attn.k_proj.weight",
            (32, 256),
            "model.layers.0.self_attn.qkv_proj.weight",
        ),
        (  # would broadcast silently into the norm
            "model.layers.0.self_attn.q_norm.weight",
            (1,),
            "model.layers.0.self_attn.q_norm.weight",
        ),
        (  # half the hidden size (a too-short input dim sglang would zero-pad instead)
            "model.layers.0.mlp.down_proj.weight",
            (128, 512),
            "model.layers.0.mlp.down_proj.weight",
        ),
    ],
)
def test_wrong_shape_fails_before_writing(
    name: str, shape: tuple[int, ...], target: str, model_dirs: dict[str, Path]
) -> None:
    replica = ModelReplica(model_dirs["qwen3-tiny"], RankSpec.derive(tp_size=2, engine_rank=1))
    dest = torch.full((replica.layouts[target].num_bytes,), 7, dtype=torch.uint8)
    with pytest.raises(ConfigError, match=name.replace(".", r"\.")):
        replica.load_into([(name, torch.ones(shape, dtype=torch.bfloat16))], {target: dest})
    assert bool((dest == 7).all())


def test_rank_spec_matches_sglang_launcher() -> None:
    from sglang.srt.runtime_context import derive_attention_ranks, derive_spawn_ranks

    for tp, ep, attn_dp, attn_cp in [(8, 8, 1, 1), (8, 2, 4, 1), (4, 1, 1, 2), (8, 4, 2, 2)]:
        attn_tp = tp // attn_dp // attn_cp
        for rank in range(2 * tp):
            spec = RankSpec.derive(
                tp_size=tp,
                pp_size=2,
                engine_rank=rank,
                ep_size=ep,
                attn_dp_size=attn_dp,
                attn_cp_size=attn_cp,
            )
            ranks = derive_spawn_ranks(
                world_rank=rank,
                tp_size=tp,
                ep_join_rank_offset=0,
                attn_cp_size=attn_cp,
                attn_tp_size=attn_tp,
                moe_dp_size=1,
                moe_ep_size=ep,
            )
            if attn_cp > 1:
                ranks["moe_dp_rank"] = ranks["attn_cp_rank"]
            attn_tp_rank, attn_dp_rank = derive_attention_ranks(
                tp_rank=ranks["tp_rank"], attn_tp_size=attn_tp, attn_cp_size=attn_cp
            )
            ranks.update(attn_tp_rank=attn_tp_rank, attn_dp_rank=attn_dp_rank)
            assert {k: getattr(spec, k) for k in ranks} == ranks


def test_from_server_info_and_demo_size(tmp_path: Path) -> None:
    """The registry's entry point; qwen3-demo is a few hundred MB and builds on meta."""
    folder = write_model_dir("qwen3-demo", tmp_path / "demo")
    info = {"tp_size": 2, "dtype": "bfloat16", "model_path": "/engine/only/path", "port": 30000}
    replica = ModelReplica.from_server_info(
        folder / "config.json", info, RankSpec.from_server_info(info, 1)
    )
    total_bytes = replica.total_bytes
    assert 150e6 < total_bytes < 250e6  # half of about 390 MB at TP 2
    assert replica.layouts["model.embed_tokens.weight"].shape == (16032, 1024)  # 32003 padded
    groups = replica.probe(
        {"model.layers.0.self_attn.q_proj.weight": InputSpec((2048, 1024), torch.bfloat16)}
    )
    assert [g.param_names for g in groups] == [("model.layers.0.self_attn.qkv_proj.weight",)]


def test_synthetic_weights_are_deterministic_per_name() -> None:
    first = dict(synthetic_weights("qwen3-tiny", seed=3))
    again = dict(reversed(list(synthetic_weights("qwen3-tiny", seed=3))))
    other = dict(synthetic_weights("qwen3-tiny", seed=4))
    assert all(torch.equal(first[n], again[n]) for n in first)
    assert not torch.equal(first["model.norm.weight"], other["model.norm.weight"])
    assert "lm_head.weight" not in dict(synthetic_weights("qwen3-tiny-tied", seed=3))


def test_probe_reports_buffers_a_loader_writes(model_dirs: dict[str, Path], weights: dict) -> None:
    """Parameters only are written; a loader that fills a module buffer from an HF tensor is
    found by the probe, and the first update refuses it (the engine publishes no buffer)."""
    from p2pweights.replica.registry import replica_for

    handle = replica_for({"model_path": str(model_dirs["qwen3-tiny"]), "tp_size": 2}, 1)
    replica = handle.replica
    norm = replica.model.model.norm
    norm.register_buffer("shadow", torch.empty(256, dtype=torch.bfloat16, device="meta"))
    loader = replica.model.load_weights

    def load_with_shadow(pairs):
        pairs = list(pairs)
        for name, tensor in pairs:
            if name == "model.norm.weight":
                norm.shadow.copy_(tensor)
        return loader(iter(pairs))

    replica.model.load_weights = load_with_shadow
    try:
        specs = {name: InputSpec(tuple(t.shape), t.dtype) for name, t in weights["qwen3-tiny"]}
        loader_map = replica.loader_map(specs)
        assert loader_map.buffer_writes == {"model.norm.weight": {"model.norm.shadow"}}
        with pytest.raises(ConfigError, match=r"module buffers \['model.norm.shadow'\]"):
            handle.groups(specs)
    finally:
        del replica.model.load_weights
        del norm.shadow
        replica._loader_maps.clear()
        replica.probe_cache.clear()
