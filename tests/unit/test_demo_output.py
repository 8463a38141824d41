"""The demo's table: one row per update, stages named, update 1's one-off work explained."""

from __future__ import annotations

from p2pweights.demo import _print_table
from p2pweights.report import UpdateReport


def _report(version: str, first: bool) -> UpdateReport:
    stages = {"control_plane": 0.04, "load": 0.5, "wait": 0.2}
    if first:
        stages |= {"probe": 0.05, "control_plane": 2.6, "verify": 2.3}
    return UpdateReport(
        version=version,
        bytes_by_target={("http://e0", 0): 383_000_000, ("http://e1", 0): 383_000_000},
        stage_seconds=stages,
        seconds=sum(stages.values()),
    )


def test_table_rows_and_notes(capsys):
    rows = [
        (_report("1", True), {"http://e0": {0: []}}),
        (_report("2", False), {"http://e0": {0: [], 1: ["model.norm.weight"]}}),
    ]
    _print_table(rows)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) <= 12
    header = next(line for line in lines if line.lstrip().startswith("update"))
    assert all(name in header for name in ("load", "wait", "control", "probe", "check"))
    first = next(line for line in lines if line.split()[:1] == ["1"])
    assert first.split()[-1] == "yes" and "0.050" in first  # the probe is shown
    second = next(line for line in lines if line.split()[:1] == ["2"])
    assert second.split()[-1] == "NO"
    assert any("rank 1: 1 tensor(s) differ" in line for line in lines)
    assert any("Update 1 also does one-off work" in line for line in lines)
