"""The whole path, real parts: trainer session -> real Mooncake / NIXL -> local engines in their
own processes, each rank a model built by sglang's model class. After every update each engine
rank must be bit-exact (sglang's WeightChecker checksums, parameters and persistent buffers)
with sglang's own ``load_weights`` of the same HF tensors into a real model of that rank.
"""

from __future__ import annotations

import pytest
import torch
from _bit_exact import assert_bit_exact, engine_mismatches, next_version, seed_weights

from p2pweights import MooncakeConfig, NixlConfig, SyncConfig, WeightSyncSession
from p2pweights.engines.client import EngineClient
from p2pweights.testing import save_safetensors, synthetic_weights

pytestmark = pytest.mark.integration

TRANSPORTS = {
    "mooncake": MooncakeConfig(protocol="tcp"),
    "nixl": NixlConfig(backend="UCX"),
}

# (model, engine TP sizes). Every case has kv heads (2) fewer than some TP, a vocabulary
# (1000) that sglang pads, tied or untied embeddings; together TP 1, 2 and 4 for both families.
MATRIX = [
    ("qwen3-tiny", [1, 2, 4]),
    ("qwen2-tiny-tied", [1, 2, 4]),
    ("qwen3-tiny-tied", [2]),
    ("qwen2-tiny", [4]),
]


# Over Mooncake by default; the same matrix over NIXL is `slow` (NIXL's whole path stays in
# the default run below: GLM4-MoE, the speculative draft, tests/integration/test_update_state.py;
# its bytes in tests/integration/test_transports.py).
CASES = [
    pytest.param(model, tps, transport, id=f"{model}-{transport}", marks=marks)
    for transport, marks in (("mooncake", ()), ("nixl", pytest.mark.slow))
    for model, tps in MATRIX
]


@pytest.mark.parametrize(("model", "tps", "transport"), CASES)
def test_updates_are_bit_exact_at_every_rank(model, tps, transport, model_dir, shared_engines):
    folder = model_dir(model)
    engines = shared_engines(folder, tps, transport=transport, seed=0)
    config = SyncConfig(transport=TRANSPORTS[transport], buffer_bytes="1MiB")
    with WeightSyncSession(config) as session:
        session.connect([e.url for e in engines])
        first = next_version(e.url for e in engines)  # shared engines: on from what they hold
        for step, seed in enumerate([11, 12]):
            report = session.update(seed_weights(folder, seed))
            assert report.version == str(first + step)
            assert set(report.bytes_by_target) == {(e.url, r) for e in engines for r in range(e.tp)}
            assert_bit_exact(engines, folder, seed)
            for engine in engines:
                assert EngineClient(engine.url).weight_version() == report.version


def test_the_reference_cache_misses_for_other_weights(model_dir, shared_engines):
    """The bit-exact check memoises sglang's reference per (weights' digest, config, layout,
    rank): the same check again is answered from it, and a check against weights the engine
    does not hold still finds every rank different."""
    import _bit_exact

    folder = model_dir("qwen3-tiny")
    (engine,) = shared_engines(folder, [2], seed=0)
    config = SyncConfig(transport=TRANSPORTS["mooncake"], buffer_bytes="1MiB")
    with WeightSyncSession(config) as session:
        session.connect([engine.url])
        session.update(seed_weights(folder, 13))
    assert_bit_exact([engine], folder, 13)
    hits, misses = _bit_exact.stats["hits"], _bit_exact.stats["misses"]
    assert_bit_exact([engine], folder, 13)
    assert (_bit_exact.stats["hits"], _bit_exact.stats["misses"]) == (hits + 2, misses)
    other = engine_mismatches(engine.url, lambda: seed_weights(folder, 14))
    assert _bit_exact.stats["misses"] == misses + 2
    assert all(other[rank] for rank in (0, 1)), other


# MoE and MLA families through the whole path (the replica-level matrix of every layout is
# in test_replica_families.py): expert parallelism, shared experts, first-k dense layers,
# MLA (derived w_kc / w_vc recomputed by the engine at end_weight_update), the MTP layer.
MOE_MATRIX = [
    ("qwen3-moe-tiny", [(2, {"ep_size": 2}), 1], "mooncake"),
    ("deepseek-v3-tiny", [(2, {"ep_size": 2})], "mooncake"),
    ("glm4-moe-tiny", [(2, {"ep_size": 2})], "nixl"),
]


@pytest.mark.parametrize(
    ("model", "layouts", "transport"), MOE_MATRIX, ids=[m for m, *_ in MOE_MATRIX]
)
def test_moe_and_mla_updates_are_bit_exact(model, layouts, transport, model_dir, shared_engines):
    folder = model_dir(model)
    engines = shared_engines(folder, layouts, transport=transport, seed=0)
    config = SyncConfig(transport=TRANSPORTS[transport], buffer_bytes="1MiB")
    with WeightSyncSession(config) as session:
        session.connect([e.url for e in engines])
        for seed in (31, 32):
            session.update(seed_weights(folder, seed))
            assert_bit_exact(engines, folder, seed)


def test_streamed_iterator_and_safetensors_engine(model_dir, start_engines, tmp_path):
    """An engine started from a safetensors folder; later updates streamed from a generator."""
    folder = model_dir("qwen3-tiny")
    save_safetensors(tmp_path, seed_weights(folder, 5))
    (engine,) = start_engines(folder, [2], weights=tmp_path, seed=None)
    assert_bit_exact([engine], folder, 5)
    config = SyncConfig(transport=MooncakeConfig(protocol="tcp"), buffer_bytes="1MiB")
    with WeightSyncSession(config) as session:
        session.connect([engine.url])
        session.update(iter(seed_weights(folder, 6)))
        assert_bit_exact([engine], folder, 6)
        session.update(synthetic_weights(folder, seed=7, dtype=torch.bfloat16))  # a generator
        assert_bit_exact([engine], folder, 7)


def test_verify_with_weight_checker_passes_on_the_weights_the_engine_holds(
    model_dir, shared_engines
):
    """The engine's weight checker snapshots what the engine holds at the session's first
    update, resets its tensors, and compares after the writes: an update rewriting those
    weights passes (and, the tensors having been reset, only the writes make it bit-exact)."""
    folder = model_dir("qwen3-tiny")
    (engine,) = shared_engines(folder, [2], seed=0)
    plain = SyncConfig(transport=MooncakeConfig(protocol="tcp"))
    with WeightSyncSession(plain) as session:
        session.connect([engine.url])
        session.update(seed_weights(folder, 3))
    assert_bit_exact([engine], folder, 3)
    config = SyncConfig(transport=MooncakeConfig(protocol="tcp"), verify_with_weight_checker=True)
    with WeightSyncSession(config) as session:
        session.connect([engine.url])
        report = session.update(seed_weights(folder, 3))  # the weights the engine holds
        assert "verify" in report.stage_seconds
        assert_bit_exact([engine], folder, 3)


@pytest.mark.parametrize(
    ("block", "layouts"),
    [([128, 128], [(2, {"ep_size": 2})]), ([64, 64], [(4, {"ep_size": 2}), 1])],
    ids=["block128-tp2ep2", "block64-tp4ep2+tp1"],
)
def test_fp8_engines_get_sender_quantized_bytes(block, layouts, start_engines, tmp_path):
    """bf16 from the trainer; fp8 block-quantized engines receive the checkpoint's bytes.

    The session quantizes each weight the engines hold in fp8 (weight + scale_inv, the
    engine's block size) before the replica's loaders run; each rank must then equal
    sglang's own loader fed with that fp8 checkpoint, derived MLA weights included.
    """
    from p2pweights.testing import model_config, write_model_dir

    config = model_config("deepseek-v3-fp8-tiny")
    config["quantization_config"]["weight_block_size"] = block
    folder = write_model_dir(config, tmp_path / "fp8")
    engines = start_engines(folder, layouts, transport="mooncake", seed=0)
    sync = SyncConfig(transport=TRANSPORTS["mooncake"], buffer_bytes="1MiB")
    with WeightSyncSession(sync) as session:
        session.connect([e.url for e in engines])
        for seed in (41, 42):
            report = session.update(seed_weights(folder, seed))
            assert report.stage_seconds["convert"] > 0
            assert_bit_exact(engines, folder, seed)


@pytest.mark.parametrize(
    ("model", "layouts", "transport"),
    [
        ("deepseek-v3-tiny", [(2, {"ep_size": 2})], "mooncake"),
        ("glm4-moe-tiny", [(2, {})], "nixl"),
    ],
    ids=["deepseek-v3-tp2ep2-mooncake", "glm4-moe-tp2-nixl"],
)
def test_speculative_draft_runners_are_updated_too(
    model, layouts, transport, model_dir, shared_engines
):
    """Same-model MTP draft (--speculative-algorithm NEXTN): every rank's draft runner,
    published apart from its target, gets the MTP layer its own loader loads; target and
    draft are each bit-exact with sglang's loader for that runner."""
    folder = model_dir(model)
    nextn = [(tp, {**args, "speculative_algorithm": "NEXTN"}) for tp, args in layouts]
    engines = shared_engines(folder, nextn, transport=transport, seed=0)
    config = SyncConfig(transport=TRANSPORTS[transport], buffer_bytes="1MiB")
    shared = frozenset({"model.embed_tokens.weight", "lm_head.weight"})  # the target's
    with WeightSyncSession(config) as session:
        session.connect([e.url for e in engines])
        for seed in (51, 52):
            session.update(seed_weights(folder, seed))
            assert_bit_exact(engines, folder, seed)
            for engine in engines:
                draft = engine_mismatches(
                    engine.url,
                    lambda seed=seed: seed_weights(folder, seed),
                    role="draft",
                    skip=shared,
                )
                assert draft == {r: [] for r in range(engine.tp)}, f"{engine.url}: {draft}"
