"""What p2pweights costs its host besides the update: start-up time, idle CPU and CPU
seconds per GB of an update.

    .venv/bin/python benchmarks/footprint.py start --repeats 1 --only import help
"""

import sys

from harness import Case, main

CASES = [
    Case(
        "start",
        "footprint_start",
        "import, --help, connect, plan, doctor, verify_engine",
        "start_time",
    ),
    Case(
        "idle-cpu",
        "footprint_idle_cpu",
        "idle CPU of local engines and a connected trainer",
        "idle_cpu",
    ),
    Case(
        "cpu-cost",
        "footprint_cpu_cost",
        "wall and CPU seconds per GB: ceiling, update, load",
        "cpu_cost",
    ),
]

if __name__ == "__main__":
    sys.exit(main(__file__, __doc__, CASES))
