"""examples/ runs as a newcomer runs it (``python examples/x.py``), and the README's
example is the code one of them runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
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


@pytest.fixture(scope="module")
def example_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, _Run]]:
    """Every example started at once, each in a process of its own (``python examples/x.py``
    as a newcomer runs it): each is single-threaded (``OMP_NUM_THREADS=1``) and spends much
    of its time starting its engine, so two cores run the three in about half the time one
    after the other takes. Each test waits for its own script."""
    folder = tmp_path_factory.mktemp("examples")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = {script: _Run(script, folder, env) for script in sorted(EXPECTED)}
    yield runs
    for run in runs.values():
        run.stop()


class _Run:
    """One example script's process; its output goes to files (no pipe fills up)."""

    def __init__(self, script: str, folder: Path, env: dict[str, str]) -> None:
        self.out, self.err = folder / f"{script}.out", folder / f"{script}.err"
        with self.out.open("wb") as out, self.err.open("wb") as err:
            self.process = subprocess.Popen(
                [sys.executable, str(EXAMPLES / script)], stdout=out, stderr=err, cwd=ROOT, env=env
            )

    def wait(self, timeout_s: float) -> tuple[int, str, str]:
        """Exit status, stdout, stderr (``TimeoutExpired`` after ``timeout_s``)."""
        returncode = self.process.wait(timeout=timeout_s)
        return returncode, self.out.read_text(), self.err.read_text()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.mark.integration
@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_example_runs(script: str, example_runs: dict[str, _Run]) -> None:
    returncode, stdout, stderr = example_runs[script].wait(timeout_s=600)
    assert returncode == 0, stdout[-3000:] + stderr[-6000:]
    assert EXPECTED[script] in stdout
