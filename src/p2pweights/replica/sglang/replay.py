"""Replaying a loader: after real loads, later loads of the same inputs repeat its copies.

sglang's loaders are Python: per HF tensor they map names, narrow to this rank's shard
and copy (tens of microseconds each, measured in benchmarks/replica.py loader and on
the H200, where they were most of an update). What they do to the bytes, though, is
almost always a fixed list of strided copies from views of the inputs into views of
the parameters, plus constant fills (padding). ``LoadRecorder`` watches one real load
(every aten op, through a ``TorchDispatchMode``) and keeps that list when it is all
there was; ``Replay`` then repeats it on the next inputs of the same names, shapes,
dtypes and strides, into destinations of the same sizes, with no loader code.

A load is recorded only if every op that touched an input, a destination or a
concatenation of inputs was a view, a ``copy_`` from a view of an input (or a whole
concatenation of input views) into a view of a destination, or a constant ``fill_`` /
``zero_`` of a destination. Anything else (arithmetic on a weight, a cast to a
temporary, ``.item()``, an indexed write) means the result may depend on the values,
and that set of inputs keeps running the loader. The copies are replayed in their
recorded order; copies queued from the GPU into pinned memory are waited for before
any later host-side write.

What a dispatch mode cannot see, and how it is caught:

* copies on another thread (DeepSeek's loader hands host tensors to a thread pool):
  ``inline_loads`` runs them inline while a load is recorded, and every recording is
  replayed onto marker bytes and compared with what the loader wrote;
* reads outside aten (``.tolist()``, ``.numpy()``) steering the loader by value: a
  recording is used only after it reproduced the loader's bytes on a second load with
  other values (``Replay.reproduces``, run on the first load that could replay). A
  loader that branched on values the two loads did not tell apart would still escape;
  sglang's loaders branch on names and shapes. ``P2PWEIGHTS_LOADER_REPLAY=0`` turns
  replay off.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from p2pweights.replica.sglang import gathered_copies
from p2pweights.thread_patch import patched_call, unpatched

aten = torch.ops.aten

_FILLS = {aten.fill_.Scalar, aten.zero_.default}
_MARKER = 0x5A

ReplayKey = tuple[object, ...]


def replay_key(
    hf_tensors: Sequence[tuple[str, torch.Tensor]], destinations: Mapping[str, torch.Tensor]
) -> ReplayKey | None:
    """What a recording is valid for: inputs and destinations alike in all but values
    (None for anything but plain dense tensors: such loads always run the loader)."""
    if not all(_plain(t) for _, t in hf_tensors) or not all(
        _plain(d) for d in destinations.values()
    ):
        return None
    return (
        tuple((n, tuple(t.shape), t.dtype, t.stride(), t.device.type) for n, t in hf_tensors),
        tuple(
            sorted(
                (n, d.numel(), d.dtype, d.dim(), d.is_contiguous(), d.device.type)
                for n, d in destinations.items()
            )
        ),
    )


def _plain(tensor: object) -> bool:
    """A dense tensor with real storage (no subclass, sparse layout, conj or neg bit)."""
    return (
        type(tensor) in (torch.Tensor, torch.nn.Parameter)
        and tensor.layout == torch.strided  # type: ignore[attr-defined]
        and not tensor.is_conj()  # type: ignore[attr-defined]
        and not tensor.is_neg()  # type: ignore[attr-defined]
    )


@dataclass(frozen=True)
class _View:
    """A strided view of one input (by index) or destination (by name), relative to it."""

    owner: int | str
    offset: int
    """Storage offset from the owner's own, in elements of the owner's dtype."""
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    def of(self, base: torch.Tensor) -> torch.Tensor:
        return torch.as_strided(base, self.shape, self.stride, base.storage_offset() + self.offset)

    def span(self) -> tuple[int, int]:
        """``[first, last + 1)`` elements of the owner it covers (empty for no elements)."""
        if 0 in self.shape:
            return self.offset, self.offset
        return self.offset, self.offset + _reach(self.shape, self.stride) + 1


@dataclass(frozen=True)
class _Copy:
    dst: _View
    src: _View


@dataclass(frozen=True)
class _Fill:
    dst: _View
    value: float | int | bool


def _steps(ops: Sequence[_Copy | _Fill]) -> list[_Fill | list[_Copy]]:
    """``ops`` as steps to run in order: each fill alone, and each longest run of
    consecutive copies whose destination bytes do not overlap (so their order within the
    run cannot matter)."""
    steps: list[_Fill | list[_Copy]] = []
    run: list[_Copy] = []
    written: dict[int | str, list[tuple[int, int]]] = {}
    for op in ops:
        if isinstance(op, _Copy):
            spans = written.setdefault(op.dst.owner, [])
            span = op.dst.span()
            at = bisect.bisect_left(spans, span)
            clash = (at > 0 and spans[at - 1][1] > span[0]) or (
                at < len(spans) and spans[at][0] < span[1]
            )
            if not clash:
                spans.insert(at, span)
                run.append(op)
                continue
        if run:
            steps.append(run)
        run, written = [], {}
        if isinstance(op, _Fill):
            steps.append(op)
        else:
            run.append(op)
            written[op.dst.owner] = [op.dst.span()]
    if run:
        steps.append(run)
    return steps


_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""Integer dtypes by item size: copies of one dtype move bytes, whatever the dtype."""


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    raw = _RAW.get(tensor.element_size())
    return tensor if raw is None or tensor.dtype == raw else tensor.view(raw)


@dataclass
class _StepPlan:
    """How one step's copies run on a GPU (indices into the step)."""

    gathered: gathered_copies.GatheredCopies | None = None
    gathered_indices: list[int] = field(default_factory=list)
    """The copies ``gathered`` takes (rows of one dtype, in a step with enough of them)."""
    dense: list[list[int]] = field(default_factory=list)
    """The other copies of one dtype, dense with equal strides, one list per item size:
    ``_foreach_copy_``'s fused path (one strided tensor, or another dtype, in a call
    would send all of them one by one)."""
    strided: list[int] = field(default_factory=list)
    """The other copies of one dtype: ``_foreach_copy_``, one by one in C++."""
    converting: list[int] = field(default_factory=list)
    """Copies between dtypes: ``copy_`` each."""


def _plan(
    step: _Fill | list[_Copy],
    inputs: list[torch.Tensor],
    targets: Mapping[str, torch.Tensor],
    names: list[str],
    kernel: bool,
) -> _StepPlan:
    """Sort a step's copies by how they run (see ``_StepPlan``; ``kernel``: whether the
    gathered-copies kernel may take some). ``names``: the destinations in the numbering
    the gathered copies use (after the inputs)."""
    plan = _StepPlan()
    if isinstance(step, _Fill):
        return plan
    number = {name: len(inputs) + k for k, name in enumerate(names)}
    dense: dict[int, list[int]] = {}
    rows: list[tuple[int, int, int, int, gathered_copies.Shape2d, int]] = []
    for i, copy in enumerate(step):
        src, dst = inputs[copy.src.owner], targets[copy.dst.owner]  # type: ignore[index]
        if src.dtype != dst.dtype or src.element_size() not in _RAW:
            plan.converting.append(i)
            continue
        shape = (
            gathered_copies.as_rows(copy.dst.shape, copy.src.stride, copy.dst.stride)
            if copy.src.shape == copy.dst.shape
            else None
        )
        item = src.element_size()
        if shape is not None:
            rows.append(
                (
                    copy.src.owner,  # type: ignore[arg-type]
                    copy.src.offset * item,
                    number[copy.dst.owner],  # type: ignore[index]
                    copy.dst.offset * item,
                    shape,
                    item,
                )
            )
            plan.gathered_indices.append(i)
        else:
            _foreach(copy, i, item, dense, plan.strided)
    if kernel and len(rows) >= gathered_copies.MIN_COPIES:
        device = next(iter(targets.values())).device
        plan.gathered = gathered_copies.GatheredCopies(rows, device)
    else:  # too few for a launch: as any other copy of one dtype
        for i in plan.gathered_indices:
            copy = step[i]
            _foreach(copy, i, inputs[copy.src.owner].element_size(), dense, plan.strided)  # type: ignore[index]
        plan.gathered_indices = []
    plan.dense = list(dense.values())
    return plan


def _foreach(
    copy: _Copy, index: int, item: int, dense: dict[int, list[int]], strided: list[int]
) -> None:
    """File a copy of one dtype for ``_foreach_copy_``: dense with equal shapes and
    strides (its fused path, one call per item size), else strided."""
    if (
        copy.src.shape == copy.dst.shape
        and copy.src.stride == copy.dst.stride
        and _dense(copy.dst.shape, copy.dst.stride)
    ):
        dense.setdefault(item, []).append(index)
    else:
        strided.append(index)


def _dense(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Row-major contiguous, ignoring dimensions of size one."""
    expected = 1
    for size, step in zip(reversed(shape), reversed(stride), strict=True):
        if size != 1 and step != expected:
            return False
        expected *= size
    return True


class Replay:
    """The recorded copies and fills of one load, to run on new inputs."""

    def __init__(self, ops: list[_Copy | _Fill], dtypes: Mapping[str, torch.dtype]):
        self._ops = ops
        self._dtypes = dict(dtypes)
        self._steps = _steps(ops)
        # The destinations, numbered after the inputs for the gathered copies.
        self._names = sorted(self._dtypes)
        # Per step, how its copies run (``_plan``), per GPU, with and without the gathered-copies
        # kernel; made on the first run there (the replay's key fixes names, dtypes, shapes and
        # strides).
        self._plans: dict[tuple[bool, torch.device], list[_StepPlan]] = {}
        # Whether it reproduced the loader on a load other than the recorded one.
        self.confirmed = False

    def reads(self) -> dict[int, list[tuple[int, tuple[int, ...], tuple[int, ...]]]]:
        """Per input (by index), the views its copies read: (element offset, shape, stride)."""
        out: dict[int, list[tuple[int, tuple[int, ...], tuple[int, ...]]]] = {}
        for op in self._ops:
            if isinstance(op, _Copy):
                view = op.src
                out.setdefault(view.owner, []).append((view.offset, view.shape, view.stride))  # type: ignore[arg-type]
        return out

    @torch.no_grad()
    def run(
        self,
        hf_tensors: Sequence[tuple[str, torch.Tensor]],
        destinations: Mapping[str, torch.Tensor],
    ) -> None:
        inputs = [t for _, t in hf_tensors]
        targets = {name: d.view(self._dtypes[name]) for name, d in destinations.items()}
        devices = {t.device for t in inputs} | {d.device for d in targets.values()}
        if len(devices) == 1 and devices.pop().type == "cuda":
            self._run_on_one_gpu(inputs, targets)
        else:  # on the CPU, copy_ is no launch and batching gains nothing (measured)
            self._run_in_order(inputs, targets)

    def _run_in_order(
        self, inputs: list[torch.Tensor], targets: Mapping[str, torch.Tensor]
    ) -> None:
        """Op by op, in the recorded order. GPU -> pinned host copies are queued, not
        waited for one by one (the loader's ``copy_`` blocks per tensor); any host-side
        write waits for them first, so writes land in the recorded order; the load
        returns once they are done."""
        waits: set[torch.device] = set()
        for op in self._ops:
            dst = op.dst.of(targets[op.dst.owner])  # type: ignore[index]
            if isinstance(op, _Copy):
                src = op.src.of(inputs[op.src.owner])  # type: ignore[index]
                queued = src.is_cuda and not dst.is_cuda and dst.is_pinned()
                if waits and not queued:
                    _wait(waits)
                dst.copy_(src, non_blocking=queued)
                if queued:
                    waits.add(src.device)
            else:
                if waits:
                    _wait(waits)
                dst.fill_(op.value)
        _wait(waits)

    def _run_on_one_gpu(
        self, inputs: list[torch.Tensor], targets: Mapping[str, torch.Tensor]
    ) -> None:
        """Each step in order: a fill, or copies into disjoint bytes. Copies that move
        bytes unchanged (one dtype) run in one Triton launch per step where there are
        enough of them (``gathered_copies``), else through ``_foreach_copy_`` on integer
        views of the same bytes, the dense ones in one call (fused launches), the
        strided ones in another (one C++ loop); copies that convert run one by one."""
        device = next(iter(targets.values())).device
        kernel = gathered_copies.available(device)
        plans = self._plans.get((kernel, device))
        if plans is None:
            plans = [_plan(s, inputs, targets, self._names, kernel) for s in self._steps]
            self._plans[(kernel, device)] = plans
        addresses: list[int] | None = None
        raw: tuple[list[torch.Tensor], dict[str, torch.Tensor]] | None = None
        for step, plan in zip(self._steps, plans, strict=True):
            if isinstance(step, _Fill):
                step.dst.of(targets[step.dst.owner]).fill_(step.value)  # type: ignore[index]
                continue
            strided = plan.strided
            if plan.gathered is not None:
                if addresses is None:
                    addresses = gathered_copies.owner_addresses(inputs, targets, self._names)
                left = gathered_copies.run_or_give_up(plan.gathered, addresses)
                taken = plan.gathered_indices
                # what the kernel left, of any layout: one by one in C++
                strided = strided + (taken if left is None else [taken[k] for k in left])
            if (plan.dense or strided) and raw is None:
                raw = [_raw(t) for t in inputs], {name: _raw(t) for name, t in targets.items()}
            for together in (*plan.dense, strided):
                if together:
                    assert raw is not None
                    raw_inputs, raw_targets = raw
                    torch._foreach_copy_(
                        [step[i].dst.of(raw_targets[step[i].dst.owner]) for i in together],  # type: ignore[index]
                        [step[i].src.of(raw_inputs[step[i].src.owner]) for i in together],  # type: ignore[index]
                    )
            for i in plan.converting:
                copy = step[i]
                copy.dst.of(targets[copy.dst.owner]).copy_(copy.src.of(inputs[copy.src.owner]))  # type: ignore[index]

    def reproduces(
        self,
        hf_tensors: Sequence[tuple[str, torch.Tensor]],
        destinations: Mapping[str, torch.Tensor],
    ) -> list[str]:
        """Destinations this replay, run onto marker bytes, writes otherwise than they are
        (they hold what the loader wrote over the same marker). Empty when it reproduces."""
        device = _scratch_device(hf_tensors, destinations)
        home = next(iter(destinations.values())).device if destinations else device
        try:
            return self._differ_on(device, hf_tensors, destinations)
        except torch.cuda.OutOfMemoryError:
            if device == home:
                raise
        # out of the handler, so the first attempt's scratch is freed: slower, but it fits
        return self._differ_on(home, hf_tensors, destinations)

    def _differ_on(
        self,
        device: torch.device,
        hf_tensors: Sequence[tuple[str, torch.Tensor]],
        destinations: Mapping[str, torch.Tensor],
    ) -> list[str]:
        scratch = {name: _marked_like(d, device) for name, d in destinations.items()}
        self.run(hf_tensors, scratch)
        return sorted(
            n for n, d in destinations.items() if not torch.equal(scratch[n], d.to(device))
        )


def mark(destinations: Mapping[str, torch.Tensor]) -> None:
    """Fill every destination byte with the marker, before a loader run that is compared."""
    for d in destinations.values():
        d.view(torch.uint8).fill_(_MARKER)


def _marked_like(d: torch.Tensor, device: torch.device) -> torch.Tensor:
    pinned = device == d.device and not d.is_cuda and d.is_pinned()
    return torch.empty(d.shape, dtype=d.dtype, device=device, pin_memory=pinned).fill_(_MARKER)


def _scratch_device(
    hf_tensors: Sequence[tuple[str, torch.Tensor]], destinations: Mapping[str, torch.Tensor]
) -> torch.device:
    """Where a replay onto marker bytes runs: on the inputs' GPU when they all sit on one
    and the destinations are host memory (the GPU fills and compares far faster than
    host threads, and fresh pinned memory is slow to allocate: 9 s per 8 GB load on the
    H200 host, docs/benchmarks-archive.md); else where the destinations are.

    On the GPU the check copies device to device where the real replay queues copies
    into pinned memory: the bytes are the same (a copy moves bytes; a copy that also
    casts would be refused for replay if the two devices cast a NaN differently, and
    such loads then keep running the loader). Its scratch takes up to twice a staging
    buffer on that GPU, on the first two updates; out of memory there, it runs on the
    host. Checks of GPU destinations (device staging, direct loads) have no other place:
    their scratch is one load's destinations, at most a staging buffer's size."""
    devices = {t.device for _, t in hf_tensors}
    first = next(iter(destinations.values()), None)
    if first is None or first.is_cuda or len(devices) != 1:
        return first.device if first is not None else torch.device("cpu")
    (device,) = devices
    return device if device.type == "cuda" else first.device


def _wait(devices: set[torch.device]) -> None:
    for device in devices:
        torch.cuda.current_stream(device).synchronize()
    devices.clear()


class LoadRecorder(TorchDispatchMode):
    """Watches one load; ``checked_replay()`` is its copies, or None with ``reason`` saying why.

    ``destinations`` are the flat uint8 tensors the load writes; ``dtypes`` the dtype
    each parameter views its destination as.
    """

    def __init__(
        self,
        hf_tensors: Sequence[tuple[str, torch.Tensor]],
        destinations: Mapping[str, torch.Tensor],
        dtypes: Mapping[str, torch.dtype],
    ):
        super().__init__()
        self._inputs = [t for _, t in hf_tensors]
        self._dtypes = {name: dtypes[name] for name in destinations}
        self._targets = {name: d.view(self._dtypes[name]) for name, d in destinations.items()}
        spans: list[tuple[tuple[int, int], int | str]] = [
            (_span(t), i) for i, t in enumerate(self._inputs)
        ]
        spans += [(_span(t), name) for name, t in self._targets.items()]
        self._spans = _SpanIndex(spans)
        self._ops: list[_Copy | _Fill] = []
        self._cats: dict[int, tuple[torch.Tensor, int, list[tuple[_View, int]]]] = {}
        # Concatenations of inputs: they hold input values, so they are watched too.
        self._temps: list[tuple[tuple[int, int], torch.device]] = []
        self.reason: str | None = None

    def __enter__(self) -> LoadRecorder:
        # Every destination byte starts as a marker, so a write the recording missed
        # (a loader thread: dispatch modes are per thread) shows in ``checked_replay``.
        mark(self._targets)
        super().__enter__()
        return self

    def checked_replay(
        self,
        hf_tensors: Sequence[tuple[str, torch.Tensor]],
        destinations: Mapping[str, torch.Tensor],
    ) -> Replay | None:
        """The recording, if replaying it onto marker bytes gives exactly what the loader
        wrote (checked once, on the load that was recorded); else None and ``reason``."""
        if self.reason is not None:
            return None
        replay = Replay(self._ops, self._dtypes)
        differ = replay.reproduces(hf_tensors, destinations)
        if differ:
            self.reason = (
                f"its recorded copies do not reproduce {differ[:3]} (a write on another "
                f"thread, or one not seen)"
            )
            return None
        return replay

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.reason is None and not func.is_view:
            self._note(func, args, kwargs, out)
        return out

    def _note(self, func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], out: Any) -> None:
        if func is aten.cat.default and self._note_cat(args, kwargs, out):
            return
        if func is aten.copy_.default and not kwargs:
            self._note_copy(args[0], args[1])
            return
        if func in _FILLS:
            dst_view = self._view_of(args[0])
            value = 0 if func is aten.zero_.default else args[1]
            if (
                dst_view is not None
                and isinstance(dst_view.owner, str)
                and isinstance(value, (int, float, bool))
            ):
                self._ops.append(_Fill(dst_view, value))
                return
        if any(self._touches(t) for t in tree_leaves((args, kwargs))):
            self.reason = f"{func} read or wrote an input or a parameter"

    def _note_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst_view = self._view_of(dst)
        if dst_view is None or not isinstance(dst_view.owner, str):
            if self._touches(dst) or self._touches(src):
                self.reason = "an input was copied somewhere other than a parameter"
            return
        cat = self._cats.get(id(src))
        if cat is not None and cat[0] is src and tuple(dst.shape) == tuple(src.shape):
            self._ops.extend(_pieces(dst_view, cat[1], cat[2]))
            return
        src_view = self._view_of(src)
        if src_view is None or not isinstance(src_view.owner, int):
            self.reason = f"parameter {dst_view.owner!r} got bytes not read from an input"
            return
        self._ops.append(_Copy(dst_view, src_view))

    def _note_cat(self, args: tuple[Any, ...], kwargs: Mapping[str, Any], out: Any) -> bool:
        """Remember a concatenation of input views (DeepSeek's fused q_a / kv_a weight):
        copied whole into a parameter, it replays as one copy per piece."""
        tensors = args[0]
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        views = [self._view_of(t) for t in tensors]
        found = [v for v in views if v is not None and isinstance(v.owner, int)]
        if (
            not views
            or len(found) != len(views)
            or not out.is_contiguous()
            or any(t.dtype != out.dtype for t in tensors)
        ):
            return False
        dim %= out.dim()
        pieces = [(v, int(t.shape[dim])) for v, t in zip(found, tensors, strict=True)]
        self._cats[id(out)] = (out, dim, pieces)  # the reference keeps id(out) unique
        self._temps.append((_span(out), out.device))
        return True

    def _owner_of(self, tensor: torch.Tensor) -> tuple[int | str, torch.Tensor] | None:
        """The one input or destination whose bytes hold all of ``tensor``'s, if exactly one
        does (the same tensor given under two names is ambiguous: the loader is kept)."""
        if tensor.numel() == 0:
            return None
        start, end = _span(tensor)
        owners = [
            owner
            for owner in self._spans.containing(start, end)
            if self._base(owner).device == tensor.device
        ]
        if len(owners) != 1:
            return None
        return owners[0], self._base(owners[0])

    def _view_of(self, tensor: Any) -> _View | None:
        if not isinstance(tensor, torch.Tensor):
            return None
        found = self._owner_of(tensor)
        if found is None:
            return None
        owner, base = found
        if tensor.dtype != base.dtype or tensor.untyped_storage().data_ptr() != (
            base.untyped_storage().data_ptr()
        ):
            return None
        return _View(
            owner,
            int(tensor.storage_offset()) - int(base.storage_offset()),
            tuple(tensor.shape),
            tuple(tensor.stride()),
        )

    def _touches(self, tensor: Any) -> bool:
        """Whether ``tensor`` shares any byte with an input or a destination."""
        if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0:
            return False
        start, end = _span(tensor)
        return any(
            self._base(o).device == tensor.device for o in self._spans.overlapping(start, end)
        ) or any(s < end and start < e and d == tensor.device for (s, e), d in self._temps)

    def _base(self, owner: int | str) -> torch.Tensor:
        return self._inputs[owner] if isinstance(owner, int) else self._targets[owner]


@contextlib.contextmanager
def inline_loads() -> Iterator[None]:
    """sglang loaders that would copy host tensors on a thread pool copy inline meanwhile
    (every loaded sglang module's ``should_async_load`` answers False), in this thread
    only: other threads' loaders keep sglang's choice (``p2pweights.thread_patch``)."""
    from sglang.srt.model_loader import utils

    # (another thread may hold the patch: the functions seen are then its dispatchers)
    original = unpatched(utils, "should_async_load")
    holders = [
        module
        for name, module in list(sys.modules.items())
        if name.startswith("sglang.") and unpatched(module, "should_async_load") is original
    ]
    with contextlib.ExitStack() as stack:
        for module in holders:
            stack.enter_context(patched_call(module, "should_async_load", _never))
        yield


def _never(weight: torch.Tensor) -> bool:
    return False


def _pieces(dst: _View, dim: int, pieces: list[tuple[_View, int]]) -> list[_Copy]:
    """The copies of a concatenation into ``dst``: each piece into its slice along ``dim``."""
    copies, start = [], 0
    for src, size in pieces:
        shape = list(dst.shape)
        shape[dim] = size
        offset = dst.offset + start * dst.stride[dim]
        copies.append(_Copy(_View(dst.owner, offset, tuple(shape), dst.stride), src))
        start += size
    return copies


class _SpanIndex:
    """Byte spans of the inputs and destinations, sorted, for the ops of a recording.

    Each query walks back from the last span starting in range and stops once no earlier
    span reaches far enough (a running maximum of the ends): a step or two when spans do
    not overlap (slices of one staging buffer, of one flat trainer buffer), so a load of
    ``n`` tensors records in about ``n`` steps, not ``n`` squared.
    """

    def __init__(self, spans: Sequence[tuple[tuple[int, int], int | str]]) -> None:
        ordered = sorted(spans, key=lambda span: span[0])
        self._starts = [start for (start, _), _ in ordered]
        self._ends = [end for (_, end), _ in ordered]
        self._owners = [owner for _, owner in ordered]
        # The largest end among the spans up to each index.
        self._reach = list(itertools.accumulate(self._ends, max))

    def containing(self, start: int, end: int) -> list[int | str]:
        """Owners of the spans holding all of ``[start, end)``."""
        found = []
        i = bisect.bisect_right(self._starts, start) - 1
        while i >= 0 and self._reach[i] >= end:
            if self._ends[i] >= end:
                found.append(self._owners[i])
            i -= 1
        return found

    def overlapping(self, start: int, end: int) -> list[int | str]:
        """Owners of the spans sharing a byte with ``[start, end)``."""
        found = []
        i = bisect.bisect_left(self._starts, end) - 1
        while i >= 0 and self._reach[i] > start:
            if self._ends[i] > start:
                found.append(self._owners[i])
            i -= 1
        return found


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """``[first byte, last byte + 1)`` of a strided tensor (non-negative strides)."""
    if tensor.numel() == 0:
        return tensor.data_ptr(), tensor.data_ptr()
    last = _reach(tuple(tensor.shape), tensor.stride())
    return tensor.data_ptr(), tensor.data_ptr() + (last + 1) * tensor.element_size()


def _reach(shape: Sequence[int], stride: Sequence[int]) -> int:
    """How many elements past its first the last element of a strided view lies."""
    return sum((size - 1) * step for size, step in zip(shape, stride, strict=True))
