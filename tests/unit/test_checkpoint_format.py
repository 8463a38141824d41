"""Choosing and applying the engine's checkpoint format (bf16 trainer -> fp8 engine)."""

from __future__ import annotations

import pytest
import torch

from p2pweights.errors import ConfigError
from p2pweights.source.checkpoint_format import AS_GIVEN, QuantizeToBlockFp8, unify
from p2pweights.source.collect import ConvertingCollector
from p2pweights.source.fp8_block import FP8, BlockFp8Format
from p2pweights.source.inputs import InputSpec, ParamGroup

BF16 = torch.bfloat16
FMT = BlockFp8Format((64, 64))
SPECS = {
    "embed.weight": InputSpec((100, 64), BF16),
    "q.weight": InputSpec((128, 64), BF16),
    "e0.weight": InputSpec((64, 64), BF16),
    "e1.weight": InputSpec((64, 64), BF16),
    "norm.weight": InputSpec((64,), BF16),
}
DTYPES = {"embed": BF16, "q": FP8, "q_scale": torch.float32, "w13": FP8, "norm": BF16}


def _choose(feeds):
    return QuantizeToBlockFp8.choose(FMT, SPECS, feeds, DTYPES)


def test_quantizes_what_the_loader_writes_into_fp8_only() -> None:
    fmt = _choose({"embed.weight": {"embed"}, "q.weight": {"q"}, "e0.weight": {"w13"}})
    assert fmt.names == {"q.weight", "e0.weight"}
    assert fmt.kept == {"embed.weight"}
    engine = fmt.engine_specs(SPECS)
    assert engine["q.weight"] == InputSpec((128, 64), FP8)
    assert engine["q.weight_scale_inv"] == InputSpec((2, 1), torch.float32)
    assert engine["embed.weight"] == SPECS["embed.weight"]
    assert "e1.weight_scale_inv" not in engine  # this rank's loader does not read e1


def test_mixed_or_half_quantized_inputs_are_refused() -> None:
    with pytest.raises(ConfigError, match="feeds fp8 parameters"):
        _choose({"q.weight": {"q", "embed"}})
    specs = {**SPECS, "q.weight_scale_inv": InputSpec((2, 1), torch.float32)}
    with pytest.raises(ConfigError, match="send both quantized"):
        QuantizeToBlockFp8.choose(FMT, specs, {"q.weight": {"q"}}, DTYPES)


def test_unify_takes_the_union_per_block_format() -> None:
    rank0 = _choose({"q.weight": {"q"}, "e0.weight": {"w13"}})
    rank1 = _choose({"q.weight": {"q"}, "e1.weight": {"w13"}})
    merged = unify({"r0": rank0, "r1": rank1, "bf16": AS_GIVEN})
    assert merged["r0"] is merged["r1"]
    assert merged["r0"].names == {"q.weight", "e0.weight", "e1.weight"}
    assert merged["bf16"] is AS_GIVEN
    conflict = _choose({"q.weight": {"embed"}})  # another layout reads q in bf16
    with pytest.raises(ConfigError, match="high precision"):
        unify({"r0": rank0, "odd": conflict})


def test_collector_converts_once_per_format_and_releases_groups() -> None:
    fp8 = QuantizeToBlockFp8(FMT, frozenset({"q.weight"}))
    groups = {
        "fp8-a": [ParamGroup(frozenset({"q.weight", "q.weight_scale_inv"}), ("q", "q_scale"))],
        "fp8-b": [ParamGroup(frozenset({"q.weight", "q.weight_scale_inv"}), ("q", "q_scale"))],
        "bf16": [ParamGroup(frozenset({"q.weight"}), ("q",))],
    }
    calls = []

    class Counting(QuantizeToBlockFp8):
        def convert(self, name, tensor):
            calls.append(name)
            return super().convert(name, tensor)

    counting = Counting(fp8.fmt, fp8.names)
    collector = ConvertingCollector(
        {key: [g.hf_names for g in gs] for key, gs in groups.items()},
        {"fp8-a": counting, "fp8-b": counting, "bf16": AS_GIVEN},
    )
    weight = torch.randn(128, 64).bfloat16()
    ready = collector.add("q.weight", weight)
    assert calls == ["q.weight"]
    by_key = {key: dict(inputs) for key, _, inputs in ready}
    assert set(by_key) == {"fp8-a", "fp8-b", "bf16"}
    assert by_key["fp8-a"]["q.weight"].dtype == FP8
    assert by_key["fp8-a"]["q.weight_scale_inv"].shape == (2, 1)
    assert by_key["fp8-a"]["q.weight"] is by_key["fp8-b"]["q.weight"]
    assert by_key["bf16"]["q.weight"] is weight
    collector.raise_if_incomplete()
    assert collector.convert_s > 0


class _Batching(QuantizeToBlockFp8):
    """Batches every weight it quantizes (as GPU weights do) and records each batch."""

    def __init__(self, fmt, names):
        super().__init__(fmt, names)
        object.__setattr__(self, "batches_seen", [])

    def batches(self, name, tensor):
        return name in self.names

    def convert_many(self, named):
        self.batches_seen.append([name for name, _ in named])
        return super().convert_many(named)


def test_batched_weights_wait_for_their_batch_and_come_out_as_alone(monkeypatch) -> None:
    from p2pweights.source import collect

    monkeypatch.setattr(collect, "_BATCH_TENSORS", 2)
    names = ["e0.weight", "e1.weight", "q.weight"]
    fmt = _Batching(FMT, frozenset(names))
    groups = {"fp8": [frozenset({n, n + "_scale_inv"}) for n in names]}
    groups["fp8"].append(frozenset({"norm.weight"}))
    collector = ConvertingCollector(groups, {"fp8": fmt})
    weights = {n: torch.randn(64, 64).bfloat16() for n in names}
    assert collector.add("e0.weight", weights["e0.weight"]) == []  # held for a batch
    assert [i for _, i, _ in collector.add("norm.weight", torch.ones(64))] == [3]  # not held
    released = collector.add("e1.weight", weights["e1.weight"])  # the batch is full
    assert [i for _, i, _ in released] == [0, 1]
    assert collector.add("q.weight", weights["q.weight"]) == []
    released += collector.flush()  # the update's tensors ended
    assert fmt.batches_seen == [["e0.weight", "e1.weight"], ["q.weight"]]
    collector.raise_if_incomplete()
    for _, index, inputs in released:
        name = names[index]
        want = QuantizeToBlockFp8(FMT, frozenset(names)).convert(name, weights[name])
        assert [n for n, _ in inputs] == sorted(n for n, _ in want)
        for (_, got), (_, expected) in zip(inputs, sorted(want), strict=True):
            assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))


def test_a_batch_is_converted_once_its_bytes_reach_the_limit(monkeypatch) -> None:
    from p2pweights.source import collect

    monkeypatch.setattr(collect, "_BATCH_BYTES", 64 * 64 * 2 * 2)  # two bf16 weights
    fmt = _Batching(FMT, frozenset({"e0.weight", "e1.weight"}))
    groups = {"fp8": [frozenset({n, n + "_scale_inv"}) for n in ("e0.weight", "e1.weight")]}
    collector = ConvertingCollector(groups, {"fp8": fmt})
    assert collector.add("e0.weight", torch.randn(64, 64).bfloat16()) == []
    assert len(collector.add("e1.weight", torch.randn(64, 64).bfloat16())) == 2
    assert collector.flush() == []


def test_cpu_weights_are_not_held_for_batches() -> None:
    fmt = QuantizeToBlockFp8(FMT, frozenset({"q.weight"}))
    assert not fmt.batches("q.weight", torch.randn(128, 64).bfloat16())
    assert not AS_GIVEN.batches("q.weight", torch.randn(128, 64).bfloat16())
