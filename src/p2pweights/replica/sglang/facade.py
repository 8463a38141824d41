"""The one door to sglang for p2pweights outside ``replica/sglang``.

``verify``, ``local_engine``, ``doctor`` and the ``sglang_plugin`` reach sglang only
through these functions, so every sglang internal p2pweights touches lives in this
package, where ``compat`` checks it. Each imports sglang when called: importing this
module imports no sglang (the plugin imports it inside sglang's own processes, and
``doctor`` on hosts that may lack sglang); the modules it re-exports import it lazily too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any

# sglang's own loading of an engine rank, and its parallel context (no sglang imported here)
from p2pweights.replica.sglang.env import rank_scope
from p2pweights.replica.sglang.reference import (
    begin_update,
    end_update,
    load_real_rank_model,
    reference_checksums,
)

if TYPE_CHECKING:
    import torch

    from p2pweights.replica.ranks import RankSpec

__all__ = [
    "compat",
    "version",
    "has_update_api",
    "weight_checker",
    "weights_checker_hash",
    "rank_scope",
    "resolved_server_args",
    "load_real_rank_model",
    "reference_checksums",
    "begin_update",
    "end_update",
    "register_hook",
    "model_args",
    "parallel",
    "serving_args",
    "bootstrap_url",
]


# -- the installed sglang -----------------------------------------------------------------------


def compat() -> ModuleType:
    """``replica.sglang.compat``; raises ``ConfigError`` where sglang is not installed."""
    from p2pweights.replica.sglang import compat as module

    return module


def version() -> str:
    """The installed sglang's release."""
    import sglang

    return str(sglang.__version__)


def has_update_api() -> bool:
    """Whether the installed sglang has ``begin/end_weight_update`` (0.5.21 and later)."""
    try:
        from sglang.srt.managers import io_struct
    except ImportError:
        return False
    return all(
        hasattr(io_struct, name)
        for name in ("BeginWeightUpdateReqInput", "EndWeightUpdateReqInput")
    )


# -- an engine rank's model: reference loading and sglang's weight checker ---------------------


def weight_checker(get_model: Callable[[], torch.nn.Module], spec: RankSpec) -> Any:
    """sglang's ``WeightChecker`` of a model of ``spec``'s rank (it records the rank's
    placement when made). Run its ``handle`` inside ``rank_scope(spec)``."""
    from sglang.srt.utils.weight_checker import WeightChecker

    with rank_scope(spec):
        return WeightChecker(get_model=get_model)


def weights_checker_hash(tensor: torch.Tensor) -> str:
    """The hash sglang's ``/weights_checker`` ``checksum`` answers for a parameter holding
    ``tensor``'s bytes: its own ``_hash_tensor`` (``mm_utils.tensor_hash``: sha256 of the
    bytes for a CPU tensor, its Triton kernel for a CUDA one, so the two differ: hash on
    the kind of device the engine holds the parameter on)."""
    from sglang.srt.utils.weight_checker import _hash_tensor

    return str(_hash_tensor(tensor))


def resolved_server_args(fields: Mapping[str, Any]) -> Any:
    """sglang's resolved ``ServerArgs`` for ``fields``, published for this (engine)
    process, as plain builtins (what its ``/server_info`` serves)."""
    from sglang.srt.runtime_context import get_server_args
    from sglang.srt.utils.msgspec_utils import msgspec_to_builtins

    from p2pweights.replica.sglang.env import ensure_server_args

    ensure_server_args(fields)
    return msgspec_to_builtins(get_server_args().resolved_dict())


def resolved_server_info(fields: Mapping[str, Any]) -> dict[str, Any]:
    """sglang's resolved ServerArgs for ``fields``, as its ``/server_info`` serves them
    (JSON values; what is not JSON as its string)."""
    import json

    info: dict[str, Any] = json.loads(json.dumps(resolved_server_args(fields), default=str))
    return info


# -- inside an sglang engine process (the plugin) -----------------------------------------------


def register_hook(target: str, hook: Any, kind: str) -> None:
    """Register ``hook`` on ``target`` with sglang's hook registry (``kind``: ``"REPLACE"``,
    ``"BEFORE"`` or ``"AFTER"``); sglang applies it after loading its plugins."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(target, hook, HookType[kind])


def model_args() -> Any:
    """This engine process's model config bag (sglang's ``get_model()``)."""
    from sglang.srt.runtime_context import get_model

    return get_model()


def parallel() -> Any:
    """This engine process's parallel context (sglang's ``get_parallel()``)."""
    from sglang.srt.runtime_context import get_parallel

    return get_parallel()


def serving_args() -> Any:
    """This engine process's serving config bag (sglang's ``get_serving()``)."""
    from sglang.srt.runtime_context import get_serving

    return get_serving()


def bootstrap_url() -> str:
    """Where this instance's ranks reach its engine info bootstrap server, derived as
    sglang derives it for Mooncake (the head node's address, the bootstrap port)."""
    from sglang.srt.utils.network import NetworkAddress

    dist_init_addr = parallel().dist_init_addr
    host = NetworkAddress.parse(dist_init_addr).resolved().host if dist_init_addr else "127.0.0.1"
    return str(NetworkAddress(host, model_args().engine_info_bootstrap_port).to_url())
