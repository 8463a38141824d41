"""Delta updates: how many values an RL step changes, what a delta costs to make and to
apply, the plan's delta cost at the field's layout, and full against delta updates fed
by real training steps.

    .venv/bin/python benchmarks/delta.py encode --mib 16 --gpu-mib 0
"""

import sys

from harness import Case, main

CASES = [
    Case(
        "fraction", "delta_fraction", "share of bf16 values an AdamW step changes", "delta_fraction"
    ),
    Case(
        "encode",
        "delta_encode",
        "compare+remember and apply, per GB, CPU and GPU",
        "delta_encode_cost",
    ),
    Case(
        "plan",
        "delta_plan",
        "the seed's Kimi-K2 row planned as full and as delta updates",
        "delta_plan",
    ),
    Case(
        "update",
        "delta_update",
        "full vs delta sessions side by side on real AdamW steps",
        "delta_update",
    ),
]

if __name__ == "__main__":
    sys.exit(main(__file__, __doc__, CASES))
