"""Every family: the replica is bit-exact at every rank of every layout, engine path included.

For each tiny config (``p2pweights/models/*-tiny.json``: 8 experts, top-2, shared
experts and first-k dense layers where the family has them, vocabulary 1000 so
sglang pads it, a DeepSeek-style MTP layer in the GLM / DeepSeek checkpoints) and
each layout, every engine rank is checked twice against ``load_real_rank_model``
(sglang's own loader and start-up postprocess into a real CPU model of the rank):

* staged bytes: every probe group staged through ``load_into`` equals the
  reference's parameter bytes;
* engine path: a real rank model holding other weights, updated as p2pweights
  updates an engine (begin_update, staged bytes over its parameters,
  end_update(run_post_load=True)), equals the reference on every parameter,
  persistent buffer and derived tensor (MLA's w_kc / w_vc).

The widest layouts (TP 8) are also marked slow.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from p2pweights.errors import ConfigError
from p2pweights.replica.ranks import RankSpec
from p2pweights.replica.sglang.model_replica import ModelReplica
from p2pweights.replica.sglang.reference import load_real_rank_model
from p2pweights.source.inputs import describe_inputs
from p2pweights.testing import model_config, synthetic_weights, write_model_dir
from p2pweights.testing.bitexact import as_bytes, engine_path_model, stage_all, state_mismatches

pytestmark = pytest.mark.integration

MODELS = [
    "qwen3-moe-tiny",
    "glm4-moe-tiny",
    "deepseek-v3-tiny",
    "glm4-moe-lite-tiny",
    "qwen3-tiny",
    "qwen3-tiny-tied",
    "qwen2-tiny",
    "qwen2-tiny-tied",
]

DP4 = {"dp_size": 4, "enable_dp_attention": True}
DP2 = {"dp_size": 2, "enable_dp_attention": True}


def _layout(name: str, **info: Any) -> Any:
    return pytest.param(info, id=name)


def _slow(name: str, **info: Any) -> Any:
    return pytest.param(info, id=name, marks=pytest.mark.slow)


LAYOUTS = {
    "qwen3-moe-tiny": [
        _layout("tp1", tp_size=1),
        _layout("tp2-ep2", tp_size=2, ep_size=2),
        _layout("tp4-ep2", tp_size=4, ep_size=2),
        _layout("tp4-ep4-dpattn4", tp_size=4, ep_size=4, **DP4),
        _slow("tp2-ep1", tp_size=2, ep_size=1),
        _slow("tp4-ep1", tp_size=4, ep_size=1),
        _slow("tp4-ep4", tp_size=4, ep_size=4),
        _slow("tp8-ep8", tp_size=8, ep_size=8),
        _slow("tp8-ep4-dpattn2", tp_size=8, ep_size=4, **DP2),
    ],
    "glm4-moe-tiny": [
        _layout("tp2-ep1", tp_size=2, ep_size=1),
        _layout("tp4-ep4", tp_size=4, ep_size=4),
        _layout("tp4-ep2-dpattn2", tp_size=4, ep_size=2, **DP2),
        _slow("tp1", tp_size=1),
        _slow("tp4-ep1", tp_size=4),
        _slow("tp4-ep4-dpattn4-densetp1", tp_size=4, ep_size=4, moe_dense_tp_size=1, **DP4),
        _slow("tp8-ep8", tp_size=8, ep_size=8),
    ],
    "deepseek-v3-tiny": [
        _layout("tp2-ep2", tp_size=2, ep_size=2),
        _layout("tp4-ep1", tp_size=4, ep_size=1),
        _layout("tp4-ep4-dpattn4-densetp1", tp_size=4, ep_size=4, moe_dense_tp_size=1, **DP4),
        _slow("tp1", tp_size=1),
        _slow("tp4-ep2", tp_size=4, ep_size=2),
        _slow("tp4-ep4", tp_size=4, ep_size=4),
        _slow("tp8-ep8", tp_size=8, ep_size=8),
        _slow(
            "tp8-ep8-dpattn8-densetp1",
            tp_size=8,
            ep_size=8,
            moe_dense_tp_size=1,
            dp_size=8,
            enable_dp_attention=True,
        ),
    ],
    "glm4-moe-lite-tiny": [
        _layout("tp2-ep2", tp_size=2, ep_size=2),
        _layout("tp4-ep4", tp_size=4, ep_size=4),
        _slow("tp1", tp_size=1),
        _slow("tp4-ep2-dpattn2", tp_size=4, ep_size=2, **DP2),
        _slow("tp8-ep8", tp_size=8, ep_size=8),
    ],
    # dense families (staged bytes at TP 1/2/4 are also in test_replica_bytes.py);
    # 2 kv heads, so TP 4 and TP 8 replicate them
    **{
        dense: [
            _layout("tp4", tp_size=4),
            _slow("tp2", tp_size=2),
            _slow("tp8", tp_size=8),
        ]
        for dense in ("qwen3-tiny", "qwen3-tiny-tied", "qwen2-tiny", "qwen2-tiny-tied")
    },
}
CASES = [
    pytest.param(model, *param.values, id=f"{model}-{param.id}", marks=param.marks)
    for model, layouts in LAYOUTS.items()
    for param in layouts
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: write_model_dir(name, root / name) for name in MODELS}


@pytest.fixture(scope="module")
def weights() -> dict[str, tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]]:
    """(the update's weights, the weights the engine held before) per model."""
    return {
        name: (list(synthetic_weights(name, seed=7)), list(synthetic_weights(name, seed=8)))
        for name in MODELS
    }


def _check_rank(
    folder: Path,
    info: Mapping[str, Any],
    rank: int,
    hf: list[tuple[str, torch.Tensor]],
    previous: list[tuple[str, torch.Tensor]],
) -> None:
    spec = RankSpec.from_server_info(info, rank)
    where = f"{folder.name} {dict(info)} rank {rank}"
    replica = ModelReplica(folder, spec, server_args_fields=info)
    loader_map = replica.loader_map(describe_inputs(hf))
    reference = load_real_rank_model(folder, spec, iter(hf), server_args_fields=info)
    real = dict(reference.named_parameters())

    assert set(replica.layouts) == set(real), where
    for name, layout in replica.layouts.items():
        assert (layout.shape, layout.stride, layout.dtype, layout.num_bytes) == (
            tuple(real[name].shape),
            real[name].stride(),
            real[name].dtype,
            real[name].nbytes,
        ), f"{where} {name}"
    assert set(loader_map.unfed_params) <= replica.optional_params, where
    # what this rank's loader skips: other ranks' experts and the MTP layer
    num_layers = replica.model_config.hf_config.num_hidden_layers
    for name in loader_map.unused:
        assert ".experts." in name or name.startswith(f"model.layers.{num_layers}."), (where, name)

    staged = stage_all(replica, loader_map, hf)
    assert set(staged) == set(real) - replica.optional_params, where
    wrong = [name for name in staged if not torch.equal(staged[name], as_bytes(real[name]))]
    assert wrong == [], f"{where}: staged bytes differ for {wrong}"
    assert all(p.device.type == "meta" for p in replica.model.parameters())

    updated = engine_path_model(folder, spec, iter(previous), staged, info)
    mismatches = state_mismatches(updated, reference)
    assert mismatches == [], f"{where}: engine path differs: {mismatches}"


@pytest.mark.parametrize(("model", "info"), CASES)
def test_every_rank_bit_exact(
    model: str, info: dict[str, Any], model_dirs: dict[str, Path], weights: dict
) -> None:
    hf, previous = weights[model]
    for rank in range(info["tp_size"]):
        _check_rank(model_dirs[model], info, rank, hf, previous)


DRAFT_CASES = [
    pytest.param("deepseek-v3-tiny", {"tp_size": 2, "ep_size": 2}, id="deepseek-v3-tp2-ep2"),
    pytest.param("glm4-moe-tiny", {"tp_size": 4, "ep_size": 4, **DP4}, id="glm4-moe-tp4-ep4-dp4"),
    pytest.param(
        "deepseek-v3-tiny",
        {"tp_size": 8, "ep_size": 8},
        id="deepseek-v3-tp8-ep8",
        marks=pytest.mark.slow,
    ),
]


@pytest.mark.parametrize(("model", "info"), DRAFT_CASES)
def test_speculative_draft_bit_exact(
    model: str, info: dict[str, Any], model_dirs: dict[str, Path], weights: dict
) -> None:
    _check_draft(model, info, model_dirs[model], *weights[model])


def test_fp8_speculative_draft_bit_exact(fp8_dirs: dict[tuple[int, ...], Path]) -> None:
    """DeepSeek-V3 as deployed: fp8 blocks and its MTP layer as the draft. The engine's
    checkpoint holds the MTP layer in fp8 too; the draft's loader reads it from there."""
    from p2pweights.replica.engine_checkpoint import engine_checkpoint

    folder = fp8_dirs[(128, 128)]
    hf = engine_checkpoint(folder, synthetic_weights("deepseek-v3-fp8-tiny", seed=7))
    previous = engine_checkpoint(folder, synthetic_weights("deepseek-v3-fp8-tiny", seed=8))
    assert dict(hf)["model.layers.3.self_attn.q_b_proj.weight"].dtype == torch.float8_e4m3fn
    info = {"tp_size": 2, "ep_size": 2}
    _check_draft("deepseek-v3-fp8-tiny", info, folder, hf, previous)


def _check_draft(
    model: str,
    info: dict[str, Any],
    folder: Path,
    hf: list[tuple[str, torch.Tensor]],
    previous: list[tuple[str, torch.Tensor]],
) -> None:
    """A same-model MTP draft (NEXTN): the draft replica is the engine's draft runner
    (the NextN class, its speculative MoE flags); its loader takes the MTP layer from the
    model's checkpoint and skips the embedding and head, which the engine shares with
    the target. Every rank's staged bytes and engine path equal sglang's draft loader."""
    info = {**info, "speculative_algorithm": "NEXTN"}
    mtp_layer = f"model.layers.{model_config(model)['num_hidden_layers']}."
    for rank in range(info["tp_size"]):
        spec = RankSpec.from_server_info(info, rank)
        replica = ModelReplica(folder, spec, server_args_fields=info, role="draft")
        assert type(replica.model).__name__.endswith("NextN")
        assert {"model.embed_tokens.weight", "lm_head.weight"} <= replica.optional_params
        others = replica.optional_params - {"model.embed_tokens.weight", "lm_head.weight"}
        assert all(name.endswith(("k_scale", "v_scale")) for name in others)  # fp8 attention
        loader_map = replica.loader_map(describe_inputs(hf))
        assert set(loader_map.unfed_params) == replica.optional_params
        used = set(loader_map.feeds) - set(loader_map.unused)
        assert used and all(name.startswith(mtp_layer) for name in used), sorted(used)[:4]
        reference = load_real_rank_model(
            folder, spec, iter(hf), server_args_fields=info, role="draft"
        )
        real = dict(reference.named_parameters())
        staged = stage_all(replica, loader_map, hf)
        assert set(staged) == set(real) - replica.optional_params
        wrong = [name for name in staged if not torch.equal(staged[name], as_bytes(real[name]))]
        assert wrong == [], f"{model} rank {rank}: {wrong}"
        updated = engine_path_model(folder, spec, iter(previous), staged, info, role="draft")
        mismatches = [
            m
            for m in state_mismatches(updated, reference)
            if m.split()[-1] not in replica.optional_params
        ]
        assert mismatches == [], f"{model} rank {rank}: {mismatches}"


def test_draft_checkpoint_path_is_the_trainers_copy(model_dirs: dict[str, Path]) -> None:
    """sglang resolves a same-model draft's path to the engine's model_path, which the
    trainer may not have; the replica reads the trainer's copy of the config instead."""
    info = {
        "tp_size": 2,
        "ep_size": 2,
        "model_path": "/engine-host/models/DeepSeek-V3",
        "speculative_algorithm": "EAGLE",
        "speculative_draft_model_path": "/engine-host/models/DeepSeek-V3",
        "speculative_draft_model_revision": "main",
    }
    folder = model_dirs["deepseek-v3-tiny"]
    spec = RankSpec.from_server_info(info, 1)
    draft = ModelReplica.from_server_info(folder / "config.json", info, spec, role="draft")
    assert type(draft.model).__name__ == "DeepseekV3ForCausalLMNextN"
    target = ModelReplica.from_server_info(folder, info, spec)
    assert "model.layers.2.mlp.experts.w13_weight" in target.layouts


def test_draft_whose_end_update_fails_in_sglang_is_refused(model_dirs: dict[str, Path]) -> None:
    """sglang 0.5.23's GLM4-MoE-Lite NextN does not override post_load_weights, so the
    engine's end_weight_update after direct writes fails; refused when the replica is built."""
    info = {"tp_size": 2, "speculative_algorithm": "NEXTN"}
    with pytest.raises(ConfigError, match=r"Glm4MoeLiteForCausalLMNextN.*post_load_weights"):
        ModelReplica(
            model_dirs["glm4-moe-lite-tiny"],
            RankSpec.from_server_info(info, 0),
            server_args_fields=info,
            role="draft",
        )


def test_deepseek_groups_mla_and_experts(model_dirs: dict[str, Path], weights: dict) -> None:
    """DeepSeek's loader fuses q_a with kv_a in one call; EP 2 rank 1 holds experts 4..7."""
    info = {"tp_size": 2, "ep_size": 2}
    replica = ModelReplica(
        model_dirs["deepseek-v3-tiny"], RankSpec.from_server_info(info, 1), server_args_fields=info
    )
    hf, _ = weights["deepseek-v3-tiny"]
    loader_map = replica.loader_map(describe_inputs(hf))
    fused = loader_map.group_of_param("model.layers.1.self_attn.fused_qkv_a_proj_with_mqa.weight")
    assert fused.hf_names == {
        "model.layers.1.self_attn.q_a_proj.weight",
        "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
    }
    experts = loader_map.group_of_param("model.layers.2.mlp.experts.w13_weight")
    assert {name.split(".")[5] for name in experts.hf_names} == {"4", "5", "6", "7"}
    assert replica.layouts["model.layers.2.mlp.experts.w13_weight"].shape == (4, 256, 256)
    # the MTP layer (layer 3) belongs to the draft model; the target loader skips it
    assert "model.layers.3.eh_proj.weight" in loader_map.unused


def test_dense_layers_follow_moe_dense_tp_size(model_dirs: dict[str, Path]) -> None:
    info = {"tp_size": 4, "ep_size": 4, "moe_dense_tp_size": 1, **DP4}
    replica = ModelReplica(
        model_dirs["glm4-moe-tiny"], RankSpec.from_server_info(info, 3), server_args_fields=info
    )
    # layer 0 is dense (first_k_dense_replace 1): gate_up unsharded at moe_dense_tp_size 1
    assert replica.layouts["model.layers.0.mlp.gate_up_proj.weight"].shape == (1024, 256)
    assert replica.layouts["model.layers.1.mlp.experts.w13_weight"].shape == (2, 256, 256)


@pytest.mark.parametrize(
    ("arg", "value"),
    [
        ("ep_num_redundant_experts", 2),
        ("init_expert_location", "/tmp/placement.json"),
        ("enable_eplb", True),
        ("elastic_ep_backend", "mooncake"),
        ("dwdp_size", 2),
        ("kt_weight_path", "/models/kt"),
    ],
)
def test_unreproducible_expert_placement_is_refused_at_build(
    arg: str, value: Any, model_dirs: dict[str, Path]
) -> None:
    info = {"tp_size": 2, "ep_size": 2, arg: value}
    with pytest.raises(ConfigError, match=arg):
        ModelReplica(
            model_dirs["qwen3-moe-tiny"],
            RankSpec.from_server_info(info, 0),
            server_args_fields=info,
        )


def test_per_expert_checkpoint_names() -> None:
    names = dict((n, s) for n, s, _ in _names("qwen3-moe-tiny"))
    assert names["model.layers.1.mlp.experts.7.gate_proj.weight"] == (128, 256)
    assert names["model.layers.1.mlp.experts.7.down_proj.weight"] == (256, 128)
    assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in names)
    glm = dict((n, s) for n, s, _ in _names("glm4-moe-tiny"))
    assert "model.layers.0.mlp.gate_proj.weight" in glm  # first_k_dense_replace
    assert glm["model.layers.3.eh_proj.weight"] == (256, 512)  # the MTP layer


def _names(model: str) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    from p2pweights.testing import hf_checkpoint_names_and_shapes

    return hf_checkpoint_names_and_shapes(model)


FP8_CASES = [
    pytest.param([128, 128], {"tp_size": 2, "ep_size": 2}, id="block128-tp2-ep2"),
    pytest.param([128, 128], {"tp_size": 4, "ep_size": 4, **DP4}, id="block128-tp4-ep4-dpattn4"),
    pytest.param([64, 64], {"tp_size": 4, "ep_size": 2}, id="block64-tp4-ep2"),
    pytest.param(
        [64, 64], {"tp_size": 2, "ep_size": 1}, id="block64-tp2-ep1", marks=pytest.mark.slow
    ),
    pytest.param([128, 128], {"tp_size": 1}, id="block128-tp1", marks=pytest.mark.slow),
    pytest.param(
        [64, 64], {"tp_size": 8, "ep_size": 8}, id="block64-tp8-ep8", marks=pytest.mark.slow
    ),
]


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, ...], Path]:
    dirs = {}
    for block in ([128, 128], [64, 64]):
        config = model_config("deepseek-v3-fp8-tiny")
        config["quantization_config"]["weight_block_size"] = block
        dirs[tuple(block)] = write_model_dir(config, tmp_path_factory.mktemp(f"fp8-{block[0]}"))
    return dirs


@pytest.mark.parametrize(("block", "info"), FP8_CASES)
def test_fp8_block_engines_bit_exact(
    block: list[int], info: dict[str, Any], fp8_dirs: dict[tuple[int, ...], Path]
) -> None:
    """DeepSeek-V3 / Kimi-K2 style block-fp8 engines: the replica reaches the reload layout
    module by module, and every rank's staged bytes and engine path equal sglang's loader
    fed the fp8 checkpoint (weights + scale_inv) that the sender quantizes bf16 into."""
    from p2pweights.replica.engine_checkpoint import engine_checkpoint

    folder = fp8_dirs[tuple(block)]
    hf = engine_checkpoint(folder, synthetic_weights("deepseek-v3-fp8-tiny", seed=7))
    previous = engine_checkpoint(folder, synthetic_weights("deepseek-v3-fp8-tiny", seed=8))
    assert dict(hf)["model.layers.1.self_attn.q_b_proj.weight"].dtype == torch.float8_e4m3fn
    assert "model.layers.1.mlp.experts.7.down_proj.weight_scale_inv" in dict(hf)
    for rank in range(info["tp_size"]):
        _check_rank(folder, info, rank, hf, previous)


def test_fp8_replica_materializes_only_modules_that_read_values(
    fp8_dirs: dict[tuple[int, ...], Path], model_dirs: dict[str, Path]
) -> None:
    """Most fp8 steps run on meta; the attention k/v-scale check reads values, so only
    those modules get (scalar) storage, one at a time, and go back to meta."""
    replica = ModelReplica(fp8_dirs[(128, 128)], RankSpec.derive(tp_size=2, engine_rank=1))
    assert replica.materialized_modules
    assert all(name.endswith(("attn_mqa", "attn_mha")) for name in replica.materialized_modules), (
        replica.materialized_modules
    )
    # (buffers may be sglang's shared rope caches, built by whichever model came first)
    assert all(p.device.type == "meta" for p in replica.model.parameters())
    assert replica.layouts["model.layers.1.mlp.experts.w13_weight"].dtype == torch.float8_e4m3fn
    assert replica.layouts["model.layers.1.mlp.experts.w13_weight_scale_inv"].shape == (8, 4, 2)
    assert replica.optional_params == {
        f"model.layers.{i}.self_attn.{attn}.{scale}"
        for i in range(3)
        for attn in ("attn_mqa", "attn_mha")
        for scale in ("k_scale", "v_scale")
    }
    bf16 = ModelReplica(model_dirs["deepseek-v3-tiny"], RankSpec.derive(tp_size=2, engine_rank=1))
    assert bf16.materialized_modules == [] and bf16.optional_params == frozenset()


def test_batch_probe_equals_name_by_name(model_dirs: dict[str, Path], weights: dict) -> None:
    """Where each name loads alone (no loader pairs names), both probes agree exactly."""
    from p2pweights.replica.sglang.probe import _probe_batch, _probe_one

    info = {"tp_size": 4, "ep_size": 2}
    replica = ModelReplica(
        model_dirs["glm4-moe-tiny"], RankSpec.from_server_info(info, 3), server_args_fields=info
    )
    hf, _ = weights["glm4-moe-tiny"]
    specs = describe_inputs(hf)
    batch = _probe_batch(replica, specs)
    assert batch is not None
    assert batch == {name: _probe_one(replica, name, spec) for name, spec in specs.items()}
