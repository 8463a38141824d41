"""Every environment variable p2pweights reads or sets, in this one module.

=====================================  =====================================================
``SGLANG_REMOTE_INSTANCE_NIXL_BACKEND``  The NIXL backend when ``NixlConfig.backend`` is not
                                         given, and the NIXL plugin's on engine hosts
                                         (default ``UCX``); the name sglang PR #35712 uses.
``SGLANG_USE_CPU_ENGINE``                sglang's own CPU engine runs in this process: the
                                         replica then needs no rope-kernel workaround.
``UCX_MODULES``                          Set to ``^efa`` by the NIXL transport when unset and
                                         the host has no EFA device (UCX's EFA module crashes
                                         at process exit otherwise). Read, never overridden.
``P2PWEIGHTS_PROGRESS``                  ``0`` turns progress bars off (``p2pweights.progress``;
                                         they are drawn only on a terminal anyway).
``P2PWEIGHTS_LOADER_REPLAY``             ``0`` runs sglang's loaders on every load instead of
                                         replaying their recorded copies
                                         (``replica/sglang/replay.py``; for A/B runs).
``P2PWEIGHTS_FUSED_FP8``                 ``0`` quantizes GPU weights to block fp8 with torch
                                         instead of the one-pass Triton kernel
                                         (``source/fp8_fused.py``; for A/B runs).
``P2PWEIGHTS_COPY_KERNEL``               ``0`` replays a load's copies on a GPU with
                                         ``torch._foreach_copy_`` instead of one Triton
                                         launch per step
                                         (``replica/sglang/gathered_copies.py``; A/B runs).
``P2PWEIGHTS_DIGEST_KERNEL``             ``0`` digests GPU regions with torch, a few launches
                                         each, instead of one Triton launch for all of them
                                         (``wire/lanes_kernel.py``; for A/B runs).
``P2PWEIGHTS_DELTA_SCRATCH``             Bytes of each engine rank's delta scratch region
                                         (``512MiB``; ``0``: none, delta updates write it
                                         in full); default 1/8 of the rank's weights, at
                                         most 1 GiB, in the local engine, and none in the
                                         sglang plugin (``p2pweights.engine_side.delta_scratch``).
``P2PWEIGHTS_WRITE_DIGESTS``             On an engine host: every rank digests its
                                         published parameters right before each
                                         ``end_weight_update``, so trainers can verify their
                                         writes (``SyncConfig.verify_writes``); ``0`` opts
                                         out. Default: on, in the sglang plugin and the local
                                         engine (verification cost +7.9 % / +9.7 % of an
                                         update on one H200, docs/benchmarks.md).
``P2PWEIGHTS_MILES_TRANSPORT``           miles' trainers (``p2pweights.integrations.miles``):
                                         ``mooncake-rdma`` (default), ``mooncake-tcp`` or
                                         ``nixl``; ``--p2p-transport nixl`` does the same.
``P2PWEIGHTS_MILES_HOSTNAME``            The address miles' trainers are reached at over
                                         Mooncake (default: Ray's node address).
``NIXL_LOG_LEVEL``                       Set to ``WARN`` by the command line's quiet output
                                         (demo, doctor) when unset: NIXL logs INFO lines to
                                         stdout otherwise. Read, never overridden.
``P2PWEIGHTS_LOG``                       The level of the ``p2pweights`` loggers (``debug``,
                                         ``info``, ``warning``, ...), set on the first
                                         session; unset: left as the process configured it.
                                         No handler is added (``p2pweights.logs``).
``P2PWEIGHTS_THIRD_PARTY_LOGS``          ``1`` lets every line of sglang, megatron, torch and
                                         Mooncake through; unset or ``0``, the known noise
                                         they print on import and start is kept out
                                         (``p2pweights.logs``), and ``MC_LOG_LEVEL``
                                         defaults to ``ERROR``.
``MC_LOG_LEVEL``                         Mooncake's log level (``TRACE``, ``INFO``, ``WARNING``,
                                         ``ERROR``): set to ``ERROR`` before a Mooncake
                                         engine starts, unless set or third-party logs are
                                         on. Read, never overridden.
``MC_FORCE_TCP``                         Read: Mooncake then installs TCP whatever RDMA
                                         devices there are (its binding ignores the protocol
                                         it is given), so ``MooncakeConfig(protocol="rdma")``
                                         is refused and a transport says it writes over TCP.
=====================================  =====================================================

Read when used, not at import, so a value set before the first session counts.
"""

from __future__ import annotations

import glob
import logging
import os

logger = logging.getLogger(__name__)

__all__ = [
    "nixl_backend",
    "delta_scratch",
    "write_digests",
    "sglang_cpu_engine",
    "keep_ucx_efa_module_out",
    "progress_allowed",
    "loader_replay_allowed",
    "fused_fp8_allowed",
    "copy_kernel_allowed",
    "digest_kernel_allowed",
    "quiet_nixl_info",
    "miles_transport",
    "miles_hostname",
    "log_level",
    "third_party_logs",
    "quiet_mooncake_logs",
    "mooncake_force_tcp",
]


def nixl_backend() -> str:
    return os.environ.get("SGLANG_REMOTE_INSTANCE_NIXL_BACKEND", "UCX")


def miles_transport() -> str | None:
    """``P2PWEIGHTS_MILES_TRANSPORT`` as given (lower case), or None when unset."""
    value = os.environ.get("P2PWEIGHTS_MILES_TRANSPORT", "").strip().lower()
    return value or None


def miles_hostname() -> str | None:
    return os.environ.get("P2PWEIGHTS_MILES_HOSTNAME") or None


def write_digests(default: bool) -> bool:
    """Whether this engine's ranks digest their weights before each end (see the table)."""
    value = os.environ.get("P2PWEIGHTS_WRITE_DIGESTS")
    return default if value in (None, "") else value == "1"


def delta_scratch() -> str | None:
    return os.environ.get("P2PWEIGHTS_DELTA_SCRATCH")


def sglang_cpu_engine() -> bool:
    return os.environ.get("SGLANG_USE_CPU_ENGINE") == "1"


def progress_allowed() -> bool:
    return _flag("P2PWEIGHTS_PROGRESS")


def loader_replay_allowed() -> bool:
    return _flag("P2PWEIGHTS_LOADER_REPLAY")


def fused_fp8_allowed() -> bool:
    return _flag("P2PWEIGHTS_FUSED_FP8")


def copy_kernel_allowed() -> bool:
    return _flag("P2PWEIGHTS_COPY_KERNEL")


def digest_kernel_allowed() -> bool:
    return _flag("P2PWEIGHTS_DIGEST_KERNEL")


def _flag(name: str) -> bool:
    """An on/off variable that is on unless set to 0, false or no."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no")


def quiet_nixl_info() -> None:
    """``NIXL_LOG_LEVEL=WARN`` unless set (see the table above)."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


def keep_ucx_efa_module_out() -> None:
    """``UCX_MODULES=^efa`` unless set or the host has EFA devices (see the table above)."""
    if "UCX_MODULES" in os.environ:
        return
    drivers = glob.glob("/sys/class/infiniband/*/device/driver")
    if any(os.path.basename(os.path.realpath(d)) == "efa" for d in drivers):
        return
    os.environ["UCX_MODULES"] = "^efa"
    logger.info(
        "p2pweights set UCX_MODULES=^efa for this process (no EFA device here; UCX's EFA "
        "module crashes at exit beside the NIXL wheel's libraries); set UCX_MODULES "
        "yourself, even to an empty string, to keep p2pweights from setting it"
    )


def log_level() -> str | None:
    """``P2PWEIGHTS_LOG`` in upper case (``"INFO"``), or None when unset."""
    value = os.environ.get("P2PWEIGHTS_LOG", "").strip().upper()
    return value or None


def third_party_logs() -> bool:
    """Whether ``P2PWEIGHTS_THIRD_PARTY_LOGS`` asks for every third-party line (see the table)."""
    return os.environ.get("P2PWEIGHTS_THIRD_PARTY_LOGS", "0").strip().lower() in (
        "1",
        "true",
        "yes",
    )


def quiet_mooncake_logs() -> None:
    """``MC_LOG_LEVEL=ERROR`` unless set or third-party logs are on (see the table above)."""
    if not third_party_logs():
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")


def mooncake_force_tcp() -> bool:
    return os.environ.get("MC_FORCE_TCP", "") not in ("", "0")
