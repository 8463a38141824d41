"""Opening sglang's model registry lazily sets ``SGLANG_EXTERNAL_MODEL_PACKAGE`` for the
import alone: never left in the process's environment, also when the import raises (a
child process started with it could not import sglang's registry)."""

from __future__ import annotations

import importlib
import os
import sys

import pytest

from p2pweights.replica.sglang import model_registry


def test_the_variable_is_restored_when_the_registry_import_raises(monkeypatch):
    pytest.importorskip("sglang")
    monkeypatch.delenv(model_registry._EXTERNAL, raising=False)
    monkeypatch.delitem(sys.modules, model_registry.REGISTRY, raising=False)
    real_import = importlib.import_module
    seen = []

    def failing(name, *args, **kwargs):
        if name == model_registry.REGISTRY:
            seen.append(os.environ.get(model_registry._EXTERNAL))
            raise ImportError("the registry broke")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(model_registry.importlib, "import_module", failing)
    with pytest.raises(ImportError, match="the registry broke"):
        model_registry._lazy_registry()
    assert seen == [model_registry.NO_MODELS]  # set while sglang imports its registry
    assert model_registry._EXTERNAL not in os.environ
