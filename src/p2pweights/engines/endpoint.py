"""How a user names an engine."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import SecretStr


@dataclass(frozen=True)
class EngineEndpoint:
    """One sglang engine (one HTTP server and all its ranks)."""

    url: str
    """e.g. ``http://10.0.0.5:30000``."""
    api_key: SecretStr | str | None = None
    """Overrides ``SyncConfig.api_key`` for this engine. A plain string is kept as a
    ``pydantic.SecretStr`` (never shown in a repr or log)."""
    model_path: str | None = None
    """This trainer's copy of the engine's HF config.json (default: the engine's model_path)."""

    def __post_init__(self) -> None:
        # One spelling per engine: writers, publications and clients are keyed by it.
        object.__setattr__(self, "url", self.url.rstrip("/"))
        if isinstance(self.api_key, str):
            object.__setattr__(self, "api_key", SecretStr(self.api_key))

    @classmethod
    def of(cls, engine: str | EngineEndpoint) -> EngineEndpoint:
        """The endpoint of a URL (an endpoint is returned as it is).

        Raises:
            ConfigError: ``engine`` is neither an endpoint nor an http(s) URL.
        """
        if isinstance(engine, EngineEndpoint):
            return engine
        if not isinstance(engine, str) or not engine.startswith(("http://", "https://")):
            from p2pweights.errors import ConfigError

            raise ConfigError(
                f"an engine is a URL such as 'http://127.0.0.1:30000', got {engine!r}"
            )
        return cls(url=engine)
