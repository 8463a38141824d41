"""Every size spelling a config, the CLI or ``P2PWEIGHTS_DELTA_SCRATCH`` accepts, and what
they refuse: the table the byte-size parser is held to."""

from __future__ import annotations

import re

import pytest

from p2pweights import ConfigError, SyncConfig
from p2pweights.config import parse_bytes

_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
}

ACCEPTED = [
    *((f"3{unit}", 3 * size) for unit, size in _UNITS.items()),
    *((f"3{unit.lower()}", 3 * size) for unit, size in _UNITS.items()),
    *((f"3{unit.upper()}", 3 * size) for unit, size in _UNITS.items()),
    *((f"3 {unit}", 3 * size) for unit, size in _UNITS.items()),
    ("512MiB", 512 * 2**20),
    ("1GiB", 2**30),
    ("1.5GB", 1_500_000_000),
    ("0.5MiB", 2**19),
    ("1.25 KiB", 1280),
    ("2.0GiB", 2 * 2**30),
    (" 64 kib ", 65536),
    ("\t8MiB\n", 8 * 2**20),
    ("2048", 2048),
    ("2048.0", 2048),
    (" 2048 ", 2048),
    ("0", 0),
    ("0MiB", 0),
    (4096, 4096),
    (0, 0),
    (2**40, 2**40),
    (1048576.0, 1048576),
]

REFUSED = [
    True,
    False,
    "",
    "   ",
    "lots",
    "MiB",
    "-1MiB",
    "+1MiB",
    "1e9",
    "1.5.3GB",
    "512MiB of it",
    "512 MiB MiB",
    "512 mebibytes",
    "0x100",
    "1,5GB",
    # refused before sizes were read by pydantic's ByteSize, and still: units past TiB,
    # a unit without a number, no digit before the point, bits
    "1PB",
    "1PiB",
    "1EiB",
    "EiB",
    ".5GiB",
    "8bit",
    "1kbit",
    "1Mibit",
]


@pytest.mark.parametrize(("given", "expected"), ACCEPTED, ids=repr)
def test_accepted(given, expected):
    size = parse_bytes(given)
    assert size == expected and type(size) is int


@pytest.mark.parametrize("given", REFUSED, ids=repr)
def test_refused(given):
    # one message for every refused spelling, whichever check refused it
    message = "size" if isinstance(given, bool) else rf"^cannot read {re.escape(repr(given))} as"
    with pytest.raises(ValueError, match=message):
        parse_bytes(given)


@pytest.mark.parametrize(
    ("given", "expected"),
    [(text, size) for text, size in ACCEPTED if isinstance(size, int) and size >= 2**20],
    ids=repr,
)
def test_buffer_bytes(given, expected):
    assert SyncConfig(buffer_bytes=given).buffer_bytes == expected


@pytest.mark.parametrize("given", [*REFUSED, "1023KiB", 2**20 - 1], ids=repr)
def test_buffer_bytes_refused(given):
    with pytest.raises(ConfigError, match="buffer_bytes"):
        SyncConfig(buffer_bytes=given)
