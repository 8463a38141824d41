"""Our log lines, and, when asked, third-party noise kept out of the user's terminal.

Every logger of the library sits under ``p2pweights``; ``P2PWEIGHTS_LOG=info`` (or
``logging.getLogger("p2pweights").setLevel(...)``) sets their level alone, not httpx's
or sglang's. The library adds no handler: a script's ``logging.basicConfig()`` shows
them. Constructing a session touches nothing else: no ``warnings`` filter, no filter on
another library's logger (``apply_log_level`` is all it runs).

sglang, megatron-core (which sglang imports) and torch print warnings and log lines on
import and start that say nothing about an update (kernels a CPU host lacks, model
classes skipped for a missing optional package). ``quiet()`` drops those, and only
those, named one by one below: a ``warnings`` filter per message and a
``logging.Filter`` on the logger that emits it (other threads, other messages and the
same loggers' other records are untouched). A user calls it, before sglang is imported,
to have that; the command line (``p2pweights ...``: the demo, the local engine) does it
itself. ``P2PWEIGHTS_THIRD_PARTY_LOGS=1`` makes it keep them all. Mooncake logs from
C++ through glog; ``MC_LOG_LEVEL=ERROR`` (set before its engine starts, unless set,
``p2pweights.environment``) leaves the two lines it prints at ERROR.
"""

from __future__ import annotations

import logging
import re
import warnings

from p2pweights import environment
from p2pweights.errors import ConfigError

__all__ = ["apply_log_level", "configure", "keep_third_party_noise_out", "quiet"]

_NOISY_WARNINGS = (
    # (message, module emitting it): regular expressions, as ``warnings.filterwarnings``
    (r"Only CUDA, .* support", r"sglang\."),
    (r"Triton is not supported on current platform", r"sglang\."),
    (r"Transformer Engine and Apex are not installed", r"megatron\."),
)
_NOISY_LOG_LINES = {
    "sglang.srt.models.registry": r"Ignore import error when loading",
    "sglang.kernels.jit.utils.arch": r"Cannot detect CUDA architecture",
    "sglang.srt.arg_groups.overrides": r"Attention backend not specified",
    "torch.utils.cpp_extension": r"No CUDA runtime is found",
    "megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision": r"Using Megatron-FSDP",
    "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer": r"Detected Megatron",
    "megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp": r"Detected Megatron",
}


class _DropNoise(logging.Filter):
    """Drops one logger's records whose message matches a known line of noise."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self._pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self._pattern.search(record.getMessage())


def keep_third_party_noise_out() -> None:
    """``quiet()``'s work, under its older name."""
    if environment.third_party_logs():
        return
    for message, module in _NOISY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning, module=module)
    for name, pattern in _NOISY_LOG_LINES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNoise) for f in logger.filters):
            logger.addFilter(_DropNoise(pattern))


def quiet() -> None:
    """Keep the known import and start-up noise of sglang, megatron and torch out of the
    terminal (see the module docstring); call it before they are imported. Idempotent.
    ``P2PWEIGHTS_THIRD_PARTY_LOGS=1`` turns it into a no-op."""
    keep_third_party_noise_out()


def apply_log_level() -> None:
    """Apply ``P2PWEIGHTS_LOG`` to the ``p2pweights`` loggers (nothing when unset); the one
    thing a session or a transport does to logging when it starts."""
    level = environment.log_level()
    if level is not None:
        if not isinstance(logging.getLevelName(level), int):
            raise ConfigError(
                f"P2PWEIGHTS_LOG={level.lower()!r} is no log level; use debug, info, warning "
                f"or error"
            )
        logging.getLogger("p2pweights").setLevel(level)


def configure() -> None:
    """``apply_log_level()`` and ``quiet()``: what the command line and the local engine
    do when they start (they own their process; a library user's process is the user's)."""
    apply_log_level()
    quiet()
