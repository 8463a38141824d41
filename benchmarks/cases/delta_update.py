"""Full against delta updates side by side, in one run, fed by real training steps.

A Qwen3-shaped transformers model (fp32 master weights, random init) takes AdamW steps
on random token batches at an RL learning rate; after each step its weights are cast
to bf16 and sent by each session in turn, each to a local engine of its own (its own
process; an engine another sender wrote in between refuses a delta against bytes it no
longer holds): one writing every byte (``full``), one with ``DeltaConfig(mode="auto")``
(``delta-auto``: a delta only where the costs measured predict it faster), one with
``DeltaConfig(mode="always")`` (``delta-always``), and with ``--verified-full`` one
writing every byte with ``verify_writes="always"`` (deltas are always verified; only
the verified sessions' engines digest their weights before every end, so the others'
pauses hold no digest). Per update and session: seconds, bytes sent, the engine's
paused seconds, the stages and, for deltas, what was decided; after every step the
delta sessions' engines are checked bit-exact against sglang's own ``load_weights`` of
the bytes sent, and every engine after each regime's last step.

Each learning rate of ``--lr`` is a regime of its own, run one after the other in the
same process against the same engines: a fresh trainer (same seed) and fresh sessions
(the first update full), so a small and a large learning rate are measured side by
side in one run.

On the CPU (this machine) the engines take Mooncake over TCP; with ``--device cuda``
the model trains on ``cuda:0`` and the engines (local engines on the same GPU: the
local engine stands in for sglang, whose CUDA stack does not run on the lent GPU
machine) take CUDA IPC writes from staging buffers on the GPU. Everything shares that one
GPU, so before anything starts the case adds up what the trainer (fp32 weights, gradients
and AdamW's two states: 16 bytes a parameter, plus the bf16 cast sent), each engine
(about twice its bf16 weights), each delta session's copy and the staging buffers will
hold, and refuses a run that cannot fit (docs/benchmarks-archive.md, "Delta updates on one H200:
what fits")::

    .venv/bin/python benchmarks/delta.py update --steps 8 --lr 1e-6 1e-4 \\
        --out benchmarks/results/delta_update_auto_cpu.json
    python3 benchmarks/delta.py update --device cuda --model qwen3-1g --steps 6 \\
        --lr 1e-6 1e-4 --buffer-mib 256 --out $OUT/delta_update_auto_h200.json
    python3 benchmarks/delta.py update --device cuda --model qwen3-4b-shape --steps 5 \\
        --lr 1e-6 1e-4 --buffer-mib 256 --only full-verified delta-auto \\
        --out $OUT/delta_update_4b_h200.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
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


def _trainer(config: dict[str, Any], lr: float, seed: int, device: str = "cpu"):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):  # initialized where it trains
        model = Qwen3ForCausalLM(Qwen3Config(**config)).float()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    generator = torch.Generator(device=device).manual_seed(seed + 1)

    def step() -> None:
        tokens = torch.randint(
            0, config["vocab_size"], (2, 128), generator=generator, device=device
        )
        model(input_ids=tokens, labels=tokens).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def tensors() -> list[tuple[str, torch.Tensor]]:
        return [(n, p.detach().to(torch.bfloat16)) for n, p in model.named_parameters()]

    return step, tensors


def _row(report: Any, session: Any) -> dict[str, Any]:
    # the sender's own summary (the report's DeltaReport gives the decision as a line); read
    # directly, so that a rename of the session's private state fails here, not silently
    delta = session._last_attempt.last_run.delta
    decision = getattr(delta, "decision", None)
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
            "decision": None
            if decision is None
            else {
                "mode": decision.mode,
                "keep_copy": decision.keep_copy,
                "reason": decision.reason,
                "predicted_delta_s": decision.predicted_delta_s,
                "predicted_full_s": decision.predicted_full_s,
            },
        },
    }


DELTA = ("delta-auto", "delta-always")
VERIFIED = ("full-verified", *DELTA)
"""The sessions whose writes are verified (their engines digest before every end)."""
SESSIONS = ["full", "full-direct", "full-verified", *DELTA]


def _sessions(args: argparse.Namespace, build: bool = True) -> dict[str, Any]:
    """The sessions compared, by name; the delta sessions last (they write last); their
    configs only where not ``build``."""
    from p2pweights import CudaIpcConfig, MooncakeConfig, SyncConfig, WeightSyncSession
    from p2pweights.config import DeltaConfig

    gpu = args.device != "cpu"
    transport: Any = (
        CudaIpcConfig(device=0, direct=False)  # staged, as a delta must be
        if gpu
        else MooncakeConfig(protocol="tcp", local_hostname="127.0.0.1")
    )
    common: dict[str, Any] = {"transport": transport}
    if args.buffer_mib:
        common["buffer_bytes"] = args.buffer_mib << 20
    staging = {"staging_device": "cuda:0"} if gpu else {}
    configs = {"full": SyncConfig(**common, verify_writes="off")}
    if gpu:  # the fastest full update there: loaders write the engine's memory
        configs["full-direct"] = SyncConfig(
            **{**common, "transport": CudaIpcConfig(device=0)}, verify_writes="off"
        )
    if args.verified_full or "full-verified" in (args.only or ()):
        configs["full-verified"] = SyncConfig(**common, verify_writes="always")
    configs["delta-auto"] = SyncConfig(**common, delta=DeltaConfig(mode="auto"))
    configs["delta-always"] = SyncConfig(**common, delta=DeltaConfig(mode="always"))
    if args.only:
        configs = {name: config for name, config in configs.items() if name in args.only}
    if not build:
        return configs
    return {name: WeightSyncSession(config, **staging) for name, config in configs.items()}


def _medians(updates: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of the updates' seconds, bytes, pause and stages (and the mean seconds:
    probes of the auto session count there)."""
    out: dict[str, Any] = {
        key: statistics.median(r[key] for r in updates) for key in ("seconds", "bytes", "paused_s")
    }
    out["mean_seconds"] = statistics.fmean(r["seconds"] for r in updates)
    stages = {name for r in updates for name in r["stages"]}
    out["stages"] = {
        name: statistics.median(r["stages"].get(name, 0.0) for r in updates)
        for name in sorted(stages)
    }
    fractions = [r["delta"]["fraction"] for r in updates if r["delta"]]
    if fractions:
        out["fraction"] = statistics.median(fractions)
    decided = [r["delta"]["decision"]["mode"] for r in updates if r["delta"]]
    if decided:
        out["decided"] = {mode: decided.count(mode) for mode in sorted(set(decided))}
    return out


GB = 1e9
ENGINE_OVERHEAD_BYTES = 0.6e9
"""Beyond twice its bf16 weights, what one local engine holds on the GPU (CUDA context,
scratch): issue 30's 16.7 GB engine of the 8.04 GB qwen3-4b-shape less 2 x 8.04 GB."""


def gpu_bytes_needed(config: dict[str, Any], args: argparse.Namespace) -> dict[str, float]:
    """An estimate of the GPU bytes of a ``--device cuda`` run, part by part."""
    from harness import hf_bytes

    bf16 = hf_bytes(config)  # the bytes sent per update (2 per parameter)
    sessions = list(_sessions(args, build=False))
    buffer_bytes = (args.buffer_mib << 20) or 512 << 20  # SyncConfig's default
    parts = {
        # fp32 weights, fp32 gradients and AdamW's two fp32 states: 16 bytes a parameter
        "trainer (weights, grads, AdamW)": 8.0 * bf16,
        "bf16 cast sent per step": float(bf16),
        # loaded, then moved into one arena: the allocator keeps the first copy's blocks
        "engines": len(sessions) * (2.0 * bf16 + ENGINE_OVERHEAD_BYTES),
        "delta sessions' copies": float(sum(bf16 for name in sessions if name in DELTA)),
        "staging buffers (2 per session)": float(len(sessions) * 2 * buffer_bytes),
    }
    parts["total"] = sum(parts.values())
    return parts


def _check_fits(config: dict[str, Any], args: argparse.Namespace) -> dict[str, float]:
    parts = gpu_bytes_needed(config, args)
    total_bytes = torch.cuda.get_device_properties(0).total_memory
    print(
        "GPU memory estimate: "
        + ", ".join(f"{name} {value / GB:.1f} GB" for name, value in parts.items())
        + f"; the device has {total_bytes / GB:.1f} GB",
        flush=True,
    )
    if parts["total"] > 0.95 * total_bytes:
        num_sessions = len(_sessions(args, build=False))
        raise SystemExit(
            f"delta update: an estimated {parts['total'] / GB:.1f} GB of GPU memory for "
            f"{num_sessions} sessions (one engine each) beside the trainer, over 95 % of the "
            f"device's {total_bytes / GB:.1f} GB; run fewer sessions "
            "(--only full-verified delta-auto) or a smaller --model (qwen3-1g)"
        )
    return parts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument(
        "--lr", type=float, nargs="+", default=[1e-6], help="one regime per rate, in turn"
    )
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (trainer and engine)")
    parser.add_argument(
        "--model", default=None, help="benchmarks/configs/<name>.json (default: a 51.6M Qwen3)"
    )
    parser.add_argument("--buffer-mib", type=int, default=0, help="0: SyncConfig's default")
    parser.add_argument(
        "--verified-full", action="store_true", help='also a full session, verify_writes="always"'
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=SESSIONS,
        help="run only these sessions (default: every one that applies)",
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    from p2pweights.local_engine import LocalEngine
    from p2pweights.testing import write_model_dir

    config = CONFIG
    if args.model:
        from harness import named_config

        config = named_config(args.model)
    gpu = args.device != "cpu"
    if gpu and not torch.cuda.is_available():
        raise SystemExit(f"delta update --device {args.device}: this host has no CUDA device")
    memory = _check_fits(config, args) if gpu else None
    folder = write_model_dir(config, tempfile.mkdtemp(prefix="p2pw-delta-"))
    out: dict[str, Any] = {
        "args": {k: str(v) for k, v in vars(args).items() if k not in ("entry", "command")},
        "gpu_bytes_estimate": memory,
        "config": config,
        "device": torch.cuda.get_device_name(0) if gpu else "cpu",
        "regimes": {},
    }
    engine_options: dict[str, Any] = (
        {"transport": "cuda_ipc", "device": "cuda:0", "startup_timeout_s": 900}
        if gpu
        else {"transport": "mooncake"}
    )
    with contextlib.ExitStack() as scope:
        names = list(_sessions(args, build=False))
        # one engine per session: an engine written by another sender in between refuses
        # the next delta against bytes it no longer holds (its base is not the rank's)
        # its engine digests its weights before every end only for a verified session
        # (deltas always are), so the unverified ones' pauses hold no digest; each
        # regime's fresh session starts with a full update, so engines serve every regime
        engines = {}
        for name in names:  # started at once, then waited for
            engine = LocalEngine(
                folder,
                tp=args.tp,
                seed=0,
                env={"P2PWEIGHTS_WRITE_DIGESTS": "1" if name in VERIFIED else "0"},
                **engine_options,
            )
            scope.callback(engine.stop)
            engines[name] = engine.start()
        for engine in engines.values():
            engine.wait_ready()
        for lr in args.lr:
            out["regimes"][f"{lr:g}"] = _regime(args, config, lr, engines, gpu)
    print(json.dumps({lr: r["median_after_first"] for lr, r in out["regimes"].items()}, indent=1))
    return out


def _regime(
    args: argparse.Namespace, config: dict[str, Any], lr: float, engines: dict[str, Any], gpu: bool
) -> dict[str, Any]:
    """One learning rate: a fresh trainer and fresh sessions, sessions alternating update
    by update; the delta engines checked after every step, every engine after the last."""
    from p2pweights.engines.client import EngineClient
    from p2pweights.verify import verify_engine

    step, tensors = _trainer(config, lr, args.seed, "cuda:0" if gpu else "cpu")
    sessions = _sessions(args)
    out: dict[str, Any] = {"train_step_s": []}
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in sessions}
    for name, session in sessions.items():
        session.connect([engines[name].url])
    for k in range(args.steps + 1):
        if k:
            started = time.perf_counter()
            step()
            out["train_step_s"].append(time.perf_counter() - started)
        sent = tensors()
        if gpu:
            torch.cuda.synchronize()
        for mode, session in sessions.items():
            row = _row(session.update(sent), session)
            rows[mode].append(row)
            delta = row["delta"]
            share = "" if not delta else f", {100 * delta['fraction']:.2f} % of the bytes"
            if delta and delta["decision"]:
                share += f" ({delta['decision']['mode']}, {delta['decision']['reason']})"
            print(
                f"lr {lr:g} step {k} {mode}: {row['seconds']:.3f} s, {row['bytes'] / 1e6:.1f} MB"
                f"{share}, engine paused {row['paused_s']:.3f} s",
                flush=True,
            )
        checked = sessions if k == args.steps else [m for m in sessions if m in DELTA]
        for mode in checked:
            client = EngineClient(engines[mode].url, timeout_s=600)
            mismatches = verify_engine(
                client, lambda sent=sent: iter(sent), device="cuda:0" if gpu else "cpu"
            )
            client.close()
            rows[mode][-1]["bit_exact"] = all(not v for v in mismatches.values())
        del sent
        if gpu:
            torch.cuda.empty_cache()
    for session in sessions.values():
        session.close()
    out["updates"] = rows
    out["median_after_first"] = {
        mode: _medians(updates[2:] or updates[1:]) for mode, updates in rows.items()
    }
    out["bit_exact"] = {
        mode: [r["bit_exact"] for r in updates if "bit_exact" in r]
        for mode, updates in rows.items()
    }
    return out
