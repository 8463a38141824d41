"""Configuration objects: what a user sets, validated once, frozen afterwards.

``SGLANG_REMOTE_INSTANCE_NIXL_BACKEND`` fills ``NixlConfig.backend`` when it is left unset
(through ``p2pweights.environment``, the one module that reads environment variables).
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    SecretStr,
    SerializeAsAny,
    TypeAdapter,
    ValidationError,
    field_validator,
)

from p2pweights import environment, transport_registry
from p2pweights.errors import ConfigError

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from typing_extensions import Self

_FROZEN = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)
"""Frozen, no unknown fields, and each field's docstring as its ``description``."""
_BYTE_SIZE: TypeAdapter[ByteSize] = TypeAdapter(ByteSize)
_SIZE = re.compile(r"\s*\d+(\.\d+)?\s*([KMGT]i?B|B)?\s*", re.IGNORECASE)
"""The spellings a size may take (tests/unit/test_byte_sizes.py lists them). pydantic's
``ByteSize`` reads more (PB, EiB, bits, ".5GiB") and only a prefix ("512MiB of it"): it
does the arithmetic, on text this grammar accepted."""


def parse_bytes(value: int | str) -> int:
    """``536870912``, ``"512MiB"``, ``"1GiB"`` or ``"1.5GB"`` as a number of bytes
    (B and K, M, G, T with B or iB: KB is 1000 bytes, KiB 1024; case is ignored)."""
    if isinstance(value, bool):
        raise ValueError("a size must be a number of bytes or a string such as '512MiB'")
    if isinstance(value, int):
        return value
    text = str(value)
    try:
        if _SIZE.fullmatch(text) is None:
            raise ValueError(text)
        return int(_BYTE_SIZE.validate_python(text))
    except ValueError as exc:  # pydantic's ValidationError is one
        raise ValueError(
            f"cannot read {value!r} as a size; use e.g. 536870912, '512MiB' or '1GiB'"
        ) from exc


class _Config(BaseModel):
    """Validation errors surface as ``ConfigError`` (one error tree for users to catch)."""

    model_config = _FROZEN

    def __init__(self, **data: object) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigError(f"invalid {type(self).__name__}: {_without_links(exc)}") from exc

    def __setattr__(self, name: str, value: object) -> None:
        try:
            super().__setattr__(name, value)
        except ValidationError as exc:
            raise ConfigError(f"{type(self).__name__} is frozen: {_without_links(exc)}") from exc

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: object) -> None:
        """Each field and its docstring under the class's own, for ``help()``."""
        super().__pydantic_init_subclass__(**kwargs)
        fields = [
            f"{name}\n    " + (field.description or "").replace("\n", "\n    ")
            for name, field in cls.model_fields.items()
            if name != "kind"
        ]
        cls.__doc__ = (cls.__doc__ or "") + "\n\nFields:\n\n" + "\n\n".join(fields)


def _without_links(exc: ValidationError) -> str:
    """pydantic's message without its "For further information visit <url>" lines."""
    lines = str(exc).splitlines()
    return "\n".join(line for line in lines if "For further information visit" not in line)


class TransportConfigBase(_Config):
    """The base of every transport's config: ``kind`` is the name it is registered under
    (``p2pweights.transports.register_transport``). A transport of your own derives its
    config from this class, with ``kind: Literal["my_name"] = "my_name"`` and its own fields."""

    model_config = _FROZEN

    kind: str


class MooncakeConfig(TransportConfigBase):
    """Write over the Mooncake transfer engine (the transport sglang publishes for)."""

    model_config = _FROZEN

    kind: Literal["mooncake"] = "mooncake"
    protocol: Literal["rdma", "tcp", "auto"] = "rdma"
    """"rdma" on clusters with RDMA NICs (a host where Mooncake finds none is refused when
    the transport starts, at connect); "tcp" where there are none (tests, one host);
    "auto" takes RDMA where Mooncake finds a device and TCP elsewhere, with a warning.
    ``UpdateReport`` names the protocol used."""
    device_name: str = ""
    """RDMA device(s), e.g. "mlx5_0"; empty lets Mooncake choose."""
    local_hostname: str = "127.0.0.1"
    """The address other hosts reach this trainer's transfer engine at."""


class NixlConfig(TransportConfigBase):
    """Write over NIXL (engines publishing with the NIXL plugin or sglang PR #35712)."""

    model_config = _FROZEN

    kind: Literal["nixl"] = "nixl"
    backend: str = Field(default_factory=environment.nixl_backend)
    """The NIXL plugin; defaults to $SGLANG_REMOTE_INSTANCE_NIXL_BACKEND, else "UCX"."""


class CudaIpcConfig(TransportConfigBase):
    """Write into engines on the trainer's own host by device copies (CUDA IPC, NVLink).

    Each engine rank's GPU memory is opened once, at connect, in the trainer GPU's own
    context; every write is a device copy on the writer's stream. Engines on other
    hosts are refused at connect (use Mooncake or NIXL for them). Stage on the device
    (``WeightSyncSession(config, staging_device="cuda:N")``) for NVLink speed; pinned
    host staging also works.
    """

    model_config = _FROZEN

    kind: Literal["cuda_ipc"] = "cuda_ipc"
    device: int | None = None
    """The trainer GPU that issues the copies; defaults to the process's current device."""
    direct: bool = True
    """Engine memory on that same GPU (colocated training and rollout) is filled by the
    loaders directly, with no staging copy; False stages it like any other."""


TransportConfig = TransportConfigBase
"""Any registered transport's config (the built-ins: ``MooncakeConfig``, ``NixlConfig``,
``CudaIpcConfig``)."""


def _transport_config(value: object) -> object:
    """A transport config from a config or a mapping with ``kind`` (default "mooncake"),
    through the transport registry; refuses a kind nobody registered."""
    if isinstance(value, TransportConfigBase):
        registered = transport_registry.config_class(value.kind)
        if not isinstance(value, registered):
            raise ValueError(
                f"transport {value.kind!r} is registered with {registered.__name__}, not "
                f"{type(value).__name__}"
            )
        return value
    if isinstance(value, Mapping):
        kind = str(value.get("kind", "mooncake"))
        cls = transport_registry.config_class(kind)
        return cls(**{k: v for k, v in value.items() if k != "kind"}, kind=kind)
    raise ValueError(
        f"transport must be a transport config (MooncakeConfig(...), ...) or a mapping "
        f"with 'kind', got {type(value).__name__}"
    )


class DeltaConfig(_Config):
    """Delta updates: after a first full update, each engine rank that received the
    previous update whole gets only the elements that changed (index and new value),
    written into the scratch region it publishes and applied there before its
    ``end_weight_update``. A parameter whose delta would not be smaller, or would not fit
    the rank's scratch region, is written in full, as is every parameter of a rank that
    did not get the previous update whole (and everything after a failed update).

    The sender keeps a copy of every byte it staged, once per shard layout: as much
    memory as one update loads (``UpdateReport`` and the log say how much)."""

    model_config = _FROZEN

    store: Literal["staging", "host"] = "staging"
    """Where the copy of the previous update's bytes lives: beside the staging buffers
    (on their GPU with ``WeightSyncSession(config, staging_device="cuda:N")``), or in
    host memory (compared there after a copy to the staging device)."""
    max_fraction: float = 0.3
    """A parameter with more than this share of its elements changed is written in full
    (bf16 deltas take 6 bytes per changed element: at a third they are no smaller)."""
    mode: Literal["auto", "always"] = "auto"
    """``"auto"``: each update goes as a delta only where the costs earlier updates measured
    (comparing per byte, writing per byte, the share a delta sent) predict it faster than
    writing every byte, else in full without comparing (a delta is probed again now and
    then; ``delta.policy``); ``UpdateReport.delta`` says what was decided and why.
    ``"always"``: every update after the first is a delta wherever an engine rank holds
    the previous update, whatever it costs."""
    objective: Literal["update", "pause"] = "update"
    """What ``mode="auto"`` minimises: ``"update"``, the seconds of ``update()``; ``"pause"``,
    the seconds the engines stand paused (only the compare done while they are paused
    counts: the first staging buffer's runs while they still generate). A delta at a
    small learning rate often pauses the engines less even where the whole update takes
    longer. ``UpdateReport.delta.decision`` names the objective."""

    @field_validator("max_fraction")
    @classmethod
    def _fraction(cls, value: float) -> float:
        if not 0 < value <= 1:
            raise ValueError(f"max_fraction must be in (0, 1], got {value}")
        return value


class TrainerTopology(_Config):
    """Where this trainer process stands among the processes that send weights: facts of
    the run, not choices. ``WeightSyncSession.from_torch_distributed`` builds it from
    ``torch.distributed``; the default is one process sending every weight.

    ``WeightSyncSession(config, topology=TrainerTopology(rank=r, num_ranks=n))`` for
    ``n`` ranks holding the same weights (engine ranks are split among them; rank 0 of
    stage 0 drives the engines' update session)."""

    model_config = _FROZEN

    rank: int = 0
    """This process's rank among the trainer ranks that send the same weights (its
    pipeline stage's ranks)."""
    num_ranks: int = 1
    """How many trainer ranks send the same weights; engine ranks are split among them.
    With pipeline stages: the ranks of one stage."""
    pipeline_stage: int = 0
    """This process's pipeline stage. Each stage is its own group of sending ranks: it
    sends only its own parameters, to every engine rank."""
    num_pipeline_stages: int = 1
    """How many pipeline stages send (disjoint parameters each); every stage has
    ``num_ranks`` ranks."""

    @field_validator("num_ranks", "num_pipeline_stages")
    @classmethod
    def _at_least_one(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"rank and stage counts must be at least 1, got {value}")
        return value

    def model_post_init(self, _context: object) -> None:
        if not 0 <= self.rank < self.num_ranks:
            raise ConfigError(f"rank {self.rank} is outside 0..{self.num_ranks - 1}")
        if not 0 <= self.pipeline_stage < self.num_pipeline_stages:
            raise ConfigError(
                f"pipeline_stage {self.pipeline_stage} is outside 0..{self.num_pipeline_stages - 1}"
            )


def _topology_fields(topology: TrainerTopology) -> dict[str, int]:
    """``topology`` under the names of ``SyncConfig``'s copy of it."""
    return {
        "trainer_rank": topology.rank,
        "num_trainer_ranks": topology.num_ranks,
        "pipeline_stage": topology.pipeline_stage,
        "num_pipeline_stages": topology.num_pipeline_stages,
    }


class Timeouts(_Config):
    """How long, in seconds, each kind of engine call or write may take before the update
    fails (grouped as httpx groups its timeouts). ``SyncConfig(timeouts=Timeouts(...))``;
    a mapping such as ``{"transfer": 120}`` is read as one too."""

    model_config = _FROZEN

    transfer: float = 30.0
    """A write still running after this many seconds fails the update (that engine rank;
    the others go on). Also how long a write given up on, still in flight, is waited for
    before the next update or ``abort()`` goes on."""
    control: float = 15.0
    """Bound on each update-session call that does no work on the weights (pause, flush,
    begin, version, continue): a hung engine outside the writes fails the update after this
    long (its state is then unknown and asked again before it is written).
    ``end_weight_update`` re-processes the model and has its own bound, ``end_update``."""
    read: float = 60.0
    """Bound on reading what an engine serves (server info, published weights at connect)
    and on the weight checker (which hashes every weight)."""
    end_update: float | None = None
    """Bound on each engine's ``end_weight_update``, where it re-processes every weight
    (derived weights, kernel layouts: seconds for a large fp8 MoE). Unset (None), it takes
    ``read`` (which bounded it before it had its own setting)."""

    @field_validator("transfer", "control", "read", "end_update")
    @classmethod
    def _positive(cls, value: float | None) -> float | None:
        if value is not None and value <= 0:
            raise ValueError(f"timeouts must be positive, got {value}")
        return value

    @property
    def end_update_bound(self) -> float:
        """What bounds ``end_weight_update``: ``end_update``, or ``read`` where unset."""
        return self.read if self.end_update is None else self.end_update


class SyncConfig(_Config):
    """Everything a ``WeightSyncSession`` needs besides the engines and the tensors."""

    model_config = _FROZEN

    transport: SerializeAsAny[TransportConfigBase] = Field(default_factory=MooncakeConfig)
    """How bytes move: ``MooncakeConfig(...)``, ``NixlConfig(...)`` or, for engines on the
    trainer's host, ``CudaIpcConfig(...)``; or a registered transport's config
    (``p2pweights.transports.register_transport``)."""
    buffer_bytes: int = 512 * 2**20
    """Size of each of the two staging buffers (grown to the largest parameter group)."""
    timeouts: Timeouts = Field(default_factory=Timeouts)
    """How long each kind of engine call or write may take: ``Timeouts(transfer=...,
    control=..., read=..., end_update=...)``, in seconds. (Was the four fields
    ``transfer_timeout_s``, ``control_timeout_s``, ``http_timeout_s`` and
    ``end_update_timeout_s``, still accepted with a ``DeprecationWarning``.)"""
    pause_mode: Literal["retract", "abort", "in_place", "caller"] = "retract"
    """How engines pause generation before the update (sglang's /pause_generation mode).
    "caller": the caller pauses every engine before ``update()`` (so that sglang can flush
    its cache: no request running) and resumes it after; p2pweights still opens, writes,
    checks, versions and closes each engine, and refuses, before any engine changes, an
    update where one says it is generating (where it reports its state). The caller pauses
    with sglang's "abort" or "retract" mode, not "in_place": p2pweights flushes the cache,
    which sglang refuses while requests run (an in_place pause keeps them), so the update
    would fail after ``timeouts.control``. verl's own checkpoint manager and slime work
    so (both pause with "abort")."""
    stage_before_pause: bool = True
    """Read, check and convert the inputs and load the first staging buffer while the
    engines still generate, pausing them only right before the first write (with several
    sending ranks and an iterator, which may run collectives as it is read, they pause
    first whatever this says). False pauses them before the inputs are read."""
    verify_with_weight_checker: bool = False
    """Verify the first update with each engine's own weight checker (sglang's
    ``/weights_checker``): snapshot its weights, reset them, update, compare. The first
    update must then send the weights the engine started with. (Was
    ``check_weight_update_equal``.)"""
    verify_writes: Literal["auto", "always", "off"] = "auto"
    """Check that every engine rank holds exactly the bytes staged for it: by write
    digests where the engine records them (the local engine and sglang with the p2pweights
    plugin, unless started with ``P2PWEIGHTS_WRITE_DIGESTS=0``: each rank's digest of
    every parameter, taken right before ``end_weight_update``, compared after it), else
    through sglang's own ``/weights_checker`` checksums (sglang 0.5.23 or later, asked
    after the writes and before ``end_weight_update``; for a GPU engine the trainer needs
    CUDA to compute the same hash). A mismatch fails the update and leaves that engine
    paused, torn, until an update passes. "auto": every engine either way can check; the
    others are skipped with one log line each. "always": such an engine is refused at
    ``connect``, naming both settings. "off": nothing is checked (not with ``delta``).
    ``UpdateReport.engines[url].verified_by`` says how each engine was checked; see
    docs/reliability.md ("Verified writes") for what each sees and costs."""
    digest_as_written: bool = False
    """With write digests: after each flush's writes into an engine rank landed, tell the
    rank which parameters did (a one-byte flag each, written into a region the rank
    publishes), so it digests them while the rest is still written and only the last
    flush's parameters are read inside ``end_weight_update``. What it gives up: a byte a
    parameter gets after its flag and before the end (a write landing late, memory
    changed behind the writes) is not seen. Not for delta updates (the engine changes
    parameters at the end). Off: every parameter is digested at the end."""
    delta: DeltaConfig | None = None
    """Send only what changed since the previous update (``DeltaConfig(...)``); None
    (the default) writes every byte every update. Delta updates need verified engines:
    an engine rank applies the payload itself before its end, and only its write digests
    show what it applied, so ``connect`` refuses an engine that records none (released
    sglang without the plugin, or one started with ``P2PWEIGHTS_WRITE_DIGESTS=0``;
    sglang's ``/weights_checker`` looks before the payload is applied and cannot serve)
    and ``verify_writes="off"`` is refused here (``SyncConfig.verification_policy``)."""
    verify_finite_inputs: bool = False
    """Refuse, before it is staged, any tensor holding NaN or Inf (reads every byte once
    more, on the tensor's own device). Off by default: on a 2-core CPU the check alone
    takes 47-65 ms for 383 MB, hidden behind the writes of a 0.5 s update there (0.99-1.01
    of the update without it), but its cost on a GPU update (tens of milliseconds for
    gigabytes) is not measured yet; ``UpdateReport.inputs_checked_finite`` and the summary
    say when inputs went unchecked. (Was ``check_finite``.)"""
    allow_sglang_mismatch: bool = False
    """Connect to engines whose sglang release differs from the trainer's (a warning
    instead of an error; the replica runs the trainer's copy of sglang's model code)."""
    api_key: SecretStr | None = None
    """Sent as ``Authorization: Bearer <key>`` when the engines require one. Give a plain
    string; it is kept as a ``pydantic.SecretStr``, shown as ``**********`` in every repr,
    dump and log (``api_key.get_secret_value()`` reads it)."""
    trainer_rank: int = 0
    """The session's copy of ``TrainerTopology.rank``. Deprecated as a setting (a fact of
    the run, not a choice): pass ``WeightSyncSession(config, topology=...)``."""
    num_trainer_ranks: int = 1
    """The session's copy of ``TrainerTopology.num_ranks`` (deprecated as a setting)."""
    pipeline_stage: int = 0
    """The session's copy of ``TrainerTopology.pipeline_stage`` (deprecated as a setting)."""
    num_pipeline_stages: int = 1
    """The session's copy of ``TrainerTopology.num_pipeline_stages`` (deprecated as a
    setting)."""

    @field_validator("transport", mode="before")
    @classmethod
    def _registered_transport(cls, value: object) -> object:
        return _transport_config(value)

    @field_validator("buffer_bytes", mode="before")
    @classmethod
    def _read_size(cls, value: int | str) -> int:
        size = parse_bytes(value)
        if size < 2**20:
            raise ValueError(f"buffer_bytes must be at least 1 MiB, got {size}")
        return size

    def __init__(self, **data: Any) -> None:
        super().__init__(**_renamed(data, Timeouts(), stacklevel=4))

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """A copy with ``update``'s fields replaced, renamed and deprecated ones read and
        warned about as ``SyncConfig(...)`` does (pydantic's copy does not validate)."""
        if update:
            update = _renamed(dict(update), self.timeouts, stacklevel=4)
        return super().model_copy(update=update, deep=deep)

    @property
    def check_weight_update_equal(self) -> bool:
        """Deprecated: ``verify_with_weight_checker``."""
        _warn_renamed("check_weight_update_equal", stacklevel=3)
        return self.verify_with_weight_checker

    @property
    def check_finite(self) -> bool:
        """Deprecated: ``verify_finite_inputs``."""
        _warn_renamed("check_finite", stacklevel=3)
        return self.verify_finite_inputs

    @property
    def transfer_timeout_s(self) -> float:
        """Deprecated: ``timeouts.transfer``."""
        _warn_timeout("transfer_timeout_s", stacklevel=3)
        return self.timeouts.transfer

    @property
    def control_timeout_s(self) -> float:
        """Deprecated: ``timeouts.control``."""
        _warn_timeout("control_timeout_s", stacklevel=3)
        return self.timeouts.control

    @property
    def http_timeout_s(self) -> float:
        """Deprecated: ``timeouts.read``."""
        _warn_timeout("http_timeout_s", stacklevel=3)
        return self.timeouts.read

    @property
    def end_update_timeout_s(self) -> float | None:
        """Deprecated: ``timeouts.end_update``."""
        _warn_timeout("end_update_timeout_s", stacklevel=3)
        return self.timeouts.end_update

    @field_validator("num_trainer_ranks", "num_pipeline_stages")
    @classmethod
    def _at_least_one(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"rank and stage counts must be at least 1, got {value}")
        return value

    def model_post_init(self, _context: object) -> None:
        if not 0 <= self.trainer_rank < self.num_trainer_ranks:
            raise ConfigError(
                f"trainer_rank {self.trainer_rank} is outside 0..{self.num_trainer_ranks - 1}"
            )
        if not 0 <= self.pipeline_stage < self.num_pipeline_stages:
            raise ConfigError(
                f"pipeline_stage {self.pipeline_stage} is outside 0..{self.num_pipeline_stages - 1}"
            )
        if self.delta is not None and self.verify_writes == "off":
            raise ConfigError(
                "delta updates need verified engines (verify_writes 'auto' or 'always', "
                "and engines that record write digests): a payload an engine rank refuses "
                "(an update it does not hold) is reported only through its write digests"
            )
        if self.delta is not None:  # a policy connect enforces: said here, where it is chosen
            logger.info("p2pweights SyncConfig: %s", self.verification_policy)
        if self.delta is not None and self.num_pipeline_stages > 1:
            raise ConfigError(
                "delta updates write one payload per engine rank, but pipeline stages each "
                "write every engine rank; use delta=None with num_pipeline_stages > 1"
            )

    @property
    def verification_policy(self) -> str:
        """What ``verify_writes`` (and ``delta``) mean for the engines ``connect`` takes, in
        one sentence (logged when a config with ``delta`` is made)."""
        if self.verify_writes == "off":
            return "verify_writes='off': no engine's writes are checked"
        if self.delta is not None:
            return (
                "delta updates need verified engines: every engine must record write "
                "digests (the p2pweights sglang plugin or local engine, not started with "
                "P2PWEIGHTS_WRITE_DIGESTS=0); connect refuses any other engine"
            )
        ways = (
            "by write digests where the engine records them, else by sglang's own "
            "/weights_checker (sglang >= 0.5.23; CUDA on the trainer for a GPU engine)"
        )
        if self.verify_writes == "always":
            return (
                f"every engine's writes are checked {ways}; connect refuses an engine "
                f"neither can check"
            )
        return (
            f"every engine's writes are checked {ways}; an engine neither can check is "
            f"updated unverified, warned about once per session"
        )

    @property
    def protocol(self) -> str:
        """What the transport was configured to write over: Mooncake's protocol (maybe
        "auto"), NIXL's backend, or "device copy" for CUDA IPC. Reports name what the
        transport writes over once set up (``Transport.protocol``), this where it says none."""
        transport = self.transport
        if isinstance(transport, MooncakeConfig):
            return transport.protocol
        if isinstance(transport, NixlConfig):
            return transport.backend
        if isinstance(transport, CudaIpcConfig):
            return "device copy"
        return str(getattr(transport, "protocol", "") or transport.kind)

    @property
    def topology(self) -> TrainerTopology:
        """Where the session that holds this config stands among the sending ranks."""
        return TrainerTopology(
            rank=self.trainer_rank,
            num_ranks=self.num_trainer_ranks,
            pipeline_stage=self.pipeline_stage,
            num_pipeline_stages=self.num_pipeline_stages,
        )

    def with_topology(self, topology: TrainerTopology) -> SyncConfig:
        """This config as a session standing at ``topology`` holds it."""
        # a copy, not __init__: no deprecation warning; and the fields a user set stay the
        # only ones set (a copy's update marks its fields set, as a user's would be)
        config = super().model_copy(update=_topology_fields(topology))
        object.__setattr__(config, "__pydantic_fields_set__", set(self.model_fields_set))
        config.model_post_init(None)
        return config

    @property
    def num_senders(self) -> int:
        """Every sending trainer rank, of every pipeline stage (the ranks that ``agree``)."""
        return self.num_trainer_ranks * self.num_pipeline_stages

    @property
    def leads(self) -> bool:
        """Whether this rank drives the engines' update session (stage 0's trainer rank 0)."""
        return self.trainer_rank == 0 and self.pipeline_stage == 0


_RENAMED = {
    "check_weight_update_equal": "verify_with_weight_checker",
    "check_finite": "verify_finite_inputs",
}
"""``SyncConfig`` fields renamed in 0.2 (issue 30): old name -> new; the old one is still
accepted, with a ``DeprecationWarning``, until the release after."""


_TIMEOUTS = {
    "transfer_timeout_s": "transfer",
    "control_timeout_s": "control",
    "http_timeout_s": "read",
    "end_update_timeout_s": "end_update",
}
"""``SyncConfig``'s timeout fields before ``Timeouts`` grouped them (issue 42): old field ->
``Timeouts`` field; the old one is still accepted, with a ``DeprecationWarning``, until the
release after."""

_TOPOLOGY_FIELDS = ("trainer_rank", "num_trainer_ranks", "pipeline_stage", "num_pipeline_stages")
_ONE_SENDER = {
    "trainer_rank": 0,
    "num_trainer_ranks": 1,
    "pipeline_stage": 0,
    "num_pipeline_stages": 1,
}


def _warn_renamed(old: str, stacklevel: int) -> None:
    warnings.warn(
        f"SyncConfig.{old} is now SyncConfig.{_RENAMED[old]}; the old name goes in the "
        "next release",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def _warn_timeout(old: str, stacklevel: int) -> None:
    warnings.warn(
        f"SyncConfig.{old} is now SyncConfig.timeouts.{_TIMEOUTS[old]} "
        f"(SyncConfig(timeouts=Timeouts({_TIMEOUTS[old]}=...))); the old field goes in the "
        "next release",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def _renamed(data: dict[str, Any], timeouts: Timeouts, stacklevel: int) -> dict[str, Any]:
    """``SyncConfig``'s keyword arguments with renamed fields under their new names (each
    old name warns; the deprecated topology fields warn too). The old timeout fields are
    read into ``timeouts`` (those the config had: defaults, or a copied config's)."""
    data = dict(data)
    old_timeouts = {old: data.pop(old) for old in _TIMEOUTS if old in data}
    if old_timeouts:
        for old in old_timeouts:
            _warn_timeout(old, stacklevel)
        if "timeouts" in data:
            raise ConfigError(
                f"SyncConfig got both timeouts and {', '.join(old_timeouts)}; give only "
                "timeouts=Timeouts(...)"
            )
        try:
            kept = {name: getattr(timeouts, name) for name in timeouts.model_fields_set}
            kept.update({_TIMEOUTS[old]: value for old, value in old_timeouts.items()})
            data["timeouts"] = Timeouts(**kept)
        except ConfigError as exc:
            raise ConfigError(f"invalid SyncConfig: {exc}") from exc
    # a dumped config holds them too: only values other than one sending process warn
    given = [
        name for name in _TOPOLOGY_FIELDS if data.get(name, _ONE_SENDER[name]) != _ONE_SENDER[name]
    ]
    if given:
        warnings.warn(
            f"SyncConfig({', '.join(given)}) is deprecated: where this process stands among "
            "the sending ranks is not a setting; pass WeightSyncSession(config, "
            "topology=TrainerTopology(...)) or use WeightSyncSession.from_torch_distributed "
            "(the fields go in the next release)",
            DeprecationWarning,
            stacklevel=stacklevel - 1,  # called here, not through _warn_renamed
        )
    for old, new in _RENAMED.items():
        if old in data:
            _warn_renamed(old, stacklevel)
            if new in data:
                raise ConfigError(f"SyncConfig got both {old} and {new}; give only {new}")
            data[new] = data.pop(old)
    return data
