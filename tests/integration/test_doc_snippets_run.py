"""The docs' Python snippets listed in tests/unit/test_doc_snippets.py's ``RUN`` run as
written: each in a fresh interpreter (``python -c <the block>``), as a reader pastes it,
and must exit 0 with what it prints."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

_LIST = Path(__file__).parents[1] / "unit" / "test_doc_snippets.py"
_spec = importlib.util.spec_from_file_location("_doc_snippet_list", _LIST)
assert _spec is not None and _spec.loader is not None
_listed = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_listed)
RUN, snippets = _listed.RUN, _listed.snippets

pytestmark = pytest.mark.integration

EXPECTED = {
    ("docs/quickstart.md", 0): "http://127.0.0.1:",
    ("docs/quickstart.md", 1): "version step-1:",
    ("docs/quickstart.md", 2): "version moe-1:",
    ("docs/quickstart.md", 3): "version step-2:",
    ("docs/quickstart.md", 5): "",
}


@pytest.mark.parametrize("key", sorted(RUN), ids=lambda k: f"{k[0]}#{k[1]}")
def test_the_snippet_runs_as_written(key: tuple[str, int], tmp_path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", snippets()[key]],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert EXPECTED[key] in done.stdout, done.stdout[-2000:]
