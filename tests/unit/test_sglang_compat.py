"""The sglang symbol check: passes on the installed sglang, names what is missing."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("sglang")

from p2pweights.errors import ConfigError
from p2pweights.replica.sglang import compat


@pytest.fixture(autouse=True)
def _fresh_check() -> Iterator[None]:
    compat.check_sglang.cache_clear()
    yield
    compat.check_sglang.cache_clear()


def test_installed_sglang_has_every_symbol() -> None:
    assert compat.missing_symbols(compat.REQUIRED) == []
    compat.check_sglang()


def test_tested_range_holds_the_installed_release() -> None:
    low, high = compat.TESTED_SGLANG
    assert compat._release(low) <= compat._release(compat.SGLANG_VERSION) <= compat._release(high)


def test_a_missing_function_is_named_with_version_and_range(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sglang.srt import runtime_context

    monkeypatch.delattr(runtime_context, "create_context")
    with pytest.raises(ConfigError) as info:
        compat.check_sglang()
    message = str(info.value)
    assert "sglang.srt.runtime_context.create_context" in message
    assert compat.SGLANG_VERSION in message
    low, high = compat.TESTED_SGLANG
    assert f"{low} to {high}" in message
    assert "use_context" not in message  # only what is missing


def test_a_missing_class_member_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.model_loader.loader import QuantizedRLModelLoader

    monkeypatch.delattr(QuantizedRLModelLoader, "is_reload_scenario")
    with pytest.raises(ConfigError, match=r"loader\.QuantizedRLModelLoader\.is_reload_scenario"):
        compat.check_sglang()


def test_a_missing_module_is_reported() -> None:
    symbol = compat.Symbol("sglang.srt.no_such_module", "thing", "a test")
    [(missing, why)] = compat.missing_symbols([symbol])
    assert missing is symbol and "ModuleNotFoundError" in why


def test_the_check_runs_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    compat.check_sglang()
    calls = []
    monkeypatch.setattr(compat, "missing_symbols", lambda symbols: calls.append(1) or [])
    compat.check_sglang()
    assert calls == []


@pytest.mark.parametrize(
    ("version", "release"),
    [("0.5.23", (0, 5, 23)), ("0.5.23.post1", (0, 5, 23)), ("0.6.0rc1", (0, 6))],
)
def test_release_parts(version: str, release: tuple[int, ...]) -> None:
    assert compat._release(version) == release


# -- the plugin's hook targets and the sglang texts p2pweights matches on ---------------------


def test_every_hook_target_of_the_plugin_is_checked() -> None:
    from p2pweights.sglang_plugin import HOOK_TARGETS

    checked = {str(symbol) for symbol in compat.PLUGIN_REQUIRED}
    assert set(HOOK_TARGETS) <= checked
    assert compat.missing_symbols(compat.PLUGIN_REQUIRED) == []


def test_a_hook_target_split_into_module_and_member() -> None:
    symbol = compat.hook_target("sglang.srt.entrypoints.engine.Engine._launch", "a test")
    assert (symbol.module, symbol.name) == ("sglang.srt.entrypoints.engine", "Engine._launch")


def test_a_hook_target_sglang_lost_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    monkeypatch.delattr(WeightUpdater, "end_weight_update")
    with pytest.raises(
        ConfigError, match=r"WeightUpdater\.end_weight_update \(used by sglang_plugin"
    ):
        compat.check_sglang(compat.PLUGIN_REQUIRED)


def test_every_text_p2pweights_matches_is_in_the_installed_sglang() -> None:
    from p2pweights.wire import sglang_texts

    assert compat.missing_texts(sglang_texts.TEXTS) == []


def test_a_reworded_sglang_answer_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.managers.scheduler_components import weight_updater

    from p2pweights.wire import sglang_texts

    def begin_weight_update(self: object, recv_req: object) -> object:
        return {"success": False, "message": "an update session is in progress"}

    monkeypatch.setattr(
        weight_updater.SchedulerWeightUpdaterManager, "begin_weight_update", begin_weight_update
    )
    with pytest.raises(ConfigError) as info:
        compat.check_sglang()
    message = str(info.value)
    assert repr(sglang_texts.ALREADY_OPEN.text) in message
    assert "SchedulerWeightUpdaterManager.begin_weight_update" in message
    assert "engines.update_state" in message
    assert repr(sglang_texts.NOT_OPEN.text) not in message  # only what is missing


def test_a_text_whose_function_is_gone_is_reported() -> None:
    from p2pweights.wire.sglang_texts import SglangText

    text = SglangText("hello", "sglang.srt.server_args", "no_such_function", "a test")
    [(missing, why)] = compat.missing_texts([text])
    assert missing is text and "AttributeError" in why


# -- branch builds: miles' sglang-miles -----------------------------------------------------

# What a build from a git checkout reports (setuptools_scm, sglang's python/pyproject.toml:
# ``git describe --tags --long --match v*``): the next release, ``.devN`` commits past the
# tag, ``+g<commit>``, ``.d<date>`` when the tree is dirty. miles' image checks out the
# ``sglang-miles`` branch over the base image's tag and runs ``pip install -e python``:
# the v0.5.19 stack (61 commits, head c9660a7e11 per miles PR 3321) and the v0.5.20 stack
# (54 commits; the CUDA 12 image edits pyproject.toml, so its tree is dirty).
SGLANG_MILES_V0519 = "0.5.20.dev61+gc9660a7e11"
SGLANG_MILES_V0520_CU12 = "0.5.21.dev54+g0123abcd.d20260919"


@pytest.mark.parametrize(
    ("version", "tested", "source_build", "commit"),
    [
        ("0.5.23", True, False, None),
        ("0.5.23.post1", True, False, None),
        ("0.5.22", False, False, None),
        ("0.5.24", False, False, None),
        (SGLANG_MILES_V0519, False, True, "c9660a7e11"),
        (SGLANG_MILES_V0520_CU12, False, True, "0123abcd"),
        # a branch on the 0.5.22 tag is numbered 0.5.23.devN: not the tested 0.5.23
        ("0.5.23.dev7+g89abcdef", False, True, "89abcdef"),
        # a branch on the 0.5.23 tag is numbered 0.5.24.devN: past the tested range
        ("0.5.24.dev3+g1a2b3c4", False, True, "1a2b3c4"),
        ("0.0.0.dev0", False, True, None),  # sglang's fallback without git metadata
    ],
)
def test_a_version_string_is_read_as_sglangs_build_writes_it(
    version: str, tested: bool, source_build: bool, commit: str | None
) -> None:
    build = compat.sglang_build(version)
    assert compat.is_tested(version) is tested
    assert build.is_source_build is source_build
    assert build.commit == commit


def test_sglang_miles_is_described_as_a_branch_build() -> None:
    build = compat.sglang_build(SGLANG_MILES_V0519)
    assert build.release == (0, 5, 20) and build.commits_past_tag == 61
    assert str(build) == (
        "0.5.20.dev61+gc9660a7e11 (a build from a git checkout at commit c9660a7e11, 61 "
        "commits past the release tag before 0.5.20: a branch such as miles' sglang-miles, "
        "not a published sglang release)"
    )


def test_sglang_miles_lacking_a_symbol_is_refused_naming_the_build_and_the_symbol(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(compat, "SGLANG_VERSION", SGLANG_MILES_V0519)
    lacking = compat.Symbol("sglang.srt.runtime_context", "no_such_accessor", "a test")
    with pytest.raises(ConfigError) as info:
        compat.check_sglang((lacking,), ())
    message = str(info.value)
    assert "sglang.srt.runtime_context.no_such_accessor (used by a test" in message
    assert "at commit c9660a7e11" in message and "sglang-miles" in message
    assert "a branch build that carries every name above" in message


def test_sglang_miles_with_every_symbol_is_accepted_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(compat, "SGLANG_VERSION", SGLANG_MILES_V0519)
    with caplog.at_level("WARNING", logger=compat.__name__):
        compat.check_sglang()  # the installed sglang's symbols, under the branch's version
    assert "outside the tested range" in caplog.text
    assert "at commit c9660a7e11" in caplog.text
