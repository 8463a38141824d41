"""A replica of one engine rank's sglang model, without parameter storage.

The replica is the rank's own sglang model built on the meta device and brought to
the layout the engine loads updates into ("reload layout"): its start-up postprocess
(``process_weights_after_loading``), then the restore every update session begins
with (``restore_weights_before_loading``). Its parameters have the shapes, strides
and dtypes of the engine's parameters but no memory.

To produce bytes, ``load_into`` points the parameters of one group at slices of a
staging buffer and runs the model's own ``load_weights``: whatever sharding, padding
and fusing the engine's loader does, it does here into the staging memory, so the
staged bytes are exactly what that rank's loader would write. The parameters are
pointed back at meta storage afterwards, so a replica never holds the model.

Each replica has its own sglang runtime context (``sglang_env.replica_context``),
built from the engine's server args; every operation on the replica runs with it
active and the process's own sglang configuration is left as it was.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from p2pweights import environment
from p2pweights.bounded_cache import LruCache
from p2pweights.errors import ConfigError
from p2pweights.replica.base import ParamLayout, bytes_spanned
from p2pweights.replica.layout_key import ENGINE_LOCAL_ARGS
from p2pweights.replica.ranks import RankSpec
from p2pweights.replica.sglang import env as sglang_env
from p2pweights.replica.sglang.parameters import repoint
from p2pweights.replica.sglang.probe import LoaderMap, Written, probe_loader
from p2pweights.replica.sglang.replay import (
    LoadRecorder,
    Replay,
    ReplayKey,
    inline_loads,
    mark,
    replay_key,
)
from p2pweights.replica.sglang.spans import Spans, written_spans
from p2pweights.source.checkpoint_format import AS_GIVEN, CheckpointFormat, QuantizeToBlockFp8
from p2pweights.source.fp8_block import FP8, BlockFp8Format, complete, partial
from p2pweights.source.fp8_regions import Read
from p2pweights.source.inputs import InputSpec, ParamGroup, describe_inputs

if TYPE_CHECKING:
    from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["ParamLayout", "ModelReplica", "bytes_spanned"]


class ModelReplica:
    """One engine rank's sglang model on meta, with its parameter layouts (a ``Replica``).

    ``model_path`` is a local folder with the model's ``config.json`` (what sglang's
    ``--model-path`` names); ``server_args_fields`` are the engine's other server args
    (e.g. from ``/server_info``) that shape its bytes, such as quantization.
    ``role="draft"`` builds the rank's same-model speculative draft (the MTP layer)
    instead of the target model.
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        spec: RankSpec,
        dtype: str | torch.dtype = "auto",
        server_args_fields: Mapping[str, Any] | None = None,
        role: str = "target",
    ) -> None:
        from p2pweights.replica.sglang.compat import check_sglang

        check_sglang()
        self.spec = spec
        self.role = role
        self._context = sglang_env.replica_context(
            sglang_env.server_args_for(model_path, dtype, server_args_fields)
        )
        with self._in_context():
            self.model_config, self.model = sglang_env.build_role_model(
                spec, torch.device("meta"), role
            )
            self._to_reload_layout()
            self.layouts: dict[str, ParamLayout] = {
                name: _layout_of(name, param) for name, param in self.model.named_parameters()
            }
            if role == "draft":
                self._check_end_update_runs()
            # The Parameter objects are final from here on (loads swap the tensors inside
            # them; the probe checks that loaders never replace one): one walk of the
            # module tree serves every later load, instead of one per staging flush.
            self._params: dict[str, torch.nn.Parameter] = dict(self.model.named_parameters())
        # Parameters an update need not feed: those sglang's own weight check skips (an
        # fp8 attention's k_scale / v_scale, not checkpoint weights), and a draft's
        # embedding and head, which its loader skips: the engine shares the target's.
        shared = sglang_env.shared_with_target(self.model) if role == "draft" else set()
        self.optional_params: frozenset[str] = frozenset(
            name
            for name, param in self.model.named_parameters()
            if getattr(param, "_skip_weight_check", False) or name in shared
        )
        # (hf name, shape, dtype) -> the parameters it writes; filled by the probe.
        self.probe_cache: LruCache[tuple[str, tuple[int, ...], torch.dtype], Written] = LruCache(
            PROBES_KEPT
        )
        self._loader_maps: LruCache[tuple[tuple[str, InputSpec], ...], LoaderMap] = LruCache(
            LOADER_MAPS_KEPT
        )
        # inputs and destinations alike but for values -> the loader's recorded copies
        # (None: that load must run the loader every time); see replay.py
        self._replays: dict[ReplayKey, Replay | None] = {}
        # Counts changes to the recordings (new, confirmed, dropped): reads learned from them are
        # stale once it moves.
        self.replays_changed = 0
        self.replayed_loads = 0
        # Loads served by a replay instead of the loader (tests and benchmarks read it).
        self._told_not_replayed = False

    @classmethod
    def from_server_info(
        cls,
        config_path: str | os.PathLike[str],
        server_info: Mapping[str, Any],
        spec: RankSpec,
        role: str = "target",
    ) -> ModelReplica:
        """The replica of ``spec``'s rank of an engine whose ``/server_info`` is ``server_info``.

        ``config_path`` is this trainer's copy of the model's config.json (or its
        folder); the engine's own paths and addresses are dropped.
        """
        path = Path(config_path)
        folder = path if path.is_dir() else path.parent
        fields = {k: v for k, v in server_info.items() if k not in ENGINE_LOCAL_ARGS}
        # a same-model draft's checkpoint is the engine's model: here, the trainer's copy
        draft = server_info.get("speculative_draft_model_path")
        if draft is not None and draft == server_info.get("model_path"):
            fields["speculative_draft_model_path"] = str(folder)
            fields.pop("speculative_draft_model_revision", None)
        return cls(folder, spec, fields.pop("dtype", "auto"), fields, role)

    def probe(self, inputs: Mapping[str, InputSpec]) -> list[ParamGroup]:
        """The probe's groups for these inputs, unchecked (``groups`` checks them)."""
        return list(self.loader_map(inputs).groups)

    def checkpoint_format(self, inputs: Mapping[str, InputSpec]) -> CheckpointFormat:
        """How this rank's loaders want the trainer's tensors (see ``CheckpointFormat``)."""
        fmt = BlockFp8Format.from_quantization_config(self.quantization_config)
        if fmt is None:
            return AS_GIVEN
        # sglang's loaders refuse to downcast, so every matrix is probed as fp8 (an
        # upcast into a high-precision parameter is allowed): the probe then says
        # which names this engine holds in fp8.
        as_fp8 = {
            name: InputSpec(spec.shape, FP8) if _quantizable(spec) else spec
            for name, spec in inputs.items()
        }
        feeds = self.loader_map(as_fp8).feeds
        dtypes = {name: layout.dtype for name, layout in self.layouts.items()}
        return QuantizeToBlockFp8.choose(fmt, inputs, feeds, dtypes)

    def feeds(self, inputs: Mapping[str, InputSpec]) -> Mapping[str, frozenset[str]]:
        """Per input, the parameters its loader writes (the probe is cached)."""
        return self.loader_map(inputs).feeds

    def groups(self, inputs: Mapping[str, InputSpec]) -> list[ParamGroup]:
        """Parameter groups for these HF inputs (the probe is cached).

        Raises ``ConfigError`` if some parameter of this layout is fed by none of the
        inputs: it would keep stale bytes while the update reports success.
        """
        loader_map = self.loader_map(inputs)
        unfed = [p for p in loader_map.unfed_params if p not in self.optional_params]
        if unfed:
            raise ConfigError(
                f"no HF tensor of this update feeds {len(unfed)} parameter(s) of the engine "
                f"layout ({self.spec}): {', '.join(unfed[:8])}; send every checkpoint tensor"
            )
        if loader_map.buffer_writes:
            # only parameters are written and published; a buffer the loader itself
            # fills (not one the engine derives at end_weight_update) would go stale
            name, buffers = next(iter(sorted(loader_map.buffer_writes.items())))
            raise ConfigError(
                f"the loader of engine layout ({self.spec}) writes HF tensor {name!r} into "
                f"module buffers {sorted(buffers)}; p2pweights writes parameters only (the "
                f"engine publishes no buffer), so these would keep stale values"
            )
        return list(loader_map.groups)

    def _in_context(self) -> contextlib.AbstractContextManager[None]:
        """This replica's sglang runtime context, active inside the block."""
        return sglang_env.in_context(self._context)

    def _to_reload_layout(self) -> None:
        """Start-up postprocess, then the restore a session's begin runs, module by module."""
        from p2pweights.replica.sglang.reload_layout import to_reload_layout

        try:
            # a draft is postprocessed under its speculative MoE flags, as at start-up
            with sglang_env.role_scope(self.role):
                self.materialized_modules = to_reload_layout(self.model, self.spec)
        except Exception as exc:
            quantization = getattr(self.model_config, "quantization", None)
            raise ConfigError(
                f"the start-up postprocess of engine rank {self.spec.world_rank} ({self.role}, "
                f"server arg quantization={quantization!r}) failed on the replica: {exc!r}"
            ) from exc

    def _check_end_update_runs(self) -> None:
        """Refuse a draft whose derived weights sglang cannot recompute after writes.

        After direct writes ``end_weight_update`` calls the model's ``post_load_weights()``
        with no arguments; NextN classes must override it (``is_nextn=True``). One that
        does not (sglang 0.5.23's ``Glm4MoeLiteForCausalLMNextN``) fails there, so the
        engine could never finish an update. Run on the meta replica, it fails the same way.
        """
        from sglang.srt.model_loader.loader import post_load_weights

        try:
            with sglang_env.rank_scope(self.spec), _derived_tensors_kept(self.model):
                post_load_weights(self.model)
        except Exception as exc:
            raise ConfigError(
                f"the speculative draft {type(self.model).__name__} of engine rank "
                f"{self.spec.world_rank} cannot recompute its derived weights after direct "
                f"writes (sglang's end_weight_update runs its post_load_weights(), which "
                f"fails: {exc!r}); update this engine with speculative decoding off"
            ) from exc
        changed = [
            name
            for name, param in self.model.named_parameters()
            if _layout_of(name, param) != self.layouts[name]
        ]
        if changed:
            raise ConfigError(
                f"the speculative draft's post_load_weights re-lays parameters {changed[:4]}; "
                "p2pweights cannot stage bytes for this draft"
            )

    @property
    def quantization_config(self) -> dict[str, Any] | None:
        """The model config's ``quantization_config`` (the engine's checkpoint format)."""
        config = getattr(self.model_config.hf_config, "quantization_config", None)
        if config is None or isinstance(config, dict):
            return config
        return dict(config.to_dict())

    @property
    def total_bytes(self) -> int:
        return sum(layout.num_bytes for layout in self.layouts.values())

    @contextlib.contextmanager
    def loading_scope(
        self, destinations: Mapping[str, torch.Tensor] | None = None
    ) -> Iterator[None]:
        """Runtime context, parallel override and default dtype of this rank, for loader calls.

        With ``destinations``, the named parameters view them meanwhile
        (``_params_viewing``). The model's ``post_load_weights``, which derives tensors
        from the loaded parameters into module attributes, is skipped
        (``_post_load_deferred``), so probing and staging leave the replica as it was
        without walking its modules on every call.
        """
        from sglang.srt.model_loader.utils import set_default_torch_dtype

        params = self._params if destinations else {}
        with (
            self._in_context(),
            sglang_env.rank_scope(self.spec),
            set_default_torch_dtype(self.model_config.dtype),
            _params_viewing(params, self.layouts, destinations or {}),
            _post_load_deferred(self.model),
            _named_parameters_cached(self.model, self._params),
        ):
            yield

    def loader_map(self, inputs: Mapping[str, InputSpec]) -> LoaderMap:
        """Which HF names feed which parameters, probed once per set of inputs (cached)."""
        key = tuple(inputs.items())
        found = self._loader_maps.get(key)
        if found is None:
            with self._in_context():
                found = probe_loader(self, inputs)
            self._loader_maps[key] = found
        return found

    def written_spans(self, inputs: Mapping[str, InputSpec]) -> Spans:
        """Per parameter, the byte ranges loading ``inputs`` alone writes (on meta)."""
        with self._in_context():
            return written_spans(self, inputs)

    def input_reads(self) -> dict[str, list[Read] | None]:
        """Per loader input this rank has loaded: the views its checked recordings read
        of it, or None while some load of it is not replayed from one (its loader runs,
        and may read anything)."""
        out: dict[str, list[Read] | None] = {}
        for key, replay in list(self._replays.items()):  # another session may record
            inputs = cast(tuple[tuple[str, ...], ...], key[0])  # (name, shape, ...) each
            names = [entry[0] for entry in inputs]
            if replay is None or not replay.confirmed:
                out.update(dict.fromkeys(names))
                continue
            reads = replay.reads()
            for index, name in enumerate(names):
                known = out.setdefault(name, [])
                if known is not None:
                    known.extend(reads.get(index, []))
        return out

    def load_into(
        self,
        hf_tensors: Sequence[tuple[str, torch.Tensor]],
        destinations: Mapping[str, torch.Tensor],
    ) -> None:
        """Run this rank's loader on ``hf_tensors``, writing into ``destinations``.

        ``destinations`` maps sglang parameter names to flat ``torch.uint8`` tensors (host
        or device) of exactly ``layouts[name].num_bytes`` (slices of a staging buffer). Every
        parameter the given HF tensors feed must have a destination; the inputs are
        checked against the probe before any byte is written.
        """
        key = replay_key(hf_tensors, destinations) if environment.loader_replay_allowed() else None
        replay = self._replays.get(key) if key is not None else None
        if replay is not None and replay.confirmed:
            # the same names, shapes, dtypes, strides and destinations as loads that
            # passed the checks below: only the values differ
            replay.run(hf_tensors, destinations)
            self.replayed_loads += 1
            return
        unset = [name for name, tensor in hf_tensors if partial(tensor)]
        if unset:
            # quantized only where a recording of this rank's loads read, but this load
            # (another composition, replay off) runs the loader, which may read anything
            logger.info("loading %s: quantizing the rest of them first", unset[:3])
            for _, tensor in hf_tensors:
                complete(tensor)
        self._check_destinations(destinations)
        inputs = describe_inputs(hf_tensors)
        with self._in_context():
            fed = probe_loader(self, inputs)  # cached per name; raises on a bad shape
        missing = sorted(
            {param for name in inputs for param in fed.params_of(name)} - set(destinations)
        )
        if missing:
            raise ConfigError(
                f"the HF tensors given to load_into also feed {missing}, which have no "
                "destination; load whole groups of LoaderMap.groups at a time"
            )
        with self.loading_scope(destinations):
            if key is None or (key in self._replays and replay is None):
                # replay off, or this load cannot be replayed
                self.model.load_weights(iter(hf_tensors))  # type: ignore[operator]
                return
            if replay is not None:
                # recorded once: the loader writes, and the replay must do the same
                mark(destinations)
                self.model.load_weights(iter(hf_tensors))  # type: ignore[operator]
            else:
                dtypes = {name: self.layouts[name].dtype for name in destinations}
                recorder = LoadRecorder(hf_tensors, destinations, dtypes)
                with recorder, inline_loads():
                    self.model.load_weights(iter(hf_tensors))  # type: ignore[operator]
        if replay is not None:
            differ = replay.reproduces(hf_tensors, destinations)
            replay.confirmed = not differ
            self.replays_changed += 1
            if differ:
                self._replays[key] = None
                self.replays_changed += 1
                self._not_replayed(f"on other values its recorded copies differ in {differ[:3]}")
            return
        if len(self._replays) >= _MAX_REPLAYS:
            self._replays.clear()  # compositions that never repeat must not pile up
            self.replays_changed += 1
        self._replays[key] = recorder.checked_replay(hf_tensors, destinations)
        self.replays_changed += 1
        if recorder.reason is not None:
            self._not_replayed(recorder.reason)

    def _not_replayed(self, reason: str) -> None:
        """Say once per replica (at INFO) that some of its loads keep running the loader."""
        log = logger.debug if self._told_not_replayed else logger.info
        self._told_not_replayed = True
        log("some loads of %s run sglang's loader every update: %s", self.spec, reason)

    def _check_destinations(self, destinations: Mapping[str, torch.Tensor]) -> None:
        for name, dest in destinations.items():
            layout = self.layouts.get(name)
            if layout is None:
                raise ConfigError(f"{name!r} is not a parameter of this replica")
            if (
                dest.dtype != torch.uint8
                or dest.dim() != 1
                or not dest.is_contiguous()
                or dest.numel() != layout.num_bytes
            ):
                raise ConfigError(
                    f"the destination of {name!r} must be a flat contiguous uint8 tensor "
                    f"of {layout.num_bytes} bytes, got {dest.dtype} {tuple(dest.shape)}"
                )


_MAX_REPLAYS = 4096

PROBES_KEPT = 1 << 18
"""Probed (HF name, shape, dtype) kept per replica: above any checkpoint's tensor count
(Kimi-K2's, block-fp8 scales included, is about 140,000), so a trainer's names are
probed once; names and shapes that keep changing drop the least recently used."""
LOADER_MAPS_KEPT = 8
"""Probed input sets kept per replica (an update's inputs, and their fp8 variant)."""


def _quantizable(spec: InputSpec) -> bool:
    return len(spec.shape) >= 2 and spec.dtype.is_floating_point and spec.dtype != FP8


def _layout_of(name: str, param: torch.Tensor) -> ParamLayout:
    shape, stride = tuple(param.shape), tuple(param.stride())
    return ParamLayout(
        name=name,
        shape=shape,
        stride=stride,
        dtype=param.dtype,
        num_bytes=bytes_spanned(shape, stride, param.element_size()),
    )


@contextlib.contextmanager
def _params_viewing(
    params: Mapping[str, torch.nn.Parameter],
    layouts: Mapping[str, ParamLayout],
    destinations: Mapping[str, torch.Tensor],
) -> Iterator[None]:
    """Let each named parameter view its destination memory, then point it back at meta.

    ``parameters.repoint`` swaps the tensor inside the same Python Parameter object
    (class and loader attributes kept), so every reference the model and its loaders
    hold (weight_loader attributes, tied modules, quant methods) sees the staging memory.
    """
    swapped: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []
    try:
        for name, dest in destinations.items():
            layout, param = layouts[name], params[name]
            view = torch.as_strided(dest.view(layout.dtype), layout.shape, layout.stride)
            swapped.append((param, repoint(param, view)))
        yield
    finally:
        for param, previous in reversed(swapped):
            torch.utils.swap_tensors(param, previous)


@contextlib.contextmanager
def _post_load_deferred(model: nn.Module) -> Iterator[None]:
    """Skip the ``post_load_weights`` a model's ``load_weights`` ends with.

    It derives tensors from the loaded parameters (DeepSeek MLA's ``w_kc`` / ``w_vc``;
    for fp8 it dequantizes ``kv_b_proj`` with its scales, which a one-group load does
    not have). The engine's ``end_weight_update`` runs it after the writes because no
    ``load_weights`` ran there, so the staged bytes are the loader's bytes before it.
    """
    if not hasattr(model, "post_load_weights"):
        yield
        return
    setattr(model, "post_load_weights", _skipped)  # noqa: B010 (an instance attribute)
    try:
        yield
    finally:
        del model.post_load_weights


def _skipped(*args: Any, **kwargs: Any) -> None:
    return None


@contextlib.contextmanager
def _named_parameters_cached(
    model: nn.Module, params: Mapping[str, torch.nn.Parameter]
) -> Iterator[None]:
    """Serve ``model.named_parameters()`` from ``params`` while loaders run.

    sglang's ``load_weights`` starts with ``dict(self.named_parameters())``, a walk of the
    whole module tree; staging calls it once per flush, and on a 36-layer model the walk
    cost as much as loading the flush's tensors (benchmarks/gpu.py update). The replica's
    Parameter objects never change after it is built, so the default call is answered
    from the dict made then; a call with arguments takes the real walk.
    """
    walk = model.named_parameters

    def named_parameters(*args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.nn.Parameter]]:
        if args or kwargs:
            return walk(*args, **kwargs)
        return iter(params.items())

    model.named_parameters = named_parameters  # type: ignore[method-assign]
    try:
        yield
    finally:
        del model.named_parameters


@contextlib.contextmanager
def _derived_tensors_kept(model: nn.Module) -> Iterator[None]:
    """Undo what ``post_load_weights`` derives into plain module attributes.

    It derives tensors from the parameters into attributes (DeepSeek MLA's ``w_kc`` /
    ``w_vc``); the draft check runs it once on the meta replica and keeps the replica's
    own values.
    """
    saved = [
        (module, name, value)
        for module in model.modules()
        for name, value in vars(module).items()
        if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter)
    ]
    before = {(id(module), name) for module, name, _ in saved}
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
        for module in model.modules():
            for name, value in list(vars(module).items()):
                if (
                    isinstance(value, torch.Tensor)
                    and not isinstance(value, torch.nn.Parameter)
                    and (id(module), name) not in before
                ):
                    setattr(module, name, None)
