"""A Mooncake transport asked for RDMA gets it or fails; "auto" falls back and says so.

Mooncake's Python binding ignores the protocol it is given: it installs RDMA when its
topology discovery finds an RDMA device (filtered by ``device_name``) and TCP otherwise.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from p2pweights.config import MooncakeConfig
from p2pweights.errors import TransportError
from p2pweights.transports import mooncake
from p2pweights.transports.base import Transport


def _sysfs(tmp_path: Path, *devices: str) -> Path:
    root = tmp_path / "infiniband"
    root.mkdir()
    for device in devices:
        (root / device).mkdir()
    return root


class _Topology:
    """Mooncake's own answer, ``TransferEngine.get_local_topology(device_name)``."""

    def __init__(self, text: str) -> None:
        self.text, self.asked = text, []

    def __call__(self, device_name: str) -> str:
        self.asked.append(device_name)
        return self.text


_NO_HCA = '{\n\t"cpu:0" : \n\t[\n\t\t[],\n\t\t[]\n\t]\n}\n'
_ONE_HCA = '{"cpu:0": [["mlx5_0"], ["mlx5_0"]], "cuda:0": [["mlx5_0"], []]}'


@pytest.mark.parametrize(
    ("devices", "device_name", "topology", "force_tcp", "expected"),
    [
        ((), "", _NO_HCA, False, "tcp"),  # no device listed: Mooncake is not even asked
        (("mlx5_0",), "", _ONE_HCA, False, "rdma"),
        (("mlx5_0",), "", _NO_HCA, False, "tcp"),  # listed, but Mooncake cannot use it
        (("mlx5_0",), "mlx5_1", _ONE_HCA, False, "tcp"),  # the filter names another device
        (("mlx5_0", "mlx5_1"), "mlx5_1,mlx5_7", _ONE_HCA, False, "rdma"),
        (("mlx5_0",), "", _ONE_HCA, True, "tcp"),  # MC_FORCE_TCP
    ],
)
def test_the_protocol_mooncake_installs(
    tmp_path: Path,
    devices: tuple[str, ...],
    device_name: str,
    topology: str,
    force_tcp: bool,
    expected: str,
) -> None:
    ask = _Topology(topology)
    found = mooncake.installed_protocol(
        device_name, ask, root=_sysfs(tmp_path, *devices), force_tcp=force_tcp
    )
    assert found == expected
    if not devices:
        assert ask.asked == []


def test_rdma_without_rdma_devices_fails_naming_the_setting(tmp_path: Path) -> None:
    with pytest.raises(TransportError) as caught:
        mooncake.choose_protocol(
            "rdma", "", _Topology(_NO_HCA), root=_sysfs(tmp_path), force_tcp=False
        )
    message = str(caught.value)
    assert "no RDMA device" in message
    assert 'protocol="tcp"' in message and 'protocol="auto"' in message


def test_rdma_with_a_device_filter_that_matches_nothing_names_the_filter(tmp_path: Path) -> None:
    with pytest.raises(TransportError, match="mlx5_9"):
        mooncake.choose_protocol(
            "rdma", "mlx5_9", _Topology(_ONE_HCA), root=_sysfs(tmp_path, "mlx5_0"), force_tcp=False
        )


def test_auto_falls_back_to_tcp_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="p2pweights"):
        chosen = mooncake.choose_protocol(
            "auto", "", _Topology(_NO_HCA), root=_sysfs(tmp_path), force_tcp=False
        )
    assert chosen == "tcp"
    assert any("over TCP" in r.getMessage() for r in caplog.records)


def test_auto_takes_rdma_where_there_is_a_device(tmp_path: Path) -> None:
    chosen = mooncake.choose_protocol(
        "auto", "", _Topology(_ONE_HCA), root=_sysfs(tmp_path, "mlx5_0"), force_tcp=False
    )
    assert chosen == "rdma"


def test_tcp_on_a_host_with_rdma_is_reported_as_what_mooncake_installs(tmp_path: Path) -> None:
    # Mooncake ignores the protocol asked: the report must name the one it uses
    chosen = mooncake.choose_protocol(
        "tcp", "", _Topology(_ONE_HCA), root=_sysfs(tmp_path, "mlx5_0"), force_tcp=False
    )
    assert chosen == "rdma"
    assert mooncake.choose_protocol("tcp", "", _Topology(_ONE_HCA), force_tcp=True) == "tcp"


def test_auto_is_a_valid_protocol() -> None:
    assert MooncakeConfig(protocol="auto").protocol == "auto"


def test_every_transport_describes_what_it_writes_over() -> None:
    assert Transport.describe.__doc__
    transport = mooncake.MooncakeTransport.__new__(mooncake.MooncakeTransport)
    transport._protocol = "tcp"
    assert transport.protocol == "tcp"
    assert transport.describe() == "mooncake/tcp"


# -- on this host: the real binding, no RDMA device --------------------------------------------


def _has_rdma() -> bool:
    root = Path("/sys/class/infiniband")
    return root.is_dir() and any(root.iterdir())


def test_rdma_on_this_host_without_devices_fails_at_creation() -> None:
    pytest.importorskip("mooncake.engine")
    if _has_rdma():
        pytest.skip("this host has RDMA devices")
    with pytest.raises(TransportError, match='protocol="auto"'):
        mooncake.MooncakeTransport(MooncakeConfig(protocol="rdma"))


def test_auto_on_this_host_without_devices_writes_over_tcp() -> None:
    pytest.importorskip("mooncake.engine")
    if _has_rdma():
        pytest.skip("this host has RDMA devices")
    with mooncake.MooncakeTransport(MooncakeConfig(protocol="auto")) as transport:
        assert transport.describe() == "mooncake/tcp"


@pytest.mark.parametrize("answer", ["not json", '{"cpu:0": 7}', "[1, 2]"])
def test_a_topology_that_cannot_be_read_is_a_transport_error(tmp_path: Path, answer) -> None:
    """Found in review: a topology answer that is not what Mooncake documents escaped as
    a raw ValueError / TypeError."""
    with pytest.raises(TransportError, match=r"topology of this host's RDMA devices \(mlx5_0\)"):
        mooncake.choose_protocol(
            "auto", "", _Topology(answer), root=_sysfs(tmp_path, "mlx5_0"), force_tcp=False
        )


def test_discovery_without_mooncake_or_failing_in_it_is_a_transport_error(monkeypatch) -> None:
    """Found in review: a host listing RDMA devices without mooncake installed got a raw
    ModuleNotFoundError from the protocol check, not the install hint."""
    import sys

    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # import fails
    with pytest.raises(TransportError, match=r"cannot import mooncake .*pip install"):
        mooncake._local_topology("")

    class Broken:
        def get_local_topology(self, device_name):
            raise RuntimeError("ibv_open_device failed")

    monkeypatch.setattr(mooncake, "_transfer_engine_class", lambda: Broken)
    with pytest.raises(TransportError, match="discovery of this host's RDMA devices failed"):
        mooncake._local_topology("")
