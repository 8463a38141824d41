"""``LocalEngine``: start a local engine in its own process, wait until it serves, stop it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

import httpx

from p2pweights.errors import EngineError
from p2pweights.polling import poll_until

_GIVEN_PORTS: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now and not handed out before by this process.

    The kernel may hand the same ephemeral port to two binds in a row once the first
    socket is closed, and engines started together bind theirs only later.

    Args:
        host: The address the port is free on.

    Returns:
        The port number.
    """
    while True:
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port not in _GIVEN_PORTS:
            _GIVEN_PORTS.add(port)
            return port


class LocalEngine:
    """A local rollout engine process speaking sglang's weight-update API.

    ``with LocalEngine("models/qwen3-tiny.json", tp=2, seed=0) as engine: engine.url``.
    ``start()`` and ``wait_ready()`` let several engines start concurrently. It runs
    ``p2pweights engine`` (sglang's own model classes and loaders) in a process of its own
    session, and stands in for a sglang server in tests and demos.

    Args:
        model: An HF ``config.json`` or a folder holding one.
        tp: Tensor-parallel ranks to serve.
        transport: ``"mooncake"``, ``"nixl"`` or ``"cuda_ipc"``: what the engine publishes
            its weights for.
        seed: Start from deterministic random HF weights of this seed
            (``p2pweights.testing.synthetic_weights``; ``None``: the engine's default
            seed). Ignored with ``weights``.
        weights: A folder of ``*.safetensors`` with HF checkpoint names to start from.
        dtype: The weights' dtype.
        host: The address the engine's HTTP server binds.
        port: Its port (default: a free one).
        startup_timeout_s: How long ``wait_ready`` waits for ``/health``.
        env: Environment variables added to this process's for the engine.
        server_args: sglang server args the engine's replicas are built with (e.g.
            ``{"quantization": "fp8"}``).
        log_path: Where the engine logs (default: a new temporary file).
        stream_log: Log to this process's stderr instead of a file.
        device: Where the engine's weights live (``"cpu"``, ``"cuda:N"``).
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        tp: int = 1,
        transport: str = "mooncake",
        seed: int | None = 0,
        weights: str | os.PathLike[str] | None = None,
        dtype: str = "bfloat16",
        host: str = "127.0.0.1",
        port: int | None = None,
        startup_timeout_s: float = 300.0,
        env: dict[str, str] | None = None,
        server_args: dict[str, object] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        stream_log: bool = False,
        device: str = "cpu",
    ):
        self.model = str(model)
        self.tp = tp
        self.transport = transport
        self.seed = seed
        self.weights = None if weights is None else str(weights)
        self.dtype = dtype
        self.device = device
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.startup_timeout_s = startup_timeout_s
        self._env = env
        self.server_args = dict(server_args or {})
        self._process: subprocess.Popen[bytes] | None = None
        # The engine's stdout and stderr: a file (``log_path``, else a new temporary one),
        # or this process's stderr with ``stream_log``.
        self.stream_log = stream_log
        self._log: IO[bytes] | None = None
        if not stream_log:
            if log_path is None:
                self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115 (lives with the engine)
                    prefix="p2pweights-engine-", suffix=".log", delete=False
                )
            else:
                self._log = open(log_path, "ab")  # noqa: SIM115 (lives with the engine)

    @property
    def url(self) -> str:
        """The engine's base URL, for ``WeightSyncSession.connect``."""
        return f"http://{self.host}:{self.port}"

    @property
    def log_path(self) -> Path | None:
        """The file the engine logs to (``None`` with ``stream_log``)."""
        return None if self._log is None else Path(self._log.name)

    @property
    def pid(self) -> int | None:
        """The engine process's id while it runs (``None`` before ``start()``)."""
        return None if self._process is None else self._process.pid

    def command(self) -> list[str]:
        """The ``p2pweights engine`` command line ``start`` runs."""
        cmd = [
            sys.executable,
            "-m",
            "p2pweights.cli",
            "engine",
            "--model",
            self.model,
            "--tp",
            str(self.tp),
            "--port",
            str(self.port),
            "--host",
            self.host,
            "--transport",
            self.transport,
            "--dtype",
            self.dtype,
            "--device",
            self.device,
        ]
        if self.server_args:
            cmd += ["--server-args", json.dumps(self.server_args)]
        if self.weights is not None:
            cmd += ["--weights", self.weights]
        elif self.seed is not None:
            cmd += ["--seed", str(self.seed)]
        return cmd

    def start(self) -> LocalEngine:
        """Start the engine process, without waiting for it (``wait_ready``)."""
        env = {**os.environ, **(self._env or {})}
        self._process = subprocess.Popen(
            self.command(),
            stdout=self._log if self._log is not None else sys.stderr,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        return self

    def wait_ready(self) -> LocalEngine:
        """Wait until the engine answers ``/health``.

        Returns:
            This engine.

        Raises:
            EngineError: ``start`` was not called, the process exited while starting (the
                message ends with its log), or it was not ready within
                ``startup_timeout_s`` (then it is stopped).
        """
        if self._process is None:
            raise EngineError(f"local engine {self.url}: call start() before wait_ready()")
        process = self._process

        def ready() -> bool:
            if process.poll() is not None:
                raise EngineError(
                    f"local engine {self.url} exited with {process.returncode} while "
                    f"starting; its log ({self.log_path}) ends with:\n{self.log_tail()}"
                )
            try:
                return httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200
            except httpx.HTTPError:
                return False

        if poll_until(ready, time.monotonic() + self.startup_timeout_s, sleep_s=0.25):
            return self
        self.stop()
        raise EngineError(
            f"local engine {self.url} not ready after {self.startup_timeout_s} s; "
            f"log tail:\n{self.log_tail()}"
        )

    def log_tail(self, num_chars: int = 3000) -> str:
        """The last ``num_chars`` characters of the engine's log file."""
        if self.log_path is None:
            return "(the engine logged to this process's stderr)"
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def stop(self) -> None:
        """Terminate the engine process (killed after 15 s); its log file stays."""
        process, self._process = self._process, None
        if self._log is not None:
            self._log.close()  # the file stays for log_tail() and post-mortems
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)

    def __enter__(self) -> LocalEngine:
        self.start()
        try:
            return self.wait_ready()
        except BaseException:  # e.g. Ctrl-C while it starts: never leave the process behind
            self.stop()
            raise

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
