"""Which speculative engines p2pweights updates, and the ones it refuses at connect."""

from __future__ import annotations

import pytest

from p2pweights.errors import EngineError
from p2pweights.replica.speculative import has_model_draft

BASE = {"model_path": "/models/dsv3", "moe_runner_backend": "auto", "moe_a2a_backend": "none"}


@pytest.mark.parametrize(
    "info",
    [
        {},
        {"speculative_algorithm": None},
        {"speculative_algorithm": "NGRAM"},  # drafts from a token cache: no weights
    ],
)
def test_no_draft_runner_to_update(info) -> None:
    assert has_model_draft("http://e", {**BASE, **info}) is False


@pytest.mark.parametrize(
    "info",
    [
        {"speculative_algorithm": "EAGLE"},
        {"speculative_algorithm": "NEXTN"},
        {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": "/models/dsv3"},
        {
            "speculative_algorithm": "EAGLE",
            "speculative_moe_runner_backend": "auto",
            "speculative_moe_a2a_backend": "none",
        },
    ],
)
def test_same_model_drafts_are_updated(info) -> None:
    assert has_model_draft("http://e", {**BASE, **info}) is True


@pytest.mark.parametrize(
    ("info", "arg"),
    [
        ({"speculative_algorithm": "EAGLE3"}, "speculative_algorithm"),
        ({"speculative_algorithm": "STANDALONE"}, "speculative_algorithm"),
        (
            {"speculative_algorithm": "EAGLE", "enable_multi_layer_eagle": True},
            "enable_multi_layer_eagle",
        ),
        (
            {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": "/models/mtp"},
            "speculative_draft_model_path",
        ),
        (
            {"speculative_algorithm": "EAGLE", "speculative_moe_runner_backend": "triton"},
            "speculative_moe_runner_backend",
        ),
        (
            {"speculative_algorithm": "EAGLE", "speculative_moe_a2a_backend": "deepep"},
            "speculative_moe_a2a_backend",
        ),
    ],
)
def test_drafts_a_replica_cannot_reproduce_are_refused(info, arg) -> None:
    with pytest.raises(EngineError, match=f"http://e: server arg {arg}="):
        has_model_draft("http://e", {**BASE, **info})
