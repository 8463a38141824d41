"""Scripts run under Triton's interpreter, each in a process of its own (the variable
that turns the interpreter on must be set before Triton is imported)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def assert_prints_ok(script: str) -> None:
    """Run ``script`` (it sets ``TRITON_INTERPRET=1`` itself); it must print only ``ok``."""
    pytest.importorskip("triton")
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.strip() == "ok"
