"""sglang's engine info bootstrap server, able to hold NIXL publications too.

Released sglang (0.5.21 - 0.5.23) collects each TP rank's transfer-engine info in
``EngineInfoBootstrapServer`` (``entrypoints/engine_info_bootstrap_server.py``): ranks
PUT ``{"tp_rank", "transfer_engine_info": {"session_id", "weights_info_dict"}}`` and
the HTTP server's ``/remote_instance_transfer_engine_info?rank=R`` route proxies
``GET /get_transfer_engine_info?rank=R`` and returns its JSON as is. That server
stores a ``(session_id, weights_info_dict)`` pair and answers it as a list, so it
cannot hold the dict sglang PR #35712 publishes for NIXL.

``NixlAwareBootstrapServer`` is a drop-in replacement (same constructor, attributes,
routes and ``close``): a Mooncake PUT is stored and answered exactly as before; a
PUT whose info says ``"backend": "nixl"`` is stored as the dict and answered as
``{"rank": R, "remote_instance_transfer_engine_info": {"backend": "nixl", ...}}``;
so is one saying ``"backend": "cuda_ipc"`` (the plugin's CUDA IPC publication,
``ipc_publish``), and one of either that says only why the rank could not publish
(``"error"``).

It also keeps each rank's write-digest record (``p2pweights.engine_side.steps``): a PUT with
``"role": "p2pweights-digests"`` is stored apart from the rank's publication and
answered at ``GET /get_transfer_engine_info?rank=R&role=p2pweights-digests`` as
``{"rank": R, "role": "p2pweights-digests", "remote_instance_transfer_engine_info":
record}`` (sglang's HTTP route forwards only the rank, so writers read it here).
This module imports no sglang; the plugin installs the class in sglang's place.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import uvicorn
from fastapi import Body, FastAPI, HTTPException
from fastapi.responses import PlainTextResponse

from p2pweights.polling import poll_until
from p2pweights.wire.publication import DIGESTS_ROLE, digest_answer

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 10.0


def _entry(info: dict[str, Any]) -> tuple[Any, Any] | dict[str, Any]:
    """What to store for one rank's PUT body ``transfer_engine_info``."""
    backend = info.get("backend", "mooncake")
    if backend == "mooncake":
        # sglang's own form, answered as [session_id, weights_info_dict] like before.
        return (info["session_id"], info["weights_info_dict"])
    if backend in _REQUIRED:
        if not isinstance(info.get("error"), str):  # a rank that could not publish says why
            for key in _REQUIRED[backend]:
                if key not in info:
                    raise KeyError(key)
        return dict(info)
    raise ValueError(f"unknown backend {backend!r}")


_REQUIRED = {
    "nixl": ("agent_name", "agent_metadata", "weights_info_dict"),
    "cuda_ipc": ("agent_name", "host_id", "segments", "weights_info_dict"),
}
"""The fields a publication of each dict-form backend must have (``wire.publication``)."""


class NixlAwareBootstrapServer:
    """Per-rank transfer info over HTTP, for Mooncake (sglang's form), NIXL (PR #35712's)
    and CUDA IPC (the plugin's)."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        # {tp_rank: (session_id, weights_info_dict)} for Mooncake, {tp_rank: info} for NIXL
        self.transfer_engine_info: dict[int, tuple[Any, Any] | dict[str, Any]] = {}
        # {tp_rank: its last write-digest record}
        self.digest_records: dict[int, dict[str, Any]] = {}
        self.lock = threading.Lock()
        self._server = uvicorn.Server(
            uvicorn.Config(self._app(), host=host, port=port, log_level="warning")
        )
        self._thread = threading.Thread(
            target=self._server.run, name="p2pweights-engine-info-bootstrap", daemon=True
        )
        self._thread.start()
        self._wait_started()
        logger.info("engine info bootstrap server (Mooncake and NIXL) serves on %s:%d", host, port)

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        def health() -> PlainTextResponse:
            return PlainTextResponse("OK")

        @app.put("/register_transfer_engine_info")
        def register_transfer_engine_info(data: dict[str, Any] = Body(...)) -> PlainTextResponse:
            try:
                tp_rank = int(data["tp_rank"])
                if data.get("role") == DIGESTS_ROLE:
                    record = dict(data["transfer_engine_info"])
                    with self.lock:
                        self.digest_records[tp_rank] = record
                    return PlainTextResponse("OK")
                entry = _entry(data["transfer_engine_info"])
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                logger.error("refused a transfer engine info registration: %r", exc)
                raise HTTPException(status_code=400, detail=repr(exc)) from exc
            with self.lock:
                self.transfer_engine_info[tp_rank] = entry
            backend = entry.get("backend") if isinstance(entry, dict) else "mooncake"
            logger.info("registered %s transfer info for tp_rank=%d", backend, tp_rank)
            return PlainTextResponse("OK")

        @app.get("/get_transfer_engine_info")
        def get_transfer_engine_info(rank: int, role: str = "target") -> dict[str, Any]:
            if rank < 0:
                raise HTTPException(status_code=400, detail="Invalid rank parameter")
            if role == DIGESTS_ROLE:
                with self.lock:
                    record = self.digest_records.get(rank)
                if record is None:
                    raise HTTPException(status_code=404, detail=f"No digest record for rank {rank}")
                return digest_answer(rank, record)
            info = self.get_transfer_engine_info(rank)
            if info is None:
                raise HTTPException(
                    status_code=404, detail=f"No transfer engine info for rank {rank}"
                )
            answer = list(info) if isinstance(info, tuple) else info
            return {"rank": rank, "remote_instance_transfer_engine_info": answer}

        return app

    def _wait_started(self) -> None:
        poll_until(
            lambda: self._server.started or not self._thread.is_alive(),
            time.monotonic() + _STARTUP_TIMEOUT_S,
            sleep_s=0.01,
        )
        if not self._server.started:
            self.close()
            raise RuntimeError(
                f"the engine info bootstrap server could not serve on {self.host}:{self.port} "
                f"(port in use?). When running several instances on one node, give each its "
                f"own --engine-info-bootstrap-port."
            )

    @property
    def url(self) -> str:
        """Where this process reaches the server (loopback when it binds every interface)."""
        host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    def get_transfer_engine_info(self, rank: int) -> tuple[Any, Any] | dict[str, Any] | None:
        """Direct in-process access, as sglang's server offers."""
        with self.lock:
            return self.transfer_engine_info.get(rank)

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)
