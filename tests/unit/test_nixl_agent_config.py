"""NIXL agents are created with a progress thread that waits for events, never one that spins."""

from __future__ import annotations

import sys

import pytest

nixl_api = pytest.importorskip("nixl._api")

from p2pweights.transports import nixl as nixl_transport  # noqa: E402


def _bindings():
    return sys.modules[nixl_api.nixl_agent.__module__].nixlBind


def test_the_config_nixl_builds_keeps_the_wait_it_is_given():
    """``nixl_agent`` sets ``pthrDelay = 0`` on the config it builds; inside the context
    the assignment keeps ``_PROGRESS_WAIT_US``, and the bindings are restored after."""
    original = _bindings().nixlAgentConfig
    with nixl_transport._waiting_progress_thread(nixl_api.nixl_agent):
        config = _bindings().nixlAgentConfig()
        config.pthrDelay = 0  # what nixl_agent.__init__ does
        assert config.pthrDelay == nixl_transport._PROGRESS_WAIT_US
        assert isinstance(config, original)
    assert _bindings().nixlAgentConfig is original


def test_bindings_without_the_field_leave_nixl_alone():
    class Agent:
        __module__ = "not.a.nixl.module"

    with nixl_transport._waiting_progress_thread(Agent):
        pass  # no bindings found: nothing patched, nothing raised
