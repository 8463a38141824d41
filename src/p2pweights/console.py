"""What the command line shows: its own lines on the terminal, everything else in a log.

sglang, Mooncake (glog) and UCX write to the process's stderr directly, from Python
and from C++; NIXL's Python logger writes INFO lines to stdout. ``quiet_console``
sends all of that, and Python's log records, to one log file, and yields the
terminal's stream for progress bars. For the command line only: the library itself
adds no logging handlers and leaves file descriptors alone.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from p2pweights.environment import quiet_nixl_info

__all__ = ["LOG_FORMAT", "quiet_console"]

LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


@contextmanager
def quiet_console(
    log_file: Path, log_level: str = "INFO", until_exit: bool = False
) -> Iterator[IO[str]]:
    """Log records and everything written to file descriptor 2 go to ``log_file``;
    yields a stream to the terminal (the former stderr).

    ``until_exit``: stderr stays in the log after the block (native libraries still log
    as Python finalizes them at exit), unless the block raised.
    """
    quiet_nixl_info()
    sys.stderr.flush()
    saved = os.dup(2)
    terminal = os.fdopen(os.dup(saved), "w", buffering=1)
    with open(log_file, "ab") as log:
        os.dup2(log.fileno(), 2)
    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT, stream=sys.stderr, force=True)
    try:
        yield terminal
    except BaseException:
        print(f"failed; the log is {log_file}", file=terminal)
        until_exit = False  # the traceback belongs on the terminal
        raise
    finally:
        sys.stderr.flush()
        if not until_exit:
            os.dup2(saved, 2)
        os.close(saved)
        terminal.close()
