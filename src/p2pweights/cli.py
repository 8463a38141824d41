"""``p2pweights``: the command line (``engine`` serves a local engine, ``demo`` runs the demo,
``plan`` predicts an update at cluster scale, ``inspect`` shows what an engine publishes,
``doctor`` says what will work on this host)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import IO


def _lacks_engine_extra(command: str) -> bool:
    """Whether the ``[engine]`` extra (the local engine's HTTP server) is missing; if so,
    say how to install it."""
    import importlib.util

    missing = [name for name in ("fastapi", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        print(
            f"p2pweights {command} serves local engines, which need {' and '.join(missing)}: "
            f"pip install 'p2pweights[engine]'",
            file=sys.stderr,
        )
    return bool(missing)


def _engine(args: argparse.Namespace) -> int:
    if _lacks_engine_extra("engine"):
        return 1
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
        device=args.device,
    )
    return 0


def _demo(args: argparse.Namespace) -> int:
    if _lacks_engine_extra("demo"):
        return 1
    from p2pweights.demo import run_demo
    from p2pweights.progress import set_progress

    if args.no_progress:
        set_progress(False)
    return run_demo(
        model=args.model,
        transport=args.transport,
        engine_tps=args.engine_tp,
        num_updates=args.updates,
        buffer_bytes=args.buffer,
        verbose=args.verbose,
        log_level=args.log_level,
        log_until_exit=True,
    )


def _doctor(args: argparse.Namespace) -> int:
    import tempfile
    from pathlib import Path

    from p2pweights.config import parse_bytes
    from p2pweights.console import quiet_console
    from p2pweights.doctor import run_doctor

    def run() -> int:
        return run_doctor(
            args.engine, buffer_bytes=parse_bytes(args.buffer), loopback=not args.no_loopback
        )

    if args.verbose:
        return run()
    handle, name = tempfile.mkstemp(prefix="p2pweights-doctor-", suffix=".log")
    os.close(handle)
    with quiet_console(Path(name), args.log_level, until_exit=True):
        code = run()
    print(f"log (sglang, transports): {name}; --verbose shows it here")
    return code


def _plan(args: argparse.Namespace) -> int:
    import contextlib
    import tempfile
    from pathlib import Path

    from p2pweights.console import quiet_console

    if args.verbose:
        return _print_plan(args, sys.stderr)
    handle, name = tempfile.mkstemp(prefix="p2pweights-plan-", suffix=".log")
    os.close(handle)
    with quiet_console(Path(name), args.log_level) as terminal:
        code = _print_plan(args, terminal)
    with contextlib.suppress(OSError):
        if os.path.getsize(name) == 0:
            os.remove(name)
            return code
    print(f"log (replica builds, sglang): {name}; --verbose shows it here", file=sys.stderr)
    return code


def _print_plan(args: argparse.Namespace, errors: IO[str]) -> int:
    """Build and print the plan (stdout); a bad argument goes to ``errors``, exit code 2."""
    import contextlib

    from p2pweights.config import parse_bytes
    from p2pweights.errors import ConfigError
    from p2pweights.plan.cost import LinkModel, PipelineModel
    from p2pweights.planner import build_cluster_plan, parse_engine_spec

    try:
        links = LinkModel(
            nic_gbps=args.nic_gbps,
            host_gbps=args.host_gbps,
            nvlink_gbps=args.nvlink_gbps,
            gpus_per_node=args.gpus_per_node,
            staging=args.staging,
        )
        pipeline = PipelineModel(
            buffer_bytes=parse_bytes(args.buffer),
            transport_efficiency=args.transport_efficiency,
            engine_finish_s=args.engine_finish_s,
        )
        specs = [parse_engine_spec(text) for text in args.engine]
        with contextlib.redirect_stdout(sys.stderr):  # sglang prints; stdout is the plan
            plan = build_cluster_plan(
                args.model,
                specs,
                num_senders=args.senders,
                num_stages=args.stages,
                links=links,
                pipeline=pipeline,
                delta_fraction=args.delta_fraction,
            )
        owners = None
        if args.owners is not None:
            from p2pweights.plan.owner_cost import compare_owner_sends
            from p2pweights.planner import trainer_expert_bytes

            owners = compare_owner_sends(
                plan, args.owners, trainer_expert_bytes(args.model, args.stages)
            )
    except (ConfigError, ValueError) as exc:
        print(f"p2pweights plan: {exc}", file=errors)
        return 2
    if args.json:
        found = plan.to_json()
        if owners is not None:
            found["owners"] = owners.to_json()
        print(json.dumps(found, indent=1))
    else:
        print(plan.render() if owners is None else f"{plan.render()}\n{owners.render()}")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from p2pweights.engines.inspect import inspect_engine, render_inspection
    from p2pweights.errors import EngineError

    try:
        found = inspect_engine(args.url, timeout_s=args.timeout, api_key=args.api_key)
    except EngineError as exc:
        print(f"p2pweights inspect: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(found, indent=1) if args.json else render_inspection(found))
    return 0


def _add_plan_parser(commands: argparse._SubParsersAction) -> None:
    plan = commands.add_parser(
        "plan",
        help="predict one update at cluster scale (replicas on meta; no engines, no GPUs)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    plan.add_argument(
        "--model", required=True, help="model folder or config.json (or a shipped model name)"
    )
    plan.add_argument(
        "--engine",
        action="append",
        required=True,
        metavar="tp=T[,ep=E][,dp_attention=D][,count=N][,ARG=V...]",
        help="an engine layout (repeat for more; count=N for N alike; ARG: sglang server args)",
    )
    plan.add_argument("--senders", type=int, required=True, help="sending trainer ranks (GPUs)")
    plan.add_argument("--stages", type=int, default=1, help="trainer pipeline stages")
    plan.add_argument(
        "--owners",
        type=int,
        metavar="EP",
        help="also cost owner sends (each trainer rank writes its own experts) against "
        "gathered sends, with trainer expert parallelism EP",
    )
    plan.add_argument("--nic-gbps", type=float, default=50.0, help="RDMA per GPU, GB/s")
    plan.add_argument("--host-gbps", type=float, default=55.0, help="pinned host <-> GPU, GB/s")
    plan.add_argument("--nvlink-gbps", type=float, default=357.0, help="GPU <-> GPU in a node")
    plan.add_argument("--gpus-per-node", type=int, default=8)
    plan.add_argument(
        "--staging", choices=["host", "device"], default="host", help="where bytes are staged"
    )
    plan.add_argument("--buffer", default="512MiB", help="each of the two staging buffers")
    plan.add_argument(
        "--transport-efficiency",
        type=float,
        default=1.0,
        help="share of the NIC rate our writes reach (0.745: NIXL vs NCCL's lower reading)",
    )
    plan.add_argument(
        "--engine-finish-s",
        type=float,
        default=0.0,
        help="engine-side work in end_weight_update (e.g. 0.884 for Kimi-K2 fp8, the seed's)",
    )
    plan.add_argument(
        "--delta-fraction",
        type=float,
        default=None,
        metavar="F",
        help="also cost the update as a delta with this fraction of values changed (0.02)",
    )
    plan.add_argument("--json", action="store_true", help="the plan as JSON")
    plan.add_argument(
        "--verbose", action="store_true", help="sglang's log lines here instead of a log file"
    )
    plan.set_defaults(run=_plan)


def _add_inspect_parser(commands: argparse._SubParsersAction) -> None:
    inspect = commands.add_parser(
        "inspect", help="what an engine publishes: layout, transport, bytes per rank, state"
    )
    inspect.add_argument("url", help="the engine, e.g. http://10.0.0.5:30000")
    inspect.add_argument("--api-key", default=None)
    inspect.add_argument("--timeout", type=float, default=10.0, help="seconds per request")
    inspect.add_argument("--json", action="store_true")
    inspect.set_defaults(run=_inspect)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="p2pweights", description=_plain(__doc__))
    parser.add_argument(
        "--log-level",
        default="INFO",
        help="level of the command's own log lines (P2PWEIGHTS_LOG for the library's)",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    engine = commands.add_parser(
        "engine",
        help="serve a local sglang-compatible rollout engine",
        description=(
            "Serve a local rollout engine: sglang's own model classes and loaders in a "
            "process that speaks sglang's update API, a stand-in for an sglang server on a "
            "CPU host (tests, demos). It starts from --weights, else from random weights of "
            "--seed. Its ranks digest their weights before every end of an update session "
            "(P2PWEIGHTS_WRITE_DIGESTS=0 turns that off) and publish a delta scratch region "
            "(P2PWEIGHTS_DELTA_SCRATCH=<bytes>, 0 for none)."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    engine.add_argument("--model", required=True, help="HF config.json or a folder holding one")
    engine.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks to serve")
    engine.add_argument("--port", type=int, required=True, help="HTTP port of the engine's API")
    engine.add_argument("--host", default="127.0.0.1", help="address to serve and publish on")
    engine.add_argument(
        "--transport",
        choices=["mooncake", "nixl", "cuda_ipc"],
        default="mooncake",
        help="what the ranks publish their weights for (SyncConfig.transport must match)",
    )
    engine.add_argument(
        "--device",
        default="cpu",
        help="where the ranks hold their weights: cpu, or cuda:N (every rank on that GPU)",
    )
    source = engine.add_mutually_exclusive_group()
    source.add_argument("--weights", help="a folder of *.safetensors with HF checkpoint names")
    source.add_argument("--seed", type=int, default=0, help="deterministic random HF weights")
    engine.add_argument(
        "--dtype", default="bfloat16", help="torch dtype of the weights (bfloat16, float16, ...)"
    )
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
    demo.add_argument(
        "--verbose",
        action="store_true",
        help="show every log line (trainer, sglang, transports, engines) instead of log files",
    )
    demo.add_argument("--no-progress", action="store_true", help="no progress bars")
    demo.set_defaults(run=_demo)

    doctor = commands.add_parser(
        "doctor", help="what will work on this host and why; exits 1 on a blocker"
    )
    doctor.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="URL",
        help="also check an engine: its sglang, update API, publications, state (repeatable)",
    )
    doctor.add_argument(
        "--buffer",
        default="512MiB",
        help="SyncConfig.buffer_bytes to check memory for (512MiB: its default)",
    )
    doctor.add_argument(
        "--no-loopback", action="store_true", help="skip the loopback write per transport"
    )
    doctor.add_argument("--verbose", action="store_true", help="log lines too")
    doctor.set_defaults(run=_doctor)
    _add_plan_parser(commands)
    _add_inspect_parser(commands)
    return parser


def _plain(text: str | None) -> str:
    """A docstring as help text: without reStructuredText's double backticks."""
    return (text or "").replace("``", "")


def main(argv: list[str] | None = None) -> int:
    from p2pweights import logs

    args = build_parser().parse_args(argv)
    logs.configure()
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per HTTP call otherwise
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
