"""End-to-end against real sglang 0.5.23 servers (``python -m sglang.launch_server``) on the CPU.

Run with ``bash scripts/real-sglang.sh test`` (it builds sglang's CPU kernel once and
points ``P2PWEIGHTS_SGL_KERNEL_DIR`` at it); without the kernel every test here skips.
Four servers of a tiny Qwen3 model, one at a time:

* ``tp1`` and ``tp2``: the p2pweights NIXL plugin publishes their weights;
* ``tp1-moving``: the plugin, plus a test plugin that gives every parameter new storage
  after each postprocess (what sglang's AMX weight packing does on CPUs with AMX), so
  the published addresses go stale after every update;
* ``tp1-mooncake``: sglang's own Mooncake publication, no plugin;
* ``tp1-cuda-ipc``: the plugin's CUDA IPC publication
  (``SGLANG_PLUGINS=p2pweights_cuda_ipc``). On a GPU (decode CUDA graphs captured at
  start unless ``P2PWEIGHTS_REAL_SGLANG_CUDA_GRAPH=0``) this process is the colocated
  trainer: it opens the server's weights by IPC handle on the same GPU and takes three
  updates through ``CudaIpcConfig``, checked as the NIXL servers are, then a fourth
  staged (``direct=False``) from a new session. On the CPU the server's rank refuses to
  publish and says why, which connect reports;
* ``tp1-cuda-ipc-moving`` (GPU only): the same with the moving-storage test plugin, so
  every update is published afresh with new IPC handles (epoch 1, 2, 3, 4) and written
  where the parameters live then.

Each NIXL server takes three updates in a row from a trainer process (this one). After
each, every rank's weights are compared bit for bit, through sglang's own
``/weights_checker`` checksums, with a reference built the way the engine builds
(sglang's CPU kernel, ``SGLANG_USE_CPU_ENGINE=1``, sglang's own loader and start-up
postprocess; ``_reference.py``), and greedy generation must equal transformers' with
the same weights (where TP 2's bf16 sums part from transformers', only at a near tie).
``P2PWEIGHTS_RECORD_ANSWERS=DIR`` also writes the servers' answers
that tests/unit/test_real_sglang_answers.py replays in CI.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import torch

from p2pweights import (
    CudaIpcConfig,
    MooncakeConfig,
    NixlConfig,
    SyncConfig,
    Timeouts,
    WeightSyncSession,
)
from p2pweights.engines.client import EngineClient
from p2pweights.errors import EngineError
from p2pweights.report import UpdateReport
from p2pweights.testing import model_config, save_safetensors, synthetic_weights, write_model_dir
from p2pweights.verify import checksums_by_rank

sys.path.insert(0, str(Path(__file__).parent))
import _server
from _server import (
    RealServer,
    cuda_graphs_by_default,
    on_gpu,
    remove_left_behind,
    shared_memory_files,
    unavailable,
)

UNAVAILABLE = unavailable()
"""Why the suite cannot run here (None: it can)."""

pytestmark = [
    pytest.mark.real_sglang,
    pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE)),
]

CONFIG = {
    **model_config("qwen3-tiny"),
    "num_attention_heads": 4,
    "head_dim": 64,
    "vocab_size": 1024,
}
"""A tiny Qwen3 (2 layers, 4 query and 2 KV heads of 64, 3.4 MB of bf16): dimensions
sglang's CPU attention kernels and TP 2 take as they are."""
SEEDS = (11, 12, 13)
"""One update per seed, in this order; the servers start from seed 0's checkpoint."""
PROMPT = [5, 17, 99, 250, 3, 42, 7, 600]
NEW_TOKENS = 8
SERVERS = {
    "tp1": {"tp": 1},
    "tp2": {"tp": 2},
    "tp1-moving": {"tp": 1, "moving_storage": True},
    "tp1-mooncake": {"tp": 1, "nixl": False, "mooncake": True},
    "tp1-no-digests": {"tp": 1, "digests": False},
    "tp1-cuda-ipc": {
        "tp": 1,
        "nixl": False,
        "cuda_ipc": True,
        "cuda_graphs": cuda_graphs_by_default(),
    },
    # without CUDA graphs: graphs captured at start would read the storage the test
    # plugin gives up after every update
    "tp1-cuda-ipc-moving": {"tp": 1, "nixl": False, "cuda_ipc": True, "moving_storage": True},
}
NIXL_SERVERS = ("tp1", "tp2", "tp1-moving")
NEAR_TIE_NATS = 0.05
"""How close transformers' own top choices may be where the engine's greedy token differs."""


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = write_model_dir(CONFIG, tmp_path_factory.mktemp("tiny-qwen3"))
    save_safetensors(folder, synthetic_weights(CONFIG, seed=0))
    return folder


@pytest.fixture
def start_server(
    model_folder: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[str], RealServer]]:
    """``start_server(name)``: one of ``SERVERS``, healthy; stopped after the test.

    One server at a time: idle CPU servers poll (a TP 2 server's ranks keep about a
    core busy), and four at once starved the 2-core machine."""
    logs = Path(os.environ.get("P2PWEIGHTS_REAL_SGLANG_LOGS") or tmp_path_factory.mktemp("logs"))
    started: list[RealServer] = []
    before = shared_memory_files()

    def start(name: str) -> RealServer:
        server = RealServer(model_folder, log_path=logs / f"{name}.log", **SERVERS[name])  # type: ignore[arg-type]
        started.append(server)
        server.start()
        server.wait_ready()
        return server

    yield start
    for server in started:
        server.stop()
    remove_left_behind(before)


def reference_checksums(url: str, model_folder: Path) -> dict[int, list[dict[str, str]]]:
    """Per seed, per rank: sglang's checksums of the reference of engine ``url``'s ranks."""
    return _server.reference_checksums(url, CONFIG, model_folder, SEEDS)


def transformers_greedy(seed: int) -> tuple[list[int], torch.Tensor]:
    """transformers' Qwen3 with seed ``seed``'s weights, in bf16: its greedy tokens after
    ``PROMPT`` and the log-probabilities it chose each from (one row per token)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**{k: v for k, v in CONFIG.items() if k != "architectures"})
    model = Qwen3ForCausalLM(config).to(torch.bfloat16).eval()
    missing, unexpected = model.load_state_dict(dict(synthetic_weights(CONFIG, seed)), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([PROMPT]),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = [int(t) for t in out.sequences[0, len(PROMPT) :]]
    logprobs = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)
    return tokens, logprobs


def _sglang_packs_for_amx() -> bool:
    """Whether sglang's CPU backend repacks the linear weights into new storage after
    every load on this host (its own test: ``torch.cpu._is_amx_tile_supported()``, with
    the kernel built, which the servers here have)."""
    if on_gpu():
        return False
    try:
        return bool(torch.cpu._is_amx_tile_supported())
    except AttributeError:
        return False


def assert_generates_as_transformers(server: RealServer, seed: int) -> None:
    """Greedy tokens equal transformers' with the same weights. Where the two part, it
    must be at a near tie in transformers' own choice (TP 2 sums bf16 partial products
    in another order); the tokens after that follow other prefixes and are not compared."""
    tokens = server.generate(PROMPT, NEW_TOKENS)
    expected, logprobs = transformers_greedy(seed)
    assert len(tokens) == NEW_TOKENS
    for index, (got, want) in enumerate(zip(tokens, expected, strict=True)):
        if got != want:
            gap = float(logprobs[index, want] - logprobs[index, got])
            print(f"{server.url} seed {seed}: token {index} {got} != {want}, gap {gap:.4f} nats")
            assert gap < NEAR_TIE_NATS, (index, tokens, expected, gap)
            return


@pytest.mark.parametrize("name", NIXL_SERVERS)
def test_three_updates_in_a_row_are_bit_exact_and_generate_as_transformers(
    name: str, start_server: Callable[[str], RealServer], model_folder: Path
) -> None:
    if on_gpu() and SERVERS[name]["tp"] > torch.cuda.device_count():
        pytest.skip(f"{name} needs {SERVERS[name]['tp']} GPUs")
    server = start_server(name)
    client = EngineClient(server.url)
    reference = reference_checksums(server.url, model_folder)
    config = SyncConfig(transport=NixlConfig(backend="UCX"), timeouts=Timeouts(transfer=60))
    with WeightSyncSession(config) as session:
        session.connect([server.url])
        for step, seed in enumerate(SEEDS, start=1):
            update_and_check(session, server, name, step, seed, reference)
            # the test plugin moved every parameter at each end_weight_update, as sglang's
            # own AMX packing does on a CPU with AMX tiles: published afresh each time
            moves = name == "tp1-moving" or _sglang_packs_for_amx()
            expected_epoch = step if moves else 0
            assert [client.publication(r).epoch for r in range(server.tp)] == [
                expected_epoch
            ] * server.tp
    assert server.alive
    record_answers(name, server)


def update_and_check(
    session: WeightSyncSession,
    server: RealServer,
    name: str,
    step: int,
    seed: int,
    reference: dict[int, list[dict[str, str]]],
) -> UpdateReport:
    """Update ``server`` to seed ``seed``'s weights as version ``step``; every rank's
    weights bit-exact by sglang's own checksums, and greedy generation as transformers'."""
    client = EngineClient(server.url)
    report = session.update(dict(synthetic_weights(CONFIG, seed)))
    assert report.version == str(step)
    # the plugins digest by default: every rank's digests of its written weights compared
    # with what was staged, each update; a run with P2PWEIGHTS_WRITE_DIGESTS=0 (the
    # servers inherit it) is checked by sglang's own /weights_checker before each end
    digests = os.environ.get("P2PWEIGHTS_WRITE_DIGESTS") != "0"
    assert report.engines[server.url].verified_by == (
        ("write_digests",) if digests else ("weights_checker",)
    )
    assert client.weight_version() == str(step)
    actual = checksums_by_rank(server.url, client.weights_checker("checksum"))
    assert len(actual) == server.tp
    for rank in range(server.tp):
        assert len(actual[rank]) == 19
        assert actual[rank] == reference[seed][rank], f"{name} rank {rank} update {step}"
    assert_generates_as_transformers(server, seed)
    return report


@pytest.mark.skipif(not on_gpu(), reason="CUDA IPC shares GPU memory: a GPU server only")
@pytest.mark.parametrize("name", ["tp1-cuda-ipc", "tp1-cuda-ipc-moving"])
def test_cuda_ipc_into_a_colocated_gpu_server_is_bit_exact_three_times_in_a_row(
    name: str, start_server: Callable[[str], RealServer], model_folder: Path
) -> None:
    """The colocated trainer (this process) on the server's own GPU, as verl's and slime's
    colocated mode runs: the weights opened by CUDA IPC handle, written in place (filled
    by the loaders directly, ``direct=True``, under the CUDA graphs captured over those
    addresses at start), three updates, then one more staged through a buffer from a new
    session. ``-moving``: every parameter gets new storage after each update, so each
    update is written through the handles the plugin published afresh."""
    moves = bool(SERVERS[name].get("moving_storage"))
    server = start_server(name)
    client = EngineClient(server.url)
    pub = client.publication(0)
    assert (pub.backend, pub.live, pub.epoch) == ("cuda_ipc", True, 0), pub
    gpu = pub.segments[0].gpu_id
    reference = reference_checksums(server.url, model_folder)
    config = SyncConfig(transport=CudaIpcConfig(device=gpu), timeouts=Timeouts(transfer=60))
    updates = []
    with WeightSyncSession(config) as session:
        session.connect([server.url])
        for step, seed in enumerate(SEEDS, start=1):
            report = update_and_check(session, server, name, step, seed, reference)
            updates.append(_summary(report, server.url, step, "direct"))
            # sglang's GPU post-processing of bf16 weights moves nothing; the test plugin
            # moves everything at each end
            assert client.publication(0).epoch == (step if moves else 0)
    staged = SyncConfig(
        transport=CudaIpcConfig(device=gpu, direct=False), timeouts=Timeouts(transfer=60)
    )
    with WeightSyncSession(staged) as session:
        session.connect([server.url])
        step = len(SEEDS) + 1
        report = update_and_check(session, server, name, step, SEEDS[0], reference)
        updates.append(_summary(report, server.url, step, "staged"))
    assert client.publication(0).epoch == (step if moves else 0)
    assert server.alive
    summary = {"case": f"qwen3-{name}", "backend": "cuda_ipc", "cuda_graphs": server.cuda_graphs}
    print(json.dumps({**summary, "updates": updates}))
    if os.environ.get("P2PWEIGHTS_GPU_SUMMARY"):  # the GPU runbook's summary (device.sh)
        with open(os.environ["P2PWEIGHTS_GPU_SUMMARY"], "a") as out:
            out.write(json.dumps({**summary, "updates": updates}) + "\n")
    record_answers(name, server)


def _summary(report: UpdateReport, url: str, step: int, how: str) -> dict[str, object]:
    engine = report.engines[url]
    return {
        "step": step,
        "loads": how,
        "update_s": round(report.seconds, 4),
        "paused_s": engine.paused_s,
        "verified_by": list(engine.verified_by),
    }


@pytest.mark.skipif(on_gpu(), reason="the refusal of a CPU server")
def test_cuda_ipc_from_a_cpu_server_is_refused_with_its_reason(
    start_server: Callable[[str], RealServer],
) -> None:
    server = start_server("tp1-cuda-ipc")
    client = EngineClient(server.url)
    with pytest.raises(EngineError) as refused:
        client.publication(0)
    message = str(refused.value)
    assert f"engine {server.url} rank 0 could not publish its weights for cuda_ipc" in message
    assert "shares GPU memory only" in message and "SGLANG_PLUGINS=p2pweights_nixl" in message
    config = SyncConfig(transport=CudaIpcConfig())
    with (
        WeightSyncSession(config) as session,
        pytest.raises(EngineError, match="could not publish its weights for cuda_ipc"),
    ):
        session.connect([server.url])
    assert client.weight_version() == "default"  # nothing was paused, opened or written
    assert len(server.generate(PROMPT, 2)) == 2  # the server serves on
    record_answers("tp1-cuda-ipc-cpu", server)


def test_a_wrong_byte_after_the_writes_fails_the_update_on_a_server_without_digests(
    start_server: Callable[[str], RealServer],
    model_folder: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The plugin with its digests off stands in for released sglang's own publication:
    sglang's /weights_checker checks every update before its end; one byte written wrong
    through the transport after the writes fails the update, naming engine, rank and
    parameter, and leaves the server paused and torn; the next update converges."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent.parent / "integration"))
    from _wrong_byte import fails_on_a_wrong_byte_then_converges

    server = start_server("tp1-no-digests")
    client = EngineClient(server.url)
    reference = reference_checksums(server.url, model_folder)
    config = SyncConfig(transport=NixlConfig(backend="UCX"), timeouts=Timeouts(transfer=60))
    with WeightSyncSession(config) as session:
        session.connect([server.url])
        fails_on_a_wrong_byte_then_converges(
            monkeypatch,
            session,
            server.url,
            lambda seed: dict(synthetic_weights(CONFIG, seed)),
            SEEDS,
            "model.layers.1.mlp.down_proj.weight",  # TP 1: held as sent, until end packs it
        )
    last = SEEDS[-1]
    actual = checksums_by_rank(server.url, client.weights_checker("checksum"))
    assert actual[0] == reference[last][0]
    assert_generates_as_transformers(server, last)
    assert server.alive


def test_mooncake_into_a_cpu_server_is_refused_at_connect(
    start_server: Callable[[str], RealServer],
) -> None:
    if on_gpu():
        pytest.skip("a GPU server takes Mooncake writes: test_real_server_gpu.py")
    server = start_server("tp1-mooncake")
    client = EngineClient(server.url)
    assert client.publication(0).backend == "mooncake"  # sglang's own, no plugin loaded
    config = SyncConfig(transport=MooncakeConfig(protocol="tcp"))
    with (
        WeightSyncSession(config) as session,
        pytest.raises(EngineError, match="NixlConfig") as err,
    ):
        session.connect([server.url])
    assert server.url in str(err.value) and "p2pweights_nixl" in str(err.value)
    assert client.weight_version() == "default"  # nothing was paused, opened or written
    assert len(server.generate(PROMPT, 2)) == 2
    record_answers("tp1-mooncake", server)


def record_answers(name: str, server: RealServer) -> None:
    """With ``P2PWEIGHTS_RECORD_ANSWERS=DIR``: what ``server`` answers now, into
    ``DIR/{name}.json``, for tests/unit/test_real_sglang_answers.py to replay."""
    if not os.environ.get("P2PWEIGHTS_RECORD_ANSWERS"):
        return
    folder = Path(os.environ["P2PWEIGHTS_RECORD_ANSWERS"])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    url = server.url
    answers = {
        route: httpx.get(f"{url}{route}", timeout=60).json()
        for route in ("/server_info", "/get_server_info", "/model_info")
    }
    answers["/weights_checker"] = httpx.post(
        f"{url}/weights_checker", json={"action": "checksum"}, timeout=60
    ).json()
    answers["publications"] = [
        httpx.get(
            f"{url}/remote_instance_transfer_engine_info", params={"rank": rank}, timeout=60
        ).json()
        for rank in range(server.tp)
    ]
    (folder / f"{name}.json").write_text(json.dumps(answers, indent=1, sort_keys=True) + "\n")
