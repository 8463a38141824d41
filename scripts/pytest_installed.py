"""Run pytest against an installed copy of p2pweights instead of the source tree.

``python scripts/pytest_installed.py SITE [pytest args]``: SITE is a folder the built
wheel was installed into (``pip install --no-deps --target SITE``). The source tree
(which the editable install in .venv puts on ``sys.path``) is taken off the path,
p2pweights must import from SITE, and processes the tests start (local engines)
find SITE first through ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    site = Path(argv[0]).resolve()
    source = (Path(__file__).resolve().parent.parent / "src").resolve()
    sys.path[:] = [str(site)] + [
        p for p in sys.path if p and Path(p).resolve() not in (source, site)
    ]
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(site), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    )
    import p2pweights

    where = Path(p2pweights.__file__).resolve()
    if site not in where.parents:
        print(f"p2pweights imported from {where}, not from {site}", file=sys.stderr)
        return 1
    print(f"p2pweights {p2pweights.__version__} imported from {where.parent}")

    import pytest

    return int(pytest.main(argv[1:]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
