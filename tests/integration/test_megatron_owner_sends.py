"""``MegatronExport.named_tensors(owned=True)`` between real trainer processes, with a
stand-in for a newer megatron-bridge that has ``local_hf_params`` (the pinned 0.3.1 has
not; its derived views are tested on real Megatron in test_megatron_bridge.py).

Two gloo trainer processes play one pipeline stage of tensor parallelism 2 over a dense
Qwen3, and over a Qwen3-MoE with expert parallelism 2 as well (each rank's experts' fc2,
a local view, owned; their fc1, which fuses gate and up, through the export). The
row-parallel linear weights (``o_proj``, ``down_proj``) are each rank's half of the
columns and the vocabulary-parallel ones (embedding, lm head) its half of the rows,
described as megatron-bridge's ``local_hf_params`` describes them (``LocalHFParam``: a
local view, its global shape, shard group and dim); the norms are replicated views; the
fused QKV and gate/up have no local view, so they go through the (stand-in) bridge's
gathered export, whole on both ranks. Each rank hands ``update()`` what the adapter makes
of that; every engine rank of a TP 2 and a TP 1 engine must be bit-exact with sglang's own
``load_weights`` after two updates.

What this does not test: a real bridge's ``local_hf_params`` (which parameters it
describes, with which global shapes and shard dims) and real Megatron parallel state.
"""

from __future__ import annotations

import re
import sys
import types
from dataclasses import dataclass

import pytest
import torch
from _bit_exact import assert_bit_exact
from _lockstep import run_in_lockstep
from _procs import gloo_session, warm_context

from p2pweights.local_engine import free_port
from p2pweights.testing import synthetic_weights

pytestmark = pytest.mark.integration

SEEDS = (191, 192)
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")


@dataclass(frozen=True)
class _View:  # megatron-bridge's LocalHFParam
    name: str
    weight: torch.Tensor
    global_weight_shape: torch.Size
    shard_group: str
    shard_dim: int | None


class _Mapping:
    def __init__(self, name: str, views, tp_rank: int, is_expert: bool = False):
        self.hf_param, self.views, self.tp_rank, self.is_expert = name, views, tp_rank, is_expert

    def local_hf_params(self, weight, *, global_param_name, megatron_module):
        if self.views is None:
            raise ValueError("interleaved: no local HF view")
        return self.views


@dataclass(frozen=True)
class _Task:
    param_name: str
    mapping: _Mapping
    megatron_module: object = "here"
    param_weight: object = None


class _Bridge:
    """The stand-in: the tasks of one TP rank, and a gathered export of whole tensors."""

    def __init__(self, tasks, whole):
        self.tasks, self.whole = tasks, whole

    def get_conversion_tasks(self, model):
        return self.tasks

    def export_hf_weights(self, model, *, conversion_tasks, **kwargs):
        for task in conversion_tasks:
            yield task.mapping.hf_param, self.whole[task.mapping.hf_param].clone()


def _stub_megatron() -> None:
    state = types.SimpleNamespace(
        get_pipeline_model_parallel_rank=lambda: 0,
        get_pipeline_model_parallel_world_size=lambda: 1,
        get_data_parallel_rank=lambda with_context_parallel=False: 0,
        get_expert_data_parallel_rank=lambda: 0,
    )
    core = types.ModuleType("megatron.core")
    core.parallel_state = state  # type: ignore[attr-defined]
    mapping = types.ModuleType("megatron.bridge.models.conversion.param_mapping")
    mapping.MegatronParamMapping = type("MegatronParamMapping", (), {"pp_size": 1})  # type: ignore[attr-defined]
    sys.modules.update(
        {"megatron": types.ModuleType("megatron"), "megatron.core": core, mapping.__name__: mapping}
    )


def _tasks(folder: str, seed: int, rank: int, size: int):
    whole = dict(synthetic_weights(folder, seed=seed, dtype=torch.bfloat16))
    tasks = []
    for name, tensor in whole.items():
        expert = _EXPERT.search(name)
        if expert is not None:  # EP: this rank's experts; fc2 (down) a local view
            if name.endswith("down_proj.weight"):
                if int(expert.group(1)) % size != rank:
                    continue  # another EP rank's expert: no task here
                view = _View(name, tensor, tensor.shape, "replicated", None)
                tasks.append(_Task(name, _Mapping(name, [view], 0, is_expert=True)))
            else:  # fc1 fuses gate and up: the bridge's export (gathered over EP)
                tasks.append(_Task(name, _Mapping(name, None, rank)))
            continue
        dim = 1 if name.endswith(("o_proj.weight", "down_proj.weight")) else None
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            dim = 0
        if dim is not None and tensor.shape[dim] % size == 0:
            local = tensor.chunk(size, dim)[rank].clone()
            views = [_View(name, local, tensor.shape, "tp", dim)]
        elif "proj" in name:  # fused QKV / gate-up in Megatron: the bridge's export
            views = None
        else:
            views = [_View(name, tensor, tensor.shape, "replicated", None)]
        tasks.append(_Task(name, _Mapping(name, views, rank)))
    return tasks, whole


def _trainer(rank, size, port, urls, folder, gos, out) -> None:
    from p2pweights.adapters.megatron import MegatronExport

    _stub_megatron()
    with gloo_session(rank, size, port, urls) as session:
        for go, seed in zip(gos, SEEDS, strict=True):
            tasks, whole = _tasks(folder, seed, rank, size)
            export = MegatronExport(_Bridge(tasks, whole), object())
            pairs = export.named_tensors(owned=True)
            try:
                report = session.update(pairs)
                result = (
                    sorted(pairs.shards()),
                    dict(report.bytes_by_target),
                    sorted(pairs.owned()),
                )
            except Exception as exc:
                result = ("error", f"{type(exc).__name__}: {exc}")
            out.put((seed, rank, result))
            go.wait(timeout=300)


@pytest.mark.parametrize("name", ["qwen3-tiny", "qwen3-moe-tiny"])
def test_tensor_parallel_shards_are_sent_by_their_megatron_ranks(name, model_dir, shared_engines):
    """Qwen3-MoE: also expert parallelism 2, each rank's experts' ``down_proj`` owned."""
    folder = model_dir(name)
    engines = shared_engines(folder, [2, 1], seed=0)
    urls = [e.url for e in engines]
    size, ctx, port = 2, warm_context(), free_port()
    out = ctx.Queue()
    gos = [ctx.Event() for _ in SEEDS]
    trainers = [
        ctx.Process(target=_trainer, args=(rank, size, port, urls, str(folder), gos, out))
        for rank in range(size)
    ]

    def check(seed: int, results: list[tuple]) -> None:
        outcomes = [r[2] for r in results]
        assert all(o[0] != "error" for o in outcomes), outcomes
        shards = outcomes[0][0]
        assert any(n.endswith("o_proj.weight") for n in shards), shards  # sent as shards
        assert not any(n.endswith("q_proj.weight") for n in shards), shards  # exported
        owned = [o[2] for o in outcomes]
        if "moe" in name:  # each rank its own experts' down_proj, no two the same
            assert owned[0] and owned[1] and not set(owned[0]) & set(owned[1]), owned
        else:
            assert owned == [[], []]
        every = {(e.url, r) for e in engines for r in range(e.tp)}
        assert set().union(*(o[1] for o in outcomes)) == every, outcomes
        assert_bit_exact(engines, folder, seed)

    run_in_lockstep(trainers, out, gos, check, steps=list(SEEDS), timeout_s=400)
