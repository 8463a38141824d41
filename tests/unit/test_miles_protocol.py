"""p2pweights.integrations.miles_protocol with a fake session, and the seam ``install`` picks.

The protocol derives from p2pweights' stand-in for miles' ``WeightTransferProtocol``
here (miles is not installed); tests/integration/test_miles_protocol.py drives it with
miles' own updater files into local engines.
"""

from __future__ import annotations

import sys
import types
from argparse import Namespace

import pytest
import torch

from p2pweights import ConfigError, MooncakeConfig, NixlConfig, SyncConfig, Timeouts
from p2pweights.integrations import FrameworkMismatchError, miles, miles_args, miles_protocol
from p2pweights.integrations.miles_protocol import (
    P2PWeightsProtocol,
    engine_urls,
    protocol_factory,
    sender_ranks,
)
from p2pweights.report import UpdateReport


@pytest.mark.parametrize(
    ("stages", "num_engine_ranks", "senders"),
    [
        ([0, 0, 0, 0], None, [0, 1, 2, 3]),  # engine GPU counts unknown: every rank
        ([0, 0, 0, 0], 8, [0, 1, 2, 3]),  # fewer ranks than engine ranks: every rank
        ([0, 0, 0, 0], 3, [0, 1, 2]),
        ([0, 0, 0, 0], 1, [0]),
        ([0, 0, 1, 1], 1, [0, 2]),  # each pipeline stage its own first ranks
        ([0, 1, 0, 1], 1, [0, 1]),  # stages interleaved in rank order
        ([0, 0, 1, 1], 2, [0, 1, 2, 3]),
    ],
)
def test_sender_ranks(stages, num_engine_ranks, senders):
    assert sender_ranks(stages, num_engine_ranks) == senders


def _args(**overrides) -> Namespace:
    fields = {
        "update_weight_buffer_size": 64 * 2**20,
        "p2p_transfer_timeout": 45.0,
        "pause_generation_mode": "retract",
        "update_weight_transfer_mode": "external",
        "colocate": False,
    }
    return Namespace(**{**fields, **overrides})


class FakeSession:
    def __init__(self):
        self.config = SyncConfig(timeouts=Timeouts(transfer=1, control=1))
        self.read: list[str] = []
        self.versions: list[str | None] = []

    def update(self, named_tensors, *, version=None):
        self.versions.append(version)
        self.read.extend(name for name, _ in named_tensors)
        return UpdateReport(
            version=str(version),
            bytes_by_target={("http://e:1", 0): 4 * len(self.read)},
            stage_seconds={"load": 0.5},
            seconds=2.0,
        )


def _bucket(*names: str) -> list[tuple[str, torch.Tensor]]:
    return [(name, torch.zeros(2)) for name in names]


def test_one_update_per_miles_version_streams_the_buckets():
    protocol = P2PWeightsProtocol(_args())
    protocol.session = session = FakeSession()  # type: ignore[assignment]
    protocol.is_sender = True
    for version in (1, 2):
        assert protocol.begin_sync(version, lambda **_: iter(())) is True
        protocol.send_bucket(_bucket("a", "b"))
        protocol.send_bucket(_bucket("c"))
        protocol.after_base_weights()
        protocol.finalize(version)
        assert protocol.pop_metrics()["perf/update_weights_p2pweights_seconds"] == 2.0
    assert session.versions == ["1", "2"]
    assert session.read == ["a", "b", "c"] * 2
    assert protocol.pop_metrics() == {}


def test_begin_sync_takes_the_rollout_id_some_miles_pass():
    """radixark 523810282c's gpu-delta test calls ``begin_sync(version, iter_buckets,
    rollout_id)``: positionally or by name, the update runs as without it."""
    protocol = P2PWeightsProtocol(_args())
    protocol.session = session = FakeSession()  # type: ignore[assignment]
    protocol.is_sender = True
    assert protocol.begin_sync(1, lambda **_: iter(()), 17) is True
    protocol.send_bucket(_bucket("a"))
    protocol.finalize(1)
    assert protocol.begin_sync(2, lambda **_: iter(()), rollout_id=18) is True
    protocol.send_bucket(_bucket("b"))
    protocol.finalize(2)
    assert session.versions == ["1", "2"] and session.read == ["a", "b"]


@pytest.mark.parametrize(
    ("positional", "named"),
    [
        # miles after PR 2752: (engines, counts, offsets, parallel_state, placement, selector)
        (("PS", "PLACEMENT", "all"), {}),
        # radixark 0274e4f: engine_cell_ids before parallel_state
        ((["cell-0"], "PS", "PLACEMENT", "all"), {}),
        # by name, either way
        ((), {"parallel_state": "PS", "placement": "PLACEMENT", "selector": "all"}),
        (
            (),
            {
                "engine_cell_ids": ["cell-0"],
                "parallel_state": "PS",
                "placement": "PLACEMENT",
                "selector": "all",
            },
        ),
    ],
)
def test_connect_takes_both_seams_of_miles(positional, named):
    seam = miles_protocol.connect_arguments(positional, named)
    assert (seam.parallel_state, seam.placement, seam.selector) == ("PS", "PLACEMENT", "all")
    assert seam.engine_cell_ids == (["cell-0"] if "cell" in repr((positional, named)) else None)


def test_connect_with_arguments_it_does_not_know_names_them():
    with pytest.raises(TypeError, match=r"connect\(\) got an unexpected argument 'cells'"):
        miles_protocol.connect_arguments(("PS", "PLACEMENT", "all"), {"cells": 1})
    with pytest.raises(TypeError, match=r"connect\(\) is missing selector"):
        miles_protocol.connect_arguments(("PS", "PLACEMENT"), {})


def test_a_rank_that_does_not_send_runs_no_update():
    protocol = P2PWeightsProtocol(_args())
    protocol.is_sender = False
    assert protocol.begin_sync(1, lambda **_: iter(())) is True
    protocol.finalize(1)
    assert protocol.pop_metrics() == {}
    with pytest.raises(ConfigError, match="is_sender"):
        protocol.send_bucket(_bucket("a"))


def test_miles_owns_no_engine_session_call():
    """miles' updater skips pause / begin / end / version / resume: p2pweights runs them."""
    assert P2PWeightsProtocol.use_weight_update_session is False
    assert P2PWeightsProtocol.supports_lora is False


def test_a_draft_only_selector_is_refused_before_anything_connects():
    protocol = P2PWeightsProtocol(_args())
    with pytest.raises(ConfigError, match=r"'target'.*separate model"):
        protocol.connect([], None, None, None, None, "target")
    with pytest.raises(ConfigError, match=r"'target'.*separate model"):
        protocol.connect([], None, None, ["cell-0"], None, None, "target")
    assert protocol.session is None and protocol.rollout_engines is None


def test_engine_urls_from_miles_clients():
    clients = [
        types.SimpleNamespace(server_url="http://a:1"),
        types.SimpleNamespace(server_url="http://b:2"),
    ]
    assert engine_urls(clients) == ["http://a:1", "http://b:2"]
    with pytest.raises(ConfigError, match="SGLangApiClient"):
        engine_urls([object()])


def test_protocol_factory_carries_a_config():
    config = SyncConfig(buffer_bytes="2MiB")
    protocol = protocol_factory(config)(_args())
    assert isinstance(protocol, P2PWeightsProtocol) and protocol.sync_config is config
    assert isinstance(miles_protocol.build_protocol(_args()), P2PWeightsProtocol)


# -- miles' flags ---------------------------------------------------------------------------


def test_a_bucket_size_below_one_mib_is_accepted(monkeypatch):
    """miles accepts any --update-weight-buffer-size; the staging buffer keeps its floor."""
    monkeypatch.setattr(miles_args, "_node_address", lambda: "10.0.0.7")
    config = miles.config_from_args(_args(update_weight_buffer_size=256 * 2**10), None, 0, 1)
    assert config.buffer_bytes == 2**20


@pytest.mark.parametrize(
    ("env", "p2p_transport", "expected"),
    [
        ({}, None, MooncakeConfig(protocol="rdma", local_hostname="10.0.0.7")),
        ({}, "nixl", NixlConfig()),
        (
            {"P2PWEIGHTS_MILES_TRANSPORT": "mooncake-tcp"},
            None,
            MooncakeConfig(protocol="tcp", local_hostname="10.0.0.7"),
        ),
        ({"P2PWEIGHTS_MILES_TRANSPORT": "NIXL"}, None, NixlConfig()),
        (
            {"P2PWEIGHTS_MILES_HOSTNAME": "h1"},
            None,
            MooncakeConfig(protocol="rdma", local_hostname="h1"),
        ),
        (
            {"P2PWEIGHTS_MILES_TRANSPORT": "mooncake-rdma"},
            "nixl",
            MooncakeConfig(protocol="rdma", local_hostname="10.0.0.7"),
        ),
    ],
)
def test_transport_from_miles_flags_and_environment(monkeypatch, env, p2p_transport, expected):
    monkeypatch.setattr(miles_args, "_node_address", lambda: "10.0.0.7")
    for name in ("P2PWEIGHTS_MILES_TRANSPORT", "P2PWEIGHTS_MILES_HOSTNAME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = _args() if p2p_transport is None else _args(p2p_transport=p2p_transport)
    assert miles.transport_from_args(args) == expected


def test_an_unknown_transport_names_the_choices(monkeypatch):
    monkeypatch.setenv("P2PWEIGHTS_MILES_TRANSPORT", "rdma")
    with pytest.raises(ConfigError, match="mooncake-rdma, mooncake-tcp or nixl"):
        miles.transport_from_args(_args())


# -- which seam install picks -----------------------------------------------------------------


def _fake_miles(monkeypatch, modules: dict[str, dict]) -> None:
    """Only these miles modules exist (with these members); every package above them too."""
    for name in [n for n in sys.modules if n == "miles" or n.startswith("miles.")]:
        monkeypatch.delitem(sys.modules, name)
    package_names = {"miles"}
    for path in modules:
        parts = path.split(".")
        package_names.update(".".join(parts[:depth]) for depth in range(1, len(parts)))
    for name in package_names:
        package = types.ModuleType(name)
        package.__path__ = []
        monkeypatch.setitem(sys.modules, name, package)
    for path, members in modules.items():
        module = types.ModuleType(path)
        for key, value in members.items():
            setattr(module, key, value)
        monkeypatch.setitem(sys.modules, path, module)


def _miles_factory(args):
    return ("miles' own", args.update_weight_transfer_mode)


def test_install_on_a_miles_with_the_protocol_routes_p2p_to_p2pweights(monkeypatch):
    _fake_miles(
        monkeypatch,
        {
            miles._PROTOCOL: {"WeightTransferProtocol": object},
            miles._UPDATER: {"get_weight_transfer_protocol": _miles_factory},
        },
    )
    assert miles.miles_seam() == "protocol"
    assert miles.install(_args(update_weight_transfer_mode="p2p")) is P2PWeightsProtocol
    miles.install(_args(update_weight_transfer_mode="p2p"))  # twice: wraps miles' once
    factory = sys.modules[miles._UPDATER].get_weight_transfer_protocol
    assert isinstance(factory(_args(update_weight_transfer_mode="p2p")), P2PWeightsProtocol)
    assert factory(_args(update_weight_transfer_mode="broadcast")) == ("miles' own", "broadcast")
    assert factory._miles_factory is _miles_factory
    config = SyncConfig(buffer_bytes="2MiB")
    miles.install(_args(update_weight_transfer_mode="p2p"), config=config)
    protocol = sys.modules[miles._UPDATER].get_weight_transfer_protocol(
        _args(update_weight_transfer_mode="p2p")
    )
    assert protocol.sync_config is config


def test_a_miles_with_neither_seam_fails_naming_it(monkeypatch):
    _fake_miles(monkeypatch, {"miles.backends.megatron_utils.actor": {}})
    with pytest.raises(FrameworkMismatchError) as caught:
        miles.install(_args(update_weight_transfer_mode="p2p"))
    message = str(caught.value)
    assert "miles of unknown version" in message
    assert "WeightTransferProtocol" in message and "DistBucketedWeightUpdateMixin" in message
    assert "Nothing was installed" in message


def test_no_miles_at_all_is_named_so(monkeypatch):
    for name in [n for n in sys.modules if n == "miles" or n.startswith("miles.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "miles", None)  # import miles raises
    with pytest.raises(FrameworkMismatchError, match="miles is not importable"):
        miles.miles_seam()
