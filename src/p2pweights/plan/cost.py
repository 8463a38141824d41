"""What one update costs at cluster scale: lower bounds and a predicted time, pure arithmetic.

Two models, both stated as plain dataclasses so every assumption is a named number:

* ``LinkModel``: the links a byte crosses. Every GPU has one RDMA NIC (each direction),
  a host link (pinned host memory <-> device) and NVLink to the GPUs of its node.
  Trainer and engines are on different nodes, so every byte p2pweights writes crosses
  the sender's NIC and the receiver's NIC; staged in pinned host memory it also
  crosses the sender's host link (device -> host), once per layout it loads.
* ``PipelineModel``: how p2pweights' own pipeline spends time on those links (load
  into a staging buffer, two buffers overlapping load and write, one writer per engine
  rank, the update session's round trips), with its constants measured where they
  could be (the numbers and where they come from are in each field's docstring).

The lower bound of a P2P update is its busiest link's bytes over that link's rate:
``max(busiest sender's NIC, busiest receiver's NIC, busiest sender's host link)``.
A broadcast must bring the whole update to every engine GPU: at best over NVLink from
a node peer plus the GPU's own NIC, and into each engine node over its NICs; each
pipeline stage's source GPU sends its stage's bytes once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from p2pweights.errors import ConfigError

__all__ = [
    "NIXL_VS_NCCL",
    "Bound",
    "LinkModel",
    "PipelineModel",
    "Prediction",
    "ReceiverLoad",
    "SenderLoad",
    "broadcast_lower_bound",
    "delta_bytes",
    "p2p_lower_bound",
    "predict",
]

GB = 1e9

# Measured on 2 x H200 (NVLink NV18, one run each; docs/benchmarks-archive.md and the
# environment notes): a NIXL/UCX write of 4 GiB from GPU 0 into GPU 1, NCCL send/recv
# GPU 0 -> GPU 1, and p2pweights' staging pipeline over NIXL with device staging
# (16 flushes of 256 MiB, benchmarks/results/gpu_staging_h200x2.json).
H200_NIXL_WRITE_GBPS = 266.0
H200_NCCL_SEND_RECV_GBPS = 357.0
H200_PIPELINE_S = 0.019767  # 4 GiB, device staging, median of 5
H200_PIPELINE_CEILING_GBPS = 263.79  # one 4 GiB NIXL write in the same run
H200_PIPELINE_FLUSHES = 16
H200_DEVICE_COPY_GBPS = 1920.0  # a device-to-device copy inside one H200
NIXL_VS_NCCL = H200_NIXL_WRITE_GBPS / H200_NCCL_SEND_RECV_GBPS


@dataclass(frozen=True, kw_only=True)
class LinkModel:
    """The links one update's bytes cross, per GPU (rates in GB/s, 1 GB = 1e9 bytes)."""

    nic_gbps: float = 50.0
    """RDMA per GPU, each direction: one 400 Gb/s NIC per GPU (the field's usual node)."""
    host_gbps: float = 55.0
    """Pinned host memory <-> device per GPU: 55.3 / 55.2 GB/s measured on H200 (PCIe Gen5)."""
    nvlink_gbps: float = H200_NCCL_SEND_RECV_GBPS
    """GPU to GPU inside a node: NCCL send/recv measured on 2 x H200 (the broadcast uses it)."""
    gpus_per_node: int = 8
    staging: Literal["host", "device"] = "host"
    """Where p2pweights stages bytes before writing them: pinned host memory (the
    library's default) or the sender's GPU (``staging_device="cuda:N"``)."""

    def __post_init__(self) -> None:
        for name in ("nic_gbps", "host_gbps", "nvlink_gbps"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.gpus_per_node < 1:
            raise ConfigError(f"gpus_per_node must be at least 1, got {self.gpus_per_node}")
        if self.staging not in ("host", "device"):
            raise ConfigError(f"staging must be 'host' or 'device', got {self.staging!r}")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class PipelineModel:
    """p2pweights' update pipeline, as time per stage; constants measured where possible."""

    buffer_bytes: int = 512 * 2**20
    """Each of the two staging buffers (``SyncConfig.buffer_bytes``' default)."""
    transport_efficiency: float = 1.0
    """Share of a link's rate (``LinkModel``) one of our writes reaches. On 2 x H200 a
    NIXL/UCX write moved 266 GB/s in the staging benchmark and 290-390 GB/s in the
    environment check, NCCL send/recv 357 GB/s, over the same NVLink pair: about the
    link's rate, so 1.0; ``NIXL_VS_NCCL`` (0.745, the lower reading) is the pessimistic
    alternative. Not measured over RDMA NICs (none here)."""
    device_copy_gbps: float = H200_DEVICE_COPY_GBPS
    """The staging copy with device staging: a device copy in one H200 (1,920 GB/s)."""
    loader_call_s: float = 12e-6
    """CPU time per HF tensor of a warm update's load with host staging: the loader's
    copies replayed one by one (``replica/sglang/replay.py``), measured on the 2-core
    development machine with kilobyte tensors (``benchmarks/replica.py loader``): 11-12
    us for Qwen3, Qwen3-MoE and DeepSeek-V3 (MLA); the first two updates run sglang's
    loaders (24-99 us). Assumed the same on a GPU host's CPU, where each GPU-to-pinned
    copy is queued one by one."""
    device_loader_call_s: float = 6.3e-6
    """The same with device staging, where a step's replayed copies run in one Triton
    launch (``gathered_copies.py``): on the H200 host, per HF tensor, copies included,
    3.1-6.3 us for a Qwen3-MoE replica (TP 4 and 1) and 5.1 us for a Kimi-K2-shaped fp8
    one (384 experts, TP 16) (``benchmarks/replica.py replay``,
    ``results/replay_cost_*_h200.json``); the highest taken. Replicas with few tensors per
    parameter group cost more (11.7 us at 4), which MoE rows hardly have."""
    quantize_gbps: float = 1700.0
    """Block-fp8 quantization on the sender (fp8 engines), GB/s of bf16 input, GPU time:
    the library's own call of the fused Triton kernel on an H200 took 1,674-2,091 GB/s
    for DeepSeek-V3 weight shapes, measured at 8 warps before the switch to 4 (the raw
    kernel at 4 warps 1,883-2,345;
    ``benchmarks/fp8.py kernel``); the lower reading is taken. torch's several
    passes ran at 95."""
    quantize_call_s: float = 10.4e-6
    """Host time per quantized HF tensor, measured on the H200 host with weights of one
    shape quantized in batches (one launch and two output allocations per batch, and
    the per-weight bookkeeping; ``benchmarks/fp8.py convert``: 8.8-10.4 us, the higher
    taken; one launch per weight took 36-49 us). Launches queue while earlier ones run,
    so a sender's quantization takes the longer of its host time and its GPU time."""
    flush_overhead_s: float = (
        H200_PIPELINE_S
        - (
            4 * 2**30 / (H200_PIPELINE_CEILING_GBPS * GB)
            + 4 * 2**30 / (H200_DEVICE_COPY_GBPS * GB) / H200_PIPELINE_FLUSHES
        )
    ) / H200_PIPELINE_FLUSHES
    """Per staging-buffer flush (synchronize, hand batches to the writers, wait for the
    other buffer): what the measured H200 pipeline took beyond this model's load/write
    overlap, per flush (about 0.2 ms)."""
    control_call_s: float = 0.059 / 7
    """One update-session call (pause, flush, begin, version, end, version, continue):
    the warm control plane measured against a local TP-4 engine (0.059 s for 7 calls)."""
    control_calls: int = 7
    control_parallel: int = 16
    """Engines whose update-session calls run at once (``engines.fleet.concurrently``)."""
    delta_host_gbps: float = 4.0
    """Delta updates with host staging: GB/s of staged bytes compared with the previous
    update's and copied over them (``delta.store``: 8-byte words compared, the differing
    ones' elements, the copy), plus ``delta_host_changed_s`` per changed element. Fitted
    to the H200 host's CPU (16 cores), 256 MiB of bf16: 2.21 GB/s at 2 % changed, 0.79 at
    10 % (``benchmarks/delta.py encode``, ``results/delta_encode_cost_h200.json``)."""
    delta_host_changed_s: float = 20.4e-9
    """Per changed element on the CPU (gathering its index and value), from the same fit."""
    delta_device_gbps: float = 620.0
    """The same on the staging GPU: an H200 compared and copied 2 GiB of bf16 at 429
    GB/s with 2 % changed and 192 GB/s with 10 % (same benchmark); fitted as 620 GB/s
    plus ``delta_device_changed_s`` per changed element."""
    delta_device_changed_s: float = 72e-12
    """Per changed element on the GPU, from the same fit."""
    engine_finish_s: float = 0.0
    """Engine-side work inside ``end_weight_update`` beyond one call (sglang's
    ``post_load_weights`` and ``process_weights_after_loading``); not measured here. The
    seed measured 0.884 s for Kimi-K2 in fp8 on H100."""

    def __post_init__(self) -> None:
        if self.buffer_bytes < 1:
            raise ConfigError(f"buffer_bytes must be positive, got {self.buffer_bytes}")
        if not 0 < self.transport_efficiency <= 1:
            raise ConfigError(
                f"transport_efficiency must be in (0, 1], got {self.transport_efficiency}"
            )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class SenderLoad:
    """What one sending trainer rank (one GPU) does in an update."""

    rank: int
    write_bytes: int
    """Bytes it writes (every target's)."""
    load_bytes: int
    """Bytes it stages (each layout once, however many targets share it)."""
    loader_inputs: int = 0
    """HF tensors its loaders read (each layout once)."""
    quantized_bytes: int = 0
    """bf16 bytes it quantizes to fp8: whole HF tensors (quantized before the loaders
    narrow them to a rank's slice), each layout once."""
    quantized_inputs: int = 0
    """HF tensors it quantizes."""
    compared_bytes: int = 0
    """Staged bytes it compares with the previous update's (delta updates: every byte it
    loads)."""
    changed_elements: int = 0
    """Elements of those that changed (each gathered into the delta)."""


@dataclass(frozen=True, kw_only=True)
class ReceiverLoad:
    """What one engine rank (one GPU) receives in an update."""

    name: str
    """e.g. ``engine 0 rank 3``."""
    num_bytes: int


@dataclass(frozen=True)
class Bound:
    """A lower bound on time, and the link that sets it."""

    seconds: float
    link: str
    link_bytes: int
    link_gbps: float


def p2p_lower_bound(
    senders: Sequence[SenderLoad], receivers: Sequence[ReceiverLoad], links: LinkModel
) -> Bound:
    """The busiest link of a P2P update: NICs both ends, the host link when staged there."""
    candidates = [Bound(0.0, "nothing to write", 0, links.nic_gbps)]
    for s in senders:
        candidates.append(_bound(s.write_bytes, links.nic_gbps, f"sender {s.rank} NIC (out)"))
        if links.staging == "host":
            candidates.append(
                _bound(s.load_bytes, links.host_gbps, f"sender {s.rank} host link (staging)")
            )
    for r in receivers:
        candidates.append(_bound(r.num_bytes, links.nic_gbps, f"{r.name} NIC (in)"))
    return max(candidates, key=lambda b: b.seconds)


def broadcast_lower_bound(
    stage_bytes: Sequence[int], num_engine_gpus: int, links: LinkModel
) -> Bound:
    """An NCCL broadcast of the same update (``stage_bytes``: each pipeline stage's part,
    broadcast from one source GPU per stage) into ``num_engine_gpus`` engine GPUs."""
    total = sum(stage_bytes)
    per_node = min(links.gpus_per_node, max(num_engine_gpus, 1))
    gpu_in = links.nic_gbps + (links.nvlink_gbps if per_node > 1 else 0.0)
    candidates = [
        _bound(total, gpu_in, "every engine GPU takes the whole update (NVLink + NIC in)"),
        _bound(total, per_node * links.nic_gbps, f"engine node ingress ({per_node} NICs)"),
    ]
    source_out = links.nic_gbps + links.nvlink_gbps
    for stage, num_bytes in enumerate(stage_bytes):
        candidates.append(
            _bound(num_bytes, source_out, f"stage {stage} source GPU (NVLink + NIC out)")
        )
    return max(candidates, key=lambda b: b.seconds)


def _bound(num_bytes: int, gbps: float, link: str) -> Bound:
    return Bound(num_bytes / (gbps * GB), link, num_bytes, gbps)


@dataclass(frozen=True)
class Prediction:
    """The predicted time of one update through p2pweights' pipeline, and its parts."""

    seconds: float
    transfer_s: float
    """The slowest sender's pipeline, or the slowest receiver's NIC."""
    control_s: float
    engine_s: float
    slowest: str
    """What sets ``transfer_s``."""
    load_s: float
    """The slowest sender's load stage (staging copy, loader calls, fp8 quantization)."""
    write_s: float
    """The slowest sender's write stage."""
    num_flushes: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def predict(
    senders: Sequence[SenderLoad],
    receivers: Sequence[ReceiverLoad],
    num_engines: int,
    links: LinkModel,
    pipeline: PipelineModel,
) -> Prediction:
    """Time of one warm update (after the first: no probe, no check) through our pipeline.

    Per sender: ``load = staged bytes / staging rate + loader calls + quantization``
    (+ compared bytes / compare rate + changed elements x their cost, delta updates)
    (quantization: the longer of its GPU time and its launches' host time),
    ``write = written bytes / (NIC x transport efficiency)``; two buffers overlap them, so
    ``pipeline = max(load, write) + min(load, write) / flushes + flushes x overhead``
    (the first buffer loads before any write, the last writes after every load). A
    receiver taking bytes from several senders (pipeline stages) is bound by its NIC.
    The update session's calls run one after another per engine, engines concurrently.
    """
    nic = links.nic_gbps * pipeline.transport_efficiency * GB
    on_host = links.staging == "host"
    stage_rate = (links.host_gbps if on_host else pipeline.device_copy_gbps) * GB
    loader_call_s = pipeline.loader_call_s if on_host else pipeline.device_loader_call_s
    compare_rate = (pipeline.delta_host_gbps if on_host else pipeline.delta_device_gbps) * GB
    per_changed = pipeline.delta_host_changed_s if on_host else pipeline.delta_device_changed_s
    sender = (0.0, "nothing to write", 0.0, 0.0, 0)  # (seconds, who, load, write, flushes)
    for s in senders:
        load = (
            s.load_bytes / stage_rate
            + s.compared_bytes / compare_rate
            + s.changed_elements * per_changed
            + s.loader_inputs * loader_call_s
            + max(
                s.quantized_bytes / (pipeline.quantize_gbps * GB),
                s.quantized_inputs * pipeline.quantize_call_s,
            )
        )
        write = s.write_bytes / nic
        flushes = max(1, math.ceil(s.load_bytes / pipeline.buffer_bytes))
        seconds = (
            max(load, write) + min(load, write) / flushes + flushes * pipeline.flush_overhead_s
        )
        if seconds > sender[0]:
            sender = (seconds, f"sender {s.rank}", load, write, flushes)
    transfer, slowest, load, write, flushes = sender
    for r in receivers:
        if r.num_bytes / nic > transfer:
            transfer, slowest = r.num_bytes / nic, f"{r.name} NIC (in)"
    waves = max(1, math.ceil(num_engines / pipeline.control_parallel))
    control = waves * pipeline.control_calls * pipeline.control_call_s
    return Prediction(
        seconds=transfer + control + pipeline.engine_finish_s,
        transfer_s=transfer,
        control_s=control,
        engine_s=pipeline.engine_finish_s,
        slowest=slowest,
        load_s=load,
        write_s=write,
        num_flushes=flushes,
    )


INDEX_BYTES = 4
"""A delta names each changed element by an int32 index (``p2pweights.wire.delta``)."""


def delta_bytes(bytes_by_itemsize: Mapping[int, int], fraction: float) -> int:
    """Bytes a delta update moves where ``fraction`` of the elements changed: for each
    changed element its index and its new value; the full bytes of a dtype where those
    are fewer (``wire.delta.encode`` decides per parameter: the same at one fraction).
    The 32-byte entry headers and padding are left out (a few kB per engine rank)."""
    total = 0
    for itemsize, num_bytes in bytes_by_itemsize.items():
        changed = round(fraction * (num_bytes // itemsize))
        total += min(num_bytes, changed * (INDEX_BYTES + itemsize))
    return total
