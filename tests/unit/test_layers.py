"""The package's layering (docs/architecture.md, "Layers"): every import points down.

Each top-level part of ``p2pweights`` (a subpackage, or a top-level module) sits on one
layer below; a module imports only from its own part or from parts on lower layers.
The trainer side and the engine side never import each other (both build on ``wire``,
``transports``, ``source`` and ``replica``), and no library module imports ``testing``.
Imports under ``if TYPE_CHECKING:`` do not run and are not counted; imports inside
functions are.
"""

from __future__ import annotations

import ast
from pathlib import Path

import p2pweights

LAYERS = [  # bottom first
    ["errors"],
    ["environment", "transport_registry"],
    [
        "config",
        "report",
        "logs",
        "console",
        "progress",
        "bounded_cache",
        "thread_patch",
        "polling",
        "one_call",
    ],
    ["wire"],  # what crosses between the sides: pure data and codecs
    ["transports", "source", "adapters"],
    ["replica"],  # sglang knowledge, shared by both sides
    ["engine_side", "engines", "delta"],
    ["sglang_plugin", "local_engine", "plan", "verification"],
    ["transfer"],
    ["collective", "sync_connection"],
    ["update_attempt"],
    ["sync_session"],
    ["integrations", "doctor", "planner", "reference_check", "testing"],
    ["verify", "session"],  # old names (reference_check, sync_session) re-exporting them
    ["demo"],
    ["cli"],
]
TRAINER_SIDE = {"engines", "delta", "plan", "verification", "transfer"}
ENGINE_SIDE = {"engine_side", "sglang_plugin", "local_engine"}

ROOT = Path(p2pweights.__file__).parent


def _imports() -> list[tuple[str, str, str]]:
    """(importing part, imported part, "file:line") for every import between parts."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        part = rel.parts[0].removesuffix(".py")
        if part == "__init__":
            continue
        package = ["p2pweights", *rel.with_suffix("").parts]
        if path.name != "__init__.py":
            package.pop()
        tree = ast.parse(path.read_text())
        skipped = {
            id(node)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
            for stmt in block.body
            for node in ast.walk(stmt)
        }
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                names = [module] if node.module else [f"{module}.{a.name}" for a in node.names]
                if module == "p2pweights":
                    names = [f"p2pweights.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                bits = name.split(".")
                if bits[0] == "p2pweights" and len(bits) > 1 and bits[1] != part:
                    found.append((part, bits[1], f"{rel}:{node.lineno}"))
    return found


def test_every_part_has_a_layer() -> None:
    placed = {part for layer in LAYERS for part in layer}
    parts = {p.name.removesuffix(".py") for p in ROOT.iterdir() if p.suffix == ".py" or p.is_dir()}
    parts -= {"__init__", "__pycache__", "models"}
    assert parts <= placed, f"place these in LAYERS (docs/architecture.md): {parts - placed}"


def test_every_import_points_down() -> None:
    layer = {part: i for i, parts in enumerate(LAYERS) for part in parts}
    up = [
        f"{where}: {a} -> {b}" for a, b, where in _imports() if b in layer and layer[b] >= layer[a]
    ]
    assert not up, "imports that do not point to a lower layer:\n" + "\n".join(up)


def test_the_sides_do_not_import_each_other() -> None:
    crossing = [
        f"{where}: {a} -> {b}"
        for a, b, where in _imports()
        if (a in TRAINER_SIDE and b in ENGINE_SIDE) or (a in ENGINE_SIDE and b in TRAINER_SIDE)
    ]
    assert not crossing, "\n".join(crossing)


def test_the_library_does_not_import_testing() -> None:
    assert not [where for _, b, where in _imports() if b == "testing"]
