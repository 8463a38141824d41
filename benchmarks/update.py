"""Update and pause time on this host's local engines (sglang's model code on the CPU):
against the transport's ceiling and a broadcast, as the model and the engines grow, and
the engine's pause.

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
        "growth",
        "update_growth",
        "update time and trainer RSS as model and engines double",
        "growth",
    ),
    Case(
        "owners",
        "update_owners",
        "expert-parallel trainer ranks: owner sends vs gathered sends",
        "owner_sends",
    ),
    Case(
        "pause",
        "update_pause",
        "engine pause: first buffer staged before the pause or not",
        "pause_time",
    ),
]

if __name__ == "__main__":
    sys.exit(main(__file__, __doc__, CASES))
