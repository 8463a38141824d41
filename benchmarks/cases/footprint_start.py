"""How long p2pweights takes to start, each case in a fresh process (issue 31, "A fast start").

Cases (wall seconds of a new ``python`` process unless said otherwise):

- ``import``: ``python -c "import p2pweights"``;
- ``help``: ``python -m p2pweights.cli --help``;
- ``connect``: a trainer process that imports the session and connects it to the demo's
  engines (``p2pweights demo``: qwen3-demo, local engines of TP 2 and TP 1, Mooncake over
  TCP, the quickstart's ``SyncConfig``); reports the process's wall, ``connect()`` alone,
  the same session's second ``connect()`` and a second session's ``connect()`` in that
  process;
- ``plan``: ``p2pweights plan --model qwen3-demo --engine tp=2 --engine tp=1 --senders 1``;
- ``doctor``: ``p2pweights doctor`` (``--no-loopback`` unless ``--doctor-loopback``);
- ``verify``: a process that runs ``verify_engine`` against the TP 2 engine.

``--baseline REF`` also times the code of git revision ``REF`` (a worktree beside this
one, put first on ``PYTHONPATH``), alternating with the working tree case by case and
repeat by repeat, so both see the same load on a shared machine. The engines are the
working tree's for both. The load average is printed before and after. Writes
``benchmarks/results/start_time.json``.

    python benchmarks/footprint.py start --repeats 5 --baseline e143b47
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import ROOT

CONNECT = r"""
import json, sys, time
start = time.perf_counter()
from p2pweights import MooncakeConfig, SyncConfig, WeightSyncSession
imported = time.perf_counter() - start
urls = sys.argv[1:]

def config():
    return SyncConfig(transport=MooncakeConfig(protocol="tcp"), buffer_bytes="512MiB")

session = WeightSyncSession(config())
t, c = time.perf_counter(), time.process_time()
session.connect(urls)
first, first_cpu = time.perf_counter() - t, time.process_time() - c
t = time.perf_counter(); session.connect(urls); again = time.perf_counter() - t
session.close()
other = WeightSyncSession(config())
t = time.perf_counter(); other.connect(urls); second_session = time.perf_counter() - t
other.close()
print(json.dumps({"import_s": imported, "connect_s": first, "connect_cpu_s": first_cpu,
                  "reconnect_s": again,
                  "second_session_s": second_session}))
"""

VERIFY = r"""
import json, sys, time
import torch
from p2pweights.verify import EngineClient, verify_engine
from p2pweights.testing import synthetic_weights
url, folder = sys.argv[1:]
t = time.perf_counter()
client = EngineClient(url)
bad = verify_engine(client, lambda: synthetic_weights(folder, seed=0, dtype=torch.bfloat16))
client.close()
print(json.dumps({"verify_s": time.perf_counter() - t, "mismatches": sum(map(len, bad.values()))}))
"""


def load_average() -> tuple[float, float, float]:
    return os.getloadavg()


def worktree(ref: str) -> Path:
    """A detached worktree of ``ref`` (made once, reused)."""
    sha = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", ref],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    path = Path(tempfile.gettempdir()) / f"p2pweights-baseline-{sha}"
    if not (path / "src" / "p2pweights").is_dir():
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), sha],
            check=True,
            capture_output=True,
        )
    return path


def timed(argv: list[str], src: Path, timeout_s: float = 600.0) -> tuple[float, float, str]:
    """Wall and CPU (user + system) seconds of ``argv`` run with ``src`` first on the import
    path, and its stdout. CPU seconds move less than wall with the load of a shared host."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout_s)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    if done.returncode not in (0, 1):  # doctor exits 1 on a blocker of this host
        raise RuntimeError(f"{argv[:4]} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return wall, cpu, done.stdout


def cases(args: argparse.Namespace, urls: list[str], folder: Path) -> dict[str, Any]:
    py = sys.executable
    cli = [py, "-m", "p2pweights.cli"]
    doctor = [*cli, "doctor"] + ([] if args.doctor_loopback else ["--no-loopback"])
    plan = [*cli, "plan", "--model", "qwen3-demo", "--engine", "tp=2", "--engine", "tp=1"]
    return {
        "import": [py, "-c", "import p2pweights"],
        "help": [*cli, "--help"],
        "connect": [py, "-c", CONNECT, *urls],
        "plan": [*plan, "--senders", "1"],
        "doctor": doctor,
        "verify": [py, "-c", VERIFY, urls[0], str(folder)],
    }


def measure_all(args: argparse.Namespace) -> dict[str, Any]:
    from p2pweights.local_engine import LocalEngine
    from p2pweights.testing import write_model_dir

    trees = {"current": ROOT / "src"}
    if args.baseline:
        trees = {"baseline": worktree(args.baseline) / "src", **trees}
    folder = write_model_dir("qwen3-demo", Path(tempfile.mkdtemp(prefix="start-time-")) / "m")
    engines = [LocalEngine(folder, tp=tp, seed=0) for tp in (2, 1)]
    for engine in engines:
        engine.start()
    samples: dict[str, dict[str, list[dict[str, float]]]] = {}
    load_before = load_average()
    try:
        for engine in engines:
            engine.wait_ready()
        commands = cases(args, [e.url for e in engines], folder)
        chosen = args.only or list(commands)
        for repeat in range(args.repeats):
            order = list(trees) if repeat % 2 == 0 else list(reversed(trees))
            for case in chosen:
                for tree in order:
                    wall, cpu, out = timed(commands[case], trees[tree])
                    sample = {"wall_s": wall, "cpu_s": cpu, "load_1min": load_average()[0]}
                    if case in ("connect", "verify"):
                        sample.update(json.loads(out.strip().splitlines()[-1]))
                    samples.setdefault(case, {}).setdefault(tree, []).append(sample)
                    print(f"repeat {repeat} {case:8s} {tree:8s} {_brief(sample)}", flush=True)
    finally:
        for engine in engines:
            engine.stop()
    return {
        "machine": f"{platform.node()} ({os.cpu_count()} cores, {platform.processor() or '?'})",
        "python": platform.python_version(),
        "baseline": args.baseline,
        "repeats": args.repeats,
        "load_before": load_before,
        "load_after": load_average(),
        "samples": samples,
        "medians": {
            case: {tree: _medians(rows) for tree, rows in by_tree.items()}
            for case, by_tree in samples.items()
        },
    }


def _brief(sample: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.3f}" for k, v in sample.items())


def _medians(rows: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(row[key] for row in rows) for key in rows[0]}


def table(result: dict[str, Any]) -> str:
    trees = ["baseline", "current"] if result["baseline"] else ["current"]
    lines = [
        "| case | measure | " + " | ".join(trees) + " |",
        "|---|---|" + "---|" * len(trees),
    ]
    for case, by_tree in result["medians"].items():
        for measure in by_tree["current"]:
            if measure == "load_1min" or measure == "mismatches":
                continue
            row = " | ".join(f"{by_tree[t][measure]:.2f}" for t in trees)
            lines.append(f"| {case} | {measure} | {row} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline", default=None, help="a git revision to time beside")
    parser.add_argument(
        "--only", nargs="+", choices=["import", "help", "connect", "plan", "doctor", "verify"]
    )
    parser.add_argument("--doctor-loopback", action="store_true")


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    print(f"load average before: {load_average()}", flush=True)
    result = measure_all(args)
    print(f"load average after: {result['load_after']}")
    print(table(result))
    return result
