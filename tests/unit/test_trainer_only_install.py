"""A trainer-only install (``pip install p2pweights``, without the ``[engine]`` extra) has no
fastapi or uvicorn: the trainer side imports, builds a session and plans without them, and
``p2pweights engine`` says which extra to install.

Each case runs in a subprocess whose ``sys.modules`` blocks both packages (an import of
either raises ``ImportError``), as if they were not installed.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

_BLOCK = """
import sys
for name in ("fastapi", "uvicorn"):
    sys.modules[name] = None  # an import of it raises ImportError, as if not installed
"""


def _run(code: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _BLOCK + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_trainer_side_imports_builds_a_session_and_plans(tmp_path):
    done = _run(
        f"""
        import contextlib, io, json

        import p2pweights
        from p2pweights import MooncakeConfig, SyncConfig, WeightSyncSession
        from p2pweights.cli import main
        from p2pweights.testing import write_model_dir

        session = WeightSyncSession(SyncConfig(transport=MooncakeConfig(protocol="tcp")))
        folder = write_model_dir("qwen3-tiny", {str(tmp_path / "qwen3-tiny")!r})
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(
                ["--log-level", "WARNING", "plan", "--model", str(folder),
                 "--engine", "tp=2", "--senders", "2", "--json"]
            )
        assert code == 0, code
        assert json.loads(out.getvalue())["p2p_bytes"] > 0
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("fastapi", "uvicorn"))
        assert all(sys.modules[m] is None for m in loaded), loaded
        print("trainer side ok")
        """
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "trainer side ok" in done.stdout


def test_no_trainer_side_module_imports_them():
    # the engine side's servers need the extra; verl's checkpoint engine imports uvicorn itself
    done = _run(
        """
        import importlib, pkgutil

        import p2pweights

        ENGINE_SIDE = ("p2pweights.local_engine", "p2pweights.sglang_plugin")
        VERL = "p2pweights.integrations.verl"  # verl's own modules import uvicorn
        failed = []
        for module in pkgutil.walk_packages(p2pweights.__path__, "p2pweights."):
            if module.name.startswith(ENGINE_SIDE) or module.name == VERL:
                continue
            try:
                importlib.import_module(module.name)
            except ImportError as exc:  # another optional package missing is not ours
                if exc.name in ("fastapi", "uvicorn"):
                    failed.append(f"{module.name}: {exc}")
        assert not failed, failed
        print("imported")
        """
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "imported" in done.stdout


def test_engine_command_names_the_extra():
    done = _run(
        """
        from p2pweights.cli import main
        sys.exit(main(["engine", "--model", "qwen3-tiny", "--port", "1"]))
        """,
        timeout=120,
    )
    assert done.returncode != 0
    assert "pip install 'p2pweights[engine]'" in done.stderr, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
