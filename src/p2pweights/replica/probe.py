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
silent broadcast). Both are raised as ``ConfigError`` naming the HF tensor.

Names that feed nothing (sglang skips e.g. ``rotary_emb.inv_freq``, or
``lm_head.weight`` when embeddings are tied) are reported in ``LoaderMap.unused``.
Results are cached per (name, shape, dtype) on the replica.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from p2pweights.errors import ConfigError

if TYPE_CHECKING:
    from p2pweights.replica.model_replica import ModelReplica

__all__ = ["HfTensorSpec", "LoaderGroup", "LoaderMap", "probe_loader"]


@dataclass(frozen=True)
class HfTensorSpec:
    """One HF (checkpoint-named) tensor a trainer sends, without its values."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> HfTensorSpec:
        return cls(name, tuple(tensor.shape), tensor.dtype)


@dataclass(frozen=True)
class LoaderGroup:
    """HF names that must be loaded together and the parameters they fill."""

    hf_names: frozenset[str]
    param_names: tuple[str, ...]
    """In ``model.named_parameters()`` order."""


@dataclass(frozen=True)
class LoaderMap:
    """HF names -> parameters of one replica, grouped by shared inputs."""

    feeds: dict[str, frozenset[str]]
    """Every probed HF name -> the parameters its loader writes (empty if none)."""
    groups: tuple[LoaderGroup, ...]
    unused: tuple[str, ...]
    """HF names that feed no parameter; reported, not an error."""
    unfed_params: tuple[str, ...]
    """Parameters no probed HF name writes (the trainer did not send their inputs)."""

    def params_of(self, hf_name: str) -> frozenset[str]:
        try:
            return self.feeds[hf_name]
        except KeyError:
            raise ConfigError(f"HF tensor {hf_name!r} was not probed") from None

    def group_of_param(self, param_name: str) -> LoaderGroup:
        for group in self.groups:
            if param_name in group.param_names:
                return group
        raise ConfigError(f"no probed HF tensor feeds parameter {param_name!r}")


def probe_loader(replica: ModelReplica, hf_specs: Sequence[HfTensorSpec]) -> LoaderMap:
    """Probe ``replica``'s loader for ``hf_specs`` (cached per spec on the replica)."""
    seen: set[str] = set()
    for spec in hf_specs:
        if spec.name in seen:
            raise ConfigError(f"HF tensor {spec.name!r} is given twice")
        seen.add(spec.name)
    feeds: dict[str, frozenset[str]] = {}
    for spec in hf_specs:
        key = (spec.name, spec.shape, spec.dtype)
        found = replica.probe_cache.get(key)
        if found is None:
            found = _probe_one(replica, spec)
            replica.probe_cache[key] = found
        feeds[spec.name] = found
    order = list(replica.layouts)
    return _group(feeds, order)


def _probe_one(replica: ModelReplica, spec: HfTensorSpec) -> frozenset[str]:
    params = dict(replica.model.named_parameters())
    before = {name: _identity(param) for name, param in params.items()}
    watcher = _WriteWatcher(params, spec.name)
    placeholder = torch.empty(spec.shape, dtype=spec.dtype, device="meta")
    try:
        with replica.loading_scope(), watcher:
            replica.model.load_weights(iter([(spec.name, placeholder)]))  # type: ignore[operator]
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(
            f"HF tensor {spec.name!r} {list(spec.shape)} {spec.dtype} does not fit what the "
            f"loader of engine rank {replica.spec.world_rank} expects: {exc}"
        ) from exc
    replaced = [
        name
        for name, param in replica.model.named_parameters()
        if before.get(name) != _identity(param)
    ]
    if replaced:
        raise ConfigError(
            f"loading {spec.name!r} replaced parameters {replaced} instead of writing into "
            "them; p2pweights cannot stage bytes for this loader"
        )
    return frozenset(watcher.written)


def _identity(param: torch.Tensor) -> tuple[int, tuple[int, ...], int]:
    return (int(param.untyped_storage()._cdata), tuple(param.shape), int(param.storage_offset()))


class _WriteWatcher(TorchDispatchMode):
    """Records which parameters aten ops write into (see the module docstring)."""

    def __init__(self, params: dict[str, torch.nn.Parameter], hf_name: str) -> None:
        super().__init__()
        self.hf_name = hf_name
        self.written: set[str] = set()
        # storage id -> [(first element, end element, name)]
        self._by_storage: dict[int, list[tuple[int, int, str]]] = {}
        for name, param in params.items():
            start = int(param.storage_offset())
            end = start + _elements_spanned(param)
            key = param.untyped_storage()._cdata
            self._by_storage.setdefault(key, []).append((start, end, name))

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        for index, argument in enumerate(func._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            target = args[index] if index < len(args) else kwargs.get(argument.name)
            if isinstance(target, torch.Tensor):
                self._record(func, target, args)
        return func(*args, **kwargs)

    def _record(self, func: Any, target: torch.Tensor, args: tuple[Any, ...]) -> None:
        candidates = self._by_storage.get(target.untyped_storage()._cdata)
        if not candidates:
            return
        start = target.storage_offset()
        end = start + _elements_spanned(target)
        hit = [name for first, last, name in candidates if first < end and start < last]
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
            LoaderGroup(
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
