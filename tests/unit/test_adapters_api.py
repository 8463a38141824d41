"""The adapters' public surface, and that importing it loads no framework."""

from __future__ import annotations

import subprocess
import sys

import p2pweights.adapters


def test_exported_members():
    assert set(p2pweights.adapters.__all__) == {
        "hf_named_tensors",
        "owned_tensors",
        "torch_agree",
        "torch_gather",
    }


def test_import_loads_no_framework():
    code = (
        "import sys, p2pweights.adapters, p2pweights.adapters.megatron; "
        "print(sorted(m for m in ('transformers', 'megatron', 'sglang') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
