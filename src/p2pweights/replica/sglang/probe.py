"""The loader probe: which HF tensors feed which parameters of one engine rank.

How it works. For each HF name the trainer sends, the replica's own
``model.load_weights`` runs on that one name alone, with a meta tensor of the
declared shape and dtype as input, against the replica's meta parameters. So no
storage is allocated and no byte is computed, but every sharding, narrowing and
fusing step of the real loader runs. A ``TorchDispatchMode`` watches every aten op
that writes into one of its arguments (schema ``alias_info.is_write``: ``copy_``,
``fill_``, ``zero_``, ...) and maps the written tensor back to a parameter by
storage identity (a view of a meta parameter shares its storage object) and offset
range. The parameters written while loading a name are the ones it feeds.

HF names whose fed parameters overlap are joined (union-find) into groups: all HF
inputs of a fused parameter such as ``qkv_proj`` (q, k, v) must be loaded together,
since one loader call writes only a slice. A group is the unit ``load_into`` stages.

Shape errors surface here, before any byte is written: the loader's own checks and
the meta ``copy_`` raise on a shape that does not fit, and the watcher also refuses
a ``copy_`` whose source has a different element count than its destination (a
silent broadcast). Both are raised as ``ConfigError`` naming the HF tensor. What
sglang's code raises when one of its APIs moved or changed (``compat.API_ERRORS``:
an AttributeError, TypeError, ImportError) is raised as ``compat.SglangApiError``
instead, naming the installed sglang and the tested range: the tensor is not at fault.

Names that feed nothing (sglang skips e.g. ``rotary_emb.inv_freq``, or
``lm_head.weight`` when embeddings are tied) are reported in ``LoaderMap.unused``.
Inputs are described as HF name -> ``InputSpec`` (shape, dtype) and groups are
``ParamGroup``s, the types the trainer side uses. Results are cached per
(name, shape, dtype) on the replica.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping, MutableMapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from p2pweights.errors import ConfigError
from p2pweights.replica.sglang.compat import api_error
from p2pweights.source.inputs import InputSpec, ParamGroup

logger = logging.getLogger(__name__)

__all__ = ["LoaderMap", "Probed", "Written", "probe_loader"]


class _HasWorldRank(Protocol):
    @property
    def world_rank(self) -> int: ...


class Probed(Protocol):
    """What the probe needs of a replica (``ModelReplica`` is one); a protocol, so the
    replica imports the probe and the probe never imports the replica."""

    @property
    def model(self) -> torch.nn.Module: ...

    @property
    def spec(self) -> _HasWorldRank: ...

    @property
    def layouts(self) -> Mapping[str, Any]: ...

    @property
    def probe_cache(self) -> MutableMapping[tuple[str, tuple[int, ...], torch.dtype], Written]:
        """(HF name, shape, dtype) -> what loading it writes; filled by the probe."""
        ...

    def loading_scope(self) -> AbstractContextManager[None]: ...


@dataclass(frozen=True)
class LoaderMap:
    """HF names -> parameters of one replica, grouped by shared inputs."""

    feeds: dict[str, frozenset[str]]
    """Every probed HF name -> the parameters its loader writes (empty if none)."""
    groups: tuple[ParamGroup, ...]
    """Parameters in ``model.named_parameters()`` order, groups by their first parameter."""
    unused: tuple[str, ...]
    """HF names that feed no parameter; reported, not an error."""
    unfed_params: tuple[str, ...]
    """Parameters no probed HF name writes (the trainer did not send their inputs)."""
    buffer_writes: dict[str, frozenset[str]] = field(default_factory=dict)
    """HF name -> module buffers its loader writes (none for the supported families)."""

    def params_of(self, hf_name: str) -> frozenset[str]:
        try:
            return self.feeds[hf_name]
        except KeyError:
            raise ConfigError(f"HF tensor {hf_name!r} was not probed") from None

    def group_of_param(self, param_name: str) -> ParamGroup:
        for group in self.groups:
            if param_name in group.param_names:
                return group
        raise ConfigError(f"no probed HF tensor feeds parameter {param_name!r}")


def probe_loader(replica: Probed, inputs: Mapping[str, InputSpec]) -> LoaderMap:
    """Probe ``replica``'s loader for HF name -> ``InputSpec`` (cached per spec on the replica).

    Names not yet cached are probed together in one ``load_weights`` call with
    provenance tracking (``_probe_batch``), as the engine's loader sees them: some
    loaders hold a tensor until its partner arrives in the same call (DeepSeek
    fuses ``q_a_proj`` with ``kv_a_proj_with_mqa``), so a name alone may write
    nothing. If the batch fails or leaves a write it cannot attribute, each name
    is probed alone (``_probe_one``), which also names the HF tensor at fault.
    Names that fed nothing are not cached: they may only have lacked a partner.
    """
    feeds: dict[str, Written] = {}
    todo: dict[str, InputSpec] = {}
    for name, spec in inputs.items():
        found = replica.probe_cache.get((name, spec.shape, spec.dtype))
        if found is None:
            todo[name] = spec
        else:
            feeds[name] = found
    if todo:
        probed = _probe_batch(replica, todo)
        if probed is None:
            probed = {name: _probe_one(replica, name, spec) for name, spec in todo.items()}
        for name, spec in todo.items():
            feeds[name] = probed[name]
            if probed[name].params:
                replica.probe_cache[(name, spec.shape, spec.dtype)] = probed[name]
    order = list(replica.layouts)
    loader_map = _group({name: feeds[name].params for name in inputs}, order)
    buffers = {name: feeds[name].buffers for name in inputs if feeds[name].buffers}
    return dataclasses.replace(loader_map, buffer_writes=buffers)


@dataclass(frozen=True)
class Written:
    """What loading one HF name writes: parameters, and module buffers."""

    params: frozenset[str]
    buffers: frozenset[str] = frozenset()


def _probe_batch(replica: Probed, inputs: Mapping[str, InputSpec]) -> dict[str, Written] | None:
    """All ``inputs`` through one ``load_weights`` call; None when a name-by-name probe must decide.

    Each placeholder's storage is tagged with its HF name; the watcher carries
    tags from inputs to outputs of every aten op (a tensor the loader caches or
    concatenates keeps its sources) and records, for each parameter write, the
    tags of what is written. Returns None if the call raised, replaced a
    parameter, or wrote a parameter no tagged input reached.
    """
    params = dict(replica.model.named_parameters())
    before = {name: _identity(param) for name, param in params.items()}
    tracer = _ProvenanceWatcher(params, dict(replica.model.named_buffers()))
    placeholders = []
    for name, spec in inputs.items():
        placeholder = torch.empty(spec.shape, dtype=spec.dtype, device="meta")
        tracer.tag(placeholder, name)
        placeholders.append((name, placeholder))
    try:
        with replica.loading_scope(), tracer:
            replica.model.load_weights(iter(placeholders))  # type: ignore[operator]
    except Exception:  # the name-by-name probe reports it, naming the HF tensor
        logger.debug("batch probe failed; probing name by name", exc_info=True)
        return None
    finally:
        tracer.release()
    if any(before[name] != _identity(param) for name, param in replica.model.named_parameters()):
        return None
    if tracer.unattributed - {p for fed in tracer.fed.values() for p in fed}:
        logger.debug("batch probe: unattributed writes to %s", sorted(tracer.unattributed))
        return None
    return {
        name: Written(
            frozenset(tracer.fed.get(name, ())),
            frozenset(tracer.fed_buffers.get(name, ())),
        )
        for name in inputs
    }


def _probe_one(replica: Probed, hf_name: str, spec: InputSpec) -> Written:
    params = dict(replica.model.named_parameters())
    before = {name: _identity(param) for name, param in params.items()}
    watcher = _WriteWatcher(params, hf_name, dict(replica.model.named_buffers()))
    placeholder = torch.empty(spec.shape, dtype=spec.dtype, device="meta")
    try:
        with replica.loading_scope(), watcher:
            replica.model.load_weights(iter([(hf_name, placeholder)]))  # type: ignore[operator]
    except ConfigError:
        raise
    except Exception as exc:
        doing = (
            f"probing how engine rank {replica.spec.world_rank} loads HF tensor {hf_name!r} "
            f"{list(spec.shape)} {spec.dtype}"
        )
        moved = api_error(exc, doing)
        if moved is not None:
            raise moved from exc
        raise ConfigError(
            f"HF tensor {hf_name!r} {list(spec.shape)} {spec.dtype} does not fit what the "
            f"loader of engine rank {replica.spec.world_rank} expects: {exc}"
        ) from exc
    replaced = [
        name
        for name, param in replica.model.named_parameters()
        if before.get(name) != _identity(param)
    ]
    if replaced:
        raise ConfigError(
            f"loading {hf_name!r} replaced parameters {replaced} instead of writing into "
            "them; p2pweights cannot stage bytes for this loader"
        )
    return Written(frozenset(watcher.written), frozenset(watcher.written_buffers))


def _identity(param: torch.Tensor) -> tuple[int, tuple[int, ...], int]:
    return (int(param.untyped_storage()._cdata), tuple(param.shape), int(param.storage_offset()))


class _ParamIndex:
    """Which parameters a tensor's elements overlap, by storage and element range.

    Meta tensors have no addresses; a view shares its base's storage object, so the
    storage identity plus the element range tells which parameter a write lands in.
    """

    def __init__(self, params: Mapping[str, torch.Tensor]) -> None:
        # storage id -> [(first element, end element, name)]
        self._by_storage: dict[int, list[tuple[int, int, str]]] = {}
        for name, param in params.items():
            start = int(param.storage_offset())
            end = start + _elements_spanned(param)
            self._by_storage.setdefault(param.untyped_storage()._cdata, []).append(
                (start, end, name)
            )

    def hit(self, target: torch.Tensor) -> list[str]:
        candidates = self._by_storage.get(target.untyped_storage()._cdata)
        if not candidates:
            return []
        start = target.storage_offset()
        end = start + _elements_spanned(target)
        return [name for first, last, name in candidates if first < end and start < last]


def written_arguments(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[torch.Tensor]:
    """The tensors an ATen op writes in place: the arguments its schema marks as written."""
    written = []
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        target = args[index] if index < len(args) else kwargs.get(argument.name)
        if isinstance(target, torch.Tensor):
            written.append(target)
    return written


class _WriteWatcher(TorchDispatchMode):
    """Records which parameters aten ops write into (see the module docstring)."""

    def __init__(
        self,
        params: dict[str, torch.nn.Parameter],
        hf_name: str,
        buffers: Mapping[str, torch.Tensor],
    ) -> None:
        super().__init__()
        self.hf_name = hf_name
        self.written: set[str] = set()
        self.written_buffers: set[str] = set()
        self._index = _ParamIndex(params)
        self._buffers = _ParamIndex(buffers)

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        for target in written_arguments(func, args, kwargs):
            self._record(func, target, args)
        return func(*args, **kwargs)

    def _record(self, func: Any, target: torch.Tensor, args: tuple[Any, ...]) -> None:
        self.written_buffers.update(self._buffers.hit(target))
        hit = self._index.hit(target)
        if not hit:
            return
        if func is torch.ops.aten.copy_.default and isinstance(args[1], torch.Tensor):
            source = args[1]
            if source.numel() != target.numel():
                raise ConfigError(
                    f"HF tensor {self.hf_name!r} would be broadcast into {hit}: the loader "
                    f"copies {list(source.shape)} into a slice of shape {list(target.shape)}"
                )
        self.written.update(hit)


_NO_DATA_FLOW = ("empty", "zeros", "ones", "full", "new_", "_like", "rand", "arange")
"""aten op names whose output takes only shape/dtype from its inputs, not values."""


class _ProvenanceWatcher(TorchDispatchMode):
    """Tracks which HF inputs each value derives from, and which parameters they write.

    Tags live on storages (a view shares its base's storage), keyed by the
    storage's ``_cdata``; every tagged storage is kept alive until ``release`` so
    an address is never reused for another tensor during the call.
    """

    def __init__(
        self, params: dict[str, torch.nn.Parameter], buffers: Mapping[str, torch.Tensor]
    ) -> None:
        super().__init__()
        # HF name -> parameters written with values derived from it.
        self.fed: dict[str, set[str]] = {}
        # HF name -> module buffers written with values derived from it.
        self.fed_buffers: dict[str, set[str]] = {}
        self._buffers = _ParamIndex(buffers)
        # Parameters written with values no tagged input reached.
        self.unattributed: set[str] = set()
        self._tags: dict[int, frozenset[str]] = {}
        self._alive: list[Any] = []
        self._index = _ParamIndex(params)

    def tag(self, tensor: torch.Tensor, hf_name: str) -> None:
        self._add(tensor, frozenset((hf_name,)))

    def release(self) -> None:
        self._tags.clear()
        self._alive.clear()

    def _add(self, tensor: torch.Tensor, tags: frozenset[str]) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        old = self._tags.get(key)
        if old is None:
            self._alive.append(storage)
            self._tags[key] = tags
        elif not tags <= old:
            self._tags[key] = old | tags

    def _tags_of(self, values: Iterable[Any]) -> frozenset[str]:
        found: frozenset[str] = frozenset()
        for value in values:
            if isinstance(value, torch.Tensor):
                tags = self._tags.get(value.untyped_storage()._cdata)
                if tags:
                    found = found | tags
            elif isinstance(value, (list, tuple)):
                found = found | self._tags_of(value)
        return found

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        targets: list[torch.Tensor] = []
        sources: list[Any] = []
        for index, argument in enumerate(func._schema.arguments):
            value = args[index] if index < len(args) else kwargs.get(argument.name)
            if argument.alias_info is not None and argument.alias_info.is_write:
                if isinstance(value, torch.Tensor):
                    targets.append(value)
            else:
                sources.append(value)
        out = func(*args, **kwargs)
        if any(word in func.__name__ for word in _NO_DATA_FLOW):
            return out
        tags = self._tags_of(sources)
        for target in targets:
            source = args[1] if func is torch.ops.aten.copy_.default else None
            if isinstance(source, torch.Tensor) and source.numel() != target.numel():
                raise ConfigError(
                    f"HF tensor(s) {sorted(tags)} would be broadcast: the loader copies "
                    f"{list(args[1].shape)} into a slice of shape {list(target.shape)}"
                )
            # A write without tagged sources (fill_, zero_) continues the target's own data.
            written = tags or self._tags_of([target])
            self._record(target, written)
            if written:
                self._add(target, written)
        if tags:
            for value in out if isinstance(out, (list, tuple)) else (out,):
                if isinstance(value, torch.Tensor):
                    self._add(value, tags)
        return out

    def _record(self, target: torch.Tensor, tags: frozenset[str]) -> None:
        hit = self._index.hit(target)
        if not tags:
            self.unattributed.update(hit)
        buffers = self._buffers.hit(target)
        for hf_name in tags:
            self.fed.setdefault(hf_name, set()).update(hit)
            if buffers:
                self.fed_buffers.setdefault(hf_name, set()).update(buffers)


def _elements_spanned(tensor: torch.Tensor) -> int:
    if tensor.numel() == 0:
        return 0
    return 1 + sum(
        int(size - 1) * step for size, step in zip(tensor.shape, tensor.stride(), strict=True)
    )


def _group(feeds: dict[str, frozenset[str]], order: Iterable[str]) -> LoaderMap:
    """Union-find over HF names that share a parameter."""
    parent: dict[str, str] = {}

    def find(item: str) -> str:
        while parent[item] != item:
            parent[item] = parent[parent[item]]
            item = parent[item]
        return item

    owner: dict[str, str] = {}  # parameter -> an HF name feeding it
    for hf_name, params in feeds.items():
        parent.setdefault(hf_name, hf_name)
        for param in params:
            other = owner.setdefault(param, hf_name)
            parent[find(other)] = find(hf_name)
    position = {name: index for index, name in enumerate(order)}
    members: dict[str, set[str]] = {}
    for hf_name, params in feeds.items():
        if params:
            members.setdefault(find(hf_name), set()).add(hf_name)
    groups = []
    for hf_names in members.values():
        fed_params = {param for hf_name in hf_names for param in feeds[hf_name]}
        groups.append(
            ParamGroup(
                hf_names=frozenset(hf_names),
                param_names=tuple(sorted(fed_params, key=lambda p: position.get(p, len(position)))),
            )
        )
    groups.sort(key=lambda g: position.get(g.param_names[0], len(position)))
    fed = set(owner)
    return LoaderMap(
        feeds=dict(feeds),
        groups=tuple(groups),
        unused=tuple(name for name, params in feeds.items() if not params),
        unfed_params=tuple(name for name in order if name not in fed),
    )
