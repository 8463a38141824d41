"""Replicas kept per shard layout for the whole trainer process.

Two engine ranks whose bytes are laid out the same way (same model, same rank
parallelism, same byte-relevant server arguments) share one replica and one
loader probe, across engines and across reconnects. sglang is imported only
when a replica is first built.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from p2pweights.engines.published import RankPublication
from p2pweights.errors import ConfigError, LayoutMismatchError
from p2pweights.source.checkpoint_format import AS_GIVEN, CheckpointFormat, QuantizeToBlockFp8
from p2pweights.source.fp8_block import FP8, BlockFp8Format
from p2pweights.source.inputs import InputSpec, ParamGroup
from p2pweights.transfer.buffers import staged_bytes

LAYOUT_SERVER_ARGS = (
    "dtype",
    "quantization",
    "tp_size",
    "ep_size",
    "pp_size",
    "dp_size",
    "enable_dp_attention",
    "enable_dp_lm_head",
    "moe_dense_tp_size",
    "moe_runner_backend",
    "moe_a2a_backend",
    "disable_shared_experts_fusion",
    "ep_num_redundant_experts",
    "moe_dp_size",
    "attn_cp_size",
    "shared_experts_tp_size",
    "enable_shared_experts_attn_tp",
    "speculative_moe_runner_backend",
    "speculative_moe_a2a_backend",
    "speculative_algorithm",
    "speculative_draft_model_quantization",
    "speculative_enable_w4a4_mxfp4_megamoe",
    "enforce_shared_experts_fusion",
    "enable_w4a4_mxfp4_megamoe",
    "fp8_gemm_runner_backend",
    "fp4_gemm_runner_backend",
    "bf16_gemm_backend",
    "kv_cache_dtype",
    "quantization_param_path",
    "rl_quant_profile",
    "enable_fp32_lm_head",
)
"""Server arguments that change which bytes a rank holds or how they are laid out."""

_HANDLES: dict[Hashable, ReplicaHandle] = {}
_LOCK = threading.Lock()


def config_path(server_info: Mapping[str, Any], model_path: str | None) -> Path:
    """The HF config.json this trainer reads for an engine's model."""
    path = Path(model_path or server_info.get("model_path", ""))
    candidate = path / "config.json" if path.is_dir() else path
    if not candidate.is_file():
        raise ConfigError(
            f"cannot read the engine's model config at {str(path)!r} from this trainer; pass "
            f"EngineEndpoint(url, model_path=<local folder or config.json of the same model>)"
        )
    return candidate


def replica_for(
    server_info: Mapping[str, Any],
    engine_rank: int,
    model_path: str | None = None,
    role: str = "target",
) -> ReplicaHandle:
    """The process-wide replica handle for ``engine_rank`` of an engine serving ``server_info``.

    ``role="draft"``: the rank's same-model speculative draft runner.
    """
    from p2pweights.replica.ranks import RankSpec

    path = config_path(server_info, model_path)
    spec = RankSpec.from_server_info(dict(server_info), engine_rank)
    layout_args = tuple((k, _hashable(server_info.get(k))) for k in LAYOUT_SERVER_ARGS)
    key = (hashlib.sha256(path.read_bytes()).hexdigest(), spec, layout_args, role)
    with _LOCK:
        handle = _HANDLES.get(key)
        if handle is None:
            handle = _HANDLES[key] = ReplicaHandle(key, path, dict(server_info), spec, role)
    return handle


def _quantizable(spec: InputSpec) -> bool:
    return len(spec.shape) >= 2 and spec.dtype.is_floating_point and spec.dtype != FP8


def _hashable(value: Any) -> Hashable:
    return json.dumps(value, sort_keys=True, default=str)


@dataclass(eq=False)
class ReplicaHandle:
    """One shard layout: its replica (built on first use) and its loader probe."""

    key: Hashable
    config_path: Path
    server_info: dict[str, Any]
    spec: Any
    role: str = "target"
    _replica: Any = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def replica(self) -> Any:
        with self._lock:
            if self._replica is None:
                from p2pweights.replica.sglang.model_replica import ModelReplica

                self._replica = ModelReplica.from_server_info(
                    self.config_path, self.server_info, self.spec, self.role
                )
            return self._replica

    def param_bytes(self, name: str) -> int:
        return int(self.replica.param_layouts[name].num_bytes)

    def group_sizes(self, group: ParamGroup) -> dict[str, int]:
        """Parameter name -> bytes, for the parameters of ``group``."""
        return {name: self.param_bytes(name) for name in group.param_names}

    def group_bytes(self, group: ParamGroup) -> int:
        """Staging bytes ``group`` takes, alignment included."""
        return staged_bytes(self.group_sizes(group).values())

    def check_published(self, pub: RankPublication) -> None:
        """Refuse an engine rank whose published parameters differ from this replica's."""
        layouts = self.replica.param_layouts
        where = f"engine {pub.engine_url} rank {pub.engine_rank}"
        if pub.role != "target":
            where += f" ({pub.role})"
        for name, layout in layouts.items():
            region = pub.regions.get(name)
            if region is None and name in self.replica.optional_params:
                continue  # never written (e.g. a draft's head, shared with the target)
            if region is None:
                raise LayoutMismatchError(
                    f"{where} did not publish parameter {name!r} that its sglang layout has; "
                    f"is the trainer's model config the engine's?"
                )
            if region.num_bytes != layout.num_bytes:
                raise LayoutMismatchError(
                    f"{where} parameter {name!r}: engine published {region.num_bytes} bytes, the "
                    f"replica lays out {layout.num_bytes} ({tuple(layout.shape)}, {layout.dtype}); "
                    f"the trainer's sglang build, model config or server args differ from the "
                    f"engine's"
                )
        extra = sorted(set(pub.regions) - set(layouts))
        if extra:
            raise LayoutMismatchError(
                f"{where} published parameters the replica does not have: {', '.join(extra[:8])}"
            )

    def check_writable(self, groups: Sequence[ParamGroup], pubs: Sequence[RankPublication]) -> None:
        """Before any write: every parameter these groups stage has a published region.

        ``check_published`` lets a parameter the update need not feed go unpublished
        (a draft's shared head); if this update's inputs do feed one, refuse it here.
        """
        for pub in pubs:
            for group in groups:
                missing = [name for name in group.param_names if name not in pub.regions]
                if missing:
                    raise LayoutMismatchError(
                        f"{pub.where} did not publish parameter(s) {missing}, which this "
                        f"update's HF tensors {sorted(group.hf_names)[:4]} feed; nothing written"
                    )

    def checkpoint_format(self, inputs: Mapping[str, InputSpec]) -> CheckpointFormat:
        """How this layout's loaders want the trainer's tensors (see ``convert``)."""
        from p2pweights.replica.sglang.probe import HfTensorSpec

        fmt = BlockFp8Format.from_quantization_config(self.replica.quantization_config)
        if fmt is None:
            return AS_GIVEN
        # sglang's loaders refuse to downcast, so every matrix is probed as fp8 (an
        # upcast into a high-precision parameter is allowed): the probe then says
        # which names this engine holds in fp8.
        specs = [
            HfTensorSpec(name, s.shape, FP8 if _quantizable(s) else s.dtype)
            for name, s in inputs.items()
        ]
        feeds = self.replica.loader_map(specs).feeds
        dtypes = {name: layout.dtype for name, layout in self.replica.param_layouts.items()}
        return QuantizeToBlockFp8.choose(fmt, inputs, feeds, dtypes)

    def groups(self, inputs: Mapping[str, InputSpec]) -> list[ParamGroup]:
        """Parameter groups for these HF inputs (the replica caches the probe).

        Raises ``ConfigError`` if some parameter of this layout is fed by none of the
        inputs: it would keep stale bytes while the update reports success.
        """
        from p2pweights.replica.sglang.probe import HfTensorSpec

        specs = [HfTensorSpec(name, s.shape, s.dtype) for name, s in inputs.items()]
        loader_map = self.replica.loader_map(specs)
        unfed = [p for p in loader_map.unfed_params if p not in self.replica.optional_params]
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
        return [ParamGroup(g.hf_names, g.param_names) for g in loader_map.groups]

    def load_into(
        self, inputs: Sequence[tuple[str, torch.Tensor]], views: Mapping[str, torch.Tensor]
    ) -> None:
        self.replica.load_into(list(inputs), dict(views))
