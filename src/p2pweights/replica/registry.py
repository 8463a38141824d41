"""Replicas kept per shard layout for the whole trainer process.

Two engine ranks whose bytes are laid out the same way share one replica and one
loader probe, across engines and across reconnects: same model, same rank
parallelism, same runner, same byte-relevant server arguments (``layout_key``
says which count). sglang is imported when a handle is first asked for, and a
replica is built on first use.
"""

from __future__ import annotations

import functools
import hashlib
import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from p2pweights.errors import ConfigError, LayoutMismatchError
from p2pweights.replica.base import ParamLayout, Replica
from p2pweights.replica.layout_key import LayoutKey, layout_args
from p2pweights.replica.ranks import RankSpec
from p2pweights.source.checkpoint_format import CheckpointFormat
from p2pweights.source.fp8_block import SCALE_SUFFIX
from p2pweights.source.fp8_regions import Read
from p2pweights.source.inputs import InputSpec, ParamGroup
from p2pweights.wire.landed import flag_names
from p2pweights.wire.publication import RankPublication

__all__ = ["ReplicaHandle", "config_path", "replica_for"]

_HANDLES: dict[LayoutKey, ReplicaHandle] = {}
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
    from p2pweights.replica.sglang import compat
    from p2pweights.replica.sglang.env import server_args_names

    compat.check_sglang()
    path = config_path(server_info, model_path)
    spec = RankSpec.from_server_info(server_info, engine_rank)
    key = LayoutKey(
        config_sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
        rank=spec,
        role=role,
        sglang_version=compat.SGLANG_VERSION,
        server_args=layout_args(server_info, server_args_names()),
    )
    info = dict(server_info)
    with _LOCK:
        handle = _HANDLES.get(key)
        if handle is None:
            build = functools.partial(_sglang_replica, path, info, spec, role)
            handle = _HANDLES[key] = ReplicaHandle(key, build)
    return handle


def _sglang_replica(path: Path, server_info: dict[str, Any], spec: RankSpec, role: str) -> Replica:
    from p2pweights.replica.sglang.model_replica import ModelReplica

    return ModelReplica.from_server_info(path, server_info, spec, role)


@dataclass(eq=False)
class ReplicaHandle:
    """One shard layout: its replica, built on first use, and the checks against engines.

    What the rest of the library uses of a replica: its ``layouts``, the
    ``checkpoint_format`` and ``groups`` of the trainer's inputs, ``load_into``, and
    the check of what engines published (``check_published``; the byte plan checks
    every write of an update).
    """

    key: Hashable
    """Equal for ranks that share this replica (a ``LayoutKey`` for sglang replicas)."""
    build: Callable[[], Replica] = field(repr=False)
    """Makes the replica; called once, on first use."""
    _replica: Replica | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def replica(self) -> Replica:
        with self._lock:
            if self._replica is None:
                self._replica = self.build()
            return self._replica

    def peek(self) -> Replica:
        """The replica, without keeping one this handle has not built yet (the ``plan``
        command reads each of hundreds of engine ranks' layouts once)."""
        with self._lock:
            replica = self._replica
        return replica if replica is not None else self.build()

    @property
    def layouts(self) -> Mapping[str, ParamLayout]:
        """Parameter name -> how the engine rank lays it out (shape, dtype, bytes)."""
        return self.replica.layouts

    def param_bytes(self, name: str) -> int:
        return int(self.layouts[name].num_bytes)

    def check_published(self, pub: RankPublication) -> None:
        """Refuse an engine rank whose published parameters differ from this replica's."""
        layouts = self.layouts
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
        extra = sorted(set(flag_names(pub.regions)) - set(layouts))  # no scratch, no flags
        if extra:
            raise LayoutMismatchError(
                f"{where} published parameters the replica does not have: {', '.join(extra[:8])}"
            )

    def checkpoint_format(self, inputs: Mapping[str, InputSpec]) -> CheckpointFormat:
        """How this layout's loaders want the trainer's tensors (see ``CheckpointFormat``)."""
        return self.replica.checkpoint_format(inputs)

    def trainer_feeds(self, inputs: Mapping[str, InputSpec]) -> dict[str, frozenset[str]]:
        """Per trainer input, the parameters its loader inputs write (a weight the
        engine holds in fp8 feeds its block scales too)."""
        engine = self.replica.feeds(self.checkpoint_format(inputs).engine_specs(inputs))
        return {
            name: engine.get(name, frozenset()) | engine.get(name + SCALE_SUFFIX, frozenset())
            for name in inputs
        }

    def groups(self, inputs: Mapping[str, InputSpec]) -> list[ParamGroup]:
        """Parameter groups for these HF inputs (the replica caches the probe).

        Raises ``ConfigError`` if some parameter of this layout is fed by none of the
        inputs: it would keep stale bytes while the update reports success.
        """
        return self.replica.groups(inputs)

    def written_spans(
        self, inputs: Mapping[str, InputSpec]
    ) -> dict[str, tuple[tuple[int, int], ...]]:
        """Per parameter, the byte ranges loading ``inputs`` alone writes (``Replica``)."""
        return self.replica.written_spans(inputs)

    def load_into(
        self, inputs: Sequence[tuple[str, torch.Tensor]], views: Mapping[str, torch.Tensor]
    ) -> None:
        """Write the bytes ``inputs`` make into ``views`` (param name -> flat uint8 view)."""
        self.replica.load_into(inputs, views)

    def input_reads(self) -> Mapping[str, list[Read] | None]:
        """What this rank's replayed loads read of each input (None: a loader still runs)."""
        return self.replica.input_reads()

    @property
    def replays_changed(self) -> int:
        """Moves whenever this rank's recorded loads change (``input_reads`` with them)."""
        return self.replica.replays_changed
