"""What a delta costs to make and to apply, per GB of staged bytes, on the CPU and a GPU.

Sender: ``PreviousBytes.delta`` (compare with the stored bytes, gather the changed
elements) then ``remember`` (copy the new bytes over the stored ones), as the executor
runs them once per staged slot. Engine: ``apply`` of the packed payload into the
parameter. bf16 bytes with ``--fractions`` of the elements changed; the payload is
checked bit-exact against the new bytes.

    .venv/bin/python benchmarks/delta_encode_cost.py --out benchmarks/results/delta_encode_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from p2pweights.delta.apply import apply
from p2pweights.delta.store import PreviousBytes
from p2pweights.delta.wire import pack_payload


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(device: torch.device, num_bytes: int, fraction: float, repeats: int) -> dict[str, Any]:
    generator = torch.Generator(device=device).manual_seed(0)
    n = num_bytes // 2
    old = torch.randn(n, generator=generator, device=device).to(torch.bfloat16)
    new = old.clone()
    changed = torch.rand(n, generator=generator, device=device) < fraction
    new[changed] = (new[changed].float() * 1.01 + 1e-3).to(torch.bfloat16)
    store = PreviousBytes()
    encode_s, apply_s = [], []
    for _ in range(repeats + 1):
        store.remember("k", "w", old.view(torch.uint8))
        _sync(device)
        started = time.perf_counter()
        entry = store.delta("k", "w", new.view(torch.uint8), 2)
        store.remember("k", "w", new.view(torch.uint8))
        _sync(device)
        encode_s.append(time.perf_counter() - started)
        assert entry is not None
        payload = torch.empty(entry.num_bytes + 64, dtype=torch.uint8, device=device)
        pack_payload([entry], 2, 1, payload)
        engine = {"w": old.clone()}
        _sync(device)
        started = time.perf_counter()
        apply(payload, engine, last_sequence=1)
        _sync(device)
        apply_s.append(time.perf_counter() - started)
        assert torch.equal(engine["w"], new)
    encode, applied = statistics.median(encode_s[1:]), statistics.median(apply_s[1:])
    return {
        "device": str(device),
        "bytes": num_bytes,
        "fraction": fraction,
        "payload_fraction": entry.num_bytes / num_bytes,
        "encode_and_copy_s": encode,
        "encode_and_copy_gb_s": num_bytes / encode / 1e9,
        "apply_s": applied,
        "apply_gb_s": num_bytes / applied / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--gpu-mib", type=int, default=4096)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.02, 0.10])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    devices = [(torch.device("cpu"), args.mib)]
    if torch.cuda.is_available():
        devices.append((torch.device("cuda:0"), args.gpu_mib))
    for device, mib in devices:
        for fraction in args.fractions:
            row = measure(device, mib * 2**20, fraction, args.repeats)
            rows.append(row)
            print(
                f"{row['device']} {100 * fraction:g} % changed: compare + copy "
                f"{row['encode_and_copy_gb_s']:.2f} GB/s, apply {row['apply_gb_s']:.2f} GB/s "
                f"(payload {100 * row['payload_fraction']:.1f} % of the bytes)",
                flush=True,
            )
    out = {"threads": torch.get_num_threads(), "rows": rows}
    if args.out is not None:
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
