"""The replica and the plan: building and probing full-size replicas, sglang's loader
cost per HF tensor, replayed loads, and the plan at the field's published layouts.

    .venv/bin/python benchmarks/replica.py loader --repeats 2
"""

import sys

from harness import Case, main

CASES = [
    Case(
        "build",
        "replica_build",
        "time and peak RSS to build and probe full-size replicas",
        "replica_cost",
    ),
    Case("loader", "replica_loader", "sglang's loader CPU time per HF tensor", "loader_overhead"),
    Case(
        "replay",
        "replica_replay",
        "a replayed load op by op, foreach and one launch",
        "replay_cost",
    ),
    Case(
        "plan-vs-field", "replica_plan_vs_field", "the plan at the field's layouts", "plan_vs_field"
    ),
]

if __name__ == "__main__":
    sys.exit(main(__file__, __doc__, CASES))
