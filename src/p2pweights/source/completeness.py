"""The first update must feed every parameter whole.

A fused parameter (``qkv_proj``, ``gate_up_proj``, an expert's ``w13_weight``) is loaded
from several checkpoint tensors. An update that leaves one of them out still feeds the
parameter, so the loader probe sees it fed, yet that slice would keep bytes no update
wrote while the update reports success; and since later updates only have to match the
first, the hole would last. ``partly_fed`` names the checkpoint tensors left out that
feed a parameter the update feeds too (a tensor left out that feeds nothing the update
feeds, such as an MTP layer of an engine without a draft, is not its concern).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping

from p2pweights.errors import ConfigError
from p2pweights.source.expected import ExpectedCheckpoint
from p2pweights.source.fp8_block import SCALE_SUFFIX
from p2pweights.source.inputs import InputSpec

Feeds = Callable[[Mapping[str, InputSpec]], Mapping[str, frozenset[str]]]
"""Trainer inputs -> for each, the parameters its loader writes (a replica's probe)."""


def left_out(sent: Collection[str], expected: ExpectedCheckpoint) -> dict[str, InputSpec]:
    """The checkpoint's tensors the update does not send, as a trainer would send them.

    A block-fp8 checkpoint's scales are left out of this when their weight is sent:
    p2pweights quantizes the weight and makes them.
    """
    found = {}
    for name in expected.missing(sent):
        if name.endswith(SCALE_SUFFIX) and name.removesuffix(SCALE_SUFFIX) in sent:
            continue
        tensor = expected.tensors[name]
        dtypes = tensor.dtypes
        dtype = expected.model_dtype if expected.model_dtype in dtypes else min(dtypes, key=str)
        found[name] = InputSpec(tuple(tensor.shape), dtype)
    return found


def partly_fed(
    sent: Mapping[str, InputSpec], missing: Mapping[str, InputSpec], feeds: Feeds
) -> list[str]:
    """The names of ``missing`` whose loaders write a parameter ``sent``'s loaders write."""
    if not missing:
        return []
    fed = feeds({**sent, **missing})
    by_sent: set[str] = set()
    for name in sent:
        by_sent |= fed.get(name, frozenset())
    return sorted(name for name in missing if fed.get(name, frozenset()) & by_sent)


def check_whole_parameters(
    sent: Mapping[str, InputSpec],
    expected: Iterable[ExpectedCheckpoint],
    feeds: Iterable[Feeds],
) -> None:
    """Raise ``ConfigError`` naming the checkpoint tensors (of any of the engines'
    checkpoints ``expected``) that ``sent`` leaves out of a parameter it feeds, by any of
    the replicas' probes ``feeds``."""
    missing: dict[str, InputSpec] = {}
    for checkpoint in expected:
        if checkpoint.unchecked is None:
            missing.update(left_out(sent.keys(), checkpoint))
    if not missing:
        return
    names = sorted({name for feed in feeds for name in partly_fed(sent, missing, feed)})
    if names:
        more = f" and {len(names) - 8} more" if len(names) > 8 else ""
        raise ConfigError(
            f"the first update leaves out {len(names)} checkpoint tensor(s) that feed the "
            f"same engine parameters as tensors it sends: {', '.join(names[:8])}{more}; those "
            f"parameter slices would keep bytes no update wrote. Send every checkpoint tensor "
            f"(nothing was written)"
        )
