"""Quiet by default: third-party noise kept out, one knob each for ours and theirs."""

from __future__ import annotations

import logging
import warnings

import pytest

from p2pweights import logs


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("P2PWEIGHTS_LOG", raising=False)
    monkeypatch.delenv("P2PWEIGHTS_THIRD_PARTY_LOGS", raising=False)
    saved = logging.getLogger("p2pweights").level
    yield
    logging.getLogger("p2pweights").setLevel(saved)


def _warn_from(module: str, message: str) -> list[warnings.WarningMessage]:
    """What ``warnings.warn(message)`` raised inside ``module`` shows, under the current filters."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        logs.keep_third_party_noise_out()
        code = compile("import warnings\nwarnings.warn(MESSAGE, UserWarning)", module, "exec")
        exec(code, {"__name__": module, "MESSAGE": message})
    return seen


def test_known_import_warnings_of_sglang_and_megatron_are_kept_out() -> None:
    assert (
        _warn_from(
            "sglang.srt.layers.quantization.awq.awq",
            "Only CUDA, HIP and XPU support AWQ currently.",
        )
        == []
    )
    assert (
        _warn_from(
            "megatron.core.optimizer", "Transformer Engine and Apex are not installed. Falling back"
        )
        == []
    )


def test_other_warnings_still_show() -> None:
    assert len(_warn_from("sglang.srt.something", "a real problem")) == 1
    assert len(_warn_from("mymodule", "Only CUDA, HIP and XPU support AWQ currently.")) == 1


def test_known_log_lines_are_dropped_and_others_kept(caplog: pytest.LogCaptureFixture) -> None:
    logs.keep_third_party_noise_out()
    registry = logging.getLogger("sglang.srt.models.registry")
    with caplog.at_level(logging.INFO):
        registry.warning("Ignore import error when loading sglang.srt.models.mamba: no module")
        registry.warning("something else")
        logging.getLogger("torch.utils.cpp_extension").warning(
            "No CUDA runtime is found, using CUDA_HOME='/usr/local'"
        )
    assert [r.getMessage() for r in caplog.records] == ["something else"]


def test_third_party_logs_on_lets_everything_through(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("P2PWEIGHTS_THIRD_PARTY_LOGS", "1")
    logger = logging.getLogger("sglang.kernels.jit.utils.arch")
    for f in list(logger.filters):
        logger.removeFilter(f)
    logs.keep_third_party_noise_out()
    with caplog.at_level(logging.INFO):
        logger.warning("Cannot detect CUDA architecture.")
    assert len(caplog.records) == 1
    assert (
        len(
            _warn_from(
                "sglang.srt.layers.quantization.gguf", "Only CUDA, MUSA and NPU support GGUF"
            )
        )
        == 1
    )


def test_p2pweights_log_sets_our_level_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("P2PWEIGHTS_LOG", "info")
    httpx_level = logging.getLogger("httpx").level
    root_handlers = list(logging.getLogger().handlers)
    logs.configure()
    assert logging.getLogger("p2pweights").level == logging.INFO
    assert logging.getLogger("httpx").level == httpx_level
    assert logging.getLogger().handlers == root_handlers  # no handler added


def test_a_bad_p2pweights_log_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from p2pweights.errors import ConfigError

    monkeypatch.setenv("P2PWEIGHTS_LOG", "loud")
    with pytest.raises(ConfigError, match="P2PWEIGHTS_LOG"):
        logs.configure()


# -- a library configures nothing the user did not ask for (issue 41 item 5) -------------------

_PROBE = """
import logging, warnings
import torch  # its own import adds filters of its own (and numpy's)
before = list(warnings.filters)
import p2pweights
{action}
noisy = ["sglang.srt.models.registry", "torch.utils.cpp_extension",
         "megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision"]
print(warnings.filters == before, [bool(logging.getLogger(n).filters) for n in noisy])
"""


def _probe(action: str) -> str:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("P2PWEIGHTS_")}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE.format(action=action)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )
    return done.stdout.strip().splitlines()[-1]


def test_constructing_a_session_changes_no_warnings_filter_or_other_logger() -> None:
    assert _probe("p2pweights.WeightSyncSession().close()") == "True [False, False, False]"


def test_quiet_is_the_explicit_way_to_keep_third_party_noise_out() -> None:
    assert _probe("import p2pweights.logs; p2pweights.logs.quiet()") == "False [True, True, True]"


def test_the_command_line_keeps_its_output_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    from p2pweights import cli

    called = []
    monkeypatch.setattr(logs, "quiet", lambda: called.append("quiet"))
    parser = cli.build_parser()
    args = parser.parse_args(["inspect", "http://127.0.0.1:1"])
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    monkeypatch.setattr(args, "run", lambda _args: 0)
    monkeypatch.setattr(parser, "parse_args", lambda _argv: args)
    assert cli.main(["inspect", "http://127.0.0.1:1"]) == 0
    assert called == ["quiet"]
