"""Our log lines, and third-party noise kept out of the user's terminal.

Every logger of the library sits under ``p2pweights``; ``P2PWEIGHTS_LOG=info`` (or
``logging.getLogger("p2pweights").setLevel(...)``) sets their level alone, not httpx's
or sglang's. The library adds no handler: a script's ``logging.basicConfig()`` shows
them.

sglang, megatron-core (which sglang imports) and torch print warnings and log lines on
import and start that say nothing about an update (kernels a CPU host lacks, model
classes skipped for a missing optional package). ``keep_third_party_noise_out`` drops
those, and only those, named one by one below: a ``warnings`` filter per message and a
``logging.Filter`` on the logger that emits it (other threads, other messages and the
same loggers' other records are untouched). ``P2PWEIGHTS_THIRD_PARTY_LOGS=1`` keeps
them all. Mooncake logs from C++ through glog; ``MC_LOG_LEVEL=ERROR`` (set before its
engine starts, ``p2pweights.environment``) leaves the two lines it prints at ERROR.
"""

from __future__ import annotations

import logging
import re
import warnings

from p2pweights import environment
from p2pweights.errors import ConfigError

__all__ = ["configure", "keep_third_party_noise_out"]

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
    """Drop the known import and start-up noise of sglang, megatron and torch (see the
    module docstring), unless ``P2PWEIGHTS_THIRD_PARTY_LOGS=1``. Idempotent; call it
    before they are imported."""
    if environment.third_party_logs():
        return
    for message, module in _NOISY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning, module=module)
    for name, pattern in _NOISY_LOG_LINES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNoise) for f in logger.filters):
            logger.addFilter(_DropNoise(pattern))


def configure() -> None:
    """Apply ``P2PWEIGHTS_LOG`` to the ``p2pweights`` loggers and keep third-party noise
    out; called when a session, a transport or the command line starts."""
    level = environment.log_level()
    if level is not None:
        if not isinstance(logging.getLevelName(level), int):
            raise ConfigError(
                f"P2PWEIGHTS_LOG={level.lower()!r} is no log level; use debug, info, warning "
                f"or error"
            )
        logging.getLogger("p2pweights").setLevel(level)
    keep_third_party_noise_out()
