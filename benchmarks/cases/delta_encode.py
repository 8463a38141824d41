"""What a delta costs to make and to apply, per GB of staged bytes, on the CPU and a GPU.

Sender: ``PreviousBytes.delta`` (compare with the stored bytes, gather the changed
elements) then ``remember`` (copy the new bytes over the stored ones), as the executor
runs them once per staged slot. Engine: ``apply`` of the packed payload into the
parameter. bf16 bytes with ``--fractions`` of the elements changed; the payload is
checked bit-exact against the new bytes.

    .venv/bin/python benchmarks/delta.py encode       # results/delta_encode_cost.json
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from harness import measure
from p2pweights.delta.store import PreviousBytes
from p2pweights.engine_side.delta_apply import apply
from p2pweights.wire.delta import pack_payload


def measure_one(
    device: torch.device, num_bytes: int, fraction: float, repeats: int
) -> dict[str, Any]:
    generator = torch.Generator(device=device).manual_seed(0)
    n = num_bytes // 2
    old = torch.randn(n, generator=generator, device=device).to(torch.bfloat16)
    new = old.clone()
    changed = torch.rand(n, generator=generator, device=device) < fraction
    new[changed] = (new[changed].float() * 1.01 + 1e-3).to(torch.bfloat16)
    store = PreviousBytes()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def encode() -> None:
        store.delta("k", "w", new.view(torch.uint8), 2)
        store.remember("k", "w", new.view(torch.uint8))

    encoded = measure(
        encode, repeats, sync=sync, setup=lambda: store.remember("k", "w", old.view(torch.uint8))
    )
    store.remember("k", "w", old.view(torch.uint8))
    entry = store.delta("k", "w", new.view(torch.uint8), 2)
    assert entry is not None
    payload = torch.empty(entry.num_bytes + 64, dtype=torch.uint8, device=device)
    pack_payload([entry], 2, 1, payload)
    engine: dict[str, torch.Tensor] = {}

    def fresh_engine() -> None:
        engine["w"] = old.clone()

    applied = measure(
        lambda: apply(payload, engine, last_sequence=1), repeats, sync=sync, setup=fresh_engine
    )
    assert torch.equal(engine["w"], new)
    return {
        "device": str(device),
        "bytes": num_bytes,
        "fraction": fraction,
        "payload_fraction": entry.num_bytes / num_bytes,
        "encode_and_copy_s": encoded.median,
        "encode_and_copy_gb_s": num_bytes / encoded.median / 1e9,
        "apply_s": applied.median,
        "apply_gb_s": num_bytes / applied.median / 1e9,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.02, 0.10])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gpu-mib", type=int, default=4096, help="0: no GPU rows")


def run(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    devices = [(torch.device("cpu"), args.mib)]
    if torch.cuda.is_available() and args.gpu_mib:
        devices.append((torch.device("cuda:0"), args.gpu_mib))
    for device, mib in devices:
        for fraction in args.fractions:
            row = measure_one(device, mib * 2**20, fraction, args.repeats)
            rows.append(row)
            print(
                f"{row['device']} {100 * fraction:g} % changed: compare + copy "
                f"{row['encode_and_copy_gb_s']:.2f} GB/s, apply {row['apply_gb_s']:.2f} GB/s "
                f"(payload {100 * row['payload_fraction']:.1f} % of the bytes)",
                flush=True,
            )
    return {"threads": torch.get_num_threads(), "rows": rows}
