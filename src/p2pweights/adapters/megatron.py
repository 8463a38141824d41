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
gather where megatron-bridge can describe a parameter as a local HF view
(``MegatronParamMapping.local_hf_params``, in newer bridges): tensor-parallel shards go
as shard descriptions, experts as owned tensors; the rest is exported as above.

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
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

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
        """This rank's parameters as owner sends take them, with no gather where the bridge
        can say so: megatron-bridge's ``local_hf_params`` (newer bridges) describes a
        parameter whose HF tensor is a plain split of the local one (row- / column-parallel
        linear layers: ``Shard(1)`` / ``Shard(0)``; a replicated one; an expert): a
        tensor-parallel shard goes as an explicit shard description, an expert (held by
        this rank alone) as owned, a replicated tensor whole. Parameters it cannot describe
        (fused QKV and gate/up interleavings, transposes) are exported gathered, as by
        ``named_tensors()``, and sent whole by every rank of the stage (they are exported
        here, before the update, and held until it ends).

        Needs one data-parallel replica per pipeline stage (data- and expert-data-parallel
        size 1): replicas would claim the same shards. Raises ``ConfigError`` otherwise.
        """
        _one_replica()
        pairs: list[tuple[str, torch.Tensor]] = []
        owned: set[str] = set()
        shards: dict[str, tuple[int, int, int]] = {}
        rest = []
        for task in self._tasks:
            views = _local_views(task)
            if views is None:
                rest.append(task)
                continue
            for view in views:
                name = self.rename(view.name) if self.rename is not None else view.name
                if name is None:
                    continue
                tensor = view.weight.detach()
                tensor = tensor.to("cpu") if cpu else tensor
                if dtype is not None and tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                pairs.append((name, tensor))
                if view.shard_dim is not None:
                    dim = view.shard_dim
                    start = task.mapping.tp_rank * tensor.shape[dim]
                    shards[name] = (dim, start, int(view.global_weight_shape[dim]))
                elif getattr(task.mapping, "is_expert", False):
                    owned.add(name)
        if rest:
            pairs.extend(self._exported(rest, cpu, dtype))
        return OwnedTensors(pairs, owned, shards)

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


def _local_views(task: Any) -> Sequence[Any] | None:
    """The bridge's local HF views of a task's parameter; None where it has none (an
    older bridge, or a mapping that needs its conversion: interleavings, transposes)."""
    local = getattr(task.mapping, "local_hf_params", None)
    if local is None:
        return None
    try:
        views = local(
            task.param_weight,
            global_param_name=getattr(task, "global_param_name", task.param_name),
            megatron_module=task.megatron_module,
        )
    except ValueError:
        return None
    return views or None


def _one_replica() -> None:
    from megatron.core import parallel_state

    data = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    expert = getattr(parallel_state, "get_expert_data_parallel_world_size", lambda: 1)()
    if data > 1 or expert > 1:
        raise ConfigError(
            f"MegatronExport owner sends need one data-parallel replica per pipeline stage "
            f"(data-parallel size {data}, expert-data-parallel size {expert}): replicas hold "
            f"the same shards and experts, and each byte must have one owner; use "
            f"named_tensors() (gathered), or send from one replica's ranks"
        )


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
