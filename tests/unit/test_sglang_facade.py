"""sglang is reached only from replica/sglang; the rest of p2pweights goes through its facade."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[2] / "src" / "p2pweights"
INSIDE = PACKAGE / "replica" / "sglang"


def _imports_sglang(path: Path) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        else:
            continue
        if any(name == "sglang" or name.startswith("sglang.") for name in names):
            lines.append(node.lineno)
    return lines


def test_only_replica_sglang_imports_sglang() -> None:
    outside = {
        str(path.relative_to(PACKAGE)): lines
        for path in sorted(PACKAGE.rglob("*.py"))
        if INSIDE not in path.parents
        for lines in [_imports_sglang(path)]
        if lines
    }
    assert outside == {}


def test_importing_the_facade_imports_no_sglang() -> None:
    code = (
        "import sys, p2pweights.replica.sglang.facade, p2pweights.sglang_plugin; "
        "print(sorted(m for m in sys.modules if m == 'sglang' or m.startswith('sglang.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


def test_the_facade_answers_for_the_installed_sglang() -> None:
    sglang = pytest.importorskip("sglang")
    from p2pweights.replica.sglang import facade

    assert facade.version() == sglang.__version__
    assert facade.has_update_api()
    assert sglang.__version__ == facade.compat().SGLANG_VERSION


def test_the_facades_weight_checker_hashes_a_rank_model() -> None:
    pytest.importorskip("sglang")
    import torch

    from p2pweights.replica.ranks import RankSpec
    from p2pweights.replica.sglang import facade

    spec = RankSpec.derive(tp_size=2, engine_rank=1)
    model = torch.nn.Linear(4, 2)
    checker = facade.weight_checker(lambda: model, spec)
    with facade.rank_scope(spec):
        info = checker.handle("checksum", role="target")
    assert sorted(info["checksums"]) == ["bias", "weight"]
    assert info["parallelism_info"]["tp_rank"] == 1
