"""``p2pweights doctor``: what will work on this host, and why.

Each check gives one ``Finding``: ``ok``, ``info``, ``warn`` (works, but slower or
with a caveat) or ``FAIL`` (a blocker: an update from this host would fail). The
command exits 1 when any check fails.

- the trainer side: sglang (the tested release, every symbol a replica uses, whether
  it has ``begin/end_weight_update``), Mooncake and NIXL importable, RDMA devices,
  CUDA devices, host memory for the staging buffers (locked-memory limit, pinned
  allocation on CUDA hosts), and one loopback write per transport inside this
  process (bytes checked; on a CUDA host from GPU memory, which shows whether UCX
  picked its CUDA transports);
- ``--engine URL`` (repeatable): the engine's sglang release against this host's,
  its update API, its layout, each rank's publication and whether this host can
  write it, its weight version and update state.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import platform
import resource
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import httpx
import torch

from p2pweights.engines.client import EngineClient
from p2pweights.errors import ConfigError, P2PWeightsError

__all__ = ["Finding", "engine_findings", "format_findings", "host_findings", "run_doctor"]

OK, INFO, WARN, FAIL = "ok", "info", "warn", "FAIL"

_LOOPBACK_BYTES = 64 << 20
_SLOW_GPU_WRITE_GB_S = 5.0
"""A GPU-to-GPU loopback write slower than this went through host memory (UCX without its
CUDA transports moved 0.42 GB/s on an H200 pair, with them 290-390 GB/s)."""


@dataclasses.dataclass(frozen=True)
class Finding:
    """One check's outcome."""

    check: str
    status: str
    """``ok``, ``info``, ``warn`` or ``FAIL`` (a blocker)."""
    detail: str


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


# -- this host ---------------------------------------------------------------------------------


def _python() -> Finding:
    from p2pweights import __version__

    return Finding(
        "python",
        INFO,
        f"Python {platform.python_version()}, p2pweights {__version__}, torch {torch.__version__}",
    )


def _sglang() -> list[Finding]:
    from p2pweights.replica.sglang import facade

    try:
        compat = facade.compat()
    except P2PWeightsError as exc:
        return [Finding("sglang", FAIL, str(exc))]
    low, high = compat.TESTED_SGLANG
    try:
        compat.check_sglang()
    except P2PWeightsError as exc:
        return [Finding("sglang", FAIL, str(exc))]
    tested = compat.is_tested()
    found = [
        Finding(
            "sglang",
            OK if tested else WARN,
            f"{compat.SGLANG_VERSION}, every symbol and answer text p2pweights relies on is there"
            + ("" if tested else f"; outside the tested {low} to {high}"),
        )
    ]
    has_update_api = facade.has_update_api()
    found.append(
        Finding(
            "sglang update API",
            OK if has_update_api else FAIL,
            "begin_weight_update / end_weight_update present"
            if has_update_api
            else "this sglang lacks begin/end_weight_update (added in 0.5.21); "
            "engines of this release cannot be updated point to point",
        )
    )
    return found


def _transport_import(kind: str) -> Finding:
    module = {"mooncake": "mooncake.engine", "nixl": "nixl._api"}[kind]
    try:
        importlib.import_module(module)
    except Exception as exc:  # ImportError, or OSError from a missing shared library
        return Finding(kind, WARN, f"not importable: {exc}; {install_hint(kind, exc)}")
    found = [f"{d} {v}" for d in _distributions(kind) for v in [_version(d)] if v]
    return Finding(kind, OK, f"importable ({', '.join(found) or 'version unknown'})")


def wanted_distribution(kind: str, cuda: str | None, gpu: bool) -> str:
    """The build of ``kind`` this host needs: by whether it has a GPU and by torch's CUDA
    (``torch.version.cuda``; Mooncake and NIXL ship one wheel per CUDA major)."""
    major = (cuda or "").split(".")[0]
    if kind == "mooncake":
        if not gpu:
            return "mooncake-transfer-engine-non-cuda"
        return "mooncake-transfer-engine" if major == "12" else "mooncake-transfer-engine-cuda13"
    return "nixl-cu12" if major == "12" else "nixl-cu13"


def install_hint(kind: str, error: BaseException, installed: list[str] | None = None) -> str:
    """What to run so ``kind`` imports here: the Debian libraries it links against if
    those are missing, else the build this host needs (replacing another build that is
    installed and does not load)."""
    if "libibverbs" in str(error) or "librdmacm" in str(error):
        return "apt-get install libibverbs1 librdmacm1 ibverbs-providers libnuma1"
    import torch

    wanted = wanted_distribution(kind, torch.version.cuda, torch.cuda.is_available())
    if installed is None:
        installed = [d for d in _distributions(kind) if _version(d)]
    others = [d for d in installed if d not in (wanted, "nixl")]  # "nixl" is the front
    if wanted in installed and not others:
        return f"{wanted} is installed but does not load here (see the error above)"
    if kind == "nixl" and wanted not in installed:
        return f"pip install --no-deps nixl {wanted}"
    remove = f"pip uninstall -y {' '.join(others)}; " if others else ""
    return f"{remove}pip install {wanted}"


def _distributions(kind: str) -> list[str]:
    if kind == "mooncake":
        return [
            "mooncake-transfer-engine",
            "mooncake-transfer-engine-non-cuda",
            "mooncake-transfer-engine-cuda13",
        ]
    return ["nixl", "nixl-cu12", "nixl-cu13"]


def rdma_devices(root: Path = Path("/sys/class/infiniband")) -> list[tuple[str, str]]:
    """(device, state of its first port) for every RDMA device the kernel lists."""
    found = []
    for device in sorted(root.glob("*")):
        states = sorted((device / "ports").glob("*/state"))
        state = states[0].read_text().strip() if states else "unknown"
        found.append((device.name, state))
    return found


def _rdma() -> Finding:
    devices = rdma_devices()
    if not devices:
        return Finding(
            "RDMA devices",
            WARN,
            "none: writes go over TCP (MooncakeConfig(protocol='tcp'); UCX picks TCP itself), "
            "about 1-3 GB/s instead of the NICs' line rate",
        )
    active = [name for name, state in devices if "ACTIVE" in state]
    listed = ", ".join(f"{name} ({state})" for name, state in devices)
    return Finding("RDMA devices", OK if active else WARN, listed)


def _cuda() -> Finding:
    if not torch.cuda.is_available():
        return Finding("CUDA", INFO, "no CUDA device: staging in host memory only")
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return Finding(
        "CUDA",
        OK,
        f"{len(names)} device(s): {', '.join(names)}; CudaIpcConfig can write engines on this host",
    )


def _memory(buffer_bytes: int) -> list[Finding]:
    need = 2 * buffer_bytes
    found = []
    available = _meminfo_bytes("MemAvailable")
    if available is not None:
        found.append(
            Finding(
                "host memory",
                OK if available >= 2 * need else WARN,
                f"{available / 2**30:.1f} GiB available; the two staging buffers take "
                f"{need / 2**30:.2f} GiB (SyncConfig.buffer_bytes {buffer_bytes / 2**20:.0f} MiB "
                f"each)",
            )
        )
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    unlimited = soft == resource.RLIM_INFINITY
    enough = unlimited or soft >= need
    found.append(
        Finding(
            "locked memory limit",
            OK if enough else (WARN if not rdma_devices() else FAIL),
            ("unlimited" if unlimited else f"{soft / 2**20:.0f} MiB")
            + (
                ""
                if enough
                else f"; RDMA registration of {need / 2**20:.0f} MiB of staging buffers needs "
                "more (ulimit -l unlimited, or LimitMEMLOCK / --ulimit memlock=-1)"
            ),
        )
    )
    if torch.cuda.is_available():
        try:
            started = time.perf_counter()
            pinned = torch.empty(need, dtype=torch.uint8, pin_memory=True)
            seconds = time.perf_counter() - started
            del pinned
            found.append(
                Finding(
                    "pinned memory",
                    OK,
                    f"{need / 2**30:.2f} GiB pinned in {seconds:.2f} s",
                )
            )
        except RuntimeError as exc:
            found.append(Finding("pinned memory", FAIL, f"cannot pin {need} bytes: {exc}"))
    return found


def _meminfo_bytes(field: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _loopback(kind: str) -> Finding:
    """One write from a registered buffer into a published one, both in this process."""
    from p2pweights.config import MooncakeConfig, NixlConfig
    from p2pweights.transports import Write, create_publisher, create_transport
    from p2pweights.wire.publication import parse_publication

    device = "cuda" if kind == "nixl" and torch.cuda.is_available() else "cpu"
    dst_device = f"cuda:{min(1, torch.cuda.device_count() - 1)}" if device == "cuda" else "cpu"
    check = f"{kind} loopback write ({device} -> {dst_device})"
    config = MooncakeConfig(protocol="tcp") if kind == "mooncake" else NixlConfig()
    src = torch.randint(0, 256, (_LOOPBACK_BYTES,), dtype=torch.uint8).to(device)
    dst = torch.zeros(_LOOPBACK_BYTES, dtype=torch.uint8, device=dst_device)
    try:
        publisher = create_publisher(kind)
    except P2PWeightsError as exc:
        return Finding(check, FAIL, str(exc))
    try:
        transport = create_transport(config)
    except P2PWeightsError as exc:
        publisher.close()
        return Finding(check, FAIL, str(exc))
    try:
        weights = {"loopback": dst}
        publisher.register(weights)
        body = {"remote_instance_transfer_engine_info": publisher.publication(weights)}
        target = parse_publication("loopback", 0, body)
        transport.register(src)
        transport.connect(target)
        write = Write(src.data_ptr(), target.regions["loopback"].address, _LOOPBACK_BYTES)
        transport.write(target, [write], timeout_s=30.0)  # first write: connection set-up
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        transport.write(target, [write], timeout_s=30.0)
        seconds = time.perf_counter() - started
    except P2PWeightsError as exc:
        return Finding(check, FAIL, str(exc))
    finally:
        transport.close()
        publisher.close()
    if not torch.equal(src.cpu(), dst.cpu()):
        return Finding(check, FAIL, "the write reported success but the bytes differ")
    rate = _LOOPBACK_BYTES / seconds / 1e9
    detail = f"{_LOOPBACK_BYTES >> 20} MiB bit-exact at {rate:.2f} GB/s"
    if device == "cuda" and rate < _SLOW_GPU_WRITE_GB_S:
        return Finding(
            check,
            WARN,
            f"{detail}: UCX moved GPU memory through the host, so it has no CUDA transports "
            "(cuda_ipc / cuda_copy). UCX picks them when an agent starts; a process must "
            "create a CUDA context before its first NIXL agent (p2pweights' agents do)",
        )
    return Finding(check, OK, detail)


def host_findings(buffer_bytes: int = 512 << 20, loopback: bool = True) -> list[Finding]:
    """Every check of this host (``loopback``: also one write per importable transport)."""
    found = [_python(), *_sglang()]
    transports = {kind: _transport_import(kind) for kind in ("mooncake", "nixl")}
    found += transports.values()
    cuda = _cuda()
    if not any(f.status == OK for f in transports.values()):
        if cuda.status == OK:  # CudaIpcConfig needs neither
            found.append(
                Finding(
                    "transports",
                    WARN,
                    "neither Mooncake nor NIXL is importable: only CudaIpcConfig works here, "
                    "for engines on this host",
                )
            )
        else:
            found.append(Finding("transports", FAIL, "neither Mooncake nor NIXL is importable"))
    found += [_rdma(), cuda, *_memory(buffer_bytes)]
    if loopback:
        found += [_loopback(kind) for kind, f in transports.items() if f.status == OK]
    return found


# -- an engine ---------------------------------------------------------------------------------


def engine_findings(
    url: str,
    timeout_s: float = 10.0,
    *,
    client: EngineClient | None = None,
    http: httpx.Client | None = None,
) -> list[Finding]:
    """What an engine at ``url`` runs and publishes, checked against this host
    (``client`` / ``http``: how to reach it, made and closed here when not given)."""
    own_client, own_http = client is None, http is None
    client = client or EngineClient(url, timeout_s=timeout_s)
    http = http or httpx.Client(timeout=timeout_s)
    try:
        return _engine_findings(url, client, http)
    finally:  # what was made here is closed here, whatever happened; the caller's stay open
        if own_client:
            client.close()
        if own_http:
            http.close()


def _engine_findings(url: str, client: EngineClient, http: httpx.Client) -> list[Finding]:
    from p2pweights.engines.fleet import check_sglang_version, num_engine_ranks

    check = f"engine {url}"
    try:
        info = client.server_info()
    except P2PWeightsError as exc:
        return [Finding(check, FAIL, f"no server info: {exc}")]
    found = [
        _guarded(f"{check} sglang", lambda: check_sglang_version(url, info, False)),
        _update_routes(check, url, http),
    ]
    try:
        num_ranks = num_engine_ranks(url, info)
    except P2PWeightsError as exc:
        return [*found, Finding(f"{check} layout", FAIL, str(exc))]
    found.append(
        Finding(
            f"{check} layout",
            INFO,
            f"{num_ranks} rank(s) (tp {info.get('tp_size')}, ep {info.get('ep_size', 1)}, "
            f"dp {info.get('dp_size', 1)}), model {info.get('model_path')}",
        )
    )
    found.append(_model_config(check, info))
    found += [_publication(check, client, rank) for rank in range(num_ranks)]
    found.append(_update_state(check, client))
    return found


def _model_config(check: str, info: Mapping[str, Any]) -> Finding:
    """What ``connect`` reads first: the engine's model config, from this host, at the path
    the engine publishes (a relative path is read from this process's directory)."""
    from p2pweights.replica.registry import config_path

    try:
        path = config_path(info, None)
    except ConfigError as exc:
        return Finding(f"{check} model config", FAIL, str(exc))
    return Finding(f"{check} model config", OK, f"{path} readable here")


def _guarded(check: str, call: Callable[[], object]) -> Finding:
    try:
        call()
    except P2PWeightsError as exc:
        return Finding(check, FAIL, str(exc))
    return Finding(check, OK, "same release as this host")


def _update_routes(check: str, url: str, http: httpx.Client) -> Finding:
    try:
        response = http.get(f"{url.rstrip('/')}/openapi.json")
        paths = set(response.json().get("paths", {})) if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        paths = None
    if paths is None:
        return Finding(f"{check} update API", WARN, "unknown (the engine serves no OpenAPI doc)")
    missing = {"/begin_weight_update", "/end_weight_update"} - paths
    if missing:
        return Finding(
            f"{check} update API",
            FAIL,
            f"lacks {sorted(missing)}; sglang >= 0.5.21 has them",
        )
    return Finding(f"{check} update API", OK, "begin_weight_update / end_weight_update served")


def _publication(check: str, client: EngineClient, rank: int) -> Finding:
    name = f"{check} rank {rank}"
    try:
        publication = client.publication(rank)
    except P2PWeightsError as exc:
        return Finding(name, FAIL, str(exc))
    from p2pweights.wire.landed import flag_names

    # the parameters, as inspect counts them: a delta scratch region or flags are no weight
    num_params = len(flag_names(publication.regions))
    detail = f"publishes {num_params} parameters for {publication.backend} ({publication.peer})"
    if publication.backend == "cuda_ipc":
        return _cuda_ipc_reach(name, detail, publication.host_id)
    usable = _transport_import(publication.backend)
    if usable.status != OK:
        return Finding(name, FAIL, f"{detail}, but this host cannot use it: {usable.detail}")
    if publication.backend == "mooncake":
        host = str(publication.session_id).rsplit(":", 1)[0]
        engine_host = str(client.url).split("://", 1)[-1].split(":", 1)[0]
        if host in ("127.0.0.1", "localhost") and engine_host not in ("127.0.0.1", "localhost"):
            return Finding(
                name,
                FAIL,
                f"{detail}: a loopback address, unreachable from another host; start the "
                "engine with --host set to an address trainers reach",
            )
    return Finding(name, OK, detail)


def _cuda_ipc_reach(name: str, detail: str, engine_host: str | None) -> Finding:
    """CUDA IPC reaches an engine on this host, from a process that sees a GPU."""
    from p2pweights.transports.cuda_ipc import host_id

    if engine_host != host_id():
        return Finding(
            name,
            FAIL,
            f"{detail}, on host {engine_host}: CUDA IPC reaches engines on this host "
            f"({host_id()}) only; publish for mooncake or nixl to reach it from here",
        )
    if not torch.cuda.is_available():
        return Finding(name, FAIL, f"{detail}, but this process sees no CUDA device")
    return Finding(name, OK, detail)


def _update_state(check: str, client: EngineClient) -> Finding:
    try:
        version = client.weight_version()
        state = client.engine_state()
    except P2PWeightsError as exc:
        return Finding(f"{check} state", WARN, str(exc))
    detail = f"weight version {version!r}"
    if version.startswith("p2pweights-updating:") or (state and any(state.values())):
        return Finding(
            f"{check} state",
            WARN,
            f"{detail}, {state or 'state not reported'}: an update did not finish; the next "
            "session's update() rewrites it whole, or session.abort() resumes it",
        )
    return Finding(f"{check} state", OK, detail + (f", {state}" if state else ""))


# -- the report --------------------------------------------------------------------------------


def format_findings(findings: Iterable[Finding]) -> str:
    rows = list(findings)
    width = max((len(f.check) for f in rows), default=0)
    return "\n".join(f"{f.status:>4}  {f.check:<{width}}  {f.detail}" for f in rows)


def run_doctor(
    engine_urls: Iterable[str] = (), buffer_bytes: int = 512 << 20, loopback: bool = True
) -> int:
    """Print every finding; 1 if any is a blocker, else 0."""
    findings = host_findings(buffer_bytes, loopback)
    for url in engine_urls:
        findings += engine_findings(url)
    print(format_findings(findings))
    blockers = sum(f.status == FAIL for f in findings)
    print(f"\n{blockers} blocker(s) (FAIL above)" if blockers else "\nno blockers")
    return 1 if blockers else 0
