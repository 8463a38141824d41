"""Error classes users catch (issue 39 item 9): a missing transport package names an
extra that exists, any other import error is shown as it is; engine calls failing
together keep the class they share."""

from __future__ import annotations

import importlib

import pytest

from p2pweights.errors import ConfigError
from p2pweights.transports import _load


def _failing_import(error: ImportError):
    real = importlib.import_module

    def imported(name: str, *args, **kwargs):
        if name.startswith("p2pweights.transports."):
            raise error
        return real(name, *args, **kwargs)

    return imported


def test_a_bug_in_a_transport_module_is_not_reported_as_a_missing_extra(monkeypatch):
    broken = ImportError("cannot import name 'Thing' from 'p2pweights.transports.base'")
    monkeypatch.setattr(importlib, "import_module", _failing_import(broken))
    for kind in ("cuda_ipc", "mooncake", "nixl"):
        with pytest.raises(ImportError, match="cannot import name 'Thing'") as caught:
            _load(f"p2pweights.transports.{kind}:X", kind, "trainer side")
        assert not isinstance(caught.value, ConfigError)


def test_a_missing_transport_package_names_an_extra_that_exists(monkeypatch):
    from pathlib import Path

    import tomllib

    pyproject = Path(__file__).parents[2] / "pyproject.toml"
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    for kind, package in (("mooncake", "mooncake"), ("nixl", "nixl")):
        missing = ModuleNotFoundError(f"No module named '{package}'", name=package)
        monkeypatch.setattr(importlib, "import_module", _failing_import(missing))
        with pytest.raises(ConfigError, match=r"p2pweights\[(\w[\w-]*)\]") as caught:
            _load(f"p2pweights.transports.{kind}:X", kind, "trainer side")
        named = caught.value.args[0].split("p2pweights[")[1].split("]")[0]
        assert named in extras, named
    missing = ModuleNotFoundError("No module named 'pycuda'", name="pycuda")
    monkeypatch.setattr(importlib, "import_module", _failing_import(missing))
    with pytest.raises(ModuleNotFoundError):  # cuda_ipc has no extra: shown as it is
        _load("p2pweights.transports.cuda_ipc:X", "cuda_ipc", "trainer side")


def test_engine_calls_failing_together_keep_their_common_error_class():
    """``concurrently`` raises one error for several failures: the class they share (an
    ``EngineStateError`` stays one, issue 39 item 9), else ``EngineError``."""
    from p2pweights.engines.concurrency import concurrently
    from p2pweights.errors import (
        EngineError,
        EngineStateError,
        EngineUnreachable,
        LayoutMismatchError,
        TransferError,
    )

    def failing(classes):
        def call(index: int) -> None:
            raise classes[index](f"engine http://e{index}: failed")

        return call

    cases = [
        ([EngineStateError, EngineStateError], EngineStateError),
        ([LayoutMismatchError, LayoutMismatchError], LayoutMismatchError),
        ([EngineUnreachable, EngineUnreachable], EngineUnreachable),
        ([TransferError, TransferError], TransferError),
        ([EngineStateError, EngineUnreachable], EngineError),
        ([TransferError, EngineUnreachable], EngineError),
    ]
    for classes, expected in cases:
        with pytest.raises(EngineError if expected is not TransferError else TransferError) as c:
            concurrently(failing(classes), [0, 1])
        assert type(c.value) is expected, (classes, type(c.value))
        assert "http://e0" in str(c.value) and "http://e1" in str(c.value)
