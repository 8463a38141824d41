"""megatron-core GPT models exported through megatron-bridge into a local engine, bit-exact.

Two trainer processes (gloo, CPU) build the bridge's Qwen3 GPT model with
megatron-core's local layer spec, load a checkpoint into it with the bridge
(``load_hf_weights``), and update a TP 2 local engine through
``p2pweights.adapters.megatron.MegatronExport``:

* TP 2: the two tensor-parallel ranks are one stage, one sender group; the bridge
  gathers the TP shards (fused QKV and gate/up split back into the checkpoint's names);
* PP 2: each pipeline stage exports only its own layers and is its own sender group.

Owner sends (``named_tensors(owned=True)``, TP 2, and TP 2 x DP 2 over four processes)
into a TP 2 and a TP 1 engine: the plain splits go as each rank's shard, only the
interleaved tensors through the bridge's export (counted by wrapping it).

After each update every engine rank must be bit-exact with sglang's loader given the
checkpoint (then the checkpoint plus 0.5, after a 'training step' on the Megatron
weights). Skipped where megatron-core and megatron-bridge are not installed; on a host
without Transformer Engine it is stood in for (``_megatron_cpu``).
"""

from __future__ import annotations

import pytest
import torch
from _bit_exact import engine_mismatches
from _megatron_cpu import megatron_available
from _procs import warm_context

from p2pweights.local_engine import free_port
from p2pweights.testing import save_safetensors, synthetic_weights, write_model_dir

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not megatron_available(), reason="megatron-core and megatron-bridge are not installed"
    ),
]

SEED, SHIFT = 81, 0.5


def _trainer(
    rank: int, port: int, tp: int, pp: int, hf_folder: str, urls, go, out, owned=False, world=2
) -> None:
    import torch.distributed as dist
    from _megatron_cpu import build_gpt, import_bridge, load_checkpoint

    from p2pweights import MooncakeConfig, SyncConfig, WeightSyncSession
    from p2pweights.adapters.megatron import MegatronExport

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        auto_bridge = import_bridge()
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
        )
        bridge = auto_bridge.from_hf_pretrained(hf_folder)
        model = build_gpt(bridge, tp, pp)
        load_checkpoint(bridge, model)
        exported: list[str] = []  # what went through the bridge's gathered export
        export_hf_weights = bridge.export_hf_weights

        def counted(*args, **kwargs):
            for name, tensor in export_hf_weights(*args, **kwargs):
                exported.append(name)
                yield name, tensor

        bridge.export_hf_weights = counted
        export = MegatronExport(bridge, model)
        config = export.stage_config(
            SyncConfig(transport=MooncakeConfig(protocol="tcp"), buffer_bytes="1MiB")
        )
        sent: list[str] = []

        def recorded(pairs):
            for name, tensor in pairs:
                sent.append(name)
                yield name, tensor

        with WeightSyncSession.from_torch_distributed(config) as session:
            session.connect(urls)
            if owned:
                pairs = export.named_tensors(owned=True)
                session.update(pairs)
                sent = [*pairs.owned(), *pairs.shards()]
            else:
                session.update(recorded(export.named_tensors()))
            out.put(("updated", rank, config.pipeline_stage, sorted(sent), sorted(exported)))
            go.wait(timeout=240)  # the test checks the engine in between
            with torch.no_grad():
                for chunk in model:
                    for param in chunk.parameters():
                        param.add_(SHIFT)
            exported.clear()
            report = session.update(export.named_tensors(owned=owned))
        out.put(("done", rank, sorted(report.bytes_by_target), None, sorted(exported)))
    except BaseException as exc:
        out.put(("error", rank, repr(exc), None, None))
        raise
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The bridge's HF folder: config and safetensors of the checkpoint loaded into Megatron."""
    folder = write_model_dir("qwen3-tiny", tmp_path_factory.mktemp("megatron-hf"))
    tensors = list(synthetic_weights(folder, seed=SEED, dtype=torch.bfloat16))
    save_safetensors(folder, tensors)
    return folder, tensors


@pytest.fixture
def engine(model_dir, shared_engines):
    (engine,) = shared_engines(model_dir("qwen3-tiny"), [2], seed=0)
    return engine


def _assert_bit_exact(url, tensors):
    assert engine_mismatches(url, lambda: tensors) == {0: [], 1: []}


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_megatron_model_through_the_bridge_is_bit_exact(tp, pp, checkpoint, engine):
    folder, tensors = checkpoint
    shifted = [(name, tensor + SHIFT) for name, tensor in tensors]
    ctx = warm_context()
    go, out = ctx.Event(), ctx.Queue()
    port = free_port()
    trainers = [
        ctx.Process(target=_trainer, args=(r, port, tp, pp, str(folder), [engine.url], go, out))
        for r in (0, 1)
    ]
    for p in trainers:
        p.start()
    try:
        updated = sorted(out.get(timeout=240) for _ in trainers)
        assert [u[0] for u in updated] == ["updated", "updated"], updated
        names = sorted(name for name, _ in tensors)
        if pp == 1:  # one stage: both ranks send every tensor
            assert [u[2] for u in updated] == [0, 0]
            assert updated[0][3] == updated[1][3] == names
        else:  # each stage sends only its own layers, together every tensor once
            assert [u[2] for u in updated] == [0, 1]
            first_stage = ("model.embed_tokens", "model.layers.0.")
            assert all(name.startswith(first_stage) for name in updated[0][3])
            assert sorted(updated[0][3] + updated[1][3]) == names
        _assert_bit_exact(engine.url, tensors)
        go.set()
        done = sorted(out.get(timeout=240) for _ in trainers)
        assert [d[0] for d in done] == ["done", "done"], done
    finally:
        for p in trainers:
            p.join(timeout=60)
    assert [p.exitcode for p in trainers] == [0, 0]
    _assert_bit_exact(engine.url, shifted)


@pytest.fixture
def engines(model_dir, shared_engines):
    return shared_engines(model_dir("qwen3-tiny"), [2, 1], seed=0)


@pytest.mark.parametrize("world", [2, 4], ids=["tp2", "tp2-dp2"])
def test_owner_sends_skip_the_gather_of_plain_split_weights(world, checkpoint, engines):
    """TP 2 with ``owned=True``, into a TP 2 and a TP 1 engine: the row- and column-parallel
    linear weights (o_proj, down_proj) and the vocabulary-parallel embedding and lm head go
    as each rank's own shard, the norms whole from every rank; only the fused QKV and
    gate/up (interleaved in Megatron) pass through the bridge's gathered export.

    With two data-parallel replicas (4 ranks) only replica 0's ranks (0 and 1) send shards;
    replica 1's send the norms and the exported tensors only."""
    folder, tensors = checkpoint
    shifted = [(name, tensor + SHIFT) for name, tensor in tensors]
    urls = [engine.url for engine in engines]
    ctx = warm_context()
    go, out = ctx.Event(), ctx.Queue()
    port = free_port()
    trainers = [
        ctx.Process(target=_trainer, args=(r, port, 2, 1, str(folder), urls, go, out, True, world))
        for r in range(world)
    ]
    for p in trainers:
        p.start()
    split = ("o_proj.weight", "down_proj.weight", "embed_tokens.weight", "lm_head.weight")
    interleaved = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight")
    interleaved += ("up_proj.weight",)
    names = sorted(name for name, _ in tensors)
    try:
        updated = sorted(out.get(timeout=240) for _ in trainers)
        assert [u[0] for u in updated] == ["updated"] * world, updated
        for _, rank, stage, shards, exported in updated:
            assert stage == 0
            assert shards == ([n for n in names if n.endswith(split)] if rank < 2 else [])
            # the first update exports them twice: to learn their shapes, then to send them
            assert exported == sorted(2 * [n for n in names if n.endswith(interleaved)])
        for engine in engines:
            mismatches = engine_mismatches(engine.url, lambda: tensors)
            assert mismatches == {r: [] for r in range(engine.tp)}, (engine.url, mismatches)
        go.set()
        done = sorted(out.get(timeout=240) for _ in trainers)
        assert [d[0] for d in done] == ["done"] * world, done
        assert [d[4] for d in done] == [[n for n in names if n.endswith(interleaved)]] * world
    finally:
        for p in trainers:
            p.join(timeout=60)
    assert [p.exitcode for p in trainers] == [0] * world
    for engine in engines:
        mismatches = engine_mismatches(engine.url, lambda: shifted)
        assert mismatches == {r: [] for r in range(engine.tp)}, (engine.url, mismatches)
