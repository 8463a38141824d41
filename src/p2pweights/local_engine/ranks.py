"""The ranks of a local engine: sglang models with real storage, published for writers.

Each rank holds the model sglang's own model class builds for that rank, filled
through sglang's own ``load_weights`` and start-up postprocess, its weights
registered with a transport publisher, and sglang's own ``WeightChecker``.

After loading, every parameter is moved into one contiguous byte arena (256-byte
aligned slices; each ``Parameter`` keeps its identity and attributes, only its
``.data`` points at the slice), as a GPU server's caching allocator keeps weights in
a few large segments: a rank's weights are then one registered region.

For the broadcast baseline of ``benchmarks/update.py ceiling`` a rank can also
hold a *broadcast area*: a registered receive buffer sized for the full HF tensor
set, applied with sglang's own ``model.load_weights`` (what an NCCL broadcast update
runs at the engine, with the broadcast replaced by writes over the same transport).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from p2pweights import environment
from p2pweights.engine_side.delta_scratch import SCRATCH_NAME, new_scratch
from p2pweights.engine_side.steps import RankSide
from p2pweights.errors import ConfigError
from p2pweights.replica.ranks import RankSpec
from p2pweights.replica.sglang import facade
from p2pweights.thread_patch import patched_call
from p2pweights.transports import Publisher, create_publisher
from p2pweights.wire.landed import LANDED_NAME, flag_bytes, flag_names

BROADCAST_AREA = "__p2pweights_broadcast_area__"
"""The name the broadcast area is published under (never a parameter name)."""

BroadcastManifest = list[tuple[str, list[int], str, int]]
"""(HF name, shape, torch dtype name, byte offset in the broadcast area) per tensor."""


def broadcast_views(area: torch.Tensor, manifest: Any) -> list[tuple[str, torch.Tensor]]:
    """Each manifest entry ``[name, shape, dtype name, byte offset]`` (from the network)
    as a view of ``area``; ``ConfigError`` for an entry that is not one, or whose bytes
    (non-negative dimensions, a torch dtype, an offset aligned to it) leave the area."""
    if not isinstance(manifest, list):
        raise ConfigError(f"the broadcast manifest must be a list, got {manifest!r:.60}")
    views = []
    for entry in manifest:
        if not isinstance(entry, list | tuple) or len(entry) != 4:
            raise ConfigError(
                f"a broadcast manifest entry is [name, shape, dtype, offset], not {entry!r:.60}"
            )
        name, shape, dtype_name, offset = entry
        dtype = getattr(torch, dtype_name, None) if isinstance(dtype_name, str) else None
        if not isinstance(dtype, torch.dtype):
            raise ConfigError(f"{name!r}: dtype {dtype_name!r:.40} is not a torch dtype")
        if not isinstance(shape, list) or not all(_whole(d) and d >= 0 for d in shape):
            raise ConfigError(f"{name!r}: shape {shape!r:.60} is not a list of sizes")
        if not _whole(offset) or offset < 0 or offset % dtype.itemsize:
            raise ConfigError(
                f"{name!r}: offset {offset!r:.40} is not a byte offset of whole {dtype} elements"
            )
        num_bytes = dtype.itemsize * int(torch.Size(shape).numel())
        if offset + num_bytes > area.numel():
            raise ConfigError(f"{name!r} at offset {offset} leaves the broadcast area")
        views.append((str(name), area[offset : offset + num_bytes].view(dtype).view(shape)))
    return views


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def move_into_arena(
    model: torch.nn.Module, keep: Iterable[torch.nn.Parameter] = ()
) -> torch.Tensor:
    """Copy every parameter of ``model`` into one flat uint8 arena; point ``.data`` at it.

    Slices start at multiples of 256 bytes. Values are copied bit for bit and each
    ``Parameter`` object (with sglang's loader attributes) stays the same, so
    sglang's loaders, postprocess and weight checker see the same model. Parameters
    in ``keep`` (a draft's, shared with the target) stay where they are. Returns
    the arena (the other parameters' only storage from now on).
    """
    kept = {id(p) for p in keep}
    # shared parameters listed once
    params = [p for _, p in model.named_parameters() if id(p) not in kept]
    device = params[0].device if params else torch.device("cpu")
    arena_bytes = sum(_aligned(p.nbytes) for p in params)
    arena = torch.empty(arena_bytes, dtype=torch.uint8, device=device)
    offset = 0
    for param in params:
        num_bytes = param.nbytes
        view = arena[offset : offset + num_bytes].view(param.dtype).view(param.shape)
        view.copy_(param.data)
        param.data = view
        offset += _aligned(num_bytes)
    return arena


def _aligned(num_bytes: int) -> int:
    """``num_bytes`` rounded up to the arena's slice alignment (256 bytes)."""
    return -(-num_bytes // 256) * 256


class _TensorsStayOnHost(TorchFunctionMode):
    """``Tensor.cuda()`` answers the tensor itself. A torch function mode is this
    thread's alone: other threads' ``.cuda()`` is torch's."""

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func is torch.Tensor.cuda:
            return args[0]
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _chunks_stay_on_host() -> Iterator[None]:
    """sglang's weight comparator moves each chunk to CUDA before comparing (``.cuda()``).

    A local engine on a host without a GPU holds its weights in host memory; there the
    chunks are compared where they are. Nothing else changes: same chunks, same
    bitwise test. Used only around the checker calls of a CPU-only local engine.
    """
    if torch.cuda.is_available():
        yield
        return
    with _TensorsStayOnHost():
        yield


@contextlib.contextmanager
def _no_cuda_sync() -> Iterator[None]:
    """sglang's ``set_embed_and_head`` empties the CUDA cache and synchronizes; on a host
    without a GPU there is nothing to wait for (only used around that call, and only
    for the calling thread: ``p2pweights.thread_patch``)."""
    if torch.cuda.is_available():
        yield
        return
    with (
        patched_call(torch.cuda, "empty_cache", _nothing),
        patched_call(torch.cuda, "synchronize", _nothing),
    ):
        yield


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


class _Runner:
    """One model runner of a rank (the target, or its speculative draft), as published."""

    def __init__(
        self,
        model: torch.nn.Module,
        spec: RankSpec,
        role: str,
        transport: str,
        device: torch.device,
        shared: Iterable[torch.nn.Parameter] = (),
    ):
        self.model, self.spec, self.role, self.device = model, spec, role, device
        shared_ids = {id(p) for p in shared}
        self.arena = move_into_arena(
            model, keep=[p for p in model.parameters() if id(p) in shared_ids]
        )
        self.checker = facade.weight_checker(lambda: self.model, spec)
        # like sglang, each runner registers its own weights with its own transport
        # endpoint; the draft's copy of the target's embedding and head is not its own
        self.params = {
            name: p.data for name, p in model.named_parameters() if id(p) not in shared_ids
        }
        scratch = new_scratch(self.params, device)  # published beside the weights
        if scratch is not None:
            self.params[SCRATCH_NAME] = scratch
        # the flags a sender sets as each parameter's writes land (wire.landed)
        num_flags = flag_bytes(len(flag_names(self.params)))
        self.params[LANDED_NAME] = torch.zeros(num_flags, dtype=torch.uint8, device=device)
        self.publisher: Publisher = create_publisher(transport, engine_rank=spec.tp_rank)
        self.publisher.register(self.params)
        self.side = RankSide(
            spec.tp_rank, role, write_digests=environment.write_digests(default=True)
        )
        # What the runner recorded at its last begin or before its last end (``engine_side.steps``).
        self.digest_record: dict[str, Any] = {"update": 0, "role": role, "digests": None}
        # Test only: a parameter one byte of which changes after the writes (one-shot).
        self.corrupt_at_end: str | None = None

    def publication(self) -> Any:
        return self.publisher.publication(self.params)

    @torch.no_grad()
    def begin_update(self) -> None:
        facade.begin_update(self.model, self.spec, self.device)
        self.digest_record = self.side.after_begin(
            self.params.get(SCRATCH_NAME), (self.params[LANDED_NAME], self.params)
        )

    @torch.no_grad()
    def end_update(self, run_post_load: bool) -> None:
        if self.corrupt_at_end is not None:
            self.params[self.corrupt_at_end].view(-1).view(torch.uint8)[0] ^= 0x01
            self.corrupt_at_end = None
        # the writes are in; sglang's postprocess below may re-lay or move the weights
        self.digest_record = self.side.before_end(self.params)
        # Bytes that arrived by writes, not load_weights, need post_load_weights (as in sglang).
        facade.end_update(self.model, self.spec, run_post_load=run_post_load, device=self.device)

    def check(self, action: str, **options: Any) -> dict[str, Any] | None:
        with facade.rank_scope(self.spec), torch.no_grad(), _chunks_stay_on_host():
            result: dict[str, Any] | None = self.checker.handle(action, role=self.role, **options)
            return result

    def close(self) -> None:
        self.publisher.close()


class EngineRank:
    """One TP rank of a local engine: its target runner and, with a same-model
    speculative draft (``speculative_algorithm`` EAGLE / NEXTN), its draft runner."""

    def __init__(
        self,
        server_info: dict[str, Any],
        spec: RankSpec,
        weights: Callable[[], Iterable[tuple[str, torch.Tensor]]],
        transport: str,
        device: torch.device | str = "cpu",
    ):
        from p2pweights.replica.speculative import has_model_draft

        self.spec = spec
        self.device = torch.device(device)

        def load(role: str) -> torch.nn.Module:
            return facade.load_real_rank_model(
                server_info["model_path"],
                spec,
                weights(),
                dtype=server_info["dtype"],
                server_args_fields=server_info,
                device=self.device,
                role=role,
            )

        self.model = load("target")
        self.runners = {"target": _Runner(self.model, spec, "target", transport, self.device)}
        if has_model_draft(f"local engine :{server_info.get('port')}", server_info):
            draft = load("draft")
            shared = self.model.get_embed_and_head()  # type: ignore[operator]
            with _no_cuda_sync():
                draft.set_embed_and_head(*shared)  # type: ignore[operator]
            self.runners["draft"] = _Runner(draft, spec, "draft", transport, self.device, shared)
        self.params = self.runners["target"].params
        self.publisher = self.runners["target"].publisher
        self.broadcast_area: torch.Tensor | None = None

    @property
    def rank(self) -> int:
        return self.spec.tp_rank

    def selected(self, selector: str) -> list[_Runner]:
        """sglang's runner selector: "target", "draft" or "all" (those this rank has)."""
        if selector == "all":
            return list(self.runners.values())
        if selector not in self.runners:
            raise ConfigError(f"rank {self.rank} has no {selector!r} runner")
        return [self.runners[selector]]

    def publication(self, role: str = "target") -> Any:
        return self.selected(role)[0].publication()

    def begin_update(self, selector: str = "all") -> None:
        for runner in self.selected(selector):
            runner.begin_update()

    def end_update(self, run_post_load: bool = True, selector: str = "all") -> None:
        for runner in self.selected(selector):
            runner.end_update(run_post_load)

    def publish_broadcast_area(self, num_bytes: int) -> Any:
        """Allocate (once) and register the broadcast area; its publication, as for weights."""
        if num_bytes <= 0:
            raise ConfigError(f"a broadcast area of {num_bytes} bytes; ask for at least one")
        if self.broadcast_area is None:
            self.broadcast_area = torch.empty(num_bytes, dtype=torch.uint8, device=self.device)
            self.publisher.register({BROADCAST_AREA: self.broadcast_area})
        elif self.broadcast_area.numel() != num_bytes:
            raise ConfigError(
                f"rank {self.rank} already has a {self.broadcast_area.numel()}-byte broadcast "
                f"area; restart the engine for one of {num_bytes} bytes"
            )
        return self.publisher.publication({BROADCAST_AREA: self.broadcast_area})

    @torch.no_grad()
    def apply_broadcast(self, manifest: BroadcastManifest) -> None:
        """sglang's own ``load_weights`` from views of the broadcast area (inside begin/end)."""
        area = self.broadcast_area
        if area is None:
            raise ConfigError("no broadcast area; POST /p2pweights/broadcast_area first")
        views = broadcast_views(area, manifest)
        with facade.rank_scope(self.spec):
            self.model.load_weights(iter(views))  # type: ignore[operator]

    def check(self, action: str, selector: str = "target", **options: Any) -> dict[str, Any] | None:
        """sglang's weight checker on one runner ("target" or "draft"), answered as sglang
        0.5.23's scheduler answers it: ``parallelism_info`` a list, one per runner."""
        (runner,) = self.selected(selector) if selector != "all" else self.selected("target")
        payload = runner.check(action, **options)
        if payload is not None and isinstance(payload.get("parallelism_info"), dict):
            payload = {**payload, "parallelism_info": [payload["parallelism_info"]]}
        return payload

    def close(self) -> None:
        for runner in self.runners.values():
            runner.close()
