"""A small synchronous client for the sglang HTTP routes a weight update uses.

Every failure raises ``EngineError`` naming the engine URL and the route, with
the engine's own message when it sent one; ``EngineUnreachable`` when no answer
came (the call may or may not have taken effect).

Two time bounds: ``timeout_s`` for reading what an engine serves (server info,
publications, the weight checker, which hashes every weight) and ``control_timeout_s``
for each update-session call that does no work on the weights (pause, flush, begin,
version, continue), so a hung engine outside the writes costs at most that long.
``end_weight_update`` re-processes the model and has its own bound,
``end_update_timeout_s`` (default: ``timeout_s``). ``SyncConfig.timeouts`` sets the three
(``read``, ``control``, ``end_update``), and a timeout's error names the setting so.

Every request is recorded in ``calls`` (route, time, whether it opened a TCP
connection: httpx keeps connections alive and reuses them; the trace extension says
when it had to open one).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
from pydantic import SecretStr

from p2pweights.engines.calls import CallLog, ControlCall
from p2pweights.engines.concurrency import at_once
from p2pweights.errors import EngineError, EngineUnreachable
from p2pweights.polling import poll_until
from p2pweights.wire.publication import (
    DIGESTS_ROLE,
    END_RECORDS_KEY,
    RankPublication,
    digest_record,
    end_records,
    is_digest_answer,
    parse_publication,
)

logger = logging.getLogger(__name__)

_FLUSH_RETRY_S = 0.2


class EngineClient:
    """Talks to one sglang engine (one HTTP server, any number of ranks)."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 60.0,
        api_key: str | SecretStr | None = None,
        control_timeout_s: float | None = None,
        end_update_timeout_s: float | None = None,
        transport: httpx.BaseTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """``transport``: httpx's, for tests that replay recorded answers (default: HTTP);
        ``clock``: monotonic seconds for ``calls`` (injectable for tests)."""
        self.url = url.rstrip("/")
        # Every request this client sent (``Fleet`` clears it when an update opens).
        self.calls = CallLog()
        self._clock = clock
        if isinstance(api_key, SecretStr):
            api_key = api_key.get_secret_value()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout_s = timeout_s
        self._control_timeout_s = timeout_s if control_timeout_s is None else control_timeout_s
        self._end_update_timeout_s = (
            timeout_s if end_update_timeout_s is None else end_update_timeout_s
        )
        self._http = httpx.Client(
            base_url=self.url, timeout=timeout_s, headers=headers, transport=transport
        )

    def close(self) -> None:
        self._http.close()

    # -- information ---------------------------------------------------------------------------

    def server_info(self) -> dict[str, Any]:
        return self._json("GET", "/server_info")

    def check_reachable(self, connections: int = 1) -> None:
        """Raise unless the engine answers within ``control_timeout_s``. Asks ``/model_info``,
        which the HTTP server answers itself: sglang's ``/health`` may run a generation,
        which a paused engine never finishes.

        ``connections`` > 1 asks that many times at once, each holding its answer (and so
        its connection) until every ask has one: that many distinct kept-alive
        connections are then ready for calls made at once right after."""
        if connections <= 1:
            self._json("GET", "/model_info", control=True)
            return
        together = threading.Barrier(connections)

        def ask() -> None:
            try:
                response = self._send("GET", "/model_info", control=True, stream=True)
            except BaseException:
                together.abort()  # the others go on; this one raises
                raise
            try:
                if response.status_code != 200:
                    together.abort()
                    response.read()
                    raise self._error("/model_info", response)
                # broken: another ask failed (it raises) or came late; this one passed
                with contextlib.suppress(threading.BrokenBarrierError):
                    together.wait(self._control_timeout_s)
                response.read()  # read to its end, the connection is kept alive, not closed
            finally:
                response.close()

        at_once(*[ask] * connections)

    def model_info(self) -> dict[str, Any]:
        return self._json("GET", "/model_info")

    def weight_version(self) -> str:
        """The engine's weight version ("" if it reports none)."""
        version = self.model_info().get("weight_version")
        return "" if version is None else str(version)

    def engine_state(self) -> dict[str, bool] | None:
        """``{"paused", "update_open"}`` where the engine reports them (the p2pweights
        local engine does; released sglang does not), else None."""
        state = self._json("GET", "/server_info", control=True).get("p2pweights_engine_state")
        if not isinstance(state, dict):
            return None
        return {"paused": bool(state.get("paused")), "update_open": bool(state.get("update_open"))}

    def publication(self, rank: int, role: str = "target") -> RankPublication:
        """What engine rank ``rank`` published about its weights (addresses, transport handle).

        ``role="draft"``: the rank's speculative draft runner, asked for as
        ``?rank=R&role=draft``. The answer must say ``"role": "draft"``: sglang 0.5.23
        keys publications by TP rank only, so there a draft's table replaces the
        target's and cannot be asked for.
        """
        params: dict[str, Any] = (
            {"rank": rank} if role == "target" else {"rank": rank, "role": role}
        )
        body = self._json("GET", "/remote_instance_transfer_engine_info", params=params)
        if body.get("role", "target") != role:
            raise EngineError(
                f"engine {self.url} rank {rank} runs a speculative {role} but does not publish "
                f"its {role} runner's weights apart from the target's (sglang 0.5.23 keys "
                f"publications by TP rank only, so the {role}'s replaces the target's); "
                f"p2pweights cannot write this engine's {role}"
            )
        return dataclasses.replace(parse_publication(self.url, rank, body), role=role)

    def write_digests(
        self, rank: int, runner: str = "target", bootstrap_port: int | None = None
    ) -> dict[str, Any]:
        """The record engine rank ``rank``'s ``runner`` took before its last
        ``end_weight_update`` (``p2pweights.engine_side.steps``: ``update``, ``digests``, ...),
        as the engine sent it: ``verification.records`` reads what it holds.

        Asked as ``?rank=R&role=p2pweights-digests`` (and ``&runner=draft`` for a draft).
        sglang's own route forwards only the rank, so its answer is then the rank's
        publication: with ``bootstrap_port`` the record is read from the engine's info
        bootstrap server (where the p2pweights plugin PUTs it) on the engine's host.
        """
        params: dict[str, Any] = {"rank": rank, "role": DIGESTS_ROLE}
        if runner != "target":
            params["runner"] = runner
        body = self._json("GET", "/remote_instance_transfer_engine_info", params=params)
        if not is_digest_answer(body) and bootstrap_port is not None:
            host = httpx.URL(self.url).host
            host = f"[{host}]" if ":" in host else host
            url = f"http://{host}:{bootstrap_port}/get_transfer_engine_info"
            # plain HTTP, and it checks no key: the engine's API key never goes there
            body = self._json("GET", url, params=params, without_key=True)
        record = digest_record(body)
        if record is None:
            raise EngineError(
                f"engine {self.url} rank {rank}: serves no write digests (it answered no "
                f"{DIGESTS_ROLE!r} record); run the engine with the p2pweights plugin, or "
                f"SyncConfig(verify_writes='auto') to skip engines that do not serve them"
            )
        return record

    # -- the update session --------------------------------------------------------------------

    def pause_generation(self, mode: str) -> None:
        self._json("POST", "/pause_generation", json={"mode": mode}, control=True)

    def flush_cache(self) -> None:
        """Flush the radix cache; sglang refuses while requests run, so retry until timeout."""
        deadline = time.monotonic() + self._control_timeout_s
        last: list[httpx.Response] = []  # the latest answer

        def flushed() -> bool:
            last[:] = [self._send("GET", "/flush_cache", control=True)]
            return last[0].status_code == 200

        if not poll_until(flushed, deadline, sleep_s=_FLUSH_RETRY_S):
            raise self._error("/flush_cache", last[0])

    def begin_weight_update(self, selector: str = "all") -> None:
        self._checked("/begin_weight_update", {"selector": selector}, control=True)

    def end_weight_update(self) -> dict[tuple[int, str], dict[str, Any]]:
        """End the update session; the write-digest records the answer carried, by (engine
        rank, runner): the local engine answers with every rank's record taken before
        this end (``END_RECORDS_KEY``), so the trainer need not read them one call a rank;
        sglang's own answer carries none, and malformed ones are dropped with a warning
        (empty: the records are then read from each rank)."""
        # its own bound, not the control one: the engine re-processes the whole model
        # here (derived weights, kernel layouts), seconds for a large fp8 MoE
        body = self._checked("/end_weight_update", {}, end=True)
        try:
            return end_records(body.get(END_RECORDS_KEY))
        except ValueError as exc:  # the session did end: read the records one by one instead
            logger.warning(
                "engine %s: the records in its end_weight_update answer are malformed (%s); "
                "they are read from each rank instead",
                self.url,
                exc,
            )
            return {}

    def update_weight_version(self, new_version: str) -> None:
        self._checked(
            "/update_weight_version",
            {"new_version": new_version, "abort_all_requests": False},
            control=True,
        )

    def continue_generation(self) -> None:
        self._json("POST", "/continue_generation", json={"torch_empty_cache": False}, control=True)

    def weights_checker(self, action: str, **options: Any) -> dict[str, Any]:
        """Run the engine's weight checker (snapshot, reset_tensors, compare, checksum)."""
        return self._checked("/weights_checker", {"action": action, **options})

    # -- plumbing ------------------------------------------------------------------------------

    def _send(
        self,
        method: str,
        route: str,
        *,
        control: bool = False,
        end: bool = False,
        stream: bool = False,
        without_key: bool = False,
        **kwargs: Any,
    ) -> httpx.Response:
        """One request; ``stream``: return once the headers came, the body unread and the
        connection held until the caller closes the response; ``without_key``: without
        the API key (a server other than the engine's). Bounded by
        ``control_timeout_s`` (``control``), ``end_update_timeout_s`` (``end``) or
        ``timeout_s``."""
        if end:
            timeout, setting = self._end_update_timeout_s, "timeouts.end_update"
        elif control:
            timeout, setting = self._control_timeout_s, "timeouts.control"
        else:
            timeout, setting = self._timeout_s, "timeouts.read"
        opened: list[bool] = []

        def trace(event: str, info: dict[str, Any]) -> None:
            if event == "connection.connect_tcp.started":
                opened.append(True)

        started = self._clock()
        try:
            request = self._http.build_request(
                method, route, timeout=timeout, extensions={"trace": trace}, **kwargs
            )
            if without_key:
                request.headers.pop("Authorization", None)
            return self._http.send(request, stream=stream)
        except httpx.TimeoutException as exc:
            raise EngineUnreachable(
                f"engine {self.url}: {method} {route} got no answer within {timeout:g} s "
                f"({setting}); the engine may be hung or overloaded"
            ) from exc
        except httpx.HTTPError as exc:
            raise EngineUnreachable(f"engine {self.url}: {method} {route} failed: {exc!r}") from exc
        finally:
            ended = self._clock()
            self.calls.record(
                ControlCall(self.url, f"{method} {route}", started, ended, bool(opened))
            )

    def _json(
        self, method: str, route: str, *, control: bool = False, **kwargs: Any
    ) -> dict[str, Any]:
        response = self._send(method, route, control=control, **kwargs)
        if response.status_code != 200:
            raise self._error(route, response)
        try:
            body = response.json()
        except ValueError as exc:
            raise EngineError(
                f"engine {self.url}: {route} answered non-JSON: {response.text[:200]!r}"
            ) from exc
        if not isinstance(body, dict):
            raise EngineError(f"engine {self.url}: {route} answered {body!r}, expected an object")
        return body

    def _checked(
        self, route: str, payload: dict[str, Any], *, control: bool = False, end: bool = False
    ) -> dict[str, Any]:
        """POST ``payload``; the answer's ``success`` must be true."""
        body = self._json("POST", route, json=payload, control=control, end=end)
        if body.get("success") is False:
            raise EngineError(f"engine {self.url}: {route} failed: {body.get('message')}")
        return body

    def _error(self, route: str, response: httpx.Response) -> EngineError:
        message = response.text[:500]
        try:
            body = response.json()
            if isinstance(body, dict):
                error = body.get("error")
                message = (
                    error.get("message", message)
                    if isinstance(error, dict)
                    else body.get("message", message)
                )
        except ValueError:
            pass
        return EngineError(
            f"engine {self.url}: {route} answered HTTP {response.status_code}: {message}"
        )
