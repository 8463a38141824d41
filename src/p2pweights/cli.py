"""``p2pweights``: the command line (``engine`` serves a local engine, ``demo`` runs the demo)."""

from __future__ import annotations

import argparse
import json
import logging
import sys


def _engine(args: argparse.Namespace) -> int:
    from p2pweights.local_engine.serve import serve

    serve(
        args.model,
        tp=args.tp,
        port=args.port,
        host=args.host,
        transport=args.transport,
        weights=args.weights,
        seed=args.seed,
        dtype=args.dtype,
        server_args=json.loads(args.server_args),
    )
    return 0


def _demo(args: argparse.Namespace) -> int:
    from p2pweights.demo import run_demo

    return run_demo(
        model=args.model,
        transport=args.transport,
        engine_tps=args.engine_tp,
        num_updates=args.updates,
        buffer_bytes=args.buffer,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="p2pweights", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    commands = parser.add_subparsers(dest="command", required=True)

    engine = commands.add_parser("engine", help="serve a local sglang-compatible rollout engine")
    engine.add_argument("--model", required=True, help="HF config.json or a folder holding one")
    engine.add_argument("--tp", type=int, default=1)
    engine.add_argument("--port", type=int, required=True)
    engine.add_argument("--host", default="127.0.0.1")
    engine.add_argument("--transport", choices=["mooncake", "nixl"], default="mooncake")
    source = engine.add_mutually_exclusive_group()
    source.add_argument("--weights", help="a folder of *.safetensors with HF checkpoint names")
    source.add_argument("--seed", type=int, default=0, help="deterministic random HF weights")
    engine.add_argument("--dtype", default="bfloat16")
    engine.add_argument(
        "--server-args",
        default="{}",
        help='more sglang ServerArgs as JSON, e.g. \'{"ep_size": 2, "enable_dp_attention": true}\'',
    )
    engine.set_defaults(run=_engine)

    demo = commands.add_parser("demo", help="two local engines, three verified updates")
    demo.add_argument("--model", default="qwen3-demo", help="a bundled model name or a config path")
    demo.add_argument("--transport", choices=["mooncake", "nixl"], default="mooncake")
    demo.add_argument("--engine-tp", type=int, nargs="+", default=[2, 1])
    demo.add_argument("--updates", type=int, default=3)
    demo.add_argument("--buffer", default="256MiB")
    demo.set_defaults(run=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per HTTP call otherwise
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
