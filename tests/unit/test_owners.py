"""Owner sends: the claims every rank makes, and the byte plan of an owner's share."""

from __future__ import annotations

import pytest
import torch

from p2pweights.adapters.owned import owned_names, owned_tensors
from p2pweights.errors import ConfigError
from p2pweights.plan.byte_plan import GroupPlan, PlannedWrite, Slot, TargetWrites
from p2pweights.plan.owners import Claim, OwnedGroup, OwnedPlan, build_owned_plan, ownership_of
from p2pweights.source.inputs import InputSpec
from p2pweights.wire.publication import RankPublication, WeightRegion

SPEC = InputSpec((4, 4), torch.bfloat16)
ATTN, E0, E1 = "attn.weight", "experts.0.w", "experts.1.w"


def _claim(rank: int, names: list[str], owned: list[str], stage: int = 0) -> Claim:
    return Claim((stage, rank), {n: SPEC for n in names}, frozenset(owned))


def test_each_rank_owns_its_experts_and_every_rank_sends_the_rest() -> None:
    specs, ownership = ownership_of([_claim(0, [ATTN, E0], [E0]), _claim(1, [ATTN, E1], [E1])])
    assert set(specs) == {ATTN, E0, E1}
    assert ownership.owner_of(E0) == (0, 0) and ownership.owner_of(E1) == (0, 1)
    assert ownership.owner_of(ATTN) is None
    assert ownership.owner_of(E1 + "_scale_inv") == (0, 1)  # an fp8 scale: its weight's owner


@pytest.mark.parametrize(
    ("claims", "says"),
    [
        (  # two owners
            [_claim(0, [ATTN, E0], [E0]), _claim(1, [ATTN, E0], [E0])],
            "HF tensor 'experts.0.w' is claimed by trainer rank 0 and trainer rank 1",
        ),
        (  # owned by one, sent whole by another
            [_claim(0, [ATTN, E0], [E0]), _claim(1, [ATTN, E0, E1], [E1])],
            "'experts.0.w' is owned by trainer rank 0 but also sent whole by trainer rank 1",
        ),
        (  # sent whole by one rank only, owned by nobody
            [_claim(0, [ATTN, E0], [E0]), _claim(1, [E1], [E1])],
            "'attn.weight' is sent whole by trainer rank 0 but neither sent nor owned by "
            "trainer rank 1, and no rank owns it",
        ),
        (
            [
                _claim(0, [E0], [E0]),
                Claim((0, 1), {E0: InputSpec((2,), torch.float32)}, frozenset()),
            ],
            "'experts.0.w' is sent as (2,)",
        ),
        ([_claim(0, [ATTN], [E0])], "declares HF tensor 'experts.0.w' owned but does not send it"),
    ],
)
def test_claims_that_leave_a_tensor_with_two_owners_or_none_are_refused(claims, says) -> None:
    with pytest.raises(ConfigError, match=None) as raised:
        ownership_of(claims)
    assert says in str(raised.value)


def test_pipeline_stages_keep_their_rules_under_owners() -> None:
    specs, _ = ownership_of(
        [
            _claim(0, [ATTN, E0], [E0], stage=0),
            _claim(0, ["head"], [], stage=1),
            _claim(1, [ATTN, E1], [E1]),
        ]
    )
    assert set(specs) == {ATTN, E0, E1, "head"}
    with pytest.raises(ConfigError, match="pipeline stages 0 and 1"):
        ownership_of([_claim(0, [ATTN], []), _claim(0, [ATTN], [], stage=1)])


class _Sizes:
    def __init__(self, sizes: dict[str, int]):
        self.sizes = sizes

    def param_bytes(self, name: str) -> int:
        return self.sizes[name]


def _pub(rank: int, sizes: dict[str, int]) -> RankPublication:
    regions = {
        name: WeightRegion(address=1_000_000 * (rank + 1) + 10_000 * i, num_bytes=size)
        for i, (name, size) in enumerate(sorted(sizes.items()))
    }
    return RankPublication("http://e", rank, "mooncake", regions)


def test_a_shared_group_writes_only_the_owners_ranges_and_a_whole_one_every_byte() -> None:
    sizes = {"w13": 1024, "w2": 512, "qkv": 256}
    pubs = [_pub(0, sizes), _pub(1, sizes)]
    owned = OwnedPlan(
        {
            "k": [
                OwnedGroup("k", frozenset({ATTN}), ("qkv",), to_all=False),
                OwnedGroup(
                    "k",
                    frozenset({E0}),
                    ("w13", "w2"),
                    to_all=True,
                    spans={"w13": ((0, 512),), "w2": ((256, 512),)},
                ),
            ]
        },
        assigned=frozenset({pubs[1].runner}),
    )
    plan = build_owned_plan(owned, {"k": _Sizes(sizes)}, {"k": pubs}, 0)
    replicated, shared = plan.group("k", 0), plan.group("k", 1)
    assert [tw.target.engine_rank for tw in replicated.targets] == [1]  # the assigned rank only
    assert not replicated.partial and replicated.unwritten() == []
    assert [tw.target.engine_rank for tw in shared.targets] == [0, 1]  # owned: every rank
    assert shared.partial
    w2 = pubs[0].regions["w2"]
    assert shared.targets[0].writes == (
        PlannedWrite(0, pubs[0].regions["w13"].address, None, 0, 512),
        PlannedWrite(1, w2.address + 256, None, 256, 256),
    )
    # w2's slot starts at 1024: its first half, and w13's second half, are others' bytes
    assert shared.unwritten() == [(512, 1024), (1024, 1280)]
    assert plan.bytes_by_target == {("http://e", 0): 768, ("http://e", 1): 768 + 256}


def test_unwritten_is_the_complement_of_the_writes() -> None:
    slots = (Slot("a", 0, 100), Slot("b", 256, 50))
    writes = (
        PlannedWrite(0, 0, None, 10, 20),
        PlannedWrite(0, 0, None, 50, 50),
        PlannedWrite(1, 0),
    )
    pub = _pub(0, {"a": 100, "b": 50})
    group = GroupPlan("k", 0, frozenset(), slots, 512, (TargetWrites(pub, writes),), partial=True)
    assert group.unwritten() == [(0, 10), (30, 50)]


def test_owned_tensors_says_what_it_yields_and_owns() -> None:
    pairs = [(ATTN, torch.zeros(4, 4)), (E0, torch.ones(2))]
    wrapped = owned_tensors(pairs, [E0])
    assert owned_names(wrapped) == {E0}
    assert wrapped.specs() == {ATTN: ((4, 4), torch.float32), E0: ((2,), torch.float32)}
    assert [name for name, _ in wrapped] == [ATTN, E0]
    assert owned_names(iter(pairs)) == frozenset()
    with pytest.raises(ConfigError, match="are not sent"):
        owned_tensors(pairs, ["nope"])
    with pytest.raises(ConfigError, match="needs the pairs as a list"):
        owned_tensors(iter(pairs), [E0])


def test_owner_sends_at_cluster_scale_gather_nothing_and_spread_the_experts() -> None:
    from p2pweights.plan.cluster import EngineLoad, RankLoad, plan_cluster
    from p2pweights.plan.owner_cost import compare_owner_sends

    gb = 10**9
    # one engine of 4 EP ranks: 10 GB of experts and 1 GB of the rest each
    ranks = tuple(
        RankLoad(layout_key=r, bytes_by_stage=(11 * gb,), expert_bytes_by_stage=(10 * gb,))
        for r in range(4)
    )
    plan = plan_cluster(
        [EngineLoad(layout={}, ranks=ranks)], num_senders=4, broadcast_bytes_by_stage=[44 * gb]
    )
    found = compare_owner_sends(plan, 4, [40 * gb])
    assert found.gathered_bytes_per_rank == 30 * gb  # 3/4 of the experts, from the others
    assert found.gather_link == "NVLink"
    assert found.gathered_write_bytes == 11 * gb  # one whole engine rank each
    assert found.owner_write_bytes == 11 * gb  # 1 GB of its rank + a quarter of 40 GB
    assert found.gather_s > 0 and found.gathered_s > found.gathered.seconds
    assert found.to_json()["owner"]["gathered_bytes_per_rank"] == 0
    with pytest.raises(ConfigError, match="must divide"):
        compare_owner_sends(plan, 3, [40 * gb])


def _sharded(rank: int, start: int, stop: int, rows: int = 8) -> Claim:
    spec = InputSpec((rows, 4), torch.bfloat16)
    return Claim((0, rank), {ATTN: spec}, frozenset(), {ATTN: (0, start, stop)})


@pytest.mark.parametrize(
    ("claims", "says"),
    [
        (
            [_sharded(0, 0, 5), _sharded(1, 4, 8)],
            "dim=0 4..5 are claimed by trainer rank 0 and trainer rank 1",
        ),
        ([_sharded(0, 0, 3), _sharded(1, 4, 8)], "3..4 are held by no rank"),
        ([_sharded(0, 0, 4), _sharded(1, 4, 6)], "6..8 are held by no rank"),
        (
            [
                _sharded(0, 0, 8),
                Claim((0, 1), {ATTN: InputSpec((8, 4), torch.bfloat16)}, frozenset()),
            ],
            "is sharded on some ranks but sent whole by trainer rank 1",
        ),
    ],
)
def test_slices_that_do_not_tile_their_tensor_are_refused(claims, says) -> None:
    with pytest.raises(ConfigError) as raised:
        ownership_of(claims)
    assert says in str(raised.value)


def test_slices_that_tile_their_tensor_are_its_holders() -> None:
    _, ownership = ownership_of([_sharded(0, 0, 4), _sharded(1, 4, 8)])
    assert ownership.holders_of(ATTN) == {(0, 0): (0, 0, 4), (0, 1): (0, 4, 8)}
    assert ownership.owner_of(ATTN) is None and bool(ownership)


def test_owned_tensors_yields_a_slice_as_held_and_whole_only_when_asked() -> None:
    """Iterated as is (a plain generator around it, say), a slice keeps its own shape, so
    the session's shape check refuses it; the session asks for whole tensors."""
    wrapped = owned_tensors([(ATTN, torch.ones(2, 3))], shards={ATTN: (0, 2, 5)})
    assert wrapped.specs() == {ATTN: ((5, 3), torch.float32)}
    assert wrapped.shards() == {ATTN: (0, 2, 4)}
    ((_, held),) = list(owned_tensors([(ATTN, torch.ones(2, 3))], shards={ATTN: (0, 2, 5)}))
    assert held.shape == (2, 3)
    ((_, full),) = list(wrapped.whole_tensors())
    assert full[:2].abs().sum() == 0 and full[2:4].eq(1).all() and full[4:].abs().sum() == 0
    with pytest.raises(ConfigError, match="passes its full size"):
        owned_tensors([(ATTN, torch.ones(2, 3))], shards={ATTN: (0, 4, 5)})


def test_a_gathered_tensor_is_assembled_from_every_holders_slice() -> None:
    from p2pweights.collective import Collective

    full = torch.arange(12, dtype=torch.bfloat16).reshape(4, 3)
    padded = torch.zeros_like(full)
    padded[:1] = full[:1]  # this rank holds row 0; the other rows 1..3
    other = ("w", (0, 1, 4), full[1:].clone())
    collective = Collective("trainer rank 0", gather=lambda mine: [mine, other])
    whole, received = collective.gathered_tensor("w", padded, (0, 0, 1))
    assert torch.equal(whole, full) and received == 9 * 2  # the other rank's 9 bf16 elements
    astray = Collective("trainer rank 0", gather=lambda mine: [mine, ("v", (0, 1, 4), full[1:])])
    with pytest.raises(ConfigError, match="reached different sharded HF tensors"):
        astray.gathered_tensor("w", padded, (0, 0, 1))
