#!/bin/bash
# A/B of the demo on a quiet machine: old (f7a43ac, before issue 9) and the current tree alternating.
cd "$(dirname "$0")/.."
for round in 1 2 3; do
  for side in old new; do
    if [ $side = old ]; then src=${OLD_SRC:?set OLD_SRC to the src/ of a checkout of the older commit}; else src=src; fi
    echo "== $side round $round load $(cut -d' ' -f1-3 /proc/loadavg)"
    PYTHONPATH=$src timeout 600 .venv/bin/python -m p2pweights.cli --log-level WARNING demo 2>/dev/null | grep -E "^ +[0-9]+ |version|update" | head -8
  done
done
