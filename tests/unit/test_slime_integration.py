"""p2pweights.integrations.slime without slime: the flags it refuses and the config it makes.

The updater itself runs against slime's own code in tests/integration/test_slime_updater.py.
"""

from __future__ import annotations

from argparse import Namespace

import pytest

from p2pweights import ConfigError, MooncakeConfig, SyncConfig
from p2pweights.integrations import FrameworkMismatchError, slime


def _args(mode="full", transport="nccl", colocate=False) -> Namespace:
    return Namespace(
        update_weight_mode=mode,
        update_weight_transport=transport,
        colocate=colocate,
        update_weight_buffer_size=64,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (_args(mode="delta", transport="disk"), r"'delta' / 'disk'"),
        (_args(transport="disk"), r"'full' / 'disk'"),
        (_args(colocate=True), r"with --colocate"),
    ],
)
def test_install_refuses_flags_that_do_not_choose_the_distributed_updater(args, message):
    with pytest.raises(ConfigError, match=message):
        slime.install(args)


def test_the_session_leaves_pausing_to_slime():
    config = slime._caller_config(None, slime.args_buffer(_args()))
    assert config.pause_mode == "caller"
    assert config.buffer_bytes == 1 << 20  # slime's 64-byte buffer raised to the floor
    given = SyncConfig(transport=MooncakeConfig(protocol="tcp"), buffer_bytes="2MiB")
    config = slime._caller_config(given, 1 << 20)
    assert config.pause_mode == "caller" and config.buffer_bytes == 2 << 20
    with pytest.raises(ConfigError, match="slime's updater pauses and resumes"):
        slime._caller_config(SyncConfig(pause_mode="retract"), 1 << 20)


def test_install_without_slime_says_what_is_missing():
    import importlib.util

    if importlib.util.find_spec("slime") is not None:
        pytest.skip("slime is importable here")
    with pytest.raises(FrameworkMismatchError, match=r"slime is not installed.*THUDM/slime"):
        slime.install(_args())
    with pytest.raises(FrameworkMismatchError, match=r"slime is not installed"):
        slime.updater_class()
