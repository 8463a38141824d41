"""The public surface is exactly __all__ of the public modules, every name the docs tell
users to import imports, and importing p2pweights loads no heavy dependency."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

import p2pweights

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

PUBLIC = {
    "p2pweights": {
        "AbortReport",
        "ConfigError",
        "CudaIpcConfig",
        "DeltaConfig",
        "DeltaReport",
        "EngineRankKey",
        "EngineReport",
        "EngineStateError",
        "EngineUnreachable",
        "InputChangedError",
        "SessionBusyError",
        "UnsettledWrite",
        "EngineEndpoint",
        "EngineError",
        "LayoutMismatchError",
        "MooncakeConfig",
        "NixlConfig",
        "P2PWeightsError",
        "PlanError",
        "SyncConfig",
        "Timeouts",
        "TrainerTopology",
        "TransportConfigBase",
        "TransferError",
        "TransportError",
        "UpdateReport",
        "WeightSyncSession",
        "__version__",
    },
    "p2pweights.verify": {
        "EngineClient",
        "HfTensors",
        "checksums_by_rank",
        "compare",
        "engine_checksums",
        "expected_checksums",
        "verify_engine",
    },
    "p2pweights.reference_check": {
        "EngineClient",
        "HfTensors",
        "checksums_by_rank",
        "compare",
        "engine_checksums",
        "expected_checksums",
        "verify_engine",
    },
    "p2pweights.local_engine": {"LocalEngine", "free_port"},
    "p2pweights.logs": {"apply_log_level", "configure", "keep_third_party_noise_out", "quiet"},
    "p2pweights.testing": {
        "MODEL_NAMES",
        "hf_checkpoint_names_and_shapes",
        "model_config",
        "save_safetensors",
        "synthetic_weights",
        "write_model_dir",
    },
}

# Public names of modules whose full surface other work still grows: at least these.
AT_LEAST = {
    "p2pweights.adapters": {"torch_agree"},
    "p2pweights.transports": {"Publisher", "Transport", "Write", "register_transport"},
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_exported_members(module: str) -> None:
    mod = importlib.import_module(module)
    assert set(mod.__all__) == PUBLIC[module]
    for name in PUBLIC[module]:
        assert hasattr(mod, name), f"{module}.{name}"


@pytest.mark.parametrize("module", sorted(AT_LEAST))
def test_documented_members_exist(module: str) -> None:
    mod = importlib.import_module(module)
    assert AT_LEAST[module] <= set(mod.__all__)


@pytest.mark.parametrize("name", ["EngineClient", "verify_engine"])
def test_moved_names_still_import_with_a_warning(name: str) -> None:
    """Former top-level names (issue 30) still work for one release, warn naming their
    new home, and are the same object as there; ``import *`` no longer brings them."""
    import p2pweights.verify

    with pytest.warns(DeprecationWarning, match=f"p2pweights.verify.{name}"):
        old = getattr(p2pweights, name)
    assert old is getattr(p2pweights.verify, name)
    with pytest.warns(DeprecationWarning, match="moved to p2pweights.verify"):
        exec(f"from p2pweights import {name}", {})
    assert name not in p2pweights.__all__


def test_the_old_session_module_still_imports_with_a_warning() -> None:
    """``p2pweights.session`` became ``p2pweights.sync_session`` (issue 42); the old module
    re-exports the session for one release and warns naming the new one."""
    sys.modules.pop("p2pweights.session", None)
    with pytest.warns(DeprecationWarning, match="p2pweights.sync_session"):
        old = importlib.import_module("p2pweights.session")
    assert old.WeightSyncSession is p2pweights.WeightSyncSession


def _documented_imports() -> set[tuple[str, str]]:
    """(module, name) for every ``from p2pweights... import X`` and ``p2pweights.a.b`` in
    the README and docs/."""
    found: set[tuple[str, str]] = set()
    for path in DOCS:
        text = path.read_text()
        for module, names in re.findall(r"from (p2pweights[\w.]*) import ([\w, ]+)", text):
            found |= {(module, n.strip()) for n in names.split(",") if n.strip()}
        for dotted in re.findall(r"\bp2pweights(?:\.\w+)+", text):
            module, _, name = dotted.rpartition(".")
            found.add((module, name))
    return found


def test_every_documented_import_imports() -> None:
    documented = _documented_imports()
    assert ("p2pweights.local_engine", "LocalEngine") in documented  # the scan sees the docs
    missing = []
    for module, name in sorted(documented):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            missing.append(f"{module} (module)")
            continue
        if not hasattr(mod, name) and importlib.util.find_spec(f"{module}.{name}") is None:
            missing.append(f"{module}.{name}")
    assert not missing, f"the docs name what does not import: {missing}"


def test_version_is_the_distribution_version() -> None:
    from importlib.metadata import version

    assert re.fullmatch(r"\d+\.\d+\.\d+([ab]\d+|rc\d+|\.dev\d+)?", p2pweights.__version__)
    assert version("p2pweights") == p2pweights.__version__


def test_package_data_ships_with_the_package() -> None:
    """py.typed and the bundled model configs sit next to the imported package (in the
    source tree and in an installed wheel alike)."""
    here = Path(p2pweights.__file__).parent
    assert (here / "py.typed").is_file()
    assert (here / "models" / "qwen3-demo.json").is_file()


HEAVY = ("torch", "sglang", "mooncake", "nixl", "transformers", "triton", "numpy")


def _loaded_after(code: str) -> list[str]:
    """The heavy top-level modules a fresh interpreter holds after running ``code``."""
    probe = f"{code}\nimport sys\nprint(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return ast.literal_eval(out.stdout.strip().splitlines()[-1])


def test_import_loads_no_heavy_dependency() -> None:
    """``import p2pweights`` loads neither torch nor sglang nor a transport (issue 31)."""
    assert _loaded_after("import p2pweights") == []


def test_a_session_loads_no_sglang_until_it_connects() -> None:
    """Making and closing a session (what a trainer does at start-up, on every rank) loads
    torch but neither sglang nor transformers: sglang's import costs seconds and changes
    the process's warning filters. A module-level import of an sglang module from the
    trainer side (plan.owners once did) shows here."""
    loaded = _loaded_after("import p2pweights\np2pweights.WeightSyncSession().close()")
    assert "torch" in loaded
    assert not {"sglang", "transformers"} & set(loaded), loaded


def test_cli_help_loads_no_heavy_dependency() -> None:
    """``p2pweights --help`` (and each command's help) starts without torch or sglang."""
    for argv in (["--help"], ["plan", "--help"], ["doctor", "--help"], ["engine", "--help"]):
        code = (
            "import contextlib, io\n"
            "from p2pweights.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            f"    main({argv!r})"
        )
        assert _loaded_after(code) == [], argv


def test_public_names_resolve_lazily() -> None:
    """Each name of ``__all__`` resolves on first use, ``dir()`` lists them, and an unknown
    name is an AttributeError (what ``hasattr`` and ``from p2pweights import X`` rely on)."""
    code = (
        "import p2pweights\n"
        "assert set(p2pweights.__all__) <= set(dir(p2pweights))\n"
        "assert not hasattr(p2pweights, 'NoSuchName')\n"
        "from p2pweights import SyncConfig, ConfigError\n"
        "assert SyncConfig.__module__ == 'p2pweights.config'"
    )
    assert _loaded_after(code) == []  # the configs and errors need no torch either
    namespace: dict[str, object] = {}
    exec("from p2pweights import *", namespace)
    assert set(p2pweights.__all__) <= set(namespace)
