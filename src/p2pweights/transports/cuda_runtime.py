"""The few CUDA runtime and driver calls the CUDA IPC transport needs, through ctypes.

torch exposes CUDA IPC only through its storage sharing, which opens a peer's handle
in the context of the GPU the memory lives on; copies from another GPU into memory
opened that way crawled on the H200 machine (38 GB/s, against 397 GB/s for the same
copy from memory opened in the writer's own context: docs/benchmarks-archive.md). So the
handles are opened here, with the CUDA runtime torch itself loaded, after selecting
the writer's device, and copies are issued with ``cudaMemcpyAsync`` on torch streams.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Iterator
from pathlib import Path

from p2pweights.errors import TransportError
from p2pweights.wire.publication import IPC_HANDLE_BYTES

_LAZY_ENABLE_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction read from the unified address space
_POINTER_DEVICE_ORDINAL = 9  # CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL


class IpcHandle(ctypes.Structure):
    """``cudaIpcMemHandle_t``: 64 opaque bytes, passed by value."""

    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


class CudaRuntime:
    """The process's CUDA runtime (the one torch loaded) and driver, for IPC and copies."""

    def __init__(self) -> None:
        import torch

        if not torch.cuda.is_available():
            raise TransportError("no CUDA device in this process")
        torch.cuda.init()
        self._rt = ctypes.CDLL(_loaded_library("libcudart.so"))
        self._driver = ctypes.CDLL("libcuda.so.1")
        rt = self._rt
        rt.cudaGetErrorString.restype = ctypes.c_char_p
        rt.cudaSetDevice.argtypes = [ctypes.c_int]
        rt.cudaGetDevice.argtypes = [ctypes.POINTER(ctypes.c_int)]
        rt.cudaIpcGetMemHandle.argtypes = [ctypes.POINTER(IpcHandle), ctypes.c_void_p]
        rt.cudaIpcOpenMemHandle.argtypes = [
            ctypes.POINTER(ctypes.c_void_p),
            IpcHandle,
            ctypes.c_uint,
        ]
        rt.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]
        rt.cudaMemcpyAsync.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_void_p,
        ]
        self._driver.cuPointerGetAttribute.argtypes = [
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_uint64,
        ]
        self._driver.cuMemGetAddressRange_v2.argtypes = [
            ctypes.POINTER(ctypes.c_uint64),
            ctypes.POINTER(ctypes.c_size_t),
            ctypes.c_uint64,
        ]

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            message = self._rt.cudaGetErrorString(code).decode(errors="replace")
            raise TransportError(f"{what} failed: CUDA error {code} ({message})")

    def set_device(self, device: int) -> None:
        """Select ``device`` for the calling thread (the runtime's current device is per thread)."""
        self._check(self._rt.cudaSetDevice(device), f"cudaSetDevice({device})")

    def get_device(self) -> int:
        device = ctypes.c_int()
        self._check(self._rt.cudaGetDevice(ctypes.byref(device)), "cudaGetDevice")
        return int(device.value)

    @contextlib.contextmanager
    def on_device(self, device: int) -> Iterator[None]:
        """``device`` current for the calling thread inside the block, the caller's after."""
        before = self.get_device()
        self.set_device(device)
        try:
            yield
        finally:
            self.set_device(before)

    def allocation_range(self, address: int) -> tuple[int, int]:
        """``(base, num_bytes)`` of the device allocation holding ``address``."""
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        code = self._driver.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), address)
        if code != 0:
            raise TransportError(f"cuMemGetAddressRange({address:#x}) failed: CUDA driver {code}")
        return int(base.value), int(size.value)

    def pointer_device(self, address: int) -> int:
        """The device (this process's numbering) whose memory ``address`` points into."""
        ordinal = ctypes.c_int()
        code = self._driver.cuPointerGetAttribute(
            ctypes.byref(ordinal), _POINTER_DEVICE_ORDINAL, address
        )
        if code != 0:
            raise TransportError(f"cuPointerGetAttribute({address:#x}) failed: CUDA driver {code}")
        return int(ordinal.value)

    def ipc_handle(self, base: int) -> bytes:
        """The IPC handle of the allocation starting at ``base``."""
        handle = IpcHandle()
        self._check(self._rt.cudaIpcGetMemHandle(ctypes.byref(handle), base), "cudaIpcGetMemHandle")
        return bytes(handle)  # the whole struct: ``.reserved`` would stop at the first NUL

    def open_ipc_handle(self, handle: bytes, device: int) -> int:
        """Map another process's allocation into this process, in ``device``'s context
        (``handle`` as parsed from a publication, which checks its size)."""
        pointer = ctypes.c_void_p()
        with self.on_device(device):
            self._check(
                self._rt.cudaIpcOpenMemHandle(
                    ctypes.byref(pointer),
                    IpcHandle.from_buffer_copy(handle),
                    _LAZY_ENABLE_PEER_ACCESS,
                ),
                "cudaIpcOpenMemHandle",
            )
        assert pointer.value is not None
        return int(pointer.value)

    def close_ipc_handle(self, address: int) -> None:
        self._check(self._rt.cudaIpcCloseMemHandle(address), "cudaIpcCloseMemHandle")

    def copy_async(self, dst: int, src: int, num_bytes: int, stream: int) -> None:
        """Queue a copy of ``num_bytes`` on ``stream`` (device or pinned host memory)."""
        self._check(
            self._rt.cudaMemcpyAsync(dst, src, num_bytes, _MEMCPY_DEFAULT, stream),
            "cudaMemcpyAsync",
        )


_runtime: CudaRuntime | None = None
_runtime_lock = threading.Lock()


def cuda_runtime() -> CudaRuntime:
    """The process's one ``CudaRuntime`` (loaded on first use)."""
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            _runtime = CudaRuntime()
        return _runtime


def _loaded_library(stem: str) -> str:
    """The path of the ``stem*`` library this process already mapped (torch's CUDA runtime)."""
    maps = Path("/proc/self/maps")
    if maps.exists():
        for line in maps.read_text().splitlines():
            path = line.split()[-1] if line.split() else ""
            if Path(path).name.startswith(stem):
                return path
    for name in (f"{stem}.13", f"{stem}.12", stem):
        try:
            ctypes.CDLL(name)
        except OSError:
            continue
        return name
    raise TransportError(f"cannot find {stem}: torch's CUDA runtime is not loaded in this process")
