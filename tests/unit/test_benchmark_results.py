"""The results page and the committed results files agree: every file a page names is in
``benchmarks/results/``, and every file there is named by a page (the rest of the history
is in git, docs/benchmarks-archive.md says where)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
# the pages whose numbers cite results files (the archive cites files kept in git history)
CITING = [
    ROOT / "docs" / "benchmarks.md",
    ROOT / "docs" / "plan-vs-field.md",
    ROOT / "src" / "p2pweights" / "plan" / "cost.py",
]
NAME = re.compile(r"[A-Za-z0-9_*-]+\.(?:json|txt)")


def _cited() -> set[str]:
    return {name for page in CITING for name in NAME.findall(page.read_text())}


def _resolve(name: str) -> list[Path]:
    return sorted(RESULTS.glob(name)) if "*" in name else [RESULTS / name]


def test_every_cited_results_file_is_committed() -> None:
    missing = [
        name
        for name in sorted(_cited())
        if not all(path.exists() for path in _resolve(name)) or not _resolve(name)
    ]
    # a name that is no results file (a config such as qwen3-1g.json) is left alone
    missing = [name for name in missing if not (ROOT / "benchmarks" / "configs" / name).exists()]
    assert not missing, f"named by a page but not in benchmarks/results/: {missing}"


def test_every_committed_results_file_is_cited() -> None:
    cited = {path.name for name in _cited() for path in _resolve(name)}
    uncited = sorted(path.name for path in RESULTS.iterdir() if path.name not in cited)
    assert not uncited, (
        f"in benchmarks/results/ but cited by no page: {uncited} (cite it in "
        "docs/benchmarks.md or remove it; the archive's history stays in git)"
    )
