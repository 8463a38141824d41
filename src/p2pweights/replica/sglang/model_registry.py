"""sglang's model registry, holding only the model modules this process builds.

Imported the ordinary way, ``sglang.srt.models.registry`` imports every model module of
sglang (259 files in 0.5.23): 3.4 s of CPU on the 2-core development machine, against
0.2 s for the one module a Qwen3 replica needs; it was the largest part of a first
``connect`` after importing sglang itself. sglang has a lazy mode for this
(``SGLANG_EXTERNAL_MODEL_PACKAGE``): the registry starts with an external package's models
and loads every default model the first time it is asked about an architecture it does
not hold. ``prepare`` uses that mode with an empty package, then imports the one sglang
model module whose ``EntryClass`` declares the architecture and registers its classes.

Why a replica's bytes cannot change: sglang's registry maps each architecture to the
class whose ``__name__`` it is among the ``EntryClass`` of its model modules, and asserts
that no two modules declare one name; the class registered here is that class (checked
after import). Any other question (another architecture, the quantized-Mixtral or
Transformers fallbacks, the list of supported architectures) makes the lazy registry load
every default model first, so it is answered as before. A process that imported the
registry already, or that set ``SGLANG_EXTERNAL_MODEL_PACKAGE`` itself, is left as it is.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import re
import sys
import threading
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["prepare"]

REGISTRY = "sglang.srt.models.registry"
MODELS = "sglang.srt.models"
NO_MODELS = "p2pweights._no_sglang_models"
"""An empty package named as sglang's external model package while the registry imports."""
_EXTERNAL = "SGLANG_EXTERNAL_MODEL_PACKAGE"

_LOCK = threading.Lock()
_ENTRY = re.compile(rb"^EntryClass\s*=\s*(\[[^\]]*\]|\w+)\s*$", re.MULTILINE)


def prepare(architectures: Sequence[str]) -> None:
    """Let sglang's registry resolve ``architectures[0]`` without importing every model."""
    if not architectures:
        return
    arch = architectures[0]
    with _LOCK:
        registry = _lazy_registry()
        if registry is None or arch in registry.models:
            return
        module = _module_declaring(arch)
        if module is None:
            return  # asked about, the registry loads every default model as sglang does
        try:
            classes = _entry_classes(importlib.import_module(module))
        except Exception as exc:  # sglang's own registry skips such a module too
            logger.debug("importing %s for %s failed (%r)", module, arch, exc)
            return
        if arch in classes:
            for name, cls in classes.items():
                registry.models.setdefault(name, cls)


def _lazy_registry() -> Any:
    """sglang's ``ModelRegistry`` while it has not loaded its default models, else None."""
    from sglang.srt.environ import envs

    if REGISTRY not in sys.modules:
        if envs.SGLANG_EXTERNAL_MODEL_PACKAGE.get():
            return None  # the user's own lazy setup
        empty = types.ModuleType(NO_MODELS)
        empty.__path__ = []
        sys.modules.setdefault(NO_MODELS, empty)
        # set and restored here, whatever the import raises (sglang's own override
        # restores nothing on an exception): os.environ is the process's, and a child
        # started with this value could not import sglang's registry
        os.environ[_EXTERNAL] = NO_MODELS
        try:
            importlib.import_module(REGISTRY)
        finally:
            os.environ.pop(_EXTERNAL, None)
    registry = sys.modules[REGISTRY].ModelRegistry
    return None if registry._default_models_loaded else registry


def _module_declaring(arch: str) -> str | None:
    """The one sglang model module whose ``EntryClass`` names ``arch`` (read from the
    sources, nothing imported), or None where not exactly one does or one cannot be read."""
    from sglang.srt.environ import envs

    spec = importlib.util.find_spec(MODELS)
    if spec is None or not spec.submodule_search_locations:
        return None
    disabled = set(envs.SGLANG_DISABLED_MODEL_ARCHS.get())
    word = re.compile(rb"\b" + re.escape(arch.encode()) + rb"\b")
    found = []
    for folder in spec.submodule_search_locations:
        for path in sorted(Path(folder).glob("*.py")):
            text = path.read_bytes()
            if b"EntryClass" not in text or not word.search(text):
                continue
            entries = _ENTRY.findall(text)
            if len(entries) != 1 or text.count(b"EntryClass") != 1:
                return None  # declared some other way: let sglang import every model
            if word.search(entries[0]):
                found.append(path.stem)
    if len(found) != 1 or found[0] in disabled:
        return None
    return f"{MODELS}.{found[0]}"


def _entry_classes(module: types.ModuleType) -> dict[str, type]:
    """What sglang's registry takes from ``module``: ``EntryClass`` by ``__name__``."""
    entry = getattr(module, "EntryClass", None)
    if entry is None:
        return {}
    return {cls.__name__: cls for cls in (entry if isinstance(entry, list) else [entry])}
