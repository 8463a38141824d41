"""The engine side of tests/integration/test_sglang_plugin.py, run as its own process.

Usage: ``python _sglang_plugin_engine.py MODEL_FOLDER BOOTSTRAP_PORT``. With nothing of
sglang or the plugin loaded yet, it

1. asks sglang's loader which general plugins ``SGLANG_PLUGINS=another_plugin``
   selects, then runs ``load_plugins()`` with ``SGLANG_PLUGINS=p2pweights_nixl``;
2. builds and loads the TP-1 model with sglang's model code, runs the plugin's
   launcher hook (bootstrap server) and rank hook (register + publish), and
3. prints one JSON line (what the loader and the registry show, the bootstrap URL,
   each parameter's sha256), then waits for a JSON line of the sha256 each
   parameter should now have and prints which match;
4. flips one bit of the first parameter (what a write gone wrong leaves), runs the
   plugin's BEFORE hook of ``end_weight_update`` (the write-digest record; the hook
   after ``begin_weight_update`` ran before the writes), prints the flipped name and
   keeps the bootstrap server serving until it reads one more line.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from types import SimpleNamespace
from typing import Any

import torch

MARKER = "p2pweights-test:"
"""Starts each line meant for the test; sglang and NIXL may print to stdout too."""


def _digest(tensor: torch.Tensor) -> str:
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()


def _loader_facts() -> dict[str, Any]:
    os.environ["SGLANG_PLUGINS"] = "another_plugin"
    from sglang.srt import plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    not_listed = sorted(plugins.load_plugins_by_group(plugins.GENERAL_PLUGINS_GROUP))
    os.environ["SGLANG_PLUGINS"] = "p2pweights_nixl"
    plugins.load_plugins()

    from sglang.srt.entrypoints import engine, engine_info_bootstrap_server
    from sglang.srt.model_executor.model_runner import ModelRunner

    import p2pweights.sglang_plugin as plugin

    launch = engine.Engine.__dict__["_launch_scheduler_processes"]
    return {
        "not_listed": not_listed,
        "hooks": {
            target: [
                [kind.value, getattr(hook, "__qualname__", ""), src.plugin_name, src.dist_name]
                for kind, hook, src in HookRegistry._hooks[target]
            ]
            for target in plugin.HOOK_TARGETS
        },
        "patched": sorted(set(plugin.HOOK_TARGETS) & HookRegistry._patched),
        "server_in_engine": engine.EngineInfoBootstrapServer.__qualname__,
        "server_in_module": engine_info_bootstrap_server.EngineInfoBootstrapServer.__qualname__,
        "launch_is_classmethod": isinstance(launch, classmethod),
        "launch_wraps": launch.__func__.__wrapped__.__qualname__,
        "initialize_wraps": ModelRunner.initialize.__wrapped__.__qualname__,
    }


def main(folder: str, port: int) -> None:
    facts = _loader_facts()

    import p2pweights.sglang_plugin as plugin
    from p2pweights.replica.ranks import RankSpec
    from p2pweights.replica.sglang.reference import load_real_rank_model
    from p2pweights.testing import synthetic_weights

    model = load_real_rank_model(
        folder,
        RankSpec.derive(tp_size=1, engine_rank=0),
        synthetic_weights("qwen3-tiny", seed=3),
        server_args_fields={"engine_info_bootstrap_port": port},
    )
    plugin.start_bootstrap_server()  # reads sglang's published args, as in the launcher
    runner = SimpleNamespace(
        model=model,
        is_draft_worker=False,
        remote_instance_weight_transporter=SimpleNamespace(tp_rank=0),
    )
    plugin.publish_after_initialize(None, runner)
    updater = SimpleNamespace(get_model_runner=lambda: runner)
    plugin.republish_after_begin(None, updater)  # the session the writes go into opens
    params = dict(model.named_parameters())
    facts["url"] = plugin._bootstrap_server.url
    facts["params"] = {
        name: [p.data_ptr(), p.numel(), p.element_size(), _digest(p)] for name, p in params.items()
    }
    print(MARKER, json.dumps(facts), flush=True)

    expected: dict[str, str] = json.loads(sys.stdin.readline())
    print(
        MARKER,
        json.dumps(
            {
                "matching": sorted(n for n, p in params.items() if _digest(p) == expected.get(n)),
                "differing": sorted(n for n, p in params.items() if _digest(p) != expected.get(n)),
            }
        ),
        flush=True,
    )
    flipped = sorted(params)[0]
    params[flipped].data.view(-1).view(torch.uint8)[0] ^= 0x01
    plugin.digests_before_end(updater)
    print(MARKER, json.dumps({"flipped": flipped}), flush=True)
    sys.stdin.readline()
    for publisher in plugin._published.values():
        publisher.close()
    plugin._bootstrap_server.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
