"""A transformers model's weights as the checkpoint names them, gathered bucket by bucket.

``hf_named_tensors(model)`` yields what ``save_pretrained`` would write: the model's
persistent state (parameters and persistent buffers) with tied weights once, under
checkpoint names. Under FSDP2 it hands each rank's own shards by default (owner sends,
``owned``: nothing is gathered); ``owned=False``, or a model owner sends cannot take,
gives full tensors (FSDP2 / DTensor shards gathered), as below. transformers 5 keeps
some weights in another form than its checkpoints (a MoE layer's experts fused into
``mlp.experts.gate_up_proj``); they are turned back with transformers' own
``revert_weight_conversion``, the reverse of what loading applied, which is what
``save_pretrained`` runs.

Parameters are gathered in buckets of about ``bucket_bytes`` (by their full size),
in state-dict order, and every rank runs the same all-gathers in the same order, so
every rank must iterate the whole generator. Weights that transformers converts
together (one fused expert tensor, or several in-memory tensors making one checkpoint
tensor) stay in one bucket. A bucket's tensors are dropped once the consumer lets
go of them; ``WeightSyncSession.update`` keeps them until their staging buffer is
written, so a streamed update holds about one bucket plus two staging buffers (for an
fp8 engine fed from GPU tensors, plus up to 1 GiB of weights held to be quantized in
one batch, ``source/collect.py``).

It meets ``update()``'s input contract: every bucket is gathered (or cast) into fresh
tensors and nothing is written into a tensor once yielded; an unsharded model without
``dtype`` yields its own parameters, so an optimizer step while the update runs (another
thread) fails the update with ``InputChangedError`` instead of sending a mix.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from p2pweights.adapters.owned import OwnedTensors
from p2pweights.config import parse_bytes
from p2pweights.errors import ConfigError

__all__ = ["HfNamedTensors", "hf_named_tensors"]

DEFAULT_BUCKET_BYTES = 512 * 2**20


def hf_named_tensors(
    model: torch.nn.Module,
    *,
    bucket_bytes: int | str = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype | None = None,
    owned: bool | None = None,
) -> HfNamedTensors | OwnedTensors:
    """(checkpoint name, tensor) pairs of a transformers ``model``, plain or FSDP2: under
    FSDP2 each rank's own shards by default (owner sends), else full tensors.

    Under FSDP2 (``fully_shard``, DTensor parameters) this is a collective: every rank
    of the mesh must iterate it to the end. Tensors come on the device the parameters
    live on. The answer is an iterator that also says what it will yield without
    gathering anything (``specs()``), so even a first ``WeightSyncSession.update``
    streams it instead of holding the whole model.

    Args:
        model: A transformers model, plain or sharded with FSDP2.
        bucket_bytes: How many bytes of parameters are gathered (and cast) at a time, as
            a number or a size such as ``"512MiB"``.
        dtype: Cast floating-point tensors to this, bucket by bucket, before gathering
            (e.g. fp32 master weights to the engine's bf16). Default: as they are.
        owned: Gather nothing (owner sends, ``plan.owners``): under FSDP2 each rank hands
            its own slice of every sharded parameter (``Shard(0)`` / ``Shard(1)`` of a
            one-dimensional mesh) and writes the bytes its rows make; other tensors are
            sent whole by every rank. ``False``: gather every tensor whole first (the
            path before owner sends). ``None`` (the default): owner sends where the model
            can give them (every DTensor ``Shard(d)`` on a one-dimensional mesh; where
            transformers converts weights on save, such as transformers 5's fused
            experts, ``Shard(0)``), else gathered; a plain model (whole tensors on every
            rank) is sent gathered, as it was. With fused experts cut along the experts,
            each rank sends the checkpoint tensors of its own experts (owned). ``True``
            refuses what owner sends cannot take: other placements, or a converted
            checkpoint tensor made from several ranks' rows.

    Returns:
        An iterator of ``(checkpoint name, tensor)`` pairs for ``WeightSyncSession.update``.
    """
    if owned is None:
        owned = _shards_only(model)
    if owned:
        return _local_shards(model, dtype)
    return HfNamedTensors(model, parse_bytes(bucket_bytes), dtype)


def _shards_only(model: torch.nn.Module) -> bool:
    """Whether owner sends can take ``model`` as it is: some parameter is a DTensor, every
    DTensor is ``Shard(d)`` on a one-dimensional mesh, and where transformers converts
    weights on save (fused experts) every DTensor is ``Shard(0)`` (FSDP2's default: whole
    experts on each rank)."""
    from torch.distributed.tensor import DTensor, Shard

    dtensors = [t for t in _checkpoint_state(model).values() if isinstance(t, DTensor)]
    if not dtensors:
        return False
    dims = {0} if _reverse_transforms(model) is not None else None
    return all(
        t.device_mesh.ndim == 1
        and all(isinstance(p, Shard) and (dims is None or p.dim in dims) for p in t.placements)
        for t in dtensors
    )


def _local_shards(model: torch.nn.Module, dtype: torch.dtype | None) -> OwnedTensors:
    """Each parameter's local slice (a DTensor's ``to_local()``), described as a shard;
    where transformers converts weights on save, the checkpoint tensors made wholly from
    this rank's rows (its experts), owned."""
    reverse = _reverse_transforms(model)
    state = _checkpoint_state(model)
    pairs: list[tuple[str, torch.Tensor]] = []
    owned: set[str] = set()
    shards: dict[str, tuple[int, int, int]] = {}
    for unit in _conversion_units(list(state), reverse):
        local = {name: _local_slice(name, state[name], dtype) for name in unit}
        if reverse is None or _unconverted(model, unit, state):
            for name, (tensor, shard) in local.items():
                pairs.append((name, tensor))
                if shard is not None:
                    shards[name] = shard
            continue
        if all(shard is None for _, shard in local.values()):  # whole on every rank
            pairs.extend(_reverted(model, {n: t for n, (t, _) in local.items()}).items())
            continue
        values = _reverted(model, {n: _padded(t, s, state[n]) for n, (t, s) in local.items()})
        marks = _reverted(
            model,
            {
                n: _padded(torch.ones_like(t, dtype=torch.int8), s, state[n])
                for n, (t, s) in local.items()
            },
        )
        for name, tensor in values.items():
            if bool(marks[name].all()):  # made of this rank's rows alone: its own
                # a copy: a view would keep the whole padded tensor alive
                pairs.append((name, tensor.clone()))
                owned.add(name)
            elif bool(marks[name].any()):
                raise ConfigError(
                    f"hf_named_tensors(model, owned=True): checkpoint tensor {name!r} is made "
                    f"from rows of several ranks ({sorted(unit)[:2]} converted on save); "
                    f"shard them along their first (expert) dim, or use owned=False"
                )
    return OwnedTensors(pairs, owned, shards)


def _local_slice(
    name: str, tensor: torch.Tensor, dtype: torch.dtype | None
) -> tuple[torch.Tensor, tuple[int, int, int] | None]:
    """A parameter's local slice and its (dim, start, full size); None for a plain tensor."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = tensor.detach()
    shard = None
    if isinstance(local, DTensor):
        placements = [p for p in local.placements if isinstance(p, Shard)]
        if local.device_mesh.ndim != 1 or len(placements) != len(local.placements):
            raise ConfigError(
                f"hf_named_tensors(model, owned=True): parameter {name!r} is placed "
                f"{local.placements} on a {local.device_mesh.ndim}-d mesh; only Shard(d) "
                f"on one mesh dimension is sent by owner"
            )
        shape, offset = compute_local_shape_and_global_offset(
            local.shape, local.device_mesh, local.placements
        )
        dim = placements[0].dim
        shard = (dim, offset[dim], local.shape[dim])
        local = local.to_local()
        assert tuple(local.shape) == tuple(shape)
    if dtype is not None:
        local = _cast(local, dtype)
    return local, shard


def _padded(
    local: torch.Tensor, shard: tuple[int, int, int] | None, like: torch.Tensor
) -> torch.Tensor:
    """``local`` in a zero tensor of ``like``'s full shape, at its shard's place."""
    if shard is None:
        return local
    dim, start, _ = shard
    full = torch.zeros(tuple(like.shape), dtype=local.dtype, device=local.device)
    full.narrow(dim, start, local.shape[dim]).copy_(local)
    return full


def _unconverted(model: Any, unit: Sequence[str], state: Mapping[str, torch.Tensor]) -> bool:
    """Whether saving leaves ``unit``'s tensors as they are (same names and shapes)."""
    meta = {n: torch.empty(tuple(state[n].shape), device="meta") for n in unit}
    out = _reverted(model, meta)
    return out.keys() == meta.keys() and all(out[n].shape == meta[n].shape for n in meta)


class HfNamedTensors(Iterator[tuple[str, torch.Tensor]]):
    """``hf_named_tensors``' answer: the pairs, gathered bucket by bucket as iterated."""

    def __init__(self, model: torch.nn.Module, bucket_bytes: int, dtype: torch.dtype | None):
        self._model = model
        self._dtype = dtype
        self._bucket_bytes = bucket_bytes
        self._state = _checkpoint_state(model)
        self._reverse = _reverse_transforms(model)
        self._pairs: Iterator[tuple[str, torch.Tensor]] | None = None

    def __iter__(self) -> HfNamedTensors:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        if self._pairs is None:
            self._pairs = self._generate()
        return next(self._pairs)

    def specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Checkpoint name -> (shape, dtype) of every tensor this will yield, from the
        parameters' global shapes (a DTensor's full shape) on the meta device: nothing
        is gathered or copied."""
        meta = {
            name: torch.empty(tuple(tensor.shape), dtype=self._dtype_of(tensor), device="meta")
            for name, tensor in self._state.items()
        }
        if self._reverse is not None:
            meta = _reverted(self._model, meta)
        return {name: (tuple(t.shape), t.dtype) for name, t in meta.items()}

    def _dtype_of(self, tensor: torch.Tensor) -> torch.dtype:
        return (
            self._dtype if self._dtype is not None and tensor.is_floating_point() else tensor.dtype
        )

    def _generate(self) -> Iterator[tuple[str, torch.Tensor]]:
        state = self._state
        sizes = {  # by the size each tensor will have (cast)
            name: tensor.numel() * self._dtype_of(tensor).itemsize for name, tensor in state.items()
        }
        units = _conversion_units(list(state), self._reverse)
        for bucket in _buckets(units, sizes, self._bucket_bytes):
            local = {name: state[name] for name in bucket}
            if self._dtype is not None:
                local = {name: _cast(tensor, self._dtype) for name, tensor in local.items()}
            full = _gathered(local)
            del local
            if self._reverse is not None:
                full = _reverted(self._model, full)
            yield from full.items()
            del full


def _checkpoint_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What ``save_pretrained`` starts from: the state dict, tied weights once."""
    state = model.state_dict(keep_vars=True)
    for name in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(name, None)
    tied_targets = set(getattr(model, "all_tied_weights_keys", None) or {})
    by_object: dict[int, list[str]] = {}
    for name, tensor in state.items():
        by_object.setdefault(id(tensor), []).append(name)
    for names in by_object.values():
        if len(names) < 2:
            continue
        # keep the tie's source (save_pretrained drops the declared targets), else the first
        keep = next((n for n in names if n not in tied_targets), names[0])
        for name in names:
            if name != keep:
                del state[name]
    return state


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    tensor = tensor.detach()
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def _conversion_units(
    names: Sequence[str], reverse: tuple[list[Any], list[Any]] | None
) -> list[list[str]]:
    """``names`` in order, those transformers converts into the same checkpoint tensors
    together (found as ``revert_weight_conversion`` finds them)."""
    if reverse is None:
        return [[name] for name in names]
    from transformers.core_model_loading import rename_source_key

    renamings, converters = reverse
    units: dict[str, list[str]] = {}
    for name in names:
        renamed, pattern = rename_source_key(name, renamings, converters, reverse=True)
        units.setdefault(renamed if pattern is not None else name, []).append(name)
    return list(units.values())


def _reverse_transforms(model: Any) -> tuple[list[Any], list[Any]] | None:
    """(renamings, converters) that saving applies, or None when nothing is converted.

    The same choice as transformers' ``revert_weight_conversion``: the conversions
    ``from_pretrained`` recorded on the model, else the model type's default mapping
    without prefix changes.
    """
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange, WeightConverter, WeightRenaming
    except ImportError:  # transformers 4: the model holds checkpoint names
        return None
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        if not hasattr(model, "config"):
            return None  # not a transformers model: its state-dict names are used as they are
        conversions = get_model_conversion_mapping(model, add_legacy=False)
        conversions = [c for c in conversions if not isinstance(c, PrefixChange)]
    if not conversions:
        return None
    reverse = [conversion.reverse_transform() for conversion in conversions[::-1]]
    return (
        [t for t in reverse if isinstance(t, WeightRenaming)],
        [t for t in reverse if isinstance(t, WeightConverter)],
    )


def _buckets(
    units: Sequence[list[str]], sizes: Mapping[str, int], limit: int
) -> Iterator[list[str]]:
    """Consecutive units packed up to ``limit`` bytes (a larger unit is a bucket alone)."""
    bucket: list[str] = []
    filled = 0
    for unit in units:
        size = sum(sizes[name] for name in unit)
        if bucket and filled + size > limit:
            yield bucket
            bucket, filled = [], 0
        bucket += unit
        filled += size
    if bucket:
        yield bucket


def _gathered(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full tensors: DTensors all-gathered (all issued before any is waited for)."""
    from torch.distributed.tensor import DTensor

    full = {}
    for name, tensor in tensors.items():
        detached = tensor.detach()
        full[name] = detached.full_tensor() if isinstance(detached, DTensor) else detached
    return {name: _waited(tensor) for name, tensor in full.items()}


def _waited(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor whose collective has completed (funcol results complete lazily)."""
    wait = getattr(tensor, "wait", None)  # AsyncCollectiveTensor
    return wait() if callable(wait) else tensor


def _reverted(model: Any, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint names and forms, by transformers' own reverse conversion."""
    from transformers.core_model_loading import revert_weight_conversion

    return dict(revert_weight_conversion(model, full))
