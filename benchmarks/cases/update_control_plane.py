"""The update session's control calls in the order before issue 22 and after, side by side.

One local engine, one trainer whose updates alternate between two orders of the
update session's calls: ``sequential`` (before issue 22: the "updating" version, then
the flush; the reachability check readies one connection), reproduced here by
``sequential_order()``, and ``concurrent`` (the code as it is: the version and the flush
at once, two connections readied). Every HTTP request the trainer sends is timed by
one hook on ``httpx.Client.send``, the same instrument for both: calls per update and
per route, their wall time (at least one in flight), their time one by one, the new
TCP connections, and the paused seconds (from the pause answer to the continue
answer). A second phase leaves ``--idle-gap-s`` between updates, longer than the
servers' keep-alive (5 s), as a training step does.

    .venv/bin/python benchmarks/update.py control-plane                  # about 2 minutes
    .venv/bin/python benchmarks/update.py control-plane --updates 5 --idle-updates 0 --no-doc
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

from harness import hf_tensors, machine, markdown_table, median, write_doc_section

NAME = "control_plane"
PAUSE, RESUME = "/pause_generation", "/continue_generation"


# -- timing every call -------------------------------------------------------------------------


def _hook_httpx(records: list[tuple[str, float, float, bool]]) -> None:
    """Time every request any httpx.Client sends; note whether it opened a connection."""
    import httpx

    send = httpx.Client.send

    def timed_send(self: httpx.Client, request: httpx.Request, **kwargs: Any) -> httpx.Response:
        opened: list[bool] = []
        prior = request.extensions.get("trace")

        def trace(event: str, info: dict[str, Any]) -> None:
            if event == "connection.connect_tcp.started":
                opened.append(True)
            if prior is not None:
                prior(event, info)

        request.extensions["trace"] = trace
        started = time.monotonic()
        try:
            return send(self, request, **kwargs)
        finally:
            records.append(
                (f"{request.method} {request.url.path}", started, time.monotonic(), bool(opened))
            )

    httpx.Client.send = timed_send  # type: ignore[method-assign]


def _wall(calls: list[tuple[str, float, float, bool]]) -> float:
    total, reached = 0.0, float("-inf")
    for _, start, end, _ in sorted(calls, key=lambda c: c[1]):
        if end > reached:
            total += end - max(start, reached)
            reached = end
    return total


def _measure(calls: list[tuple[str, float, float, bool]]) -> dict[str, Any]:
    pause_end = max(end for route, _, end, _ in calls if route.endswith(PAUSE))
    resume_end = max(end for route, _, end, _ in calls if route.endswith(RESUME))
    in_pause = [c for c in calls if c[1] >= pause_end]
    routes: dict[str, int] = {}
    route_s: dict[str, float] = {}
    for route, start, end, _ in calls:
        routes[route] = routes.get(route, 0) + 1
        route_s[route] = route_s.get(route, 0.0) + end - start
    return {
        "calls": len(calls),
        "wall_s": _wall(calls),
        "one_by_one_s": sum(end - start for _, start, end, _ in calls),
        "new_connections": sum(c[3] for c in calls),
        "new_connections_in_pause": sum(c[3] for c in in_pause),
        "calls_in_pause": len(in_pause),
        "paused_s": resume_end - pause_end,
        "calls_in_pause_wall_s": _wall(in_pause),
        "routes": routes,
        "route_s": route_s,
    }


@contextmanager
def sequential_order() -> Iterator[None]:
    """The order before issue 22: the updating marker, then the flush; one connection
    readied by the reachability check."""
    from p2pweights.engines.client import EngineClient
    from p2pweights.engines.update_session import EngineUpdate, updating_version

    def one_after_another(self: EngineUpdate, version: str, flush: bool) -> None:
        marker = updating_version(version)
        self._call(lambda c: c.update_weight_version(marker))
        if flush:
            self._call(lambda c: c.flush_cache())

    check = EngineClient.check_reachable
    saved = EngineUpdate._flush_with_marker
    EngineUpdate._flush_with_marker = one_after_another  # type: ignore[method-assign]
    EngineClient.check_reachable = lambda self, connections=1: check(self, 1)  # type: ignore[method-assign]
    try:
        yield
    finally:
        EngineUpdate._flush_with_marker = saved  # type: ignore[method-assign]
        EngineClient.check_reachable = check  # type: ignore[method-assign]


def run_orders(args: argparse.Namespace, url: str) -> dict[str, list[dict[str, Any]]]:
    """Updates alternating between the two orders, each timed call by call."""
    from p2pweights.config import MooncakeConfig, SyncConfig
    from p2pweights.session import WeightSyncSession

    records: list[tuple[str, float, float, bool]] = []
    _hook_httpx(records)
    tensors = hf_tensors(args.model)
    config = SyncConfig(transport=MooncakeConfig(protocol="tcp"), buffer_bytes="64MiB")
    rows: dict[str, list[dict[str, Any]]] = {"sequential": [], "concurrent": []}
    with WeightSyncSession(config) as session:
        session.connect([url])
        session.update(tensors)  # the first update probes: not counted
        phases = (("back to back", args.updates, 0.0), ("idle", args.idle_updates, args.idle_gap_s))
        for phase, count, gap in phases:
            for _ in range(count):
                for order in rows:
                    time.sleep(gap)
                    records.clear()
                    started = time.monotonic()
                    with sequential_order() if order == "sequential" else nullcontext():
                        report = session.update(tensors)
                    row = _measure([r for r in records if r[1] >= started])
                    row["phase"], row["update_s"] = phase, report.seconds
                    # what the code reports itself, beside the hook's measure
                    calls = session._connection.fleet.control_calls()
                    row["own_paused_s"] = max(report.paused_s.values(), default=0.0)
                    row["own_calls"], row["own_wall_s"] = calls.num_calls, calls.wall_seconds
                    row["report_paused_s"] = getattr(report, "paused_s", {})
                    rows[order].append(row)
    return rows


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("calls", "calls_in_pause", "wall_s", "one_by_one_s", "paused_s", "update_s")
    out = {key: median([r[key] for r in rows]) for key in keys}
    out["pause_outside_calls_s"] = median(
        [r["paused_s"] - r["calls_in_pause_wall_s"] for r in rows]
    )
    out["route_s"] = {
        route: median([r["route_s"].get(route, 0.0) for r in rows]) for route in rows[0]["route_s"]
    }
    out["new_connections"] = sum(r["new_connections"] for r in rows) / len(rows)
    out["new_connections_in_pause"] = sum(r["new_connections_in_pause"] for r in rows) / len(rows)
    out["min_wall_s"] = min(r["wall_s"] for r in rows)
    out["min_paused_s"] = min(r["paused_s"] for r in rows)
    out["routes"] = rows[0]["routes"]
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="qwen3-tiny")
    parser.add_argument("--updates", type=int, default=100, help="back to back, per order")
    parser.add_argument("--idle-updates", type=int, default=3, help="per order, after a gap")
    parser.add_argument("--idle-gap-s", type=float, default=6.0)
    parser.add_argument("--no-doc", action="store_true")


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    logging.basicConfig(level=logging.WARNING)
    from p2pweights.local_engine import LocalEngine

    command = args.command
    before, started = machine(), time.perf_counter()
    with LocalEngine(args.model, tp=1, transport="mooncake") as engine:
        rows = run_orders(args, engine.url)
    summary = {
        (order, phase): _summary([r for r in rows[order] if r["phase"] == phase])
        for order in rows
        for phase in ("back to back", "idle")
        if any(r["phase"] == phase for r in rows[order])
    }
    meta = {
        "model": args.model,
        "machine_before": before,
        "machine_after": machine(),
        "wall_s": time.perf_counter() - started,
        "command": command,
    }
    text = _report(summary, meta, args)
    if not args.no_doc:
        write_doc_section(NAME, text)
    print(text)
    return {
        "meta": meta,
        "updates": rows,
        "summary": {f"{o}/{p}": v for (o, p), v in summary.items()},
    }


def _report(summary: dict, meta: dict[str, Any], args: argparse.Namespace) -> str:
    table = markdown_table(
        [
            "order",
            "updates",
            "calls / update",
            "calls in the pause",
            "control wall ms (min)",
            "one by one ms",
            "paused ms (min)",
            "paused, no call in flight ms",
            "new connections / update (in the pause)",
            "update s",
        ],
        [
            [
                order if phase == "back to back" else f"{order}, {args.idle_gap_s:g} s apart",
                args.updates if phase == "back to back" else args.idle_updates,
                s["calls"],
                s["calls_in_pause"],
                f"{s['wall_s'] * 1e3:.1f} ({s['min_wall_s'] * 1e3:.1f})",
                s["one_by_one_s"] * 1e3,
                f"{s['paused_s'] * 1e3:.1f} ({s['min_paused_s'] * 1e3:.1f})",
                s["pause_outside_calls_s"] * 1e3,
                f"{s['new_connections']:.1f} ({s['new_connections_in_pause']:.1f})",
                s["update_s"],
            ]
            for (order, phase), s in summary.items()
        ],
    )
    routes = sorted({route for s in summary.values() for route in s["routes"]})
    seq, conc = summary[("sequential", "back to back")], summary[("concurrent", "back to back")]
    per_route = markdown_table(
        ["route", "calls sequential", "calls concurrent", "ms sequential", "ms concurrent"],
        [
            [
                f"`{route}`",
                seq["routes"].get(route, 0),
                conc["routes"].get(route, 0),
                seq["route_s"].get(route, 0.0) * 1e3,
                conc["route_s"].get(route, 0.0) * 1e3,
            ]
            for route in routes
        ],
    )
    m = meta
    return (
        f"Command: `{m['command']}`; one local engine ({m['model']}, TP 1, Mooncake TCP) on "
        f"the 2-core development machine, one trainer whose updates alternate between the "
        f"two orders, medians after a warm-up update; load average "
        f"{m['machine_before']['loadavg_1_5_15']} before, "
        f"{m['machine_after']['loadavg_1_5_15']} after ({m['machine_before']['time']}, "
        f"{m['wall_s']:.0f} s).\n\n{table}\n\nCalls per update by route and their median "
        f"milliseconds (added up), back to back:\n\n{per_route}"
    )
