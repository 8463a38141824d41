"""The benchmarks' one harness: case selection, arguments, timing loop, results.

Each entry script in ``benchmarks/`` (``update.py``, ``gpu.py``, ``verify.py``, ``delta.py``,
``fp8.py``, ``replica.py``, ``footprint.py``) is a table of cases; ``main`` picks the case
named by the first argument, imports only that case's module (``benchmarks/cases/``), lets
it add its arguments to the options every case shares (``--out``), runs it and writes what
it returns to ``benchmarks/results/<name>.json`` (or ``--out``) together with the run:
command, git commit, machine and load, wall seconds. ``measure`` and ``side_by_side`` are
the timing loop (warm-up, repeats, median and min; variants interleaved repeat by repeat,
so a shared machine's load hits all alike).

Benchmarks are measurements, never tests: nothing here asserts a timing. Cases that keep
a section of ``docs/benchmarks-archive.md`` (between ``<!-- <name>:begin -->`` and
``<!-- <name>:end -->``) replace it with ``write_doc_section`` unless ``--no-doc``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "benchmarks-archive.md"
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


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of every thread of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
    """``benchmarks/results/<name>.json`` (a case's extra file; the harness writes its result)."""
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
    """Replace ``docs/benchmarks-archive.md``'s generated section ``name`` (the results page,
    docs/benchmarks.md, is written by hand from the results files)."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    doc = DOC.read_text() if DOC.exists() else ""
    if begin in doc and end in doc:
        head, rest = doc.split(begin, 1)
        _, tail = rest.split(end, 1)
        DOC.write_text(f"{head}{begin}\n{text}\n{end}{tail}")


# -- the timing loop -----------------------------------------------------------------------


@dataclasses.dataclass
class Timing:
    """Seconds of the timed repeats (the warm-ups left out)."""

    seconds: list[float]

    @property
    def median(self) -> float:
        return median(self.seconds)

    @property
    def min(self) -> float:
        return min(self.seconds) if self.seconds else float("nan")

    def as_dict(self) -> dict[str, Any]:
        return {"median_s": self.median, "min_s": self.min, "seconds": self.seconds}


def cuda_sync() -> None:
    """Wait for the current CUDA device (a no-op on a host without one)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def measure(
    call: Callable[[], Any],
    repeats: int,
    warmup: int = 1,
    sync: Callable[[], None] | None = None,
    setup: Callable[[], Any] | None = None,
) -> Timing:
    """Time ``call`` ``repeats`` times after ``warmup`` untimed calls; ``sync`` (e.g.
    ``cuda_sync``) runs before the clock starts and before it stops; ``setup``, untimed,
    before every call."""
    return side_by_side({"call": call}, repeats, warmup, sync, setup=setup)["call"]


def side_by_side(
    calls: Mapping[str, Callable[[], Any]],
    repeats: int,
    warmup: int = 1,
    sync: Callable[[], None] | None = None,
    alternate: bool = True,
    setup: Callable[[], Any] | None = None,
) -> dict[str, Timing]:
    """A/B (or more) in one run: each repeat times every call once, in turns, so the
    machine's load hits all alike; with ``alternate`` the order reverses every repeat
    (whichever runs second no longer gains from the first's warm caches)."""
    names = list(calls)
    for _ in range(warmup):
        for name in names:
            if setup is not None:
                setup()
            calls[name]()
    out = {name: Timing([]) for name in names}
    for repeat in range(repeats):
        order = names[::-1] if alternate and repeat % 2 else names
        for name in order:
            if setup is not None:
                setup()
            if sync is not None:
                sync()
            started = time.perf_counter()
            calls[name]()
            if sync is not None:
                sync()
            out[name].seconds.append(time.perf_counter() - started)
    return out


# -- the entry scripts ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """One subcommand of an entry script."""

    name: str
    """What follows the script's name on the command line."""
    module: str
    """``cases.<module>``: ``add_arguments(parser)`` and ``run(args)``; imported only when run."""
    what: str
    """One line for the script's ``--help``."""
    result: str
    """``benchmarks/results/<result>.json`` unless ``--out`` says otherwise."""
    needs_cuda: bool = False
    """Refused at once, with the reason, on a host without a CUDA device."""


def git_commit() -> str | None:
    """The checkout's commit (``+dirty`` when the tree differs), or None outside git."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def _usage(script: str, doc: str, cases: Sequence[Case]) -> str:
    width = max(len(case.name) for case in cases)
    lines = [f"usage: {script} CASE [options]   ({script} CASE --help: the case's options)", ""]
    lines += [doc.strip(), "", "cases:"]
    lines += [
        f"  {case.name:<{width}}  {case.what}" + ("  [CUDA]" if case.needs_cuda else "")
        for case in cases
    ]
    return "\n".join(lines)


def main(
    script_file: str, doc: str, cases: Sequence[Case], argv: Sequence[str] | None = None
) -> int:
    """Run the case named by ``argv[0]``; write its result with the run's facts."""
    argv = list(sys.argv[1:] if argv is None else argv)
    script = f"benchmarks/{Path(script_file).name}"
    by_name = {case.name: case for case in cases}
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(script, doc, cases))
        return 0 if argv else 2
    case = by_name.get(argv[0])
    if case is None:
        print(
            f"{script}: unknown case {argv[0]!r}; the cases are: {', '.join(by_name)}",
            file=sys.stderr,
        )
        return 2
    wants_help = "-h" in argv or "--help" in argv
    if case.needs_cuda and not wants_help and not torch.cuda.is_available():
        print(f"{script} {case.name}: needs a CUDA device and this host has none", file=sys.stderr)
        return 2
    module = importlib.import_module(f"cases.{case.module}")
    parser = argparse.ArgumentParser(
        prog=f"{script} {case.name}",
        description=module.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=RESULTS / f"{case.result}.json",
        help=f"where the JSON result goes (default: benchmarks/results/{case.result}.json)",
    )
    module.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    args.command = shlex.join(["python", script, *argv])
    args.entry = [sys.executable, str(Path(script_file).resolve()), case.name]
    before, started = machine(), time.perf_counter()
    payload, status = module.run(args), 0
    if isinstance(payload, tuple):  # (result, exit status): a check that failed
        payload, status = payload
    if payload is None:  # a child process of a case
        return status
    run = {
        "benchmark": f"{script} {case.name}",
        "command": args.command,
        "git_commit": git_commit(),
        "machine_before": before,
        "machine_after": machine(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "wall_s": round(time.perf_counter() - started, 3),
    }
    print(f"results: {write_result(args.out, run, payload)}")
    return status


def write_result(path: Path, run: dict[str, Any], payload: Any) -> Path:
    """``{"run": run, **payload}`` (or ``{"run": run, "results": payload}``) as JSON."""
    body = (
        {"run": run, **payload} if isinstance(payload, dict) else {"run": run, "results": payload}
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body, indent=1, default=str) + "\n")
    return path
