"""What a user reads about the configs and the command line: field docs, clean errors, help."""

from __future__ import annotations

import pydoc

import pytest

from p2pweights.config import DeltaConfig, MooncakeConfig, SyncConfig, Timeouts
from p2pweights.errors import ConfigError


@pytest.mark.parametrize("config", [SyncConfig, MooncakeConfig, DeltaConfig, Timeouts])
def test_every_field_has_its_docstring_as_description(config: type) -> None:
    missing = [n for n, f in config.model_fields.items() if n != "kind" and not f.description]
    assert missing == []


def test_help_shows_the_field_docstrings() -> None:
    text = pydoc.render_doc(SyncConfig, renderer=pydoc.plaintext)
    assert "Size of each of the two staging buffers" in text
    assert "timeouts" in text
    assert "A write still running after this many seconds" in pydoc.render_doc(
        Timeouts, renderer=pydoc.plaintext
    )


def test_validation_errors_carry_no_pydantic_link() -> None:
    with pytest.raises(ConfigError) as caught:
        SyncConfig(buffer_bytes="lots")
    message = str(caught.value)
    assert "buffer_bytes" in message
    assert "For further information" not in message and "errors.pydantic.dev" not in message


def test_cli_help_has_no_restructuredtext_and_engine_options_are_explained() -> None:
    from p2pweights.cli import build_parser

    parser = build_parser()
    assert "``" not in parser.format_help()
    commands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    engine = commands["engine"]
    helps = {a.dest: a.help for a in engine._actions}
    for dest in ("tp", "port", "dtype", "host", "transport"):
        assert helps[dest], dest
    for command in commands.values():
        assert "``" not in command.format_help()
