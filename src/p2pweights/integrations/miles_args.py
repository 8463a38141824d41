"""What p2pweights reads from miles' arguments and environment, and what it reports back
to miles' step log: shared by the updater before miles' ``WeightTransferProtocol``
(``integrations.miles``) and the protocol after it (``integrations.miles_protocol``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from p2pweights import environment
from p2pweights.config import (
    MooncakeConfig,
    NixlConfig,
    SyncConfig,
    Timeouts,
    TrainerTopology,
    TransportConfig,
)
from p2pweights.errors import ConfigError

if TYPE_CHECKING:
    from p2pweights.report import UpdateReport

__all__ = [
    "METRIC_PREFIX",
    "MIN_BUFFER_BYTES",
    "config_from_args",
    "missing_module",
    "transport_from_args",
    "update_metrics",
]

METRIC_PREFIX = "perf/update_weights_p2pweights"
MIN_BUFFER_BYTES = 2**20
"""SyncConfig's smallest staging buffer."""


def missing_module(exc: ModuleNotFoundError, module: str) -> bool:
    """Whether ``exc`` says ``module`` or a package above it does not exist (as opposed
    to ``module`` existing and failing on an import of its own)."""
    missing = exc.name or ""
    return module == missing or module.startswith(missing + ".")


def update_metrics(report: UpdateReport) -> dict[str, float]:
    """An update's report as miles step-log metrics: ``report.metrics()`` under
    ``perf/update_weights_p2pweights_`` (``..._seconds``, ``..._bytes``, ``..._gb_per_s``,
    ``..._paused_s_max``, each stage's ``..._<stage>_s``, ...; docs/metrics.md), as floats."""
    return {
        name: float(value) for name, value in report.metrics(prefix=f"{METRIC_PREFIX}_").items()
    }


def config_from_args(
    args: Any, config: SyncConfig | None, pipeline_stage: int, num_pipeline_stages: int
) -> SyncConfig:
    """The session's config: miles' flags (``--update-weight-buffer-size``,
    ``--p2p-transfer-timeout``, ``--pause-generation-mode``), then every field ``config``
    sets explicitly, then this rank's pipeline stage. The transport defaults to Mooncake
    over RDMA at this node's address (Ray's).

    ``--check-weight-update-equal`` stays miles' own: miles snapshots and resets the
    engines' weights before training and compares after the first update itself; the
    session's check (a snapshot when it opens the engines) would snapshot the reset ones.
    """
    fields: dict[str, Any] = {
        # miles' bucket size may be below the staging buffer's 1 MiB floor; the buckets
        # stay miles' own, the session stages them in buffers of at least 1 MiB
        "buffer_bytes": max(int(args.update_weight_buffer_size), MIN_BUFFER_BYTES),
        "pause_mode": args.pause_generation_mode,
    }
    if config is None or "transport" not in config.model_fields_set:
        fields["transport"] = transport_from_args(args)
    if config is not None:
        fields.update({name: getattr(config, name) for name in config.model_fields_set})
    # the flag's transfer bound, under the timeouts the config sets explicitly
    given = config.timeouts if config is not None else Timeouts()
    fields["timeouts"] = Timeouts(
        **{"transfer": args.p2p_transfer_timeout}
        | {name: getattr(given, name) for name in given.model_fields_set}
    )
    # this rank's stage; its place among the stage's ranks comes from from_torch_distributed
    for name in ("trainer_rank", "num_trainer_ranks", "pipeline_stage", "num_pipeline_stages"):
        fields.pop(name, None)
    stage = TrainerTopology(pipeline_stage=pipeline_stage, num_pipeline_stages=num_pipeline_stages)
    return SyncConfig(**fields).with_topology(stage)


def transport_from_args(args: Any) -> TransportConfig:
    """The transport from ``P2PWEIGHTS_MILES_TRANSPORT`` (``mooncake-rdma``, the default,
    ``mooncake-tcp`` or ``nixl``), else miles' ``--p2p-transport`` where miles has it.
    Mooncake listens at ``P2PWEIGHTS_MILES_HOSTNAME``, else at Ray's node address."""
    choice = environment.miles_transport()
    if choice is None:
        choice = "nixl" if getattr(args, "p2p_transport", None) == "nixl" else "mooncake-rdma"
    if choice == "nixl":
        return NixlConfig()
    if choice not in ("mooncake-rdma", "mooncake-tcp"):
        raise ConfigError(
            f"P2PWEIGHTS_MILES_TRANSPORT={choice!r} is not a transport p2pweights knows; "
            "use mooncake-rdma, mooncake-tcp or nixl"
        )
    hostname = environment.miles_hostname() or _node_address()
    protocol: Literal["rdma", "tcp"] = "tcp" if choice == "mooncake-tcp" else "rdma"
    return MooncakeConfig(protocol=protocol, local_hostname=hostname)


def _node_address() -> str:
    import ray.util

    return str(ray.util.get_node_ip_address())
