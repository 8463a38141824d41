"""Full against delta updates side by side, in one run, fed by real training steps.

A Qwen3-shaped transformers model (fp32 master weights, random init) takes AdamW steps
on random token batches at an RL learning rate; after each step its weights are cast
to bf16 and sent to one local engine (CPU, its own process, Mooncake over TCP) twice:
by a session writing every byte, then by a session with ``SyncConfig(delta=...)``
(a delta sets the changed elements to their new values, so it lands on the full
session's bytes as on its own). Per update and mode: seconds, bytes sent, the engine's
paused seconds and the stages; the engine is checked bit-exact against sglang's own
``load_weights`` after the last update of each mode.

    .venv/bin/python benchmarks/delta_update.py --steps 4 --lr 1e-6 \\
        --out benchmarks/results/delta_update.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "num_hidden_layers": 6,
    "vocab_size": 32000,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def _trainer(config: dict[str, Any], lr: float, seed: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**config)).float()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    generator = torch.Generator().manual_seed(seed + 1)

    def step() -> None:
        tokens = torch.randint(0, config["vocab_size"], (2, 128), generator=generator)
        model(input_ids=tokens, labels=tokens).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def tensors() -> list[tuple[str, torch.Tensor]]:
        return [(n, p.detach().to(torch.bfloat16)) for n, p in model.named_parameters()]

    return step, tensors


def _row(report: Any, session: Any) -> dict[str, Any]:
    run = getattr(session, "_last_run", None)
    delta = getattr(run, "delta", None)
    return {
        "seconds": report.seconds,
        "bytes": report.bytes_written,
        "paused_s": max(report.paused_s.values(), default=0.0),
        "stages": report.stage_seconds,
        "delta": None
        if delta is None
        else {
            "full_bytes": delta.full_bytes,
            "sent_bytes": delta.sent_bytes,
            "fraction": delta.fraction,
            "delta_slots": delta.num_delta_slots,
            "full_slots": delta.num_full_slots,
            "unchanged_slots": delta.num_unchanged_slots,
            "store_bytes": delta.store_bytes,
        },
    }


def main() -> None:
    from p2pweights import MooncakeConfig, SyncConfig, WeightSyncSession
    from p2pweights.config import DeltaConfig
    from p2pweights.engines.client import EngineClient
    from p2pweights.local_engine import LocalEngine
    from p2pweights.testing import write_model_dir
    from p2pweights.verify import verify_engine

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    folder = write_model_dir(CONFIG, tempfile.mkdtemp(prefix="p2pw-delta-"))
    step, tensors = _trainer(CONFIG, args.lr, args.seed)
    transport = MooncakeConfig(protocol="tcp", local_hostname="127.0.0.1")
    out: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "config": CONFIG}
    rows: dict[str, list[dict[str, Any]]] = {"full": [], "delta": []}
    with LocalEngine(folder, tp=args.tp, transport="mooncake", seed=0) as engine:
        sessions = {
            "full": WeightSyncSession(SyncConfig(transport=transport)),
            "delta": WeightSyncSession(SyncConfig(transport=transport, delta=DeltaConfig())),
        }
        for session in sessions.values():
            session.connect([engine.url])
        for k in range(args.steps + 1):
            if k:
                started = time.perf_counter()
                step()
                out.setdefault("train_step_s", []).append(time.perf_counter() - started)
            sent = tensors()
            for mode, session in sessions.items():
                row = _row(session.update(sent), session)
                rows[mode].append(row)
                share = (
                    f", {100 * row['delta']['fraction']:.2f} % of the bytes" if row["delta"] else ""
                )
                print(
                    f"step {k} {mode}: {row['seconds']:.3f} s, {row['bytes'] / 1e6:.1f} MB"
                    f"{share}, engine paused {row['paused_s']:.3f} s",
                    flush=True,
                )
            client = EngineClient(engine.url)
            mismatches = verify_engine(client, lambda sent=sent: sent)
            client.close()
            rows["delta"][-1]["bit_exact"] = all(not v for v in mismatches.values())
        for session in sessions.values():
            session.close()
    out["updates"] = rows
    out["median_after_first"] = {
        mode: {
            key: statistics.median(r[key] for r in updates[2:] or updates[1:])
            for key in ("seconds", "bytes", "paused_s")
        }
        for mode, updates in rows.items()
    }
    print(json.dumps(out["median_after_first"], indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
