"""sglang's model registry holding only the model modules a process builds
(``replica.sglang.model_registry``) resolves every architecture to the class sglang's full
registry resolves it to (issue 31: a first connect imported all 259 model modules)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("sglang")
pytestmark = pytest.mark.integration

PROBE = r"""
import json, sys
from p2pweights.replica.sglang import compat, model_registry
compat.check_sglang()
model_registry.prepare(["Qwen3ForCausalLM"])
from sglang.srt.models.registry import ModelRegistry
lazy = not ModelRegistry._default_models_loaded
imported = sorted(m for m in sys.modules if m.startswith("sglang.srt.models."))
cls, arch = ModelRegistry.resolve_model_cls(["Qwen3ForCausalLM"])
first = f"{cls.__module__}.{cls.__qualname__}"
ModelRegistry.get_supported_archs()  # asking for them loads every default model
declared = {}
for name, module in list(sys.modules.items()):
    entry = getattr(module, "EntryClass", None) if name.startswith("sglang.srt.models.") else None
    for c in entry if isinstance(entry, list) else [entry] if entry is not None else []:
        declared[c.__name__] = name
found = {arch: model_registry._module_declaring(arch) for arch in ModelRegistry.models}
print(json.dumps({"lazy": lazy, "imported": imported, "first": first,
                  "after": ModelRegistry._default_models_loaded, "declared": declared,
                  "found": found, "everything": sorted(ModelRegistry.models)}))
"""


def test_lazy_registry_resolves_what_the_full_one_does() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["lazy"]
    assert "sglang.srt.models.qwen3" in found["imported"]
    assert len(found["imported"]) < 10, found["imported"]  # not sglang's 259 modules
    assert found["first"] == "sglang.srt.models.qwen3.Qwen3ForCausalLM"
    assert found["after"]  # any other question loads every default model, as sglang does
    # each architecture the source scan places, it places where sglang's registry found it
    placed = {arch: module for arch, module in found["found"].items() if module is not None}
    wrong = {
        a: (m, found["declared"].get(a)) for a, m in placed.items() if found["declared"].get(a) != m
    }
    assert not wrong
    assert len(placed) > 0.9 * len(found["everything"])  # and it places nearly all of them
