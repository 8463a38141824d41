"""One engine rank's NIXL publication: register the loaded weights, hand the info to sglang.

``publish_model`` does what sglang PR #35712 does per TP rank: one agent
``nixl_weight_tp{rank}_<uuid>``, the merged blocks holding ``model.named_parameters()``
registered (VRAM with the GPU id on a GPU engine, DRAM on a CPU one), and the agent
metadata taken after registration. ``put_publication`` PUTs it to the instance's
engine info bootstrap server, the way sglang's ``RemoteInstanceWeightTransporter``
PUTs Mooncake info. ``LivePublication`` keeps one rank's publication true for the
life of the engine: published afresh whenever a parameter's storage moved. Nothing
here imports sglang.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import httpx

from p2pweights import environment
from p2pweights.errors import ConfigError, EngineError
from p2pweights.polling import poll_until
from p2pweights.transports.base import Publisher
from p2pweights.transports.nixl import NixlPublisher
from p2pweights.wire.digest import SCHEME
from p2pweights.wire.publication import DIGESTS_ROLE

if TYPE_CHECKING:
    import torch
    from torch import nn

logger = logging.getLogger(__name__)


def publish_model(
    model: nn.Module,
    engine_rank: int,
    backend: str,
    extra: dict[str, torch.Tensor] | None = None,
) -> tuple[NixlPublisher, dict[str, Any]]:
    """Register ``model``'s parameters (and ``extra`` regions, such as the delta scratch
    region) with a new NIXL agent; return it and its publication.

    The publisher must stay alive (and unclosed) as long as writers may write: it
    owns the agent and the registrations.
    """
    params = {name: p.data for name, p in model.named_parameters()}
    if not params:
        raise ConfigError(f"tp rank {engine_rank}: the model has no parameters to publish")
    params.update(extra or {})
    publisher = NixlPublisher(backend=backend, engine_rank=engine_rank)
    try:
        publisher.register(params)
        info = publisher.publication(params)
    except ConfigError as exc:
        publisher.close()
        raise ConfigError(
            f"tp rank {engine_rank}: cannot publish the weights over NIXL ({exc}); all "
            f"parameters must live on one device (CPU offload is not supported)"
        ) from exc
    except BaseException:
        publisher.close()
        raise
    return publisher, info


Storage = dict[str, tuple[int, int]]
"""Parameter name -> (address, bytes) of its storage."""


def storage_of(model: nn.Module) -> Storage:
    return {name: (p.data_ptr(), p.nbytes) for name, p in model.named_parameters()}


class LivePublication:
    """One engine rank's NIXL publication, published afresh when parameters move.

    Every publication says ``"live": true`` and its ``"epoch"`` (0 at start-up), so
    writers know to re-read it once an update session is open. ``refresh`` compares
    each parameter's storage with the published one; when any moved (or changed
    size), it registers the model again under a new agent, PUTs that with the next
    epoch and the moved names, and only then closes the old agent: the freed memory is
    deregistered, so a writer still holding the old publication is refused instead of
    writing into it.

    A subclass publishes for another transport by overriding ``_register`` and
    ``_published_over`` (``ipc_publish.IpcLivePublication``: CUDA IPC).
    """

    plugin = "p2pweights_nixl"
    """The plugin this publication is made by, as its log lines name it."""

    def __init__(self, engine_rank: int, backend: str, bootstrap_url: str) -> None:
        self.engine_rank = engine_rank
        self.backend = backend
        self.bootstrap_url = bootstrap_url
        self.epoch = -1
        self._publisher: Publisher | None = None
        self._storage: Storage = {}
        # The delta scratch region (``p2pweights.engine_side.delta_scratch``), published with the
        # weights under its reserved name; allocated once, kept across publications.
        self.scratch: torch.Tensor | None = None
        # The flags senders set as each parameter's writes land (``wire.landed``),
        # published under ``LANDED_NAME``; allocated once, kept across publications.
        self.landed: torch.Tensor | None = None

    def _new_flags(self, model: nn.Module) -> torch.Tensor | None:
        """The zeroed flags region (``wire.landed``) on the weights' device; None where it
        cannot be made (senders then flag nothing and the rank digests at its end)."""
        import torch

        from p2pweights.wire.landed import flag_bytes, flag_names

        params = dict(model.named_parameters())
        if not params:
            return None
        device = next(iter(params.values())).device
        try:
            num_bytes = flag_bytes(len(flag_names(params)))
            return torch.zeros(num_bytes, dtype=torch.uint8, device=device)
        except (RuntimeError, TypeError) as exc:
            logger.warning(
                "%s: tp rank %d: no landed flags region (%s); its weights are digested at "
                "each end only",
                self.plugin,
                self.engine_rank,
                exc,
            )
            return None

    def publish(self, model: nn.Module, moved: list[str] | None = None) -> None:
        import torch

        from p2pweights.engine_side.delta_scratch import SCRATCH_NAME, new_scratch
        from p2pweights.wire.landed import LANDED_NAME

        if self.scratch is None and self.epoch < 0:  # once, at the first publication
            params = {name: p.data for name, p in model.named_parameters()}
            device = next(iter(params.values())).device if params else None
            try:
                self.scratch = (
                    None if device is None else new_scratch(params, device, by_default=False)
                )
            except torch.OutOfMemoryError:  # the engine serves; deltas are written in full
                logger.warning(
                    "%s: tp rank %d: no memory for the delta scratch region; "
                    "delta updates of this rank are written in full (set "
                    "P2PWEIGHTS_DELTA_SCRATCH smaller, or 0)",
                    self.plugin,
                    self.engine_rank,
                )
        if self.epoch < 0:  # once, at the first publication
            self.landed = self._new_flags(model)
        extra = {} if self.landed is None else {LANDED_NAME: self.landed}
        if self.scratch is not None:
            extra[SCRATCH_NAME] = self.scratch
        publisher, info = self._register(model, extra)
        info.update(
            live=True,
            epoch=self.epoch + 1,
            write_digests=environment.write_digests(default=True),
            digest_scheme=SCHEME,
        )
        if moved is not None:
            info["moved"] = moved
        try:
            if moved is None:  # at start-up: the head node's server may come up later
                put_publication(self.bootstrap_url, self.engine_rank, info)
            else:  # inside sglang's update hooks: one short attempt
                put_publication(
                    self.bootstrap_url, self.engine_rank, info, HOOK_PUT_TIMEOUT_S, retry=False
                )
        except BaseException:
            publisher.close()
            raise
        old, self._publisher = self._publisher, publisher
        self._storage, self.epoch = storage_of(model), self.epoch + 1
        if old is not None:
            try:
                old.close()
            except Exception:  # the new publication stands; the old agent's memory may stay
                logger.exception(
                    "%s: tp rank %d: closing the previous publisher failed",
                    self.plugin,
                    self.engine_rank,
                )
        logger.info(
            "%s: tp rank %d published %d parameters %s (epoch %d)",
            self.plugin,
            self.engine_rank,
            len(info["weights_info_dict"]),
            self._published_over(info),
            self.epoch,
        )

    def _register(
        self, model: nn.Module, extra: dict[str, torch.Tensor]
    ) -> tuple[Publisher, dict[str, Any]]:
        """A new publisher holding ``model``'s parameters and ``extra``, and its publication
        (closed by the caller if the publication cannot be put)."""
        return publish_model(model, self.engine_rank, self.backend, extra)

    def _published_over(self, info: dict[str, Any]) -> str:
        """How ``info`` reaches the weights, for the log line."""
        return f"({info['mem_type']}) through NIXL agent {info['agent_name']} ({self.backend})"

    def refresh(self, model: nn.Module, after: str) -> list[str]:
        """Publish afresh if any parameter moved since the last publication; the moved names."""
        now = storage_of(model)
        moved = sorted(
            n for n in now.keys() | self._storage.keys() if now.get(n) != self._storage.get(n)
        )
        if not moved:
            return []
        logger.warning(
            "%s: tp rank %d: %s replaced the storage of %d parameter(s) (%s); "
            "publishing the new addresses",
            self.plugin,
            self.engine_rank,
            after,
            len(moved),
            ", ".join(moved[:4]) + (" ..." if len(moved) > 4 else ""),
        )
        try:
            self.publish(model, moved)
        except Exception:
            # The old addresses are freed memory: no write may reach them, even if the new
            # ones could not be published (writers are then refused and fail the update).
            # Not raised: an exception here would take the engine's scheduler down.
            self.close()
            logger.exception(
                "%s: tp rank %d could not publish afresh; p2pweights updates "
                "of this engine will fail until it restarts",
                self.plugin,
                self.engine_rank,
            )
        return moved

    def put_record(self, record: dict[str, Any]) -> None:
        """PUT this rank's write-digest record (``engine_side.steps``) to the bootstrap server.

        Not raised: an exception here would take the engine's scheduler down; a writer
        that finds no record for its update fails that update instead."""
        try:
            put_publication(
                self.bootstrap_url,
                self.engine_rank,
                record,
                HOOK_PUT_TIMEOUT_S,
                role=DIGESTS_ROLE,
                retry=False,
            )
        except Exception:
            logger.exception(
                "p2pweights_nixl: tp rank %d could not PUT its write-digest record",
                self.engine_rank,
            )

    def close(self) -> None:
        if self._publisher is not None:
            self._publisher.close()
            self._publisher = None


HOOK_PUT_TIMEOUT_S = 2.0
"""Bound on a PUT made inside sglang's update hooks (``begin_weight_update``'s AFTER,
``end_weight_update``'s BEFORE and AFTER, on every TP rank, inside the trainer's pause):
one attempt, never retried, so a bootstrap server that does not answer stalls sglang's
scheduler for at most this long. The failure is logged; the trainer then finds no
record (or a refused publication) for its update and fails it."""

_PLUGINS = {"nixl": ("NIXL", "p2pweights_nixl"), "cuda_ipc": ("CUDA IPC", "p2pweights_cuda_ipc")}
"""Published backend -> (its name in messages, the plugin that publishes it)."""


def put_publication(
    bootstrap_url: str,
    engine_rank: int,
    info: dict[str, Any],
    timeout_s: float = 60.0,
    role: str | None = None,
    retry: bool = True,
) -> None:
    """PUT one rank's info to the bootstrap server, retrying until it answers.

    The server starts before the ranks on the head node, but ranks on other nodes
    may finish loading first; so connection failures are retried for ``timeout_s``.
    A refusal (4xx / 5xx) is not retried. ``retry=False``: one attempt bounded by
    ``timeout_s`` (inside sglang's update hooks, which must not stall its scheduler).
    """
    url = f"{bootstrap_url}/register_transfer_engine_info"
    payload: dict[str, Any] = {"tp_rank": engine_rank, "transfer_engine_info": info}
    if role is not None:  # a record kept apart from the publication (bootstrap.DIGESTS_ROLE)
        payload["role"] = role
    failed: list[httpx.TransportError] = []  # the latest connection failure

    def answered() -> bool:
        try:
            response = httpx.put(url, json=payload, timeout=min(10.0, timeout_s))
        except httpx.TransportError as exc:
            failed[:] = [exc]
            return False
        if response.status_code != 200:
            label, plugin = _PLUGINS.get(str(info.get("backend")), _PLUGINS["nixl"])
            raise EngineError(
                f"tp rank {engine_rank}: the engine info bootstrap server at {bootstrap_url} "
                f"refused the {label} publication ({response.status_code}: "
                f"{response.text[:300]}); is SGLANG_PLUGINS={plugin} set for the launching "
                f"process too?"
            )
        return True

    if not retry:
        if answered():
            return
        raise EngineError(
            f"tp rank {engine_rank}: the engine info bootstrap server at {bootstrap_url} "
            f"did not answer within {timeout_s:g} s ({failed[0]!r}); not retried inside "
            f"sglang's update hooks"
        ) from failed[0]
    if not poll_until(answered, time.monotonic() + timeout_s, sleep_s=0.5):
        raise EngineError(
            f"tp rank {engine_rank}: the engine info bootstrap server at {bootstrap_url} "
            f"did not answer within {timeout_s:g} s ({failed[0]!r}); check "
            f"--engine-info-bootstrap-port and that the head node's launcher runs the "
            f"p2pweights_nixl plugin too"
        ) from failed[0]
