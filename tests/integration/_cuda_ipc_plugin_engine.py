"""The engine side of tests/integration/test_cuda_ipc_plugin_cpu.py, run as its own process.

Usage: ``python _cuda_ipc_plugin_engine.py MODEL_FOLDER BOOTSTRAP_PORT``. It runs sglang's
own ``load_plugins()`` with ``SGLANG_PLUGINS=p2pweights_cuda_ipc``, builds and loads the
TP-1 model with sglang's model code on the CPU, runs the plugin's launcher hook
(bootstrap server) and rank hook, which must refuse to publish without raising; prints
one JSON line of what it saw and serves the bootstrap server until stdin gives a line.
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

MARKER = "p2pweights-test:"


def main(folder: str, port: int) -> None:
    os.environ["SGLANG_PLUGINS"] = "p2pweights_cuda_ipc"
    from sglang.srt import plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    plugins.load_plugins()

    import p2pweights.sglang_plugin as plugin
    from p2pweights.replica.ranks import RankSpec
    from p2pweights.replica.sglang.reference import load_real_rank_model
    from p2pweights.testing import synthetic_weights

    facts = {
        "sources": sorted(
            {src.plugin_name for t in plugin.HOOK_TARGETS for _, _, src in HookRegistry._hooks[t]}
        ),
        "backend": plugin.publishing_backend(),
    }
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
    plugin.publish_after_initialize(None, runner)  # refuses, logs and records; no raise
    updater = SimpleNamespace(get_model_runner=lambda: runner)
    plugin.republish_after_begin(None, updater)  # a refused rank's hooks do nothing
    plugin.republish_after_end(None, updater)
    facts["published"] = id(runner) in plugin._published
    facts["url"] = plugin._bootstrap_server.url
    print(MARKER, json.dumps(facts), flush=True)
    sys.stdin.readline()
    plugin._bootstrap_server.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
