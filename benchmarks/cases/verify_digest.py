"""How fast the write digest reads bytes, on the CPU and on a GPU, for one rank's weights.

The parameters of a Qwen3-8B-shaped TP-1 rank (bf16, about 16.4 GB; ``--layers`` fewer
on the CPU) or of the 1 GB ``qwen3-1g`` shape (``--shape``, 227 tensors), digested the
way the two sides do it: all at once (the engine rank before ``end_weight_update``) and
in staging-buffer-sized batches (the sender, once per flush). On a GPU each is timed
through the one-launch Triton kernel and through torch's launches per region
(``P2PWEIGHTS_DIGEST_KERNEL=1`` / ``0``), side by side in one run. Printed: seconds,
GB/s, and a device-to-device copy of the same bytes for scale. Loads
``p2pweights/wire/digest.py`` alone (it needs only torch), so it runs where the
rest of p2pweights is not installed:

    python3 benchmarks/verify.py digest --device cuda --out $OUT/digest.json
    .venv/bin/python benchmarks/verify.py digest --device cpu --layers 2
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import types

import torch

from harness import ROOT, cuda_sync, measure


def _digest_module() -> types.ModuleType:
    """``p2pweights.wire.digest`` without the package's ``__init__`` (and what it
    imports): the two packages stand in as bare namespaces."""
    src = ROOT / "src" / "p2pweights"
    for name, path in (("p2pweights", src), ("p2pweights.verification", src / "integrity")):
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(path)]
            sys.modules[name] = package
    return importlib.import_module("p2pweights.wire.digest")


digest_module = _digest_module()


SHAPES = {  # hidden, intermediate, heads, kv heads, head dim, vocab, layers
    "qwen3-8b": (4096, 12288, 32, 8, 128, 151936, 36),
    "qwen3-1g": (1024, 3072, 16, 8, 128, 32003, 28),
}


def rank_params(shape: str, layers: int | None, device: str) -> dict[str, torch.Tensor]:
    hidden, inter, heads, kv, head_dim, vocab, default_layers = SHAPES[shape]
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (vocab, hidden)}
    for i in range(default_layers if layers is None else layers):
        p = f"layers.{i}."
        shapes[p + "qkv_proj.weight"] = ((heads + 2 * kv) * head_dim, hidden)
        shapes[p + "o_proj.weight"] = (hidden, heads * head_dim)
        shapes[p + "gate_up_proj.weight"] = (2 * inter, hidden)
        shapes[p + "down_proj.weight"] = (hidden, inter)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            shapes[p + norm + ".weight"] = (hidden,)
        shapes[p + "q_norm.weight"] = (head_dim,)
        shapes[p + "k_norm.weight"] = (head_dim,)
    shapes["norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return {n: torch.randn(s, dtype=torch.bfloat16, device=device) for n, s in shapes.items()}


def batches(params: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    out: list[dict[str, torch.Tensor]] = [{}]
    used = 0
    for name, tensor in params.items():
        if used and used + tensor.nbytes > limit:
            out.append({})
            used = 0
        out[-1][name] = tensor
        used += tensor.nbytes
    return out


def timed(call, device: str, repeats: int) -> float:
    """Median seconds of ``repeats`` calls after one warm-up, the device synchronized."""
    return measure(call, repeats, sync=None if device == "cpu" else cuda_sync).median


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    parser.add_argument("--layers", type=int, default=None, help="default: the shape's")
    parser.add_argument("--buffer-mib", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)


def run(args: argparse.Namespace) -> dict[str, object]:
    if args.device != "cpu" and not torch.cuda.is_available():
        raise SystemExit(f"verify digest --device {args.device}: this host has no CUDA device")
    params = rank_params(args.shape, args.layers, args.device)
    num_bytes = sum(t.nbytes for t in params.values())
    flushes = batches(params, args.buffer_mib * 2**20)
    result: dict[str, object] = {
        "device": torch.cuda.get_device_name() if args.device != "cpu" else "cpu",
        "torch": torch.__version__,
        "shape": args.shape,
        "num_params": len(params),
        "bytes": num_bytes,
        "num_flushes": len(flushes),
    }
    digests = digest_module.digests
    # side by side: the one-launch kernel (GPU, Triton), then torch's launches per region
    routes = {"kernel": "1", "torch": "0"} if args.device != "cpu" else {"torch": "0"}
    for route, flag in routes.items():
        os.environ["P2PWEIGHTS_DIGEST_KERNEL"] = flag
        whole_s = timed(lambda: digests(params), args.device, args.repeats)
        flush_s = timed(lambda: [digests(f) for f in flushes], args.device, args.repeats)
        result[f"{route}_route"] = {
            "whole_s": whole_s,
            "whole_gb_s": num_bytes / whole_s / 1e9,
            "per_flush_s": flush_s,
            "per_flush_gb_s": num_bytes / flush_s / 1e9,
        }
    flat = torch.empty(num_bytes, dtype=torch.uint8, device=args.device)
    result["cat_copy_s_for_scale"] = timed(
        lambda: flat.copy_(torch.cat([t.view(-1).view(torch.uint8) for t in params.values()])),
        args.device,
        2,
    )
    if args.device != "cpu":
        os.environ["P2PWEIGHTS_DIGEST_KERNEL"] = "1"
        host = {n: t.cpu() for n, t in list(params.items())[:40]}
        result["cpu_equals_gpu_first_40"] = digests(host) == digests({n: params[n] for n in host})
        odd = {
            f"{size}": torch.randint(0, 256, (size,), dtype=torch.uint8)
            for size in (1, 7, 9, 127, 129, 1000, 262143, 262144, 262157, 5_000_011)
        }
        on_gpu = {n: t.to(args.device) for n, t in odd.items()}
        result["cpu_equals_gpu_odd_sizes"] = digests(odd) == digests(on_gpu)
        result["cpu_equals_gpu_unaligned"] = digests({n: t[1:] for n, t in odd.items()}) == (
            digests({n: t[1:] for n, t in on_gpu.items()})
        )
        result["cpu_equals_gpu_8_aligned_views"] = digests(
            {n: t[8:] for n, t in odd.items() if t.numel() > 8}
        ) == digests({n: t[8:] for n, t in on_gpu.items() if t.numel() > 8})
        lanes_kernel = sys.modules["p2pweights.wire.lanes_kernel"]
        result["kernel_given_up"] = list(lanes_kernel._broken)
    print(json.dumps(result, indent=2))
    return result
