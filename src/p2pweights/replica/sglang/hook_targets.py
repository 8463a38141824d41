"""The functions and classes of sglang the p2pweights plugin hooks (``sglang_plugin``).

They are sglang knowledge, so they live with the rest of it: the plugin registers its
hooks on them and ``compat`` checks that each still exists in the installed sglang.
Imports nothing.
"""

from __future__ import annotations

__all__ = [
    "BEGIN_TARGET",
    "BOOTSTRAP_SERVER_TARGET",
    "END_TARGET",
    "HOOK_TARGETS",
    "LAUNCH_TARGET",
    "RUNNER_TARGET",
]

BOOTSTRAP_SERVER_TARGET = (
    "sglang.srt.entrypoints.engine_info_bootstrap_server.EngineInfoBootstrapServer"
)
LAUNCH_TARGET = "sglang.srt.entrypoints.engine.Engine._launch_scheduler_processes"
RUNNER_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.initialize"
_UPDATER = "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater"
BEGIN_TARGET = f"{_UPDATER}.begin_weight_update"
END_TARGET = f"{_UPDATER}.end_weight_update"
HOOK_TARGETS = (BOOTSTRAP_SERVER_TARGET, LAUNCH_TARGET, RUNNER_TARGET, BEGIN_TARGET, END_TARGET)
"""What the plugin hooks in sglang, in registration order (``END_TARGET`` twice: BEFORE
and AFTER; ``replica.sglang.compat`` checks each target and hook type)."""
