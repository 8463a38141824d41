"""Transports by name: the built-ins registered as a user's transport is, lazily; a
user's config accepted by SyncConfig, as an instance or a mapping; unknown names and
mismatched classes refused by name (issue 41 item 6)."""

from __future__ import annotations

import subprocess
import sys
from typing import Literal

import pytest

from p2pweights import ConfigError, MooncakeConfig, SyncConfig
from p2pweights.config import TransportConfigBase
from p2pweights.transport_registry import entry, publication_backend, transport_names
from p2pweights.transports import Transport, register_transport


class CarrierConfig(TransportConfigBase):
    kind: Literal["carrier"] = "carrier"
    birds: int = 2


class OtherConfig(TransportConfigBase):
    kind: Literal["carrier"] = "carrier"


class CarrierTransport(Transport):
    name = "carrier"

    def __init__(self, config: CarrierConfig) -> None:
        self.config = config

    def register(self, buffer):  # pragma: no cover - not driven here
        pass

    def unregister(self, buffer):  # pragma: no cover
        pass

    def connect(self, target):  # pragma: no cover
        pass

    def write(self, target, writes, timeout_s):  # pragma: no cover
        pass

    def close(self):  # pragma: no cover
        pass


@pytest.fixture(autouse=True)
def carrier():
    register_transport("carrier", config=CarrierConfig, transport=CarrierTransport, replace=True)


def test_the_built_ins_are_registered_as_strings_imported_on_use():
    assert {"mooncake", "nixl", "cuda_ipc", "carrier"} <= set(transport_names())
    assert entry("nixl").transport == "p2pweights.transports.nixl:NixlTransport"
    assert publication_backend("mooncake") == "mooncake"
    probe = (
        "import sys, p2pweights.config, p2pweights.transports\n"
        "print(any(m in sys.modules for m in ('p2pweights.transports.nixl', "
        "'p2pweights.transports.mooncake', 'nixl', 'mooncake')))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr


def test_sync_config_takes_a_registered_config_or_its_mapping():
    assert SyncConfig(transport=CarrierConfig(birds=5)).transport == CarrierConfig(birds=5)
    config = SyncConfig(transport={"kind": "carrier", "birds": 3})
    assert isinstance(config.transport, CarrierConfig) and config.transport.birds == 3
    assert config.model_dump()["transport"] == {"kind": "carrier", "birds": 3}
    assert SyncConfig.model_validate(config.model_dump()) == config
    assert SyncConfig().transport == MooncakeConfig()  # the default stays


def test_unknown_and_mismatched_transports_are_refused_by_name():
    with pytest.raises(ConfigError, match=r"unknown transport 'pigeon'; known: .*carrier"):
        SyncConfig(transport={"kind": "pigeon"})
    with pytest.raises(ConfigError, match="registered with CarrierConfig, not OtherConfig"):
        SyncConfig(transport=OtherConfig())
    with pytest.raises(ConfigError, match="registered already"):
        register_transport("carrier", config=OtherConfig, transport=CarrierTransport)


def test_create_transport_builds_the_registered_class():
    from p2pweights.transports import create_transport

    made = create_transport(CarrierConfig(birds=7))
    assert isinstance(made, CarrierTransport) and made.config.birds == 7
