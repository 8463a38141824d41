"""Owner sends that write one parameter in shares from several trainer ranks are refused,
before anything is sent, where no check could verify the parameter: digests taken as the
writes land (a share may land after the flag) and engines checked through sglang's
``/weights_checker`` (its hash cannot be made from shares). Write digests, summed over
the shares, verify them."""

from __future__ import annotations

import pytest

from p2pweights.errors import ConfigError
from p2pweights.verification.check import WriteCheck
from p2pweights.verification.checker import CheckerTarget


def test_early_digests_are_refused_with_shared_parameters():
    check = WriteCheck(engines={"http://d": object()})  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match="digest_as_written=False with owned tensors"):
        check.refuse_shared_parameters(digest_as_written=True)
    check.refuse_shared_parameters(digest_as_written=False)  # digests at the end: summed


def test_engines_checked_by_their_checker_are_refused_with_shared_parameters():
    target = CheckerTarget(object(), "cpu")  # type: ignore[arg-type]
    check = WriteCheck(checker={"http://sgl": target})
    with pytest.raises(ConfigError, match=r"engines http://sgl are verified through sglang's"):
        check.refuse_shared_parameters(digest_as_written=False)


def test_only_engines_that_digest_are_flagged_and_only_when_asked():
    check = WriteCheck(engines={"http://d": object()})  # type: ignore[dict-item]
    check.checker["http://sgl"] = CheckerTarget(object(), "cpu")  # type: ignore[arg-type]
    assert check.flagged(digest_as_written=True) == {"http://d"}
    assert check.flagged(digest_as_written=False) == frozenset()
