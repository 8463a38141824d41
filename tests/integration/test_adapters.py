"""transformers models sharded with FSDP2 push their weights through ``hf_named_tensors``.

Two trainer processes (gloo, CPU) hold a Qwen3 / Qwen3-MoE model sharded with FSDP2
(``fully_shard``, DTensor parameters) and are one sender group
(``WeightSyncSession.from_torch_distributed``). Every rank iterates
``hf_named_tensors(model)``: the first update is read whole, the second streams. After
each, every rank of a TP 2 local engine must be bit-exact with sglang's own loader given
the checkpoint ``save_pretrained`` writes for the same weights (an unsharded copy, in the
test process), which also pins the names to the checkpoint's (fused experts split back).
"""

from __future__ import annotations

import pytest
import torch
from _bit_exact import engine_mismatches
from _procs import warm_context
from safetensors.torch import load_file

from p2pweights.engines.client import EngineClient
from p2pweights.local_engine import free_port
from p2pweights.testing import model_config

pytestmark = pytest.mark.integration

SEED, SHIFT = 7, 0.5


def _model(name: str):
    import transformers

    torch.manual_seed(SEED)
    config = transformers.AutoConfig.for_model(**model_config(name))
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def _shift(model) -> None:
    """The 'training step' between the updates: elementwise, so shards and copies agree."""
    with torch.no_grad():
        for param in model.parameters():
            param.add_(SHIFT)


def _trainer(rank: int, port: int, name: str, url: str, go, out, owned: bool | None) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from p2pweights import MooncakeConfig, SyncConfig, WeightSyncSession
    from p2pweights.adapters import hf_named_tensors

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model = _model(name)
        mesh = init_device_mesh("cpu", (2,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        config = SyncConfig(transport=MooncakeConfig(protocol="tcp"), buffer_bytes="1MiB")
        reports = []
        with WeightSyncSession.from_torch_distributed(config) as session:
            session.connect([url])
            pairs = hf_named_tensors(model, bucket_bytes="256KiB", owned=owned)
            kind = type(pairs).__name__  # owner sends or gathered
            reports.append(session.update(pairs))
            out.put(("updated", rank))
            go.wait(timeout=240)  # the test checks the engine in between
            _shift(model)
            pairs = hf_named_tensors(model, bucket_bytes="256KiB", owned=owned)
            reports.append(session.update(pairs))
        out.put(("done", rank, [sorted(r.bytes_by_target) for r in reports], kind))
    except BaseException as exc:
        out.put(("error", rank, repr(exc)))
        raise
    finally:
        dist.destroy_process_group()


def _checkpoint(model, folder) -> list[tuple[str, torch.Tensor]]:
    model.save_pretrained(folder)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    return list(tensors.items())


def _assert_bit_exact(url: str, tensors) -> None:
    assert engine_mismatches(url, lambda: tensors) == {0: [], 1: []}


@pytest.mark.parametrize(
    ("name", "owned"),
    [
        ("qwen3-tiny", False),  # asked for: gathered
        ("qwen3-moe-tiny", False),
    ],
)
def test_fsdp2_model_updates_a_tp2_engine_bit_exact(
    name, owned, model_dir, shared_engines, tmp_path
):
    (engine,) = shared_engines(model_dir(name), [2], seed=0)
    reference = _model(name)  # the same weights, unsharded
    first = _checkpoint(reference, tmp_path / "first")
    _shift(reference)
    second = _checkpoint(reference, tmp_path / "second")

    ctx = warm_context()
    go, out = ctx.Event(), ctx.Queue()
    port = free_port()
    trainers = [
        ctx.Process(target=_trainer, args=(r, port, name, engine.url, go, out, owned))
        for r in (0, 1)
    ]
    for p in trainers:
        p.start()
    try:
        assert sorted(out.get(timeout=240) for _ in trainers) == [("updated", 0), ("updated", 1)]
        _assert_bit_exact(engine.url, first)
        go.set()
        done = sorted(out.get(timeout=240) for _ in trainers)
    finally:
        for p in trainers:
            p.join(timeout=60)
    assert [d[0] for d in done] == ["done", "done"], done
    assert [d[3] for d in done] == ["HfNamedTensors"] * 2
    # the two ranks split the engine's two ranks, every update
    written = sorted(t for d in done for t in d[2][1])
    assert written == [(engine.url, 0), (engine.url, 1)]
    assert [p.exitcode for p in trainers] == [0, 0]
    _assert_bit_exact(engine.url, second)
    assert any(n.endswith("experts.0.gate_proj.weight") for n, _ in first) == ("moe" in name)


@pytest.mark.parametrize(
    ("name", "owned"),
    [
        ("qwen3-tiny", True),
        ("qwen3-tiny", None),  # the default
        ("qwen3-moe-tiny", None),  # experts fused by transformers: each rank's own, owned
    ],
)
def test_fsdp2_shards_are_sent_by_their_holders_with_no_gather(
    name, owned, model_dir, shared_engines, tmp_path
):
    """``hf_named_tensors(model)`` (by default) and ``owned=True``: each rank hands its
    FSDP2 shards (no ``full_tensor()``) and writes the bytes its rows make into both
    engine ranks. Under transformers 5 a MoE layer's experts are one fused parameter;
    FSDP2 cuts it along the experts, so each rank sends the checkpoint tensors of its own
    experts, owned."""
    (engine,) = shared_engines(model_dir(name), [2], seed=0)
    reference = _model(name)
    first = _checkpoint(reference, tmp_path / "first")
    _shift(reference)
    second = _checkpoint(reference, tmp_path / "second")

    ctx = warm_context()
    go, out = ctx.Event(), ctx.Queue()
    port = free_port()
    trainers = [
        ctx.Process(target=_trainer, args=(r, port, name, engine.url, go, out, owned))
        for r in (0, 1)
    ]
    for p in trainers:
        p.start()
    try:
        got = sorted(out.get(timeout=240) for _ in trainers)
        assert got == [("updated", 0), ("updated", 1)], got
        _assert_bit_exact(engine.url, first)
        go.set()
        done = sorted(out.get(timeout=240) for _ in trainers)
    finally:
        for p in trainers:
            p.join(timeout=60)
    assert [d[0] for d in done] == ["done", "done"], done
    for d in done:  # each holder writes its share of both engine ranks
        assert d[2][1] == [(engine.url, 0), (engine.url, 1)]
        assert d[3] == "OwnedTensors"
    assert [p.exitcode for p in trainers] == [0, 0]
    _assert_bit_exact(engine.url, second)


def _wrapping_trainer(rank: int, port: int, name: str, url: str, out) -> None:
    """A trainer that wraps ``hf_named_tensors(model)`` in a plain generator (a filter or a
    rename would): the owner-sends declarations do not survive the wrapper."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from p2pweights import MooncakeConfig, SyncConfig, WeightSyncSession
    from p2pweights.adapters import hf_named_tensors
    from p2pweights.errors import P2PWeightsError

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model = _model(name)
        mesh = init_device_mesh("cpu", (2,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        config = SyncConfig(transport=MooncakeConfig(protocol="tcp"), buffer_bytes="1MiB")
        with WeightSyncSession.from_torch_distributed(config) as session:
            session.connect([url])
            wrapped = ((n, t) for n, t in hf_named_tensors(model, bucket_bytes="256KiB"))
            try:
                session.update(wrapped)
                out.put(("written", rank, ""))
            except P2PWeightsError as exc:
                out.put(("refused", rank, str(exc)))
    finally:
        dist.destroy_process_group()


def test_owner_sends_wrapped_in_a_plain_generator_are_refused_not_written(
    model_dir, shared_engines
):
    """Under FSDP2 ``hf_named_tensors(model)`` hands each rank its own slices. A plain
    generator around it drops what says they are slices; each rank's tensors are then its
    slices alone (not zero-padded to the full shape), so the first update's shape check
    refuses them before any byte, instead of writing one rank's zeros over another's rows."""
    name = "qwen3-tiny"
    (engine,) = shared_engines(model_dir(name), [2], seed=0)
    client = EngineClient(engine.url)
    version = client.weight_version()
    before = client.weights_checker("checksum")
    ctx = warm_context()
    out = ctx.Queue()
    port = free_port()
    trainers = [
        ctx.Process(target=_wrapping_trainer, args=(r, port, name, engine.url, out)) for r in (0, 1)
    ]
    for p in trainers:
        p.start()
    try:
        got = sorted(out.get(timeout=240) for _ in trainers)
    finally:
        for p in trainers:
            p.join(timeout=60)
    assert [g[0] for g in got] == ["refused", "refused"], got
    assert all("shape" in g[2] for g in got), got
    assert client.weight_version() == version  # not paused, not written
    assert client.weights_checker("checksum")["ranks"] == before["ranks"]
