"""examples/ runs as a newcomer runs it (``python examples/x.py``), and the README's
example is the code one of them runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

# script -> a line its output must hold once it has checked what it did
EXPECTED = {
    "update_local_engine.py": "bit-exact at every engine rank",
    "multi_rank.py": "every trainer rank updated the engine",
    "delta_updates.py": "bit-exact at every engine rank",
}


def test_every_example_is_run_here() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(EXPECTED)


def _readme_regions(text: str) -> str:
    """The lines of an example between its ``# [readme]`` and ``# [/readme]`` markers
    (each region without its blank lines at the ends, one blank line between regions)."""
    regions = re.findall(r"^# \[readme\]\n(.*?)^\s*# \[/readme\]", text, re.S | re.M)
    return "\n\n".join(region.strip("\n") for region in regions) + "\n"


def test_the_readme_example_is_the_example_script() -> None:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Usage\n.*?```python\n(.*?)```", readme, re.S)
    assert block, "README's Usage section has no python block"
    script = (EXAMPLES / "update_local_engine.py").read_text()
    assert block.group(1) == _readme_regions(script)


@pytest.mark.integration
@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_example_runs(script: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / script)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=env,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert EXPECTED[script] in run.stdout
