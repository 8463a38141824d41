"""Megatron-core models (TP / PP / EP) as checkpoint-named tensors, through megatron-bridge.

megatron-bridge's HF export (``AutoBridge.export_hf_weights``) gathers each
parameter's tensor-parallel and expert-parallel shards and converts it to the HF
checkpoint's names and layout (fused QKV split into q, k, v; gate/up split; ...).
By default it also broadcasts every pipeline stage's parameters to every rank.
``MegatronExport`` runs the same export one of two ways:

* ``per_stage=True`` (default): each pipeline stage exports only its own
  parameters. Its ranks are one sender group (``stage_config`` sets
  ``pipeline_stage`` / ``num_pipeline_stages``): the stage writes its own parameters
  to every engine rank, no collective crosses stages during an update (the export's
  TP and EP gathers stay inside the stage), and the session's ``agree`` spans all ranks.
* ``per_stage=False``: the bridge's own export; every rank gets every tensor and all
  ranks are one sender group (``num_pipeline_stages=1``). Needed for LoRA adapters to
  be merged into the exported weights (the bridge gathers adapters across stages).

``named_tensors(owned=True)`` (owner sends, ``MegatronExport.owned_views``) skips the
gather where the HF tensor is a plain split of the ranks' local tensors (row- and
column-parallel linear weights, the vocabulary-parallel embedding and output layer, the
experts' plain weights; ``megatron_views``): each rank hands its own shard as a shard
description and its own experts as owned tensors; the rest (fused QKV and gate/up) is
exported as above. The views come from megatron-bridge's ``local_hf_params`` in newer
bridges and from the mapping classes in bridge 0.3.

Every rank of the Megatron job must iterate the export to the end (it is collective
within each stage). A model the bridge has no mapping for needs a bridge of its own
(megatron-bridge's ``MegatronModelBridge.register_bridge`` and
``MegatronMappingRegistry``); names the bridge exports under another name than the
engine's checkpoint uses are fixed with ``rename``.

Only the bridge's documented export API is used (``get_conversion_tasks``,
``export_hf_weights(conversion_tasks=...)``), plus one thing for ``per_stage``: while
the export computes a tensor, megatron-bridge's parameter mappings see a pipeline of
one stage (``MegatronParamMapping.pp_size`` is 1), so their broadcast from the owning
stage (``broadcast_from_pp_rank``, which every local tensor would skip anyway) is not
a collective across stages. That holds only for the duration of each export step, on
the exporting thread's watch: do not run another bridge export concurrently in the
same process.

``update()``'s input contract (no yielded tensor changes until the update returns):
the bridge gathers and converts each parameter into tensors of its own, and ``cpu`` /
``dtype`` make new ones; should a bridge version refill a buffer it already yielded,
the update fails with ``InputChangedError`` naming the tensor, never sends other bytes.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from p2pweights.adapters.megatron_views import LocalView, derived_view, derives_views
from p2pweights.adapters.owned import OwnedTensors
from p2pweights.config import SyncConfig, TrainerTopology
from p2pweights.errors import ConfigError

__all__ = ["MegatronExport", "Rename", "stage_config"]

Rename = Callable[[str], "str | None"]
"""The name-mapping hook: the bridge's HF name -> the engine checkpoint's name, or None
to leave the tensor out."""


class MegatronExport:
    """Checkpoint-named tensors of a megatron-core model, every update.

    ``bridge``: a ``megatron.bridge.AutoBridge`` for the engines' model (e.g.
    ``AutoBridge.from_hf_pretrained(<the engines' model folder>)``); its checkpoint's
    names decide what is exported. ``model``: the model chunks (one per virtual
    pipeline stage) or one module, as Megatron built them. Building this runs one
    all-gather of parameter names over the pipeline group (the bridge's planning);
    every rank must build it.
    """

    def __init__(
        self,
        bridge: Any,
        model: Any,
        *,
        per_stage: bool = True,
        rename: Rename | None = None,
    ):
        self.bridge = bridge
        self.model = model if isinstance(model, list) else [model]
        self.per_stage = per_stage
        self.rename = rename
        tasks = [t for t in bridge.get_conversion_tasks(self.model) if t is not None]
        self._tasks = stage_tasks(tasks) if per_stage else tasks
        self._rest_specs: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None
        self._derives: bool | None = None
        self._tied = False
        self._vocab_size: int | None = None

    def stage_config(self, config: SyncConfig | None = None) -> SyncConfig:
        """``config`` with this rank's pipeline stage filled in (see ``stage_config``)."""
        return stage_config(config, per_stage=self.per_stage)

    def named_tensors(
        self, *, cpu: bool = False, dtype: torch.dtype | None = None, owned: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint name, full tensor) pairs, for ``WeightSyncSession.update``.

        ``cpu`` moves each tensor to host memory as it is exported; ``dtype`` casts
        floating-point tensors (e.g. fp32 norm weights to the checkpoint's bf16).
        ``owned``: owner sends (``owned_views``): each rank hands its own tensor-parallel
        shards and experts where the bridge describes them as local HF views, and only
        the other parameters go through the bridge's gathered export.
        """
        if owned:
            return self.owned_views(cpu=cpu, dtype=dtype)
        return self._exported(self._tasks, cpu, dtype)

    def owned_views(self, *, cpu: bool = False, dtype: torch.dtype | None = None) -> OwnedTensors:
        """This rank's parameters as owner sends take them, with no gather where the HF
        tensor is a plain split of the local ones (``megatron_views``): a row- or
        column-parallel linear weight, or the unpadded vocabulary-parallel embedding and
        output layer, goes as this rank's shard (an explicit shard description), an
        expert held by this expert-parallel rank as owned, a replicated tensor whole from
        every rank of the stage. The views come from megatron-bridge's
        ``local_hf_params`` where the bridge has it, else from the mapping's class (bridge
        0.3). The other parameters (fused QKV and gate/up interleavings, ...) stream
        through the bridge's gathered export, as in ``named_tensors()``, and are sent whole
        by every rank of the stage; the first call exports them once more beforehand, one
        at a time, to learn their names and shapes (later calls reuse them).

        Data-parallel replicas (and context-parallel ranks) hold the same shards: only
        data-parallel rank 0 hands its shards, and expert-data-parallel rank 0 its
        experts; the others hand the replicated and exported tensors only (every rank
        still runs the export, which is collective in its tensor- and expert-parallel
        groups). Needs ``per_stage=True``; raises ``ConfigError`` otherwise.
        """
        if not self.per_stage:
            raise ConfigError(
                "MegatronExport owner sends need per_stage=True (each pipeline stage its own "
                "sender group); with per_stage=False use named_tensors(owned=False)"
            )
        dense_first, expert_first = _first_replica()
        views: list[LocalView] = []
        rest = []
        for task in self._tasks:
            found = self._views(task)
            if found is None:
                rest.append(task)
                continue
            for view in found:
                if view.expert and not expert_first:
                    continue
                if view.shard is not None and not view.expert and not dense_first:
                    continue
                views.append(view)
        if self._rest_specs is None:  # names and shapes of the export, one tensor at a time
            self._rest_specs = {
                name: (tuple(tensor.shape), tensor.dtype)
                for name, tensor in self._exported(rest, cpu, dtype)
            }
        pairs: list[tuple[str, torch.Tensor]] = []
        owned: set[str] = set()
        shards: dict[str, tuple[int, int, int]] = {}
        for view in views:
            name = self.rename(view.name) if self.rename is not None else view.name
            if name is None:
                continue
            tensor = view.tensor.to("cpu") if cpu else view.tensor
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(dtype)
            pairs.append((name, tensor))
            if view.shard is not None:
                shards[name] = view.shard
            elif view.expert:
                owned.add(name)
        return OwnedTensors(
            _Streamed(pairs, self._exported(rest, cpu, dtype), self._rest_specs), owned, shards
        )

    def _views(self, task: Any) -> list[LocalView] | None:
        """The task's local HF views (``megatron_views``), or None: the gathered export."""
        if getattr(task.mapping, "local_hf_params", None) is not None:
            return _bridge_views(task)
        if self._derives is None:
            self._derives = derives_views(self.bridge)
            self._tied, self._vocab_size = _vocabulary(self.bridge, self.model)
        if not self._derives:
            return None
        view = derived_view(task, tied=self._tied, vocab_size=self._vocab_size)
        return None if view is None else [view]

    def _exported(
        self, tasks: Sequence[Any], cpu: bool, dtype: torch.dtype | None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        exported = self.bridge.export_hf_weights(
            self.model,
            cpu=cpu,
            show_progress=False,
            conversion_tasks=list(tasks),
            merge_adapter_weights=not self.per_stage,
        )
        if self.per_stage:
            exported = stepped(exported, one_pipeline_stage)
        return renamed(((name, tensor) for name, tensor in exported), self.rename, dtype)


def _bridge_views(task: Any) -> list[LocalView] | None:
    """The bridge's own local HF views of a task's parameter (``local_hf_params``, newer
    bridges); None where it has none (interleavings, transposes)."""
    mapping = task.mapping
    try:
        found = mapping.local_hf_params(
            task.param_weight,
            global_param_name=getattr(task, "global_param_name", task.param_name),
            megatron_module=task.megatron_module,
        )
    except ValueError:
        return None
    views = []
    for view in found or ():
        tensor = view.weight.detach()
        shard = None
        if view.shard_dim is not None:
            dim = view.shard_dim
            shard = (dim, mapping.tp_rank * tensor.shape[dim], int(view.global_weight_shape[dim]))
        views.append(
            LocalView(view.name, tensor, shard, bool(getattr(mapping, "is_expert", False)))
        )
    return views or None


def _vocabulary(bridge: Any, model: Sequence[Any]) -> tuple[bool, int | None]:
    """Whether the model ties its embedding to the output layer, and the checkpoint's
    vocabulary size (None: unknown)."""
    config = getattr(getattr(bridge, "hf_pretrained", None), "config", None)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for chunk in model:
        while hasattr(chunk, "module"):  # DDP / Float16Module wrappers
            chunk = chunk.module
        tied = tied or bool(getattr(chunk, "share_embeddings_and_output_weights", False))
    return tied, getattr(config, "vocab_size", None)


class _Streamed(Iterator[tuple[str, torch.Tensor]]):
    """The views, then the gathered export as it streams; ``specs()`` says what comes."""

    def __init__(
        self,
        views: list[tuple[str, torch.Tensor]],
        exported: Iterator[tuple[str, torch.Tensor]],
        exported_specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
    ):
        self._specs = {name: (tuple(t.shape), t.dtype) for name, t in views}
        self._specs.update(exported_specs)
        self._pairs = itertools.chain(views, exported)

    def __next__(self) -> tuple[str, torch.Tensor]:
        return next(self._pairs)

    def specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return dict(self._specs)


def _first_replica() -> tuple[bool, bool]:
    """Whether this rank is in data-parallel replica 0 (context-parallel ranks included),
    and in expert-data-parallel replica 0: those send the shards and experts."""
    from megatron.core import parallel_state

    dense = parallel_state.get_data_parallel_rank(with_context_parallel=True)
    expert = getattr(parallel_state, "get_expert_data_parallel_rank", lambda: 0)()
    return dense == 0, expert == 0


def stage_tasks(tasks: Sequence[Any]) -> list[Any]:
    """The conversion tasks of this rank's pipeline stage (a task whose parameter lives on
    another stage has no module here)."""
    return [task for task in tasks if task.megatron_module is not None]


@contextlib.contextmanager
def one_pipeline_stage() -> Iterator[None]:
    """megatron-bridge's parameter mappings see one pipeline stage meanwhile."""
    from megatron.bridge.models.conversion.param_mapping import MegatronParamMapping

    original = MegatronParamMapping.__dict__["pp_size"]
    MegatronParamMapping.pp_size = property(lambda self: 1)
    try:
        yield
    finally:
        MegatronParamMapping.pp_size = original


def stepped(
    items: Iterator[Any], scope: Callable[[], contextlib.AbstractContextManager[None]]
) -> Iterator[Any]:
    """``items``, each one computed inside ``scope()`` (the consumer's code runs outside)."""
    iterator = iter(items)
    while True:
        with scope():
            item = next(iterator, _DONE)
        if item is _DONE:
            return
        yield item


_DONE = object()


def stage_config(config: SyncConfig | None = None, *, per_stage: bool = True) -> SyncConfig:
    """``config`` with ``pipeline_stage`` / ``num_pipeline_stages`` from Megatron's
    parallel state (or one stage for ``per_stage=False``); pass the result to
    ``WeightSyncSession.from_torch_distributed`` over all ranks."""
    from megatron.core import parallel_state

    config = config or SyncConfig()
    stage, num_stages = 0, 1
    if per_stage:
        stage = parallel_state.get_pipeline_model_parallel_rank()
        num_stages = parallel_state.get_pipeline_model_parallel_world_size()
    # the config's ranks stay (from_torch_distributed fills them in); only the stage is set
    topology = TrainerTopology(
        rank=config.trainer_rank,
        num_ranks=config.num_trainer_ranks,
        pipeline_stage=stage,
        num_pipeline_stages=num_stages,
    )
    return config.with_topology(topology)


def renamed(
    pairs: Iterator[tuple[str, torch.Tensor]],
    rename: Rename | None,
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``pairs`` through the ``rename`` hook (None drops a tensor) and the ``dtype`` cast.

    Raises ``ConfigError`` if two tensors end up under one name.
    """
    seen: dict[str, str] = {}
    for name, tensor in pairs:
        target = rename(name) if rename is not None else name
        if target is None:
            continue
        if target in seen:
            raise ConfigError(
                f"the export gives {seen[target]!r} and {name!r} both the name {target!r}; "
                f"fix the rename hook"
            )
        seen[target] = name
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        yield target, tensor
