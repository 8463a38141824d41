"""The public surface is exactly __all__, and importing it loads no heavy dependency."""

from __future__ import annotations

import subprocess
import sys

import p2pweights

PUBLIC = {
    "ConfigError",
    "EngineEndpoint",
    "EngineError",
    "LayoutMismatchError",
    "MooncakeConfig",
    "NixlConfig",
    "P2PWeightsError",
    "PlanError",
    "SyncConfig",
    "TransferError",
    "TransportError",
    "UpdateReport",
    "WeightSyncSession",
    "__version__",
}


def test_exported_members():
    assert set(p2pweights.__all__) == PUBLIC
    for name in PUBLIC:
        assert hasattr(p2pweights, name)


def test_import_loads_no_sglang_or_transport():
    code = (
        "import sys, p2pweights; "
        "print(sorted(m for m in ('sglang', 'mooncake', 'nixl') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
