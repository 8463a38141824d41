"""The sglang NIXL plugin, as far as a host without a GPU sglang server allows.

An engine-side process (``_sglang_plugin_engine.py``) starts with nothing loaded,
runs sglang's own ``load_plugins()`` (entry point found, ``SGLANG_PLUGINS``
honoured, hooks registered and applied), builds and loads a model with sglang's
model code and runs the plugin's hooks: the bootstrap server starts and the rank
publishes over NIXL. This process reads the publication from the bootstrap server,
writes new bytes into every parameter with a ``NixlTransport`` and the engine side
checks them bit for bit. A session also refuses an engine published for the other
transport, both ways (local engines, started in the background meanwhile).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from p2pweights.config import MooncakeConfig, NixlConfig, SyncConfig
from p2pweights.errors import EngineError
from p2pweights.local_engine import LocalEngine
from p2pweights.local_engine.process import free_port
from p2pweights.sync_session import WeightSyncSession
from p2pweights.testing import write_model_dir
from p2pweights.transports import Write, create_transport
from p2pweights.wire.delta import SCRATCH_NAME
from p2pweights.wire.digest import digest
from p2pweights.wire.landed import LANDED_NAME, flag_names
from p2pweights.wire.publication import DIGESTS_ROLE, parse_publication

pytestmark = pytest.mark.integration

ENGINE_SCRIPT = Path(__file__).with_name("_sglang_plugin_engine.py")
MARKER = "p2pweights-test:"  # as in ENGINE_SCRIPT
HOOKS = {
    "sglang.srt.entrypoints.engine_info_bootstrap_server.EngineInfoBootstrapServer": [
        ["replace", "NixlAwareBootstrapServer", "p2pweights_nixl", "p2pweights"]
    ],
    "sglang.srt.entrypoints.engine.Engine._launch_scheduler_processes": [
        ["before", "start_bootstrap_server", "p2pweights_nixl", "p2pweights"]
    ],
    "sglang.srt.model_executor.model_runner.ModelRunner.initialize": [
        ["after", "publish_after_initialize", "p2pweights_nixl", "p2pweights"]
    ],
    "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater."
    "begin_weight_update": [["after", "republish_after_begin", "p2pweights_nixl", "p2pweights"]],
    "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater."
    "end_weight_update": [
        ["before", "digests_before_end", "p2pweights_nixl", "p2pweights"],
        ["after", "republish_after_end", "p2pweights_nixl", "p2pweights"],
    ],
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir("qwen3-tiny", tmp_path_factory.mktemp("qwen3-tiny"))


@pytest.fixture(scope="module")
def engines(folder: Path) -> Iterator[dict[str, LocalEngine]]:
    """A NIXL and a Mooncake local engine, started (not awaited) so they boot meanwhile."""
    started = {
        kind: LocalEngine(folder, tp=1, transport=kind, seed=0) for kind in ("nixl", "mooncake")
    }
    try:
        for engine in started.values():
            engine.start()
        yield started
    finally:
        for engine in started.values():
            engine.stop()


@pytest.fixture(scope="module")
def plugin_engine(folder: Path) -> Iterator[tuple[subprocess.Popen[str], dict[str, Any]]]:
    """The engine-side process, once it has published; yields it and what it reported."""
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_PLUGINS"}
    env.pop("P2PWEIGHTS_WRITE_DIGESTS", None)  # the plugin's ranks digest by default
    env["P2PWEIGHTS_DELTA_SCRATCH"] = "1MiB"  # the plugin takes a scratch region only if asked
    process = subprocess.Popen(
        [sys.executable, str(ENGINE_SCRIPT), str(folder), str(free_port())],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        facts = _read_report(process)
        if facts is None:
            _, stderr = process.communicate(timeout=30)
            pytest.fail(f"the engine-side process exited before publishing:\n{stderr[-3000:]}")
        yield process, facts
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate()


def _read_report(process: subprocess.Popen[str]) -> Any:
    """The next line the engine-side process meant for the test (None if it exited)."""
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER) :])
    return None


# Requests the local engines first, so they boot while the plugin's process works.
@pytest.mark.usefixtures("engines")
def test_sglang_loader_runs_the_plugin_and_applies_its_hooks(
    plugin_engine: tuple[subprocess.Popen[str], dict[str, Any]],
) -> None:
    _, seen = plugin_engine
    assert "p2pweights_nixl" not in seen["not_listed"]  # SGLANG_PLUGINS filters it out
    assert seen["hooks"] == HOOKS
    assert seen["patched"] == sorted(HOOKS)
    # the class is swapped where engine.py creates it, not only in its own module
    assert seen["server_in_engine"] == seen["server_in_module"] == "NixlAwareBootstrapServer"
    assert seen["launch_is_classmethod"]
    assert seen["launch_wraps"] == "Engine._launch_scheduler_processes"
    assert seen["initialize_wraps"] == "ModelRunner.initialize"


def _new_bytes(name: str, num_bytes: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=generator)


def test_published_weights_are_written_bit_exact(
    plugin_engine: tuple[subprocess.Popen[str], dict[str, Any]],
) -> None:
    process, seen = plugin_engine
    body = httpx.get(f"{seen['url']}/get_transfer_engine_info", params={"rank": 0}).json()
    info = body["remote_instance_transfer_engine_info"]
    assert body["rank"] == 0 and info["backend"] == "nixl"
    assert info["agent_name"].startswith("nixl_weight_tp0_")
    scratch = info["weights_info_dict"].pop(SCRATCH_NAME)  # delta updates' scratch region
    weight_bytes = sum(numel * size for _, numel, size, _ in seen["params"].values())
    assert scratch[1] * scratch[2] == 2**20 < weight_bytes
    flags = info["weights_info_dict"][LANDED_NAME]  # a flag per parameter (wire.landed)
    assert flags[1] * flags[2] >= len(seen["params"])
    info = {**info, "weights_info_dict": dict(info["weights_info_dict"])}
    del info["weights_info_dict"][LANDED_NAME]
    assert info["weights_info_dict"] == {
        name: [ptr, numel, element_size, 0]
        for name, (ptr, numel, element_size, _) in seen["params"].items()
    }
    target = parse_publication("http://engine-under-test", 0, body)
    assert target.backend == "nixl" and target.mem_type == "DRAM" and target.write_digests

    regions = sorted((n, target.regions[n]) for n in flag_names(target.regions))
    staging = torch.empty(
        sum(r.num_bytes for _, r in regions) + 8 * len(regions), dtype=torch.uint8
    )
    writes, expected, cursor = [], {}, 0
    for name, region in regions:
        new = _new_bytes(name, region.num_bytes)
        staging[cursor : cursor + region.num_bytes] = new
        writes.append(Write(staging.data_ptr() + cursor, region.address, region.num_bytes))
        expected[name] = hashlib.sha256(new.numpy().tobytes()).hexdigest()
        assert expected[name] != seen["params"][name][3], f"{name}: the new bytes are the old"
        cursor += region.num_bytes + 7  # unaligned sources
    staging[-1] = 1  # the landed flag's byte (wire.landed)
    last = len(regions) - 1  # flag the last parameter as landed (the first is flipped below)
    landed = target.regions[LANDED_NAME]
    flag = Write(staging.data_ptr() + staging.numel() - 1, landed.address + last, 1)
    transport = create_transport(NixlConfig(backend="UCX"))
    try:
        transport.register(staging)
        transport.write(target, writes, timeout_s=30.0)
        transport.write(target, [flag], timeout_s=30.0)  # once its writes completed
    finally:
        transport.close()

    assert process.stdin is not None
    process.stdin.write(json.dumps(expected) + "\n")
    process.stdin.flush()
    checked = _read_report(process)
    assert checked["differing"] == []
    assert checked["matching"] == sorted(seen["params"])

    # the rank's write digests, taken before end_weight_update after one bit was flipped
    flipped = _read_report(process)["flipped"]
    asked = {"rank": 0, "role": DIGESTS_ROLE}
    body = httpx.get(f"{seen['url']}/get_transfer_engine_info", params=asked).json()
    record = body["remote_instance_transfer_engine_info"]
    assert body["role"] == DIGESTS_ROLE and record["update"] == 1 and record["error"] is None
    cursor, staged = 0, {}
    for name, region in regions:
        staged[name] = digest(staging[cursor : cursor + region.num_bytes])
        cursor += region.num_bytes + 7
    assert sorted(n for n in staged if record["digests"][n] != staged[n]) == [flipped]
    assert record["digested_early"] == 1  # the flagged one, while the session was open
    process.stdin.write("done\n")
    process.stdin.flush()


@pytest.mark.parametrize(
    ("published", "session_config"),
    [
        ("nixl", MooncakeConfig(protocol="tcp")),
        ("mooncake", NixlConfig(backend="UCX")),
    ],
    ids=["mooncake-session-nixl-engine", "nixl-session-mooncake-engine"],
)
def test_transport_mismatch_is_refused_at_connect(
    engines: dict[str, LocalEngine], published: str, session_config: Any
) -> None:
    url = engines[published].wait_ready().url
    session = WeightSyncSession(SyncConfig(transport=session_config))
    try:
        with pytest.raises(EngineError) as refused:
            session.connect([url])
    finally:
        session.close()
    message = str(refused.value)
    assert url in message
    assert f"published its weights for {published}" in message
    assert f"writes over {session_config.kind}" in message
    fix = {"nixl": "NixlConfig", "mooncake": "MooncakeConfig"}[published]
    assert f"SyncConfig(transport={fix}(...))" in message
    flag = {
        "mooncake": "--remote-instance-weight-loader-start-seed-via-transfer-engine",
        "nixl": "SGLANG_PLUGINS=p2pweights_nixl",
    }[session_config.kind]
    assert flag in message
