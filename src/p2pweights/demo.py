"""The demo: two local engines, a trainer process, verified updates, one table.

Each update sends new HF weights (the first sends the weights the engines started
with, so the engines' own weight checker can compare snapshot and update), and
every engine rank is then checked bit-exactly: the engine's sglang checksums
against sglang's own ``load_weights`` of the same tensors into a real model of
that rank.

Output: a few status lines and the table on stdout; progress bars on a terminal.
Everything else (the trainer's log records, sglang's and Mooncake's own lines, each
engine's output) goes to log files in the demo's folder, whose path is printed once;
``verbose=True`` shows it all on stderr instead.
"""

from __future__ import annotations

import gc
import logging
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import torch

from p2pweights.config import MooncakeConfig, NixlConfig, SyncConfig, parse_bytes
from p2pweights.console import LOG_FORMAT, quiet_console
from p2pweights.engines.client import EngineClient
from p2pweights.local_engine import LocalEngine
from p2pweights.progress import progress
from p2pweights.reference_check import verify_engine
from p2pweights.report import UpdateReport
from p2pweights.source.synthetic import synthetic_weights, write_model_dir
from p2pweights.sync_session import WeightSyncSession

Mismatches = dict[str, dict[int, list[str]]]


def run_demo(
    *,
    model: str = "qwen3-demo",
    transport: str = "mooncake",
    engine_tps: list[int] | tuple[int, ...] = (2, 1),
    num_updates: int = 3,
    buffer_bytes: int | str = "256MiB",
    verbose: bool = False,
    log_level: str = "INFO",
    log_until_exit: bool = False,
) -> int:
    """Run the demo; 0 when every update was bit-exact at every rank.

    ``log_until_exit``: native libraries' stderr stays in the trainer log after the demo
    returns (the command line: transports the process still holds log as Python
    finalizes them at exit).
    """
    run_dir = Path(tempfile.mkdtemp(prefix="p2pweights-demo-"))
    folder = write_model_dir(model, run_dir / "model")
    engines = [
        LocalEngine(
            folder,
            tp=tp,
            transport=transport,
            seed=0,
            log_path=None if verbose else run_dir / f"engine-{i}.log",
            stream_log=verbose,
        )
        for i, tp in enumerate(engine_tps)
    ]
    num_bytes = sum(t.numel() * t.element_size() for _, t in _weights(folder, 0))
    print(
        f"p2pweights demo: {model} ({num_bytes / 1e6:.0f} MB of bf16 weights, all of them to "
        f"each engine) into {len(engines)} local engine(s) of TP "
        f"{', '.join(map(str, engine_tps))} over {transport} (loopback)"
    )
    if not verbose:
        names = ",".join(["trainer", *(f"engine-{i}" for i in range(len(engines)))])
        print(f"logs: {run_dir}/{{{names}}}.log (--verbose prints them here)")
    with _output(run_dir / "trainer.log", verbose, log_level, log_until_exit) as terminal:
        try:
            started = time.perf_counter()
            with progress("starting engines", total=len(engines), stream=terminal) as advance:
                for engine in engines:
                    engine.start()
                for engine in engines:
                    engine.wait_ready()
                    advance(1)
            ready_s = time.perf_counter() - started
            rows = _run_updates(folder, engines, transport, num_updates, buffer_bytes, terminal)
        finally:
            for engine in engines:
                engine.stop()
            gc.collect()  # transport objects log as they go: while stderr is still the log
    print(f"engines ready in {ready_s:.1f} s; {len(rows)} update(s):")
    _print_table(rows)
    return 0 if all(_bit_exact(m) for _, m in rows) else 1


def _weights(folder: Path, seed: int) -> list[tuple[str, torch.Tensor]]:
    return list(synthetic_weights(folder, seed=seed, dtype=torch.bfloat16))


def _run_updates(
    folder: Path,
    engines: list[LocalEngine],
    transport: str,
    num_updates: int,
    buffer_bytes: int | str,
    terminal: IO[str],
) -> list[tuple[UpdateReport, Mismatches]]:
    config = SyncConfig(
        transport=MooncakeConfig(protocol="tcp") if transport == "mooncake" else NixlConfig(),
        buffer_bytes=parse_bytes(buffer_bytes),
        verify_with_weight_checker=True,
    )
    rows = []
    with WeightSyncSession(config) as session:
        with progress("connecting (building sglang replicas)", stream=terminal):
            session.connect([e.url for e in engines])
        for step in range(num_updates):
            seed = 0 if step == 0 else 1000 + step  # the first update resends the start weights

            def weights(seed: int = seed) -> list[tuple[str, torch.Tensor]]:
                return _weights(folder, seed)

            label = f"update {step + 1}/{num_updates}"
            with progress(label + (" (probe, weight check)" if step == 0 else ""), stream=terminal):
                report = session.update(weights())
            with progress(f"{label}: checking every rank bit-exactly", stream=terminal):
                mismatches = {
                    engine.url: verify_engine(EngineClient(engine.url), weights)
                    for engine in engines
                }
            rows.append((report, mismatches))
    return rows


@contextmanager
def _output(log_file: Path, verbose: bool, log_level: str, until_exit: bool) -> Iterator[IO[str]]:
    """Unless ``verbose``, everything but the demo's own lines goes to ``log_file``;
    yields the terminal's stream for progress bars."""
    if verbose:
        logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT, force=True)
        yield sys.stderr
        return
    with quiet_console(log_file, log_level, until_exit) as terminal:
        yield terminal


def _bit_exact(mismatches: Mismatches) -> bool:
    return all(not names for ranks in mismatches.values() for names in ranks.values())


def _print_table(rows: list[tuple[UpdateReport, Mismatches]]) -> None:
    stages = ("load", "wait", "control_plane", "probe", "verify")
    header = ("load", "wait", "control", "probe", "check")
    print()
    print(
        f"{'update':>6} {'MB written':>10} {'ranks':>5} {'seconds':>8} {'GB/s':>5}  "
        + " ".join(f"{h:>7}" for h in header)
        + "  every rank bit-exact"
    )
    for report, mismatches in rows:
        cells = [report.stage_seconds.get(s) for s in stages]
        print(
            f"{report.version:>6} {report.bytes_written / 1e6:>10.1f} "
            f"{len(report.bytes_by_target):>5} {report.seconds:>8.3f} {report.gb_per_s:>5.2f}  "
            + " ".join(f"{c:>7.3f}" if c else f"{'-':>7}" for c in cells)
            + ("  yes" if _bit_exact(mismatches) else "  NO")
        )
        for url, ranks in mismatches.items():
            for rank, names in ranks.items():
                if names:
                    print(f"        {url} rank {rank}: {len(names)} tensor(s) differ: {names[:4]}")
    print(
        "\nseconds: pause to resume. load: sglang's loaders into the staging buffers; wait: on\n"
        "writes; control: pause, begin, end, version, resume. Update 1 also does one-off work:\n"
        "probe (which loader writes which parameter) and the engines' own weight check\n"
        "(verify_with_weight_checker: snapshot and reset inside control, compare as check).\n"
        "bit-exact: each rank's weights equal sglang's own load_weights of the same tensors."
    )
