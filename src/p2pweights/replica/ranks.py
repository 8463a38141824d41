"""The parallelism of one engine rank: pure arithmetic, no sglang import.

Widths follow ``sglang.srt.runtime_context.derive_parallel_widths`` and ranks follow
``derive_spawn_ranks`` / ``derive_attention_ranks``; they are recomputed here so
planning code and the ``plan`` command need not import sglang.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from p2pweights.errors import ConfigError

__all__ = ["RankSpec"]


@dataclass(frozen=True, kw_only=True)
class RankSpec:
    """The parallelism of one engine rank, as sglang's parallel context states it.

    Widths follow ``sglang.srt.runtime_context.derive_parallel_widths`` and ranks
    follow ``derive_spawn_ranks`` / ``derive_attention_ranks``; they are recomputed
    here (pure arithmetic) so planning code need not import sglang.
    """

    tp_size: int
    """Tensor-parallel width of the engine (one PP stage)."""
    tp_rank: int
    """This rank's place in its TP group."""
    pp_size: int = 1
    pp_rank: int = 0
    attn_tp_size: int = 1
    """Attention TP width: ``tp_size // attn_dp_size // attn_cp_size``."""
    attn_tp_rank: int = 0
    attn_dp_size: int = 1
    """Attention data-parallel groups inside the TP group (DP attention)."""
    attn_dp_rank: int = 0
    attn_cp_size: int = 1
    attn_cp_rank: int = 0
    moe_ep_size: int = 1
    """Expert-parallel width (``ep_size``)."""
    moe_ep_rank: int = 0
    moe_tp_size: int = 1
    """MoE TP width: ``tp_size // moe_ep_size // moe_dp_size``."""
    moe_tp_rank: int = 0
    moe_dp_size: int = 1
    moe_dp_rank: int = 0
    dcp_size: int = 1
    """Decode context parallelism; its group is built only when wider than one."""
    dcp_rank: int = 0
    shared_experts_tp_size: int | None = None
    """Shared-expert TP width (Kimi-style); None leaves sglang's default."""

    @property
    def world_rank(self) -> int:
        """The engine-local world rank: ``tp_size * pp_rank + tp_rank``."""
        return self.tp_size * self.pp_rank + self.tp_rank

    @classmethod
    def derive(
        cls,
        *,
        tp_size: int,
        engine_rank: int,
        pp_size: int = 1,
        ep_size: int = 1,
        attn_dp_size: int = 1,
        attn_cp_size: int = 1,
        moe_dp_size: int = 1,
        dcp_size: int = 1,
        shared_experts_tp_size: int | None = None,
    ) -> RankSpec:
        """Derive every width and rank of engine rank ``engine_rank`` as sglang's launcher does.

        ``engine_rank`` is the rank's world rank inside one engine,
        ``tp_size * pp_rank + tp_rank`` (what sglang spawns it with).
        """
        for name, value in (
            ("tp_size", tp_size),
            ("pp_size", pp_size),
            ("ep_size", ep_size),
            ("attn_dp_size", attn_dp_size),
            ("attn_cp_size", attn_cp_size),
            ("moe_dp_size", moe_dp_size),
            ("dcp_size", dcp_size),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if not 0 <= engine_rank < tp_size * pp_size:
            raise ConfigError(
                f"engine rank {engine_rank} is not a rank of an engine with "
                f"tp_size {tp_size} x pp_size {pp_size}"
            )
        if tp_size % (attn_dp_size * attn_cp_size):
            raise ConfigError(
                f"tp_size {tp_size} is not divisible by attn_dp_size {attn_dp_size}"
                f" x attn_cp_size {attn_cp_size}"
            )
        if tp_size % (ep_size * moe_dp_size):
            raise ConfigError(
                f"tp_size {tp_size} is not divisible by ep_size {ep_size}"
                f" x moe_dp_size {moe_dp_size}"
            )
        tp_rank = engine_rank % tp_size
        attn_tp_size = tp_size // attn_dp_size // attn_cp_size
        attn_cp_rank = (tp_rank // attn_tp_size) % attn_cp_size
        moe_group = tp_size // moe_dp_size
        moe_tp_size = moe_group // ep_size
        # MoE-DP aliases the attention-CP group when CP is wider (runtime_context.publish).
        moe_dp_rank = attn_cp_rank if moe_dp_size < attn_cp_size else tp_rank // moe_group
        return cls(
            tp_size=tp_size,
            tp_rank=tp_rank,
            pp_size=pp_size,
            pp_rank=engine_rank // tp_size,
            attn_tp_size=attn_tp_size,
            attn_tp_rank=tp_rank % attn_tp_size,
            attn_dp_size=attn_dp_size,
            attn_dp_rank=tp_rank // (attn_tp_size * attn_cp_size),
            attn_cp_size=attn_cp_size,
            attn_cp_rank=attn_cp_rank,
            moe_ep_size=ep_size,
            moe_ep_rank=tp_rank % moe_group // moe_tp_size,
            moe_tp_size=moe_tp_size,
            moe_tp_rank=tp_rank % moe_tp_size,
            moe_dp_size=moe_dp_size,
            moe_dp_rank=moe_dp_rank,
            dcp_size=dcp_size,
            dcp_rank=tp_rank % dcp_size,
            shared_experts_tp_size=shared_experts_tp_size,
        )

    @classmethod
    def from_server_info(cls, server_info: Mapping[str, Any], engine_rank: int) -> RankSpec:
        """The spec of ``engine_rank`` of an engine whose ``GET /server_info`` is ``server_info``.

        Handles the deprecated spelling ``--dp-size N --enable-dp-attention``, which
        sglang resolves to ``attn_dp_size = N, dp_size = 1``. Data-parallel replicas
        (``dp_size`` without DP attention) are separate engines of identical layout,
        so ``engine_rank`` counts ranks of one replica.
        """

        def field(name: str, default: int) -> int:
            value = server_info.get(name)
            return default if value is None else int(value)

        attn_dp_size = field("attn_dp_size", 1)
        if attn_dp_size == 1 and server_info.get("enable_dp_attention"):
            attn_dp_size = field("dp_size", 1)
        shared = server_info.get("shared_experts_tp_size")
        return cls.derive(
            tp_size=field("tp_size", 1),
            engine_rank=engine_rank,
            pp_size=field("pp_size", 1),
            ep_size=field("ep_size", 1),
            attn_dp_size=attn_dp_size,
            attn_cp_size=field("attn_cp_size", 1),
            moe_dp_size=field("moe_dp_size", 1),
            dcp_size=field("dcp_size", 1),
            shared_experts_tp_size=None if shared is None else int(shared),
        )
