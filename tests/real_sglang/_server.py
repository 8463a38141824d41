"""A real ``python -m sglang.launch_server``, started and stopped by tests.

On the CPU (the default) the server runs sglang 0.5.23's CPU backend
(``SGLANG_USE_CPU_ENGINE=1``, the ``intel_amx`` attention backend) with sglang's CPU
kernel (``sgl_kernel``) from the folder ``scripts/real-sglang.sh build`` made. With
``P2PWEIGHTS_REAL_SGLANG_DEVICE=cuda`` it runs on the GPU with the kernel package
installed beside sglang (scripts/gpu_sglang/ carries both to a lent GPU machine), with
Triton attention and without CUDA graphs (``cuda_graphs=True``: decode graphs captured).
With ``nixl=True`` the p2pweights NIXL plugin publishes, with ``cuda_ipc=True`` its CUDA
IPC publication. docs/real-sglang.md explains each setting.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from p2pweights.local_engine.process import free_port

KERNEL_ENV = "P2PWEIGHTS_SGL_KERNEL_DIR"
"""The folder holding the built ``sgl_kernel`` package (``scripts/real-sglang.sh env``)."""


PLUGIN_SITE = Path(__file__).with_name("plugin_site")
"""Where the test-only ``p2pweights_moving_storage`` plugin and its entry point live."""


ENTRY_POINT_SITE = Path(__file__).with_name("cuda_ipc_entry")
"""A dist-info naming the ``p2pweights_cuda_ipc`` entry point, put on the servers' path
where the installed p2pweights metadata predates it (an editable install made before
the entry point was added; its code is this tree's, which has the plugin)."""


DEVICE_ENV = "P2PWEIGHTS_REAL_SGLANG_DEVICE"
"""``cpu`` (default) or ``cuda``: where the servers run."""


def on_gpu() -> bool:
    return os.environ.get(DEVICE_ENV, "cpu") == "cuda"


def cuda_graphs_by_default() -> bool:
    """Whether the GPU cases capture CUDA graphs (``P2PWEIGHTS_REAL_SGLANG_CUDA_GRAPH``, on
    by default; test_real_server_gpu.py)."""
    return on_gpu() and os.environ.get("P2PWEIGHTS_REAL_SGLANG_CUDA_GRAPH", "1") != "0"


def unavailable() -> str | None:
    """Why the suite cannot run here, or None where it can."""
    if on_gpu():
        import torch

        return None if torch.cuda.is_available() else f"{DEVICE_ENV}=cuda but no GPU is visible"
    if kernel_dir() is None:
        return (
            "sglang's CPU kernel is not built: run `bash scripts/real-sglang.sh test` "
            "(docs/real-sglang.md)"
        )
    return None


def kernel_dir() -> Path | None:
    """The built kernel's folder, or None where it is not built (the suite then skips)."""
    value = os.environ.get(KERNEL_ENV)
    if not value or not (Path(value) / "BUILT").is_file():
        return None
    return Path(value)


def kernel_env() -> dict[str, str]:
    """This process's environment plus what makes sglang's CPU backend with the kernel run
    (on the GPU: the environment, offline)."""
    if on_gpu():
        return {**os.environ, "SGLANG_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1"}
    folder = kernel_dir()
    assert folder is not None
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), env.get("PYTHONPATH")]))
    env.update(
        SGLANG_USE_CPU_ENGINE="1",
        SGLANG_HOST_IP="127.0.0.1",
        HF_HUB_OFFLINE="1",
        # torch's CUDA wheel ships libnccl, so sglang would set up PyNccl on the CPU
        # and fail ("Expected a cuda device"); a missing library turns it off.
        SGLANG_NCCL_SO_PATH="/nonexistent/libnccl.so",
    )
    return env


def reference_checksums(
    url: str, config: dict[str, Any], model_folder: Path, seeds: tuple[int, ...]
) -> dict[int, list[dict[str, str]]]:
    """Per seed, per rank: sglang's checksums of the reference of engine ``url``'s ranks,
    built by ``_reference.py`` in a process of its own on the servers' device."""
    from p2pweights.engines.client import EngineClient

    info = EngineClient(url).server_info()
    cases = [{"key": str(seed), "server_info": info, "seed": seed} for seed in seeds]
    job = {
        "config": config,
        "model_path": str(model_folder),
        "device": "cuda" if on_gpu() else "cpu",
        "cases": cases,
    }
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("_reference.py"))],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        env=kernel_env(),
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    return {int(seed): ranks for seed, ranks in answer.items()}


class RealServer:
    """One sglang server process (its own process group), its log in ``log_path``."""

    def __init__(
        self,
        model_dir: Path,
        tp: int,
        log_path: Path,
        *,
        nixl: bool = True,
        mooncake: bool = False,
        moving_storage: bool = False,
        digests: bool | None = None,
        cuda_ipc: bool = False,
        cuda_graphs: bool = False,
        model_args: tuple[str, ...] = (),
    ) -> None:
        """``nixl``: the p2pweights NIXL plugin publishes; ``mooncake``: sglang's own
        transfer-engine publication; ``moving_storage``: the test plugin in
        ``plugin_site/`` gives every parameter new storage after each postprocess;
        ``digests``: False starts it with ``P2PWEIGHTS_WRITE_DIGESTS=0`` (None: as this
        process's environment says);
        ``cuda_ipc``: the plugin publishes by CUDA IPC handle (``p2pweights_cuda_ipc``);
        ``cuda_graphs``: on the GPU, decode CUDA graphs are captured (at start-up, over
        the weights' addresses) instead of turned off; ``model_args``: more
        ``launch_server`` arguments (they come last, so they override the defaults)."""
        self.model_dir = model_dir
        self.tp = tp
        self.port = free_port()
        self.bootstrap_port = free_port()
        while self.bootstrap_port == self.port:  # two asks may get the same free port
            self.bootstrap_port = free_port()
        self.log_path = log_path
        self.nixl = nixl
        self.mooncake = mooncake
        self.moving_storage = moving_storage
        self.digests = digests
        self.cuda_ipc = cuda_ipc
        self.cuda_graphs = cuda_graphs
        self.model_args = model_args
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        args = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(self.model_dir),
            "--device",
            "cuda" if on_gpu() else "cpu",
            "--tp",
            str(self.tp),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--engine-info-bootstrap-port",
            str(self.bootstrap_port),
            "--skip-tokenizer-init",
            "--attention-backend",
            "triton" if on_gpu() else "intel_amx",
            "--disable-overlap-schedule",
            "--max-total-tokens",
            "4096",
            "--mem-fraction-static",
            "0.05",
            "--max-running-requests",
            "8",
            "--chunked-prefill-size",
            "1024",
        ]
        if on_gpu():
            # FA3 (flash_ops) is not carried to the GPU machine, and nothing here needs
            # FlashInfer's sampling or a grammar backend
            args += ["--sampling-backend", "pytorch", "--grammar-backend", "none"]
            if self.cuda_graphs:  # decode graphs (batches up to 8); prefill runs eagerly
                args += ["--disable-prefill-cuda-graph", "--cuda-graph-max-bs-decode", "8"]
            else:
                args.append("--disable-cuda-graph")
        if self.mooncake:
            args.append("--remote-instance-weight-loader-start-seed-via-transfer-engine")
        return args + list(self.model_args)

    def start(self) -> None:
        env = kernel_env()
        env["MOONCAKE_PROTOCOL"] = "tcp"
        if self.digests is not None:
            env["P2PWEIGHTS_WRITE_DIGESTS"] = "1" if self.digests else "0"
        plugins = ["p2pweights_nixl"] if self.nixl else []
        if self.cuda_ipc:
            plugins.append("p2pweights_cuda_ipc")
            if not cuda_ipc_entry_point_installed():
                paths = [str(ENTRY_POINT_SITE), env.get("PYTHONPATH")]
                env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
        if self.moving_storage:
            plugins.append("p2pweights_moving_storage")
            env["PYTHONPATH"] = os.pathsep.join([str(PLUGIN_SITE), env["PYTHONPATH"]])
        # an empty SGLANG_PLUGINS loads every installed plugin (p2pweights_nixl included)
        env["SGLANG_PLUGINS"] = ",".join(plugins) or "none"
        if self.tp > 1 and not on_gpu():
            # one core per rank: sglang's CPU backend binds each rank's OpenMP threads
            env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(
                str(i % os.cpu_count()) for i in range(self.tp)
            )  # type: ignore[operator]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self._process = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Until ``/health`` answers 200; raise with the log's tail if the server exits or
        does not come up in time."""
        assert self._process is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(
                    f"sglang server (tp {self.tp}) exited with {self._process.returncode}:\n"
                    f"{self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise RuntimeError(
            f"sglang server (tp {self.tp}) not healthy in {timeout_s:g} s:\n{self.log_tail()}"
        )

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def log_tail(self, num_bytes: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-num_bytes:].decode(errors="replace")
        except OSError:
            return "(no log)"

    def generate(self, input_ids: list[int], max_new_tokens: int) -> list[int]:
        """Greedy tokens after ``input_ids`` (the server runs without a tokenizer)."""
        body = {
            "input_ids": input_ids,
            "sampling_params": {
                "temperature": 0.0,
                "max_new_tokens": max_new_tokens,
                "ignore_eos": True,
            },
        }
        answer = httpx.post(f"{self.url}/generate", json=body, timeout=120).json()
        return list(answer["output_ids"])

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL after 30 s."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            for sig, wait_s in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(process.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    process.wait(timeout=wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue


def cuda_ipc_entry_point_installed() -> bool:
    """Whether sglang finds ``p2pweights_cuda_ipc`` among its plugins' entry points here;
    raises if the p2pweights the servers import has no such plugin (an old wheel)."""
    import importlib.metadata

    import p2pweights.sglang_plugin

    if not hasattr(p2pweights.sglang_plugin, "register_cuda_ipc"):
        raise RuntimeError(
            f"the p2pweights imported here ({p2pweights.sglang_plugin.__file__}) has no CUDA "
            f"IPC plugin: build and install this tree's p2pweights"
        )
    found = importlib.metadata.entry_points(group="sglang.srt.plugins")
    return any(ep.name == "p2pweights_cuda_ipc" for ep in found)


def shared_memory_files() -> set[str]:
    return set(glob.glob("/dev/shm/*"))


def remove_left_behind(before: set[str]) -> None:
    """Remove the shared-memory files sglang's processes left (each rank's 258 MB
    ``deepspeed_allreduce_buffer_*``, ``sglang_loads_*``, ``sgl_shm_mq_*``) that were not
    there ``before``: they outlive a stopped server. Call once every server stopped."""
    for path in shared_memory_files() - before:
        name = os.path.basename(path)
        if name.startswith(("sgl", "deepspeed_allreduce")):
            with contextlib.suppress(OSError):
                os.unlink(path)
