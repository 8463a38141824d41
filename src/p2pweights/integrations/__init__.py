"""Glue for RL frameworks' own weight-sync seams, one module per framework.

Each module imports its framework when it is imported itself; nothing here is
imported eagerly (``p2pweights.integrations.verl`` needs verl installed).
"""

from __future__ import annotations

from p2pweights.errors import ConfigError

__all__ = ["FrameworkMismatchError"]


class FrameworkMismatchError(ConfigError):
    """The installed framework has none of the seams an integration was written for.

    The message names the installed framework (version and where it was imported
    from), the seams looked for, and which p2pweights path fits which framework
    release. Raised before anything connects."""
