"""Update and pause time on this host's local engines (sglang's model code on the CPU):
against the transport's ceiling and a broadcast, stage by stage, as the model and the
engines grow, the engine's pause, the control plane's calls, which miles ranks send, and
the demo before and after a change.

    .venv/bin/python benchmarks/update.py ceiling --quick
"""

import sys

from harness import Case, main

CASES = [
    Case(
        "ceiling",
        "update_ceiling",
        "update vs transport ceiling vs broadcast, TP 1/2/4",
        "update_vs_ceiling",
    ),
    Case(
        "stages",
        "update_stages",
        "UpdateReport stages; --profile: the load stage profiled",
        "stage_breakdown",
    ),
    Case(
        "load-contention",
        "update_load_contention",
        "the load stage beside background writes",
        "load_contention",
    ),
    Case(
        "growth",
        "update_growth",
        "update time and trainer RSS as model and engines double",
        "growth",
    ),
    Case(
        "pause",
        "update_pause",
        "engine pause: first buffer staged before the pause or not",
        "pause_time",
    ),
    Case(
        "control-plane",
        "update_control_plane",
        "the session's HTTP calls, two orders A/B",
        "control_plane",
    ),
    Case(
        "miles-senders",
        "update_miles_senders",
        "every miles rank sends vs miles' rule",
        "miles_senders",
    ),
]

if __name__ == "__main__":
    sys.exit(main(__file__, __doc__, CASES))
