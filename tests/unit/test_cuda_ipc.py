"""The CUDA IPC transport where no GPU is: its publication format, merging and refusals.

Device copies between processes need CUDA, so on a host without a GPU only what comes
before them is tested here: parsing what an engine publishes, which engines are
refused (another host, another transport) and the refusals of the transport and the
publisher themselves. tests/integration/test_cuda_ipc_gpu.py runs the copies on a GPU.
"""

from __future__ import annotations

import base64

import pytest
import torch

from p2pweights import CudaIpcConfig, SyncConfig
from p2pweights.errors import ConfigError, EngineError, TransferError, TransportError
from p2pweights.transfer.staging_device import staging_device_for
from p2pweights.transports import Write
from p2pweights.transports.cuda_ipc import (
    CudaIpcPublisher,
    CudaIpcTransport,
    Opened,
    check_mapped,
    check_reachable,
    check_segments,
    host_id,
    merge_adjacent,
    translate,
)
from p2pweights.transports.regions import RegionIndex
from p2pweights.wire.publication import parse_publication

URL = "http://engine-a:30000"
HANDLE = bytes(range(64))


def _info(**overrides: object) -> dict[str, object]:
    info: dict[str, object] = {
        "backend": "cuda_ipc",
        "agent_name": "cuda_ipc_weight_tp1_42_abc",
        "host_id": host_id(),
        "segments": [
            {
                "address": 0x7F0000001000,
                "num_bytes": 4096,
                "gpu_id": 1,
                "handle": base64.b64encode(HANDLE).decode(),
                "offset": 0x1000,
            }
        ],
        "weights_info_dict": {"w": [0x7F0000001000, 1024, 2, 1]},
    }
    info.update(overrides)
    return info


def test_publication_is_parsed_with_its_segments() -> None:
    pub = parse_publication(URL, 1, {"remote_instance_transfer_engine_info": _info()})
    assert pub.backend == "cuda_ipc"
    assert pub.peer == "cuda_ipc_weight_tp1_42_abc"
    assert pub.host_id == host_id()
    (segment,) = pub.segments
    assert (segment.address, segment.num_bytes, segment.gpu_id, segment.offset) == (
        0x7F0000001000,
        4096,
        1,
        0x1000,
    )
    assert segment.handle == HANDLE
    assert pub.regions["w"].num_bytes == 2048 and pub.regions["w"].gpu_id == 1


def _without_host(info: dict[str, object]) -> None:
    del info["host_id"]


def _segment_without_handle(info: dict[str, object]) -> None:
    info["segments"] = [{"address": 1, "num_bytes": 2, "gpu_id": 0, "offset": 0}]


def _handle_not_base64(info: dict[str, object]) -> None:
    info["segments"][0]["handle"] = "%%%"  # type: ignore[index]


@pytest.mark.parametrize("breaks", [_without_host, _segment_without_handle, _handle_not_base64])
def test_malformed_publication_names_the_engine_rank(breaks) -> None:
    info = _info()
    breaks(info)
    with pytest.raises(EngineError, match=f"engine {URL} rank 3: malformed"):
        parse_publication(URL, 3, {"remote_instance_transfer_engine_info": info})


def test_an_engine_on_another_host_is_refused_with_the_way_out() -> None:
    pub = parse_publication(
        URL, 2, {"remote_instance_transfer_engine_info": _info(host_id="node-7/boot")}
    )
    with pytest.raises(ConfigError) as caught:
        check_reachable(pub, host_id())
    message = str(caught.value)
    assert f"engine {URL} rank 2" in message and "node-7/boot" in message
    assert "MooncakeConfig or NixlConfig" in message


def test_an_engine_publishing_for_another_transport_is_refused() -> None:
    pub = parse_publication(
        URL, 0, {"remote_instance_transfer_engine_info": ["127.0.0.1:1234", {"w": [1, 2, 2]}]}
    )
    with pytest.raises(
        EngineError, match=f"engine {URL} rank 0 published its weights for mooncake"
    ):
        check_reachable(pub, host_id())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a host without a GPU")
def test_transport_refuses_to_start_without_cuda() -> None:
    with pytest.raises(ConfigError, match=r"needs a CUDA device.*MooncakeConfig or NixlConfig"):
        CudaIpcTransport(CudaIpcConfig())


def test_publisher_refuses_host_memory() -> None:
    publisher = CudaIpcPublisher(engine_rank=0)
    with pytest.raises(ConfigError, match=r"GPU memory only.*cpu.*--device cuda:N"):
        publisher.register({"w": torch.zeros(8)})


def test_adjacent_writes_merge_and_others_stay() -> None:
    writes = [
        Write(100, 1000, 10, 1),
        Write(110, 1010, 6, 1),  # continues both: merged
        Write(116, 1100, 4, 1),  # destination jumps
        Write(200, 1104, 4, 1),  # source jumps
        Write(204, 1108, 4, 0),  # another device
    ]
    assert merge_adjacent(writes) == [
        Write(100, 1000, 16, 1),
        Write(116, 1100, 4, 1),
        Write(200, 1104, 4, 1),
        Write(204, 1108, 4, 0),
    ]
    assert merge_adjacent([]) == []


def test_config_selects_the_transport_and_refuses_unknown_fields() -> None:
    config = SyncConfig(transport={"kind": "cuda_ipc", "device": 1})
    assert isinstance(config.transport, CudaIpcConfig) and config.transport.device == 1
    with pytest.raises(ConfigError):
        CudaIpcConfig(gpu=1)


def test_staging_defaults_to_the_transport_gpu_else_host() -> None:
    given = staging_device_for(CudaIpcConfig(), "cpu")
    assert given == torch.device("cpu")
    assert staging_device_for(SyncConfig().transport, None) == torch.device("cpu")
    default = staging_device_for(CudaIpcConfig(device=0), None)
    expected = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    assert default == expected


def _two_blocks(**overrides: object) -> dict[str, object]:
    """Two allocations adjacent in the engine (0x1000-0x2000, 0x2000-0x3000), each with
    its own handle."""
    first, second = (base64.b64encode(h).decode() for h in (HANDLE, bytes(range(64, 128))))
    segments = [
        {"address": 0x1000, "num_bytes": 0x1000, "gpu_id": 1, "handle": first, "offset": 0},
        {"address": 0x2000, "num_bytes": 0x1000, "gpu_id": 1, "handle": second, "offset": 0x40},
    ]
    table = {"a": [0x1000, 2048, 2, 1], "b": [0x2000, 2048, 2, 1]}
    return _info(segments=segments, weights_info_dict=table) | overrides


def test_adjacent_blocks_mapped_apart_are_written_each_through_its_own_mapping() -> None:
    pub = parse_publication(URL, 0, {"remote_instance_transfer_engine_info": _two_blocks()})
    check_segments(pub)
    opened = Opened(((0x1000, 0x2000, 0x70000000), (0x2000, 0x3000, 0x90000040)), ())
    sources = RegionIndex([(0x500000, 0x10000)])
    first = translate(pub, opened, sources, Write(0x500000, 0x1F00, 0x100))
    second = translate(pub, opened, sources, Write(0x500100, 0x2000, 0x100))
    assert (first.dst_address, second.dst_address) == (0x70000F00, 0x90000040)
    # contiguous in the engine and in the source, but two mappings: not merged
    assert len(merge_adjacent([first, second])) == 2
    with pytest.raises(TransferError, match=f"not inside one block of the memory engine {URL}"):
        translate(pub, opened, sources, Write(0x500000, 0x1F00, 0x200))  # crosses blocks
    with pytest.raises(TransferError, match="not in a registered staging buffer"):
        translate(pub, opened, sources, Write(0x900000, 0x1000, 0x10))


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"num_bytes": 0}, "impossible"),
        ({"address": 0}, "impossible"),
        ({"address": 0x1800}, "overlapping"),
    ],
)
def test_impossible_segments_are_refused_before_any_handle_is_opened(change, says) -> None:
    info = _two_blocks()
    info["segments"][1].update(change)  # type: ignore[index]
    pub = parse_publication(URL, 0, {"remote_instance_transfer_engine_info": info})
    with pytest.raises(TransportError, match=says):
        check_segments(pub)


@pytest.mark.parametrize(
    "change", [{"offset": -1}, {"num_bytes": -5}, {"address": 2**64 - 16}, {"gpu_id": "1"}]
)
def test_segments_out_of_range_are_refused_as_malformed(change) -> None:
    info = _two_blocks()
    info["segments"][1].update(change)  # type: ignore[index]
    with pytest.raises(EngineError, match=f"engine {URL} rank 0: malformed.*segment"):
        parse_publication(URL, 0, {"remote_instance_transfer_engine_info": info})


def test_a_parameter_outside_the_segments_is_refused() -> None:
    info = _two_blocks(weights_info_dict={"c": [0x2F00, 1024, 2, 1]})  # runs past 0x3000
    pub = parse_publication(URL, 0, {"remote_instance_transfer_engine_info": info})
    with pytest.raises(TransportError, match="parameter 'c' outside"):
        check_segments(pub)


def test_staging_on_another_gpu_than_the_transport_is_warned(caplog) -> None:
    config = SyncConfig(transport=CudaIpcConfig(device=0))
    with caplog.at_level("WARNING", logger="p2pweights.sync_session"):
        assert staging_device_for(config.transport, "cuda:1") == torch.device("cuda", 1)
    assert "crosses GPUs twice" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="p2pweights.sync_session"):
        staging_device_for(config.transport, "cuda:0")
    assert caplog.text == ""


def _segment(address: int, num_bytes: int, offset: int, handle: bytes = HANDLE) -> dict:
    encoded = base64.b64encode(handle).decode()
    return {
        "address": address,
        "num_bytes": num_bytes,
        "gpu_id": 1,
        "handle": encoded,
        "offset": offset,
    }


def test_a_segment_past_the_allocation_its_handle_opened_is_refused() -> None:
    """The bytes a handle maps here bound every segment published on it: offset +
    num_bytes past them would make the trainer copy past the mapping."""
    info = _info(
        segments=[_segment(0x10000, 0x1000, 0x800)],
        weights_info_dict={"w": [0x10000, 2048, 2, 1]},
    )
    pub = parse_publication(URL, 1, {"remote_instance_transfer_engine_info": info})
    check_mapped(pub, {HANDLE: 0x1800})  # exactly fits
    with pytest.raises(TransportError) as caught:
        check_mapped(pub, {HANDLE: 0x17FF})
    message = str(caught.value)
    assert f"engine {URL} rank 1" in message and "0x1800" in message and "0x17ff" in message
    assert "nothing was written" in message


def test_segments_of_one_handle_must_agree_on_where_its_allocation_starts() -> None:
    """Two segments of one allocation: address - offset is the allocation's base in the
    engine, the same for both, else one of them is translated to the wrong bytes."""
    info = _info(
        segments=[_segment(0x10000, 0x1000, 0), _segment(0x11000, 0x1000, 0x2000)],
        weights_info_dict={"w": [0x10000, 2048, 2, 1]},
    )
    pub = parse_publication(URL, 1, {"remote_instance_transfer_engine_info": info})
    with pytest.raises(TransportError, match=rf"engine {URL} rank 1.*allocation"):
        check_segments(pub)


class _FakeRuntime:
    """The CUDA calls ``connect`` makes, on a host without CUDA: each handle maps
    ``mapped_bytes`` at a pointer of its own."""

    def __init__(self, mapped_bytes: int) -> None:
        self.mapped_bytes = mapped_bytes
        self.opened: list[int] = []
        self.closed: list[int] = []

    def open_ipc_handle(self, handle: bytes, device: int) -> int:
        pointer = 0x7000_0000_0000 + 0x1000_0000 * len(self.opened)
        self.opened.append(pointer)
        return pointer

    def allocation_range(self, address: int) -> tuple[int, int]:
        return address, self.mapped_bytes

    def close_ipc_handle(self, address: int) -> None:
        self.closed.append(address)

    def on_device(self, device: int):
        import contextlib

        return contextlib.nullcontext()


def _transport(monkeypatch, runtime: _FakeRuntime) -> CudaIpcTransport:
    from p2pweights.transports import cuda_ipc

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(cuda_ipc, "cuda_runtime", lambda: runtime)
    return CudaIpcTransport(CudaIpcConfig(device=0))


def test_connect_refuses_a_publication_past_the_mapping_and_closes_what_it_opened(
    monkeypatch,
) -> None:
    info = _info(
        segments=[_segment(0x10000, 0x1000, 0x800)],
        weights_info_dict={"w": [0x10000, 2048, 2, 1]},
    )
    pub = parse_publication(URL, 1, {"remote_instance_transfer_engine_info": info})
    runtime = _FakeRuntime(mapped_bytes=0x1000)  # the allocation is 0x1000, not 0x1800
    transport = _transport(monkeypatch, runtime)
    with pytest.raises(TransportError, match=f"engine {URL} rank 1"):
        transport.connect(pub)
    assert runtime.closed == runtime.opened and transport.peers == frozenset()
    fits = _transport(monkeypatch, _FakeRuntime(mapped_bytes=0x1800))
    fits.connect(pub)
    assert fits.peers == {pub.peer}
