"""How many bf16 values change per RL step: the realistic fraction a delta update sends.

A Qwen3-shaped transformers model is built from a config (random init, about 120M
parameters by default) with fp32 master weights; each step is AdamW on a random token
batch (causal LM loss, gradients clipped at 1.0), after which the weights are cast to
bf16 as a trainer sends them. Per step and learning rate: the fraction of bf16 values
that differ from the previous step's cast, overall and per parameter kind, and the
bytes a delta update would send (``p2pweights.wire.delta.encode`` per tensor: 4-byte
index + 2-byte value per changed element, the full bytes where that is smaller) as a
fraction of the full update. Runs on the CPU or a GPU:

    .venv/bin/python benchmarks/delta.py fraction --lr 1e-6 1e-5 --steps 5
"""

from __future__ import annotations

import argparse
import re
import time
from collections import defaultdict
from typing import Any

import torch

from p2pweights.wire.delta import encode

_KINDS = [
    ("embed", re.compile(r"embed_tokens")),
    ("lm_head", re.compile(r"lm_head")),
    ("attn_qkv", re.compile(r"\.(q|k|v)_proj\.")),
    ("attn_o", re.compile(r"\.o_proj\.")),
    ("mlp", re.compile(r"\.(gate|up|down)_proj\.")),
    ("norm", re.compile(r"norm")),
]


def kind_of(name: str) -> str:
    for kind, pattern in _KINDS:
        if pattern.search(name):
            return kind
    return "other"


def build_model(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    return Qwen3ForCausalLM(config).to(device=device, dtype=torch.float32)


def cast(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: p.detach().to(torch.bfloat16).contiguous() for name, p in model.named_parameters()
    }


def compare(previous: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict[str, Any]:
    changed: dict[str, int] = defaultdict(int)
    total: dict[str, int] = defaultdict(int)
    sent = full = 0
    for name, tensor in new.items():
        kind = kind_of(name)
        num = int(torch.ne(previous[name], tensor).sum())
        changed[kind] += num
        total[kind] += tensor.numel()
        old_bytes = previous[name].view(-1).view(torch.uint8)
        new_bytes = tensor.view(-1).view(torch.uint8)
        entry = encode(old_bytes, new_bytes, 2)
        sent += new_bytes.numel() if entry is None else entry.num_bytes
        full += new_bytes.numel()
    return {
        "changed_fraction": sum(changed.values()) / sum(total.values()),
        "by_kind": {kind: changed[kind] / total[kind] for kind in sorted(total)},
        "bytes_sent_fraction": sent / full,
    }


def run_lr(args: argparse.Namespace, lr: float, device: torch.device) -> dict[str, Any]:
    model = build_model(args, device)
    num_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=args.weight_decay
    )
    generator = torch.Generator(device="cpu").manual_seed(args.seed + 1)
    previous = cast(model)
    steps = []
    for step in range(1, args.steps + 1):
        started = time.perf_counter()
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=generator).to(
            device
        )
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        new = cast(model)
        result = compare(previous, new)
        result.update(step=step, loss=float(loss.detach()), step_s=time.perf_counter() - started)
        steps.append(result)
        previous = new
        print(
            f"lr {lr:g} step {step}: {100 * result['changed_fraction']:.2f} % of bf16 values "
            f"changed, delta sends {100 * result['bytes_sent_fraction']:.2f} % of the bytes "
            f"({result['step_s']:.1f} s)",
            flush=True,
        )
    return {"lr": lr, "num_params": num_params, "steps": steps}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lr", type=float, nargs="+", default=[1e-6, 1e-5])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    config = {k: v for k, v in vars(args).items() if k not in ("entry", "command")}
    results: dict[str, Any] = {"config": config | {"out": str(args.out)}, "runs": []}
    for lr in args.lr:
        results["runs"].append(run_lr(args, lr, device))
    return results
