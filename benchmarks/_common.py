"""Helpers shared by the benchmark scripts: models, engines, host memory, results.

Benchmarks are measurements, never tests: nothing here asserts a timing. Every
script writes ``benchmarks/results/<name>.json``, a markdown table and a PNG, and
replaces its section of ``docs/benchmarks.md`` (between ``<!-- <name>:begin -->``
and ``<!-- <name>:end -->``) so the document shows what the last run measured.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "benchmarks.md"
CONFIGS = ROOT / "benchmarks" / "configs"

GB = 1e9


def named_config(name: str) -> dict[str, Any]:
    """The HF config ``benchmarks/configs/<name>.json``, else the shipped model ``name``'s."""
    from p2pweights.testing import model_config

    path = CONFIGS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else model_config(name)


def qwen3_config(num_layers: int, base: str = "qwen3-demo") -> dict[str, Any]:
    """A Qwen3 config of ``base``'s shape with ``num_layers`` decoder layers."""
    from p2pweights.testing import model_config

    config = model_config(base)
    config["num_hidden_layers"] = num_layers
    return config


def hf_bytes(config: Any) -> int:
    """Bytes of the HF checkpoint tensors of ``config`` (bf16 unless the config says)."""
    from p2pweights.testing import hf_checkpoint_names_and_shapes

    return sum(
        torch.Size(shape).numel() * dtype.itemsize
        for _, shape, dtype in hf_checkpoint_names_and_shapes(config)
    )


def hf_tensors(config: Any, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    from p2pweights.testing import synthetic_weights

    return list(synthetic_weights(config, seed=seed, dtype=torch.bfloat16))


def rss_bytes() -> int:
    """Resident set size of this process (``VmRSS``)."""
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """Peak resident set size since start or the last ``reset_peak_rss`` (``VmHWM``)."""
    return _status_kib("VmHWM") * 1024


def reset_peak_rss() -> None:
    """Make ``VmHWM`` restart from the current RSS (Linux ``clear_refs`` 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def machine() -> dict[str, Any]:
    """What the numbers were measured on, and how loaded it was (others share it)."""
    load = os.getloadavg()
    return {
        "cpus": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "loadavg_1_5_15": [round(x, 2) for x in load],
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


@contextmanager
def timed(into: dict[str, float], name: str) -> Iterator[None]:
    started = time.perf_counter()
    try:
        yield
    finally:
        into[name] = into.get(name, 0.0) + time.perf_counter() - started


def save_json(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
        return str(value)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_doc_section(name: str, text: str) -> None:
    """Replace ``docs/benchmarks.md``'s section ``name`` (and the results/<name>.md copy)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.md").write_text(text + "\n")
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    doc = DOC.read_text() if DOC.exists() else ""
    if begin in doc and end in doc:
        head, rest = doc.split(begin, 1)
        _, tail = rest.split(end, 1)
        DOC.write_text(f"{head}{begin}\n{text}\n{end}{tail}")
