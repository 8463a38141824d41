"""Owner sends: expert-parallel trainer ranks each write their own experts, no gather.

Two or four trainer processes (gloo, CPU) hold a Qwen3-MoE or DeepSeek-V3-shaped tiny
model (bf16, or a block-fp8 engine's: each owner quantizes its own experts) as expert
parallelism splits it: every rank the attention, norms, dense and
shared-expert weights whole, and only its own routed experts (rank r experts
r*E/n .. (r+1)*E/n - 1). Each hands ``update()`` what it holds, its experts declared
with ``owned_tensors``. The engines are an EP 2 engine (with two trainer ranks each
engine rank's local experts are one trainer rank's: whole groups; with four, two ranks'
shares) and a TP 1 engine (every layer's fused experts come from every rank: each
writes its own byte ranges). First two refused inputs, then two updates; after each
update every engine rank must be bit-exact with sglang's own ``load_weights`` of the
whole checkpoint (and the write digests, summed over the owners' shares, must agree).
"""

from __future__ import annotations

import re

import pytest
import torch
from _bit_exact import assert_bit_exact
from _lockstep import run_in_lockstep
from _procs import gloo_session, warm_context

from p2pweights.local_engine import free_port
from p2pweights.testing import synthetic_weights

pytestmark = pytest.mark.integration

_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")
STEPS = {"double_claim": 41, "unowned": 42, "first": 43, "second": 44}


def _held(folder: str, seed: int, rank: int, size: int, num_experts: int):
    """What trainer rank ``rank`` of ``size`` holds under EP, and the names it owns."""
    per_rank = num_experts // size
    held, owned = [], set()
    for name, tensor in synthetic_weights(folder, seed=seed, dtype=torch.bfloat16):
        found = _EXPERT.search(name)
        if found is None:
            held.append((name, tensor))
        elif int(found.group(1)) // per_rank == rank:
            held.append((name, tensor))
            owned.add(name)
    return held, owned


def _trainer(rank, size, port, urls, folder, num_experts, gos, out) -> None:
    from p2pweights.adapters import owned_tensors

    with gloo_session(rank, size, port, urls) as session:
        for go, (step, seed) in zip(gos, STEPS.items(), strict=True):
            held, owned = _held(folder, seed, rank, size, num_experts)
            if step == "double_claim" and rank == 1:  # also claims rank 0's first expert
                extra, _ = _held(folder, seed, 0, size, num_experts)
                first = next(n for n, _ in extra if ".experts.0." in n)
                held += [(n, t) for n, t in extra if n == first]
                owned.add(first)
            if step == "unowned" and rank == 1:  # drops one of its experts: nobody has it
                dropped = sorted(owned)[0]
                held = [(n, t) for n, t in held if n != dropped]
                owned.discard(dropped)
            try:
                report = session.update(owned_tensors(held, owned))
                result = dict(report.bytes_by_target)
            except Exception as exc:
                result = (type(exc).__name__, str(exc))
            out.put((step, rank, result))
            go.wait(timeout=300)  # the test checks the engines in between


@pytest.mark.parametrize(
    ("model", "num_experts", "size"),
    [
        ("qwen3-moe-tiny", 8, 2),
        ("deepseek-v3-tiny", 8, 2),
        ("deepseek-v3-fp8-tiny", 8, 2),
        ("qwen3-moe-tiny", 8, 4),
    ],
)
def test_expert_owners_write_their_experts(model, num_experts, size, model_dir, shared_engines):
    folder = model_dir(model)
    engines = shared_engines(folder, [(2, {"ep_size": 2}), 1], seed=0)
    urls = [e.url for e in engines]
    ctx = warm_context()
    out = ctx.Queue()
    gos = [ctx.Event() for _ in STEPS]
    port = free_port()
    trainers = [
        ctx.Process(
            target=_trainer,
            args=(rank, size, port, urls, str(folder), num_experts, gos, out),
        )
        for rank in range(size)
    ]

    def check(step: str, results: list[tuple]) -> None:
        seed = STEPS[step]
        outcomes = [r[2] for r in results]
        if step == "double_claim":
            assert len({str(o) for o in outcomes}) == 1, outcomes  # the same on every rank
            kind, message = outcomes[0]
            assert kind == "ConfigError", message
            assert (
                ".experts.0." in message
                and "claimed by trainer rank 0 and trainer rank 1" in message
            )
        elif step == "unowned":
            kind, message = outcomes[0]
            assert kind == "ConfigError", message
            assert ".experts." in message, message
        else:
            every = {(e.url, r) for e in engines for r in range(e.tp)}
            assert set().union(*outcomes) == every, outcomes
            tp1 = (engines[1].url, 0)  # both ranks write their experts' ranges there
            assert all(o.get(tp1, 0) > 0 for o in outcomes), outcomes
            assert_bit_exact(engines, folder, seed)

    run_in_lockstep(trainers, out, gos, check, steps=list(STEPS), timeout_s=400)


SHARD_STEPS = {"overlap": 51, "first": 52, "second": 53}


def _sliced(folder: str, seed: int, rank: int, size: int, overlap: bool):
    """Rank ``rank``'s ``Shard(0)`` slice of every tensor, as FSDP2 cuts them (chunks of
    ceil(n / size) rows; a tensor of fewer rows leaves the last ranks an empty slice)."""
    held, shards = [], {}
    for name, tensor in synthetic_weights(folder, seed=seed, dtype=torch.bfloat16):
        rows = tensor.shape[0]
        chunk = -(-rows // size)
        start, stop = min(rank * chunk, rows), min((rank + 1) * chunk, rows)
        if overlap and rank == 1 and start > 0:
            start -= 1  # one row also held by rank 0
        held.append((name, tensor[start:stop].clone()))
        shards[name] = (0, start, rows)
    return held, shards


def _shard_trainer(rank, size, port, urls, folder, gos, out) -> None:
    from p2pweights.adapters import owned_tensors

    with gloo_session(rank, size, port, urls) as session:
        for go, (step, seed) in zip(gos, SHARD_STEPS.items(), strict=True):
            held, shards = _sliced(folder, seed, rank, size, step == "overlap")
            try:
                report = session.update(owned_tensors(held, shards=shards))
                result = dict(report.bytes_by_target)
            except Exception as exc:
                result = (type(exc).__name__, str(exc))
            out.put((step, rank, result))
            go.wait(timeout=300)


def test_row_shards_are_written_by_their_holders(model_dir, shared_engines):
    """Two ranks each hold half the rows of every tensor of a dense Qwen3 (``Shard(0)``,
    as FSDP2 cuts them) and write the bytes their rows make, into TP 2 and TP 1 engines."""
    folder = model_dir("qwen3-tiny")
    engines = shared_engines(folder, [2, 1], seed=0)
    urls = [e.url for e in engines]
    size = 2
    ctx = warm_context()
    out = ctx.Queue()
    gos = [ctx.Event() for _ in SHARD_STEPS]
    port = free_port()
    trainers = [
        ctx.Process(target=_shard_trainer, args=(rank, size, port, urls, str(folder), gos, out))
        for rank in range(size)
    ]

    def check(step: str, results: list[tuple]) -> None:
        seed = SHARD_STEPS[step]
        outcomes = [r[2] for r in results]
        if step == "overlap":
            kind, message = outcomes[0]
            assert kind == "ConfigError", message
            assert "are claimed by trainer rank 0 and trainer rank 1" in message
        else:
            every = {(e.url, r) for e in engines for r in range(e.tp)}
            assert all(set(o) == every for o in outcomes), outcomes
            # each holder writes about half of the bytes (on the TP 2 engine mostly one
            # rank's: a column-parallel weight's first rows are TP rank 0's)
            total = sum(sum(o.values()) for o in outcomes)
            assert all(0.3 * total < sum(o.values()) < 0.7 * total for o in outcomes)
            assert_bit_exact(engines, folder, seed)

    run_in_lockstep(trainers, out, gos, check, steps=list(SHARD_STEPS), timeout_s=400)


GATHER_STEPS = {"first": 61, "second": 62}


def _ep_and_rows(folder: str, seed: int, rank: int, size: int, num_experts: int):
    """Expert parallelism for the routed experts (owned whole), FSDP2's ``Shard(0)`` rows
    for every other tensor."""
    held, owned = _held(folder, seed, rank, size, num_experts)
    pairs, shards = [], {}
    for name, tensor in held:
        if name in owned:
            pairs.append((name, tensor))
            continue
        rows = tensor.shape[0]
        chunk = -(-rows // size)
        start, stop = min(rank * chunk, rows), min((rank + 1) * chunk, rows)
        pairs.append((name, tensor[start:stop].clone()))
        shards[name] = (0, start, rows)
    return pairs, owned, shards


def _gather_trainer(rank, size, port, urls, folder, num_experts, gos, out) -> None:
    from p2pweights.adapters import owned_tensors

    with gloo_session(rank, size, port, urls) as session:
        for go, (step, seed) in zip(gos, GATHER_STEPS.items(), strict=True):
            pairs, owned, shards = _ep_and_rows(folder, seed, rank, size, num_experts)
            try:
                report = session.update(owned_tensors(pairs, owned, shards=shards))
                result = {
                    "targets": dict(report.bytes_by_target),
                    "gathered": dict(report.gathered_bytes_by_tensor),
                    "metric": report.metrics()["p2pweights/gathered_bytes"],
                    "dict": report.to_dict()["gathered_bytes"],
                }
            except Exception as exc:
                result = {"error": (type(exc).__name__, str(exc))}
            out.put((step, rank, result))
            go.wait(timeout=300)


def test_a_sharded_tensor_an_fp8_engine_quantizes_is_gathered_alone(model_dir, shared_engines):
    """Two ranks hold a block-fp8 DeepSeek-V3 as EP (routed experts) plus FSDP2 rows (the
    rest). A sharded weight the engine takes quantized has 128 x 128 blocks across both
    holders' rows: it is all-gathered for that tensor alone and sent by the normal path;
    the report counts those bytes, per tensor. Experts and the bf16 tensors (norms,
    embeddings) are written by their owners: no byte of them is gathered."""
    folder = model_dir("deepseek-v3-fp8-tiny")
    engines = shared_engines(folder, [(2, {"ep_size": 2}), 1], seed=0)
    urls = [e.url for e in engines]
    size = 2
    ctx = warm_context()
    out = ctx.Queue()
    gos = [ctx.Event() for _ in GATHER_STEPS]
    port = free_port()
    trainers = [
        ctx.Process(target=_gather_trainer, args=(rank, size, port, urls, str(folder), 8, gos, out))
        for rank in range(size)
    ]

    def check(step: str, results: list[tuple]) -> None:
        seed = GATHER_STEPS[step]
        outcomes = [r[2] for r in results]
        assert all("error" not in o for o in outcomes), outcomes
        every = {(e.url, r) for e in engines for r in range(e.tp)}
        assert set().union(*(o["targets"] for o in outcomes)) == every, outcomes
        assert_bit_exact(engines, folder, seed)
        for o in outcomes:
            gathered = o["gathered"]
            assert gathered and all(v > 0 for v in gathered.values()), gathered
            assert o["metric"] == o["dict"] == sum(gathered.values())
            assert not any(_EXPERT.search(n) for n in gathered), gathered  # experts: 0
            # the linear weights the engine takes in fp8 (q_a_proj, kv_a_proj_with_mqa,
            # ...): not norms, embeddings, the router or the lm head (bf16 there)
            assert all("_proj" in n and n.endswith(".weight") for n in gathered), gathered
            assert "model.embed_tokens.weight" not in gathered
        # each rank received the other's rows of the same tensors
        assert outcomes[0]["gathered"].keys() == outcomes[1]["gathered"].keys()

    run_in_lockstep(trainers, out, gos, check, steps=list(GATHER_STEPS), timeout_s=400)


def _refused_trainer(rank, size, port, urls, folder, digest_as_written, out) -> None:
    from p2pweights.adapters import owned_tensors

    with gloo_session(rank, size, port, urls, digest_as_written=digest_as_written) as session:
        held, owned = _held(folder, 71, rank, size, 8)
        try:
            session.update(owned_tensors(held, owned))
            out.put((rank, None))
        except Exception as exc:
            out.put((rank, (type(exc).__name__, str(exc))))


@pytest.mark.parametrize("guard", ["digest_as_written", "weights_checker"])
def test_parameters_two_owners_share_are_refused_where_a_share_cannot_be_verified(
    guard, model_dir, shared_engines
):
    """On a TP 1 engine a layer's fused experts are written in shares by both expert
    owners. ``digest_as_written`` (a parameter digested once its flag lands, perhaps before
    the other owner's share) and an engine verified only by sglang's ``/weights_checker``
    (whose hash cannot be made from shares) cannot check such a parameter: the first
    update is refused on every rank, naming the parameter and its HF tensors, before the
    engine is paused or any byte is written."""
    from p2pweights.engines.client import EngineClient

    folder = model_dir("qwen3-moe-tiny")
    env = {"P2PWEIGHTS_WRITE_DIGESTS": "0"} if guard == "weights_checker" else {}
    (engine,) = shared_engines(folder, [1], seed=0, env=env)
    client = EngineClient(engine.url)
    version = client.weight_version()
    before = client.weights_checker("checksum")
    size, ctx, port = 2, warm_context(), free_port()
    out = ctx.Queue()
    trainers = [
        ctx.Process(
            target=_refused_trainer,
            args=(rank, size, port, [engine.url], str(folder), guard == "digest_as_written", out),
        )
        for rank in range(size)
    ]
    for p in trainers:
        p.start()
    try:
        outcomes = [out.get(timeout=400)[1] for _ in trainers]
    finally:
        for p in trainers:
            p.join(timeout=60)
    assert [p.exitcode for p in trainers] == [0] * size
    for outcome in outcomes:
        assert outcome is not None, "the update was not refused"
        kind, message = outcome
        assert kind == "ConfigError", message
        assert guard.replace("weights_checker", "/weights_checker") in message, message
        assert ".mlp.experts" in message and "nothing was sent" in message, message
    assert client.weight_version() == version
    assert not (client.engine_state() or {}).get("paused")
    assert client.weights_checker("checksum") == before  # no byte written
    client.close()


def test_a_lone_sender_handing_a_slice_is_refused(model_dir, shared_engines):
    """One sending rank with half the rows of each tensor (``hf_named_tensors(model)``
    under FSDP2 in a session of one sender gives this): refused, naming a tensor and its
    rows, instead of sending zeros for the other half."""
    from p2pweights import ConfigError, MooncakeConfig, SyncConfig, WeightSyncSession
    from p2pweights.adapters import owned_tensors
    from p2pweights.engines.client import EngineClient

    folder = model_dir("qwen3-tiny")
    (engine,) = shared_engines(folder, [1], seed=0)
    version = EngineClient(engine.url).weight_version()
    held, shards = _sliced(str(folder), 81, 0, 2, overlap=False)
    config = SyncConfig(transport=MooncakeConfig(protocol="tcp"), buffer_bytes="1MiB")
    with WeightSyncSession(config) as session:
        session.connect([engine.url])
        with pytest.raises(ConfigError, match="it is the only sending trainer rank") as refused:
            session.update(owned_tensors(held, shards=shards))
    assert "holds only rows 0.." in str(refused.value) and "nothing was sent" in str(refused.value)
    assert EngineClient(engine.url).weight_version() == version


PARTIAL_SEEDS = {"first": 57, "partial": 58}


def _trained(name: str) -> bool:
    return name.startswith("model.layers.1.mlp.") or name == "model.norm.weight"


def _partial_trainer(rank, size, port, urls, folder, gos, out) -> None:
    from p2pweights.adapters import owned_tensors

    with gloo_session(rank, size, port, urls) as session:
        for go, (step, seed) in zip(gos, PARTIAL_SEEDS.items(), strict=True):
            held, shards = _sliced(folder, seed, rank, size, overlap=False)
            subset = None
            if step == "partial":
                held = [(n, t) for n, t in held if _trained(n)]
                shards = {n: s for n, s in shards.items() if _trained(n)}
                subset = set(shards)
            try:
                report = session.update(owned_tensors(held, shards=shards), subset=subset)
                result = dict(report.bytes_by_target)
            except Exception as exc:
                result = (type(exc).__name__, str(exc))
            out.put((step, rank, result))
            go.wait(timeout=300)


def test_a_partial_update_of_sharded_tensors_writes_its_subset_from_the_holders(
    model_dir, shared_engines
):
    """Two FSDP2-style row holders update every tensor, then only one layer's MLP and the
    final norm (``update(..., subset=...)``), each handing its slices of those alone: every
    engine rank holds the new values there and the first update's elsewhere."""
    from _bit_exact import engine_mismatches, seed_weights

    folder = model_dir("qwen3-tiny")
    engines = shared_engines(folder, [2, 1], seed=0)
    urls = [e.url for e in engines]
    size = 2
    ctx = warm_context()
    out = ctx.Queue()
    gos = [ctx.Event() for _ in PARTIAL_SEEDS]
    port = free_port()
    trainers = [
        ctx.Process(target=_partial_trainer, args=(rank, size, port, urls, str(folder), gos, out))
        for rank in range(size)
    ]
    written = {}

    def check(step: str, results: list[tuple]) -> None:
        outcomes = [r[2] for r in results]
        assert all(isinstance(o, dict) for o in outcomes), outcomes
        written[step] = sum(sum(o.values()) for o in outcomes)

    run_in_lockstep(trainers, out, gos, check, steps=list(PARTIAL_SEEDS), timeout_s=400)
    first, second = seed_weights(folder, 57), seed_weights(folder, 58)
    mixed = [(n, t) for n, t in second if _trained(n)] + [
        (n, t) for n, t in first if not _trained(n)
    ]
    for engine in engines:
        assert engine_mismatches(engine.url, lambda: mixed) == {r: [] for r in range(engine.tp)}
    assert 0 < written["partial"] < written["first"] / 4
