"""The local engine's broadcast-baseline route takes a manifest from the network: each
tensor's shape, dtype and offset is checked against the broadcast area before a view of
it is made (issue 28, item 4)."""

from __future__ import annotations

import pytest
import torch

from p2pweights.errors import ConfigError
from p2pweights.local_engine.ranks import broadcast_views

AREA = torch.zeros(1024, dtype=torch.uint8)


def test_a_well_formed_manifest_gives_views_of_the_area() -> None:
    views = broadcast_views(AREA, [["a", [4, 8], "bfloat16", 0], ["b", [3], "float32", 64]])
    assert [(n, tuple(v.shape), v.dtype) for n, v in views] == [
        ("a", (4, 8), torch.bfloat16),
        ("b", (3,), torch.float32),
    ]
    assert views[1][1].data_ptr() == AREA.data_ptr() + 64


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        (["a", [-4, 8], "bfloat16", 0], "shape"),  # numel -32: passed the bounds check before
        (["a", [4, 8], "nn", 0], "dtype"),  # getattr(torch, "nn") is a module
        (["a", [4, 8], "bfloat16", 1020], "leaves"),
        (["a", [4, 8], "bfloat16", -8], "offset"),
        (["a", [4, 8], "bfloat16", 1.5], "offset"),
        (["a", [4, 8], "bfloat16", 1], "offset"),  # not a whole bfloat16 from the start
        (["a", "48", "bfloat16", 0], "shape"),
        (["a", [4, 8], "bfloat16"], "manifest"),
    ],
)
def test_a_manifest_entry_that_cannot_be_viewed_is_refused(entry, says) -> None:
    with pytest.raises(ConfigError, match=says):
        broadcast_views(AREA, [entry])
