"""A real sglang 0.5.23 server on a GPU taking p2pweights updates: every path, every shape.

Runs only with ``P2PWEIGHTS_REAL_SGLANG_DEVICE=cuda`` on a host with a GPU (the lent GPU
machine: ``bash scripts/gpu_sglang/device.sh stage2``, docs/real-sglang.md); everywhere
else it skips.
Each case starts one server of a tiny model with CUDA graphs captured at start (before any
update), writes three updates in a row over one path, and after each compares every
rank's weights bit for bit through sglang's own ``/weights_checker`` checksums (the GPU
hash kernel) with a reference sglang builds on the same GPU from the same tensors, then
generates greedily (equal to transformers' for the dense model; MoE and MLA models print
where they part from it, since their bf16 routing and attention sums differ from
transformers' at near ties).

The paths:

* ``mooncake-device`` / ``mooncake-host``: the seed's own path. The server publishes
  through sglang's own flag (``--remote-instance-weight-loader-start-seed-via-transfer-engine``,
  no plugin, ``MOONCAKE_PROTOCOL=tcp``); the trainer stages on its GPU, or in pinned host
  memory, and writes over Mooncake.
* ``nixl``: the p2pweights NIXL plugin publishes the server's VRAM.

And a wrong byte written over sglang's own Mooncake publication after the writes: its
``/weights_checker`` fails the update (issue 40 on the GPU).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from p2pweights import MooncakeConfig, NixlConfig, SyncConfig, Timeouts, WeightSyncSession
from p2pweights.engines.client import EngineClient
from p2pweights.testing import model_config, save_safetensors, synthetic_weights, write_model_dir
from p2pweights.verify import checksums_by_rank

sys.path.insert(0, str(Path(__file__).parent))
from _server import (
    RealServer,
    cuda_graphs_by_default,
    on_gpu,
    reference_checksums,
    remove_left_behind,
    shared_memory_files,
)

pytestmark = [
    pytest.mark.real_sglang,
    pytest.mark.skipif(
        not on_gpu() or not torch.cuda.is_available(),
        reason="the GPU server cases need P2PWEIGHTS_REAL_SGLANG_DEVICE=cuda and a GPU",
    ),
]

MODELS: dict[str, dict[str, Any]] = {
    "qwen3": {
        **model_config("qwen3-tiny"),
        "num_attention_heads": 4,
        "head_dim": 64,
        "vocab_size": 1024,
    },
    "qwen3-moe": model_config("qwen3-moe-tiny"),
    "deepseek-v3": model_config("deepseek-v3-tiny"),
    "deepseek-v3-fp8": model_config("deepseek-v3-fp8-tiny"),
}
"""Tiny models of each family the GPU server is checked on (the fp8 one is block-quantized
128 x 128, which sglang re-lays on Hopper after loading)."""

PATHS: dict[str, dict[str, Any]] = {
    "mooncake-device": {"nixl": False, "mooncake": True, "staging": "cuda:0"},
    "mooncake-host": {"nixl": False, "mooncake": True, "staging": "cpu"},
    "nixl": {"nixl": True, "mooncake": False, "staging": "cpu"},
}
SEEDS = (11, 12, 13)
PROMPT = [5, 17, 99, 250, 3, 42, 7, 600]
NEW_TOKENS = 8
NEAR_TIE_NATS = 0.05
SUMMARY = os.environ.get("P2PWEIGHTS_GPU_SUMMARY")
"""A JSON-lines file each case appends what it saw to (the runbook's summary)."""


def summarize(**entry: Any) -> None:
    print(json.dumps(entry))
    if SUMMARY:
        with open(SUMMARY, "a") as out:
            out.write(json.dumps(entry) + "\n")


@pytest.fixture(scope="module")
def model_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folders = {}
    for name, config in MODELS.items():
        folder = write_model_dir(config, tmp_path_factory.mktemp(name))
        save_safetensors(folder, synthetic_weights(config, seed=0))
        folders[name] = folder
    return folders


@pytest.fixture
def start_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., RealServer]]:
    logs = Path(os.environ.get("P2PWEIGHTS_REAL_SGLANG_LOGS") or tmp_path_factory.mktemp("logs"))
    started: list[RealServer] = []
    before = shared_memory_files()

    def start(name: str, folder: Path, **options: Any) -> RealServer:
        server = RealServer(
            folder,
            tp=1,
            log_path=logs / f"{name}.log",
            cuda_graphs=cuda_graphs_by_default(),
            **options,
        )
        started.append(server)
        server.start()
        server.wait_ready()
        return server

    yield start
    for server in started:
        server.stop()
    remove_left_behind(before)


def transformers_greedy(config: dict[str, Any], seed: int) -> tuple[list[int], torch.Tensor]:
    """transformers' model of ``config`` with seed ``seed``'s weights (bf16, CPU): its greedy
    tokens after ``PROMPT`` and the log-probabilities it chose each from."""
    import tempfile

    import transformers

    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    with tempfile.TemporaryDirectory() as folder:
        # transformers' own loading (and its checkpoint conversions, e.g. fused experts)
        write_model_dir(plain, Path(folder))
        save_safetensors(Path(folder), synthetic_weights(config, seed, dtype=torch.bfloat16))
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.bfloat16
        ).eval()
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
    return tokens, torch.log_softmax(torch.cat(out.logits).float(), dim=-1)


def first_parting(
    tokens: list[int], expected: list[int], logprobs: torch.Tensor
) -> tuple[int, float] | None:
    """Where the engine's greedy tokens first part from transformers', and transformers' own
    gap between its choice and the engine's there (None: equal)."""
    for index, (got, want) in enumerate(zip(tokens, expected, strict=True)):
        if got != want:
            return index, float(logprobs[index, want] - logprobs[index, got])
    return None


CASES = [
    ("qwen3", "mooncake-device"),
    ("qwen3", "mooncake-host"),
    ("qwen3", "nixl"),
    ("qwen3-moe", "nixl"),
    ("deepseek-v3", "nixl"),
    ("deepseek-v3-fp8", "nixl"),
    ("qwen3-moe", "mooncake-device"),
]


@pytest.mark.parametrize(("model", "path"), CASES, ids=[f"{m}-{p}" for m, p in CASES])
def test_three_updates_bit_exact_on_a_gpu_server(
    model: str, path: str, start_server: Callable[..., RealServer], model_folders: dict[str, Path]
) -> None:
    config, folder, options = MODELS[model], model_folders[model], dict(PATHS[path])
    staging = options.pop("staging")
    started = time.perf_counter()
    server = start_server(f"{model}-{path}", folder, **options)
    start_s = time.perf_counter() - started
    client = EngineClient(server.url)
    backend = client.publication(0).backend
    reference = reference_checksums(server.url, config, folder, SEEDS)
    transport = MooncakeConfig(protocol="tcp") if options["mooncake"] else NixlConfig(backend="UCX")
    reports = []
    with WeightSyncSession(
        SyncConfig(transport=transport, timeouts=Timeouts(transfer=60)), staging_device=staging
    ) as session:
        session.connect([server.url])
        for step, seed in enumerate(SEEDS, start=1):
            report = session.update(dict(synthetic_weights(config, seed)))
            assert report.version == str(step)
            actual = checksums_by_rank(server.url, client.weights_checker("checksum"))
            assert actual[0] == reference[seed][0], f"{model} over {path}: update {step} differs"
            tokens = server.generate(PROMPT, NEW_TOKENS)
            assert len(tokens) == NEW_TOKENS
            expected, logprobs = transformers_greedy(config, seed)
            parting = first_parting(tokens, expected, logprobs)
            if model == "qwen3" and parting is not None:
                assert parting[1] < NEAR_TIE_NATS, (tokens, expected, parting)
            engine = report.engines[server.url]
            # sglang's own Mooncake publication records no digests: its /weights_checker
            # GPU hashes are compared with the sender's (issue 40); the plugins digest
            expected = ("weights_checker",) if options["mooncake"] else ("write_digests",)
            assert engine.verified_by == expected, (engine.verified_by, engine.unverified_reason)
            reports.append(
                {
                    "step": step,
                    "update_s": round(report.seconds, 4),
                    "paused_s": engine.paused_s,
                    "verified_by": list(engine.verified_by),
                    "tensors_checked": len(actual[0]),
                    "generation_parts_at": parting,
                }
            )
    assert server.alive
    summarize(
        case=f"{model}-{path}",
        backend=backend,
        staging=staging,
        cuda_graphs=cuda_graphs_by_default(),
        server_start_s=round(start_s, 1),
        updates=reports,
    )
    record_answers(f"gpu-{model}-{path}", server)


def record_answers(name: str, server: RealServer) -> None:
    """With ``P2PWEIGHTS_RECORD_ANSWERS=DIR``: what the GPU server answers now, for
    tests/unit/test_real_sglang_answers.py to replay in CI."""
    if not os.environ.get("P2PWEIGHTS_RECORD_ANSWERS"):
        return
    folder = Path(os.environ["P2PWEIGHTS_RECORD_ANSWERS"])
    folder.mkdir(parents=True, exist_ok=True)
    url = server.url
    answers = {
        route: httpx.get(f"{url}{route}", timeout=60).json()
        for route in ("/server_info", "/model_info")
    }
    answers["/weights_checker"] = httpx.post(
        f"{url}/weights_checker", json={"action": "checksum"}, timeout=60
    ).json()
    answers["publications"] = [
        httpx.get(
            f"{url}/remote_instance_transfer_engine_info", params={"rank": 0}, timeout=60
        ).json()
    ]
    (folder / f"{name}.json").write_text(json.dumps(answers, indent=1, sort_keys=True) + "\n")


def test_a_wrong_byte_over_sglangs_own_mooncake_publication_fails_the_update(
    start_server: Callable[..., RealServer],
    model_folders: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 40 on the GPU: released sglang publishing through its own Mooncake flag
    records no write digests, so its ``/weights_checker`` GPU hashes check each update
    before its end. One byte written wrong over Mooncake after the update's writes fails
    the update, naming engine, rank and parameter, and leaves the server paused and torn;
    after ``abort()`` the next update is verified and bit-exact."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent.parent / "integration"))
    from _wrong_byte import fails_on_a_wrong_byte_then_converges

    config, folder = MODELS["qwen3"], model_folders["qwen3"]
    options = dict(PATHS["mooncake-device"])
    staging = options.pop("staging")
    server = start_server("qwen3-mooncake-wrong-byte", folder, **options)
    client = EngineClient(server.url)
    reference = reference_checksums(server.url, config, folder, SEEDS)
    sync = SyncConfig(transport=MooncakeConfig(protocol="tcp"), timeouts=Timeouts(transfer=60))
    with WeightSyncSession(sync, staging_device=staging) as session:
        session.connect([server.url])
        message = fails_on_a_wrong_byte_then_converges(
            monkeypatch,
            session,
            server.url,
            lambda seed: dict(synthetic_weights(config, seed)),
            SEEDS,
            "model.layers.1.mlp.down_proj.weight",
        )
    last = SEEDS[-1]
    actual = checksums_by_rank(server.url, client.weights_checker("checksum"))
    assert actual[0] == reference[last][0]
    assert server.alive
    summarize(case="qwen3-mooncake-wrong-byte", backend="mooncake", failed_with=message)
