"""Every Python snippet in README.md and docs/ is accounted for: run as written by a test
(``RUN`` here, run by tests/integration/test_doc_snippets.py; or ``RUN_ELSEWHERE``), or a
fragment of a framework's own code (``FRAGMENTS``, with why it cannot run here), whose
syntax is checked and whose p2pweights imports must import. A new snippet fails this test
until it is put in one of them."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)

RUN = {
    ("docs/quickstart.md", 0): "a local engine from a shipped tiny config",
    ("docs/quickstart.md", 1): "two local engines, one update with a version",
    ("docs/quickstart.md", 2): "a MoE engine with expert parallelism",
    ("docs/quickstart.md", 3): "a partial update of one layer's MLP",
    ("docs/quickstart.md", 5): "p2pweights.logs.quiet()",
}
"""(page, index of the python block on it) -> what it does; tests/integration runs it."""

RUN_ELSEWHERE = {
    ("README.md", 0): "tests/integration/test_examples.py: examples/update_local_engine.py's "
    "# [readme] regions are this block, and the script runs",
    ("docs/integrations/plain-pytorch.md", 0): "tests/integration/test_plain_pytorch_guide.py "
    "runs it under torchrun",
}

FRAGMENTS = {
    ("docs/quickstart.md", 4): "CUDA IPC: needs GPUs and an engine on the same host "
    "(tests/integration/test_cuda_ipc_gpu.py on the GPU machine)",
    ("docs/metrics.md", 0): "a line inside a training loop (session, step, wandb)",
    ("docs/cuda-ipc-plugin.md", 0): "needs a real sglang server on the trainer's GPU with the "
    "CUDA IPC plugin (tests/real_sglang/test_real_server.py's tp1-cuda-ipc on a GPU)",
    ("docs/nixl-plugin.md", 0): "needs sglang servers with the NIXL plugin at those hosts",
    ("docs/integrations/README.md", 0): "Megatron-Bridge and Megatron's model chunks",
    ("docs/integrations/miles-slime.md", 0): "miles' init hook, called by miles with its args",
    ("docs/integrations/nemo-rl.md", 0): "methods on NeMo-RL's worker and synchronizer classes",
    ("docs/integrations/openrlhf.md", 0): "inside OpenRLHF's actor (self, deepspeed)",
    ("docs/integrations/skyrl.md", 0): "inside SkyRL's FSDP policy worker (self, its config)",
}


def snippets() -> dict[tuple[str, int], str]:
    found = {}
    for page in PAGES:
        for index, match in enumerate(_BLOCK.finditer(page.read_text())):
            found[(str(page.relative_to(ROOT)), index)] = match.group(1)
    return found


def test_every_snippet_is_run_or_named_a_fragment() -> None:
    known = RUN.keys() | RUN_ELSEWHERE.keys() | FRAGMENTS.keys()
    assert sorted(snippets()) == sorted(known)
    assert not (RUN.keys() & FRAGMENTS.keys())


@pytest.mark.parametrize("key", sorted(FRAGMENTS), ids=lambda k: f"{k[0]}#{k[1]}")
def test_a_fragment_parses_and_its_p2pweights_imports_import(key: tuple[str, int]) -> None:
    tree = ast.parse(snippets()[key])
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("p2pweights"):
            module = importlib.import_module(node.module or "")
            for alias in node.names:
                assert hasattr(module, alias.name), f"{node.module}.{alias.name} ({key})"
