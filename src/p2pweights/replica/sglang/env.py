"""Everything that touches sglang's process-global state, in one place.

A replica runs sglang's own model code inside the trainer process. That code reads
its configuration from the active ``sglang.srt.runtime_context`` context: the
``ServerArgs`` and config bags, the MoE runtime flags, and the parallel context
(``get_parallel()``), which says which rank of which group this process is. The
trainer is none of those ranks and must not replace the process's own sglang
configuration (a colocated trainer may run an sglang engine in this process too),
so this module

* builds one context per replica from the engine's server arguments without
  touching the process's (``replica_context``) and activates it around every
  replica operation (``in_context``); an engine process instead publishes its
  server arguments process-wide (``ensure_server_args``: the local engine, the
  reference models of bit-exact checks),
* states one engine rank's parallelism as a scoped override with stand-in group
  objects (``rank_scope``), so construction and loaders shard for that rank,
* builds a model the way sglang's ``DefaultModelLoader`` does (``build_model``).

sglang is imported lazily: ``import p2pweights`` must not pull it in.

The CPU-only trap. ``RotaryEmbedding.__init__`` picks a forward kernel while it is
built; on a host that is neither CUDA nor sglang's CPU engine it imports
``vllm._custom_ops.rotary_embedding``. ``SGLANG_USE_CPU_ENGINE=1`` would avoid that,
but it also changes how loaders pad and shard, so replicas would no longer match a
GPU server. Instead, on hosts without CUDA, ``_rope_without_forward_kernel`` marks
the rotary module's platform flag as CPU while a model is constructed, for the
constructing thread only (``p2pweights.thread_patch``; other threads see sglang's flag):
the rope then skips choosing a fallback kernel (``use_fallback_kernel = False``).
That choice only decides which kernel ``forward`` calls; the rope holds no parameters
(its ``cos_sin_cache`` is a non-persistent buffer, dtype chosen by a separate flag),
and a replica never runs a forward pass, so no loader's bytes change. On a CUDA host
nothing is patched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from p2pweights import environment
from p2pweights.errors import ConfigError
from p2pweights.replica.ranks import RankSpec
from p2pweights.thread_patch import patched_call, patched_flag
from p2pweights.wire import sglang_texts

if TYPE_CHECKING:
    from torch import nn

logger = logging.getLogger(__name__)

__all__ = [
    "FakeGroup",
    "ensure_server_args",
    "replica_context",
    "in_context",
    "server_args_names",
    "check_reproducible_layout",
    "initialize_moe_config",
    "rank_scope",
    "build_model",
    "model_config_for",
    "modules_with_quant_method",
    "shared_with_target",
    "ROLES",
    "role_scope",
    "build_role_model",
]

ROLES = ("target", "draft")
"""An engine rank's model runners: the target, and a same-model speculative draft."""


@dataclass(frozen=True)
class FakeGroup:
    """Stands in for sglang's ``GroupCoordinator`` during construction and loading.

    Loaders only read the rank and width; no collective ever runs in a replica, so
    the process-group handles are None.
    """

    rank_in_group: int
    world_size: int
    ranks: tuple[int, ...]
    cpu_group: None = None
    device_group: None = None

    @classmethod
    def of(cls, rank_in_group: int, world_size: int, first_rank: int = 0) -> FakeGroup:
        return cls(rank_in_group, world_size, tuple(range(first_rank, first_rank + world_size)))

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1


def parallel_fields(spec: RankSpec) -> dict[str, Any]:
    """The keyword arguments of ``get_parallel().override`` that make this process ``spec``."""
    fields: dict[str, Any] = {}
    for name in ("tp", "pp", "attn_tp", "attn_cp", "moe_ep", "moe_tp", "moe_dp"):
        size, rank = getattr(spec, f"{name}_size"), getattr(spec, f"{name}_rank")
        fields[f"{name}_size"] = size
        fields[f"{name}_rank"] = rank
        fields[f"{name}_group"] = FakeGroup.of(rank, size)
    fields["attn_dp_size"] = spec.attn_dp_size
    fields["attn_dp_rank"] = spec.attn_dp_rank
    # The data-parallel controller's replica index; None = no controller (one DP replica),
    # which is what one engine process of a replica is. The weight checker reads it.
    fields["dp_rank"] = None
    dcp_enabled = spec.dcp_size > 1
    fields["dcp_size"] = spec.dcp_size
    fields["dcp_enabled"] = dcp_enabled
    fields["attn_dcp_size"] = spec.dcp_size if dcp_enabled else 1
    fields["dcp_rank"] = spec.dcp_rank
    fields["attn_dcp_rank"] = spec.dcp_rank if dcp_enabled else 0
    fields["dcp_group"] = FakeGroup.of(spec.dcp_rank, spec.dcp_size) if dcp_enabled else None
    world_size = spec.tp_size * spec.pp_size
    fields["world_group"] = FakeGroup.of(spec.world_rank, world_size)
    fields["launch_world_rank"] = spec.world_rank
    shared = spec.shared_experts_tp_size
    fields["shared_experts_tp_size"] = shared
    if shared is not None and shared > 1:
        fields["shared_experts_tp_group"] = FakeGroup.of(spec.tp_rank % shared, shared)
    else:
        fields["shared_experts_tp_group"] = None
    return fields


_published_key: tuple[tuple[str, str], ...] | None = None

_CONTEXT_LOCK = threading.RLock()
"""Held while a replica's context is active: sglang's ``use_context`` swaps process
globals and does not isolate threads, so replica operations are serialized."""


def ensure_server_args(server_args_fields: Mapping[str, Any]) -> None:
    """Publish ``ServerArgs(**fields)`` process-wide unless the same fields already are.

    For engine processes only (the local engine, the reference model of a bit-exact
    check): it replaces this process's sglang configuration. A replica in a trainer
    uses ``replica_context`` instead. ``server_args_fields`` is typically an engine's
    ``/server_info`` with ``model_path`` pointing at a local folder holding the
    model's ``config.json`` (see ``_fields_for_server_args``).
    """
    global _published_key
    from sglang.srt.server_args import set_global_server_args_for_scheduler

    fields = _fields_for_server_args(server_args_fields)
    key = tuple(sorted((k, repr(v)) for k, v in fields.items()))
    if key == _published_key:
        return
    server_args = _server_args(fields)
    try:
        set_global_server_args_for_scheduler(server_args)
    except (TypeError, ValueError) as exc:
        raise ConfigError(_rejected(fields, exc)) from exc
    # MoE layers read the runtime MoE flags (runner / a2a backend) while they are
    # built; sglang's scheduler seeds them right after publishing, and so do we.
    # Cheap, and harmless for dense models.
    initialize_moe_config()
    _published_key = key
    logger.debug("published sglang server args for %s", fields["model_path"])


def replica_context(server_args_fields: Mapping[str, Any]) -> Any:
    """A runtime context of its own for a replica of an engine with these server args.

    sglang's ``create_context`` resolves the args into config bags without replacing
    the active process config; the MoE flags are seeded inside it, as an engine's
    scheduler seeds them after publishing. Activate it with ``in_context``.
    """
    from sglang.srt.runtime_context import create_context

    fields = _fields_for_server_args(server_args_fields)
    server_args = _server_args(fields)
    try:
        # the role of the process that runs the model (sglang's scheduler)
        context = create_context(server_args, role="scheduler")
    except (TypeError, ValueError) as exc:
        raise ConfigError(_rejected(fields, exc)) from exc
    with in_context(context):
        initialize_moe_config()
    return context


@contextlib.contextmanager
def in_context(context: Any) -> Iterator[None]:
    """Make ``context`` sglang's active runtime context inside the block (nestable).

    The previous context comes back on exit, so the process's own sglang
    configuration, published or not, is never replaced.
    """
    from sglang.srt.runtime_context import use_context

    with _CONTEXT_LOCK, use_context(context):
        yield


def server_args_names() -> frozenset[str]:
    """The names of the installed sglang's ``ServerArgs`` fields."""
    from sglang.srt.server_args import ServerArgs

    return _server_args_names(ServerArgs)


def _fields_for_server_args(server_args_fields: Mapping[str, Any]) -> dict[str, Any]:
    """The ``ServerArgs`` fields among ``server_args_fields``, checked.

    Keys that are not ServerArgs fields (runtime state in ``/server_info``), None
    values (sglang's default) and values sglang redacted are dropped: sglang 0.5.23's
    ``/server_info`` shows the watermark secrets as ``"<redacted>"`` even when unset,
    and no redacted field lays out weights. ``device`` defaults to ``"cuda"``, the
    engine's device: sglang resolves defaults from it, and a replica never allocates
    on it.
    """
    known = server_args_names()
    fields = {
        k: v
        for k, v in server_args_fields.items()
        if k in known and v is not None and not _redacted(v)
    }
    if "model_path" not in fields:
        raise ConfigError("server args need a model_path (a folder holding config.json)")
    fields.setdefault("device", "cuda")
    check_reproducible_layout(fields)
    return fields


REDACTED = sglang_texts.REDACTED.text
"""What sglang's ``/server_info`` shows in place of a secret."""


def _redacted(value: Any) -> bool:
    """Whether ``value`` is, or holds, sglang's redaction marker."""
    if isinstance(value, str):
        return value == REDACTED
    if isinstance(value, Mapping):
        return any(_redacted(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_redacted(v) for v in value)
    return False


def _server_args(fields: Mapping[str, Any]) -> Any:
    from sglang.srt.server_args import ServerArgs

    try:
        return ServerArgs(**fields)
    except (TypeError, ValueError) as exc:
        raise ConfigError(_rejected(fields, exc)) from exc


def _rejected(fields: Mapping[str, Any], exc: Exception) -> str:
    """Why sglang refused an engine's server args, without the ~500 fields themselves."""
    return (
        f"sglang rejected the server args of the engine of {fields.get('model_path')!r} "
        f"(tp_size={fields.get('tp_size')}, device={fields.get('device')!r}, "
        f"{len(fields)} fields from its /server_info): {exc!r}"
    )


ARGS_CLASSES_KEPT = 4
"""ServerArgs classes whose field names are remembered (one per installed sglang)."""


@functools.lru_cache(maxsize=ARGS_CLASSES_KEPT)
def _server_args_names(server_args_cls: type) -> frozenset[str]:
    """Cached: msgspec resolves ServerArgs' ~550 annotations on every call (~10 ms)."""
    return frozenset(f.name for f in _server_args_fields(server_args_cls))


_UNREPRODUCIBLE: tuple[tuple[str, Any, str], ...] = (
    ("ep_num_redundant_experts", 0, "redundant expert slots"),
    ("init_expert_location", "trivial", "a non-default initial expert placement"),
    ("enable_eplb", False, "expert placement rebalanced at run time (EPLB)"),
    ("elastic_ep_backend", None, "elastic expert parallelism"),
    ("enable_elastic_expert_backup", False, "elastic expert backup"),
    ("dwdp_size", 1, "DWDP"),
    ("kt_weight_path", None, "KTransformers CPU experts"),
)
"""(server arg, the only value a replica reproduces, what another value means)."""


def check_reproducible_layout(server_args_fields: Mapping[str, Any]) -> None:
    """Refuse engines whose expert placement a replica cannot reproduce.

    A replica lays experts out as sglang's default placement does (global expert
    ``e`` on EP rank ``e // experts_per_rank``, one slot each). Redundant slots,
    EPLB, a custom initial placement, elastic EP, DWDP and KTransformers all move
    experts at start-up or at run time, so the replica's bytes would be wrong.
    """
    for name, reproducible, meaning in _UNREPRODUCIBLE:
        value = server_args_fields.get(name)
        if value is None or value == reproducible:
            continue
        raise ConfigError(
            f"server arg {name}={value!r} ({meaning}) places experts in a way a p2pweights "
            f"replica cannot reproduce; start the engine with {name}={reproducible!r} or use "
            "the broadcast weight update"
        )


def _server_args_fields(server_args_cls: type) -> list[Any]:
    """ServerArgs is a msgspec Struct in 0.5.23 and a dataclass in older releases."""
    if dataclasses.is_dataclass(server_args_cls):
        return list(dataclasses.fields(server_args_cls))
    import msgspec

    return list(msgspec.structs.fields(server_args_cls))


def initialize_moe_config() -> None:
    """Materialize sglang's MoE runtime flags; MoE models need them to be built."""
    from sglang.srt.layers.moe import initialize_moe_config as _initialize

    _initialize()


def _current_server_args() -> Any:
    from sglang.srt.runtime_context import get_server_args

    return get_server_args()


def model_config_for(role: str = "target") -> Any:
    """sglang's ``ModelConfig`` of ``role`` for the active context's server args.

    The draft's is what sglang's draft worker makes: the draft checkpoint (for a
    same-model draft, the model itself) with ``is_draft_model=True``, which switches
    the architecture to the MTP class (``DeepseekV3ForCausalLMNextN``, ...), and the
    target's context length.
    """
    from sglang.srt.configs.model_config import ModelConfig

    server_args = _current_server_args()
    target = ModelConfig.from_server_args(server_args)
    if role == "target":
        return target
    if role != "draft":
        raise ConfigError(f"unknown model role {role!r}; one of {ROLES}")
    from sglang.srt.runtime_context import get_spec

    spec = get_spec()
    return ModelConfig.from_server_args(
        server_args,
        model_path=spec.speculative_draft_model_path or server_args.model_path,
        model_revision=spec.speculative_draft_model_revision,
        is_draft_model=True,
        context_length=target.context_len,
    )


@contextlib.contextmanager
def role_scope(role: str, building: bool = False) -> Iterator[None]:
    """The MoE flags sglang's draft worker builds and loads its model under.

    For the target nothing changes. The draft uses the speculative MoE runner and
    a2a backends (p2pweights refuses engines where they differ from the target's:
    sglang reloads a draft under the target's), and while it is constructed,
    sglang's ``draft_model_build_scope``.
    """
    if role == "target":
        yield
        return
    from sglang.srt.layers.moe.utils import (
        draft_model_build_scope,
        speculative_moe_a2a_backend_context,
        speculative_moe_backend_context,
    )

    with contextlib.ExitStack() as stack:
        stack.enter_context(speculative_moe_backend_context())
        stack.enter_context(speculative_moe_a2a_backend_context())
        if building:
            stack.enter_context(draft_model_build_scope())
        yield


def build_role_model(
    spec: RankSpec, device: torch.device | str, role: str = "target"
) -> tuple[Any, nn.Module]:
    """``(model_config, model)`` of ``role`` for the active server args (see build_model)."""
    model_config = model_config_for(role)
    with role_scope(role, building=True):
        model = build_model(model_config, spec, device)
    return model_config, model


@contextlib.contextmanager
def rank_scope(spec: RankSpec) -> Iterator[None]:
    """Make sglang's parallel context read as ``spec`` inside the block (nestable)."""
    from sglang.srt.runtime_context import get_parallel

    try:
        scope = get_parallel().override(**parallel_fields(spec))
        scope.__enter__()
    except ValueError as exc:
        raise ConfigError(f"sglang rejected the parallel layout {spec}: {exc}") from exc
    try:
        yield
    finally:
        scope.__exit__(None, None, None)


@contextlib.contextmanager
def _rope_without_forward_kernel(device: torch.device | str) -> Iterator[None]:
    """The CPU-only trap fix described in the module docstring.

    Also: DeepSeek's yarn rope (``DeepseekScalingRotaryEmbedding``) asks sglang's
    ``get_device()`` for the accelerator to build its non-persistent
    ``cos_sin_cache`` on, which raises on a host without one. During construction
    it gets the device the model is built on ("meta" for a replica, so the cache,
    2 GB at DeepSeek-V3's 163840 x 40 positions, costs nothing).
    """
    from sglang.srt.layers.rotary_embedding import base, rope_variant
    from sglang.srt.utils import is_cuda

    if is_cuda() or environment.sglang_cpu_engine():
        yield
        return
    # for this thread only: other threads of the trainer keep sglang's answers
    with (
        patched_flag(base, "_is_cpu", True),
        patched_call(rope_variant, "get_device", lambda device_id=None: str(torch.device(device))),
    ):
        yield


def build_model(
    model_config: Any,
    spec: RankSpec,
    device: torch.device | str,
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """Construct the sglang model of ``spec``'s rank on ``device``, as DefaultModelLoader does.

    The class comes from the HF config's ``architectures`` through sglang's model
    registry (``model_registry.prepare``: importing only that class's module); the
    quantization config and shared-expert override are resolved by sglang's own helpers.
    ``torch.device("meta")`` builds a replica without storage.
    The parameter dtype is ``dtype``, by default ``model_config.dtype`` (the
    engine's resolved ``--dtype``).
    """
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.loader import _get_quantization_config, _initialize_model
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    from p2pweights.replica.sglang import model_registry

    architectures = getattr(model_config.hf_config, "architectures", None) or []
    model_registry.prepare(architectures)  # its one model module, not all of sglang's
    load_config = LoadConfig()
    with rank_scope(spec), _rope_without_forward_kernel(device):
        try:
            quant_config = _get_quantization_config(model_config, load_config)
        except ValueError as exc:
            raise ConfigError(f"sglang cannot build architectures {architectures}: {exc}") from exc
        default_dtype = model_config.dtype if dtype is None else dtype
        _check_heads_divide(model_config.hf_config, spec)
        try:
            with set_default_torch_dtype(default_dtype), torch.device(device):
                model = _initialize_model(model_config, load_config, quant_config)
        except (AssertionError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(_cannot_build(architectures, spec, exc)) from exc
    return model.eval()


def _layout(spec: RankSpec) -> str:
    parts = [f"tp={spec.tp_size}"]
    if spec.attn_tp_size != spec.tp_size:
        parts.append(f"attention TP {spec.attn_tp_size}")
    if spec.moe_ep_size > 1:
        parts.append(f"ep={spec.moe_ep_size} (MoE TP {spec.moe_tp_size})")
    return ", ".join(parts)


def _check_heads_divide(hf_config: Any, spec: RankSpec) -> None:
    """Attention heads that cannot be split over the attention TP ranks, said in one line
    (sglang asserts it deep inside the model's constructor)."""
    width = spec.attn_tp_size
    text_config = getattr(hf_config, "text_config", None) or hf_config
    heads = getattr(text_config, "num_attention_heads", None)
    if isinstance(heads, int) and heads % width:
        raise ConfigError(
            f"num_attention_heads={heads} does not divide by the attention TP size {width} "
            f"({_layout(spec)}): each attention TP rank holds heads / {width} heads; serve it "
            f"at a TP size that divides {heads}"
        )
    kv_heads = getattr(text_config, "num_key_value_heads", None)
    if (
        isinstance(kv_heads, int)
        and kv_heads
        and (kv_heads % width if kv_heads >= width else width % kv_heads)
    ):
        raise ConfigError(
            f"num_key_value_heads={kv_heads} and the attention TP size {width} "
            f"({_layout(spec)}) do not divide one into the other: sglang splits the KV heads "
            f"over the ranks, or replicates them when there are fewer"
        )


def _cannot_build(architectures: list[str], spec: RankSpec, exc: BaseException) -> str:
    """One line for an assertion or ValueError raised while sglang built the model: the
    module being built (the innermost ``prefix`` sglang passes down), what failed, and
    the known way out for fp8 blocks that do not divide."""
    import traceback

    module = ""
    frames = traceback.walk_tb(exc.__traceback__)
    for frame, _ in reversed(list(frames)):
        prefix = frame.f_locals.get("prefix")
        if isinstance(prefix, str) and prefix:
            module = prefix
            break
    if isinstance(exc, AssertionError) and not str(exc):
        last = traceback.extract_tb(exc.__traceback__)[-1]
        where = last.filename.split("site-packages/")[-1]
        what = f"`{(last.line or '').strip()}` failed ({where}:{last.lineno})"
    else:
        what = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    line = (
        f"sglang cannot build {', '.join(architectures) or 'the model'} at {_layout(spec)}: "
        f"{module + ': ' if module else ''}{what}: a dimension does not divide by this "
        f"layout's parallel size"
    )
    if "block_n" in what or "block_k" in what:
        line += (
            "; the checkpoint's fp8 blocks (weight_block_size) are wider than this rank's "
            "share: re-quantize to smaller blocks (the design seed re-quantizes Kimi-K2's "
            "128 x 128 blocks to 64 x 64 and updates the affected scales), or, where it is a "
            "dense layer, keep dense layers whole with --engine moe_dense_tp_size=1"
        )
    return line


def server_args_for(
    model_path: str | os.PathLike[str],
    dtype: str | torch.dtype,
    server_args_fields: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """Merge a model folder and dtype into the engine's server args."""
    fields = dict(server_args_fields or {})
    fields["model_path"] = os.fspath(model_path)
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    fields.setdefault("dtype", dtype)
    return fields


def modules_with_quant_method(model: nn.Module) -> Iterator[tuple[str, nn.Module, Any]]:
    """(name, module, quant method) for every module sglang's postprocess and restore visit."""
    from sglang.srt.model_loader.loader import _modules_with_quant_method

    visited = {id(module) for module, _ in _modules_with_quant_method(model)}
    for name, module in model.named_modules():
        if id(module) in visited:
            yield name, module, module.quant_method


def shared_with_target(draft: nn.Module) -> set[str]:
    """Names of a draft's parameters the engine takes from its target (``set_embed_and_head``)."""
    get = getattr(draft, "get_embed_and_head", None)
    shared = {id(p) for p in get() if isinstance(p, torch.nn.Parameter)} if get else set()
    return {name for name, p in draft.named_parameters() if id(p) in shared}
