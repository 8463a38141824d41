"""The HTTP face of a local engine: the sglang routes a weight update uses, same JSON shapes.

No generation happens here; pause and continue only flip state. Everything a
weight-sync library reads or triggers (server args, published weights, the
update session, the weight checker) is served as sglang 0.5.23 serves it.

Two benchmark routes, not sglang's, serve the broadcast baseline of
``benchmarks/update.py ceiling``: ``POST /p2pweights/broadcast_area`` allocates
and publishes each rank's receive area for the full HF tensor set, and ``POST
/p2pweights/apply_broadcast`` runs each rank's sglang ``load_weights`` from it
inside an open update session (what an NCCL broadcast update runs at the engine).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from typing import Any

from fastapi import Body, FastAPI, Query
from fastapi.responses import JSONResponse

from p2pweights import environment
from p2pweights.errors import ConfigError
from p2pweights.local_engine.ranks import EngineRank
from p2pweights.replica.sglang import facade
from p2pweights.wire.digest import SCHEME
from p2pweights.wire.publication import (
    DIGESTS_ROLE,
    END_RECORDS_KEY,
    digest_answer,
    end_record,
)

logger = logging.getLogger(__name__)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def create_app(server_info: dict[str, Any], ranks: list[EngineRank]) -> FastAPI:
    """The FastAPI app serving ``ranks`` (ordered by TP rank) of one engine."""
    app = FastAPI(title="p2pweights local engine")
    state: dict[str, Any] = {
        "weight_version": "default",
        "paused": False,
        "updating": False,
        "loaded_in_session": False,  # load_weights ran in this update session (broadcast route)
    }
    lock = threading.Lock()  # update-session routes run one at a time, as in sglang's scheduler

    # Routes that only read or set a field answer on the event loop (``async``): a plain
    # ``def`` route hops to a worker thread and back, about 0.3 ms a call, six of them
    # inside every update's pause. The routes that touch the ranks stay plain and locked.

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/server_info")
    def get_server_info() -> dict[str, Any]:
        return {
            **server_info,
            "version": facade.version(),
            "weight_version": state["weight_version"],
            # each rank's record: see digest_record below
            "p2pweights_write_digests": environment.write_digests(default=True),
            "p2pweights_digest_scheme": SCHEME,
            # not sglang's: what state a failure left this engine in, for tests and users
            "p2pweights_engine_state": {
                "paused": state["paused"],
                "update_open": state["updating"],
            },
        }

    @app.get("/model_info")
    async def model_info() -> dict[str, Any]:
        return {
            "model_path": server_info["model_path"],
            "is_generation": True,
            "weight_version": state["weight_version"],
        }

    def transfer_engine_info(rank: int, role: str = "target") -> Any:
        if not 0 <= rank < len(ranks):
            return _error(400, f"rank {rank} not found; this engine has ranks 0..{len(ranks) - 1}")
        if role not in ranks[rank].runners:
            return _error(400, f"rank {rank} has no {role!r} runner")
        answer = {
            "rank": rank,
            "remote_instance_transfer_engine_info": ranks[rank].publication(role),
        }
        if role != "target":
            answer["role"] = role  # a draft is published apart from the target (see client)
        return answer

    def digest_record(rank: int, runner: str) -> Any:
        """The record a rank's runner took before its last end (``engine_side.steps``)."""
        if not 0 <= rank < len(ranks) or runner not in ranks[rank].runners:
            return _error(400, f"rank {rank} has no {runner!r} runner")
        record = ranks[rank].runners[runner].digest_record
        return digest_answer(rank, record)

    @app.get("/remote_instance_transfer_engine_info")
    def remote_info(
        rank: int = Query(...), role: str = Query("target"), runner: str = Query("target")
    ) -> Any:
        if role == DIGESTS_ROLE:
            return digest_record(rank, runner)
        return transfer_engine_info(rank, role)

    @app.post("/p2pweights/corrupt_at_end")
    def corrupt_at_end(body: dict[str, Any] = Body(...)) -> Any:
        """Test only: ``{"rank", "param"}``: at the next end, after the writes and before
        the digests, flip one bit of that parameter (what a write gone wrong leaves)."""
        rank, param = int(body["rank"]), str(body["param"])
        if not 0 <= rank < len(ranks):  # a negative index would pick another rank
            return _error(400, f"rank {rank} not found; this engine has ranks 0..{len(ranks) - 1}")
        runner = ranks[rank].runners["target"]
        if param not in runner.params:
            return _error(400, f"rank {rank} publishes no parameter {param!r}")
        runner.corrupt_at_end = param
        return {"success": True}

    @app.get("/get_remote_instance_transfer_engine_info")
    def remote_info_old(rank: int = Query(...)) -> Any:
        logger.warning("/get_remote_instance_transfer_engine_info is deprecated")
        return transfer_engine_info(rank)

    @app.post("/pause_generation")
    async def pause(body: dict[str, Any] = Body(default={})) -> dict[str, Any]:
        state["paused"] = True
        return {"status": "ok", "mode": body.get("mode", "abort")}

    @app.post("/continue_generation")
    async def resume(body: dict[str, Any] = Body(default={})) -> dict[str, Any]:
        state["paused"] = False
        return {"status": "ok"}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Any:
        return JSONResponse("Cache flushed.", status_code=200)

    @app.post("/begin_weight_update")
    def begin(body: dict[str, Any] = Body(default={})) -> dict[str, Any]:
        with lock:
            if state["updating"]:  # sglang's rule and message
                return {
                    "success": False,
                    "message": "a weight-update session is already open; "
                    "call end_weight_update() first",
                }
            state["selector"] = body.get("selector", "all")  # end runs on the same runners
            for rank in ranks:
                rank.begin_update(state["selector"])
            state["updating"] = True
            state["loaded_in_session"] = False
        return {"success": True, "message": "begin_weight_update done"}

    @app.post("/end_weight_update")
    def end(body: dict[str, Any] = Body(default={})) -> dict[str, Any]:
        with lock:
            if not state["updating"]:  # sglang's rule and message
                return {
                    "success": False,
                    "message": "no weight-update session is open; call begin_weight_update() first",
                }
            records = []
            for rank in ranks:
                rank.end_update(not state["loaded_in_session"], state["selector"])
                for runner in rank.selected(state["selector"]):
                    runner.digest_record["weight_version"] = state["weight_version"]
                    records.append(end_record(rank.rank, runner.role, runner.digest_record))
            state["updating"] = False
        # the records the trainer compares, with the answer (no read per rank after it)
        return {"success": True, "message": "end_weight_update done", END_RECORDS_KEY: records}

    @app.post("/p2pweights/broadcast_area")
    def broadcast_area(body: dict[str, Any] = Body(...)) -> Any:
        """Benchmark route: ``{"num_bytes": N}`` -> each rank's publication of its area."""
        try:
            with lock:
                published = [rank.publish_broadcast_area(int(body["num_bytes"])) for rank in ranks]
        except (ConfigError, KeyError, ValueError) as exc:
            return _error(400, f"broadcast_area: {exc}")
        return {
            "ranks": [
                {"rank": rank.rank, "remote_instance_transfer_engine_info": info}
                for rank, info in zip(ranks, published, strict=True)
            ]
        }

    @app.post("/p2pweights/apply_broadcast")
    def apply_broadcast(body: dict[str, Any] = Body(...)) -> Any:
        """Benchmark route: ``{"tensors": [[name, shape, dtype, offset], ...]}``, load each rank."""
        rank_seconds = []
        with lock:
            if not state["updating"]:
                return _error(400, "apply_broadcast needs an open update (begin_weight_update)")
            try:
                for rank in ranks:
                    started = time.perf_counter()
                    rank.apply_broadcast(body["tensors"])
                    rank_seconds.append(time.perf_counter() - started)
            except (ConfigError, KeyError, ValueError) as exc:
                return _error(400, f"apply_broadcast: {exc}")
            state["loaded_in_session"] = True
        return {"success": True, "rank_seconds": rank_seconds}

    @app.post("/update_weight_version")
    async def update_version(body: dict[str, Any] = Body(...)) -> dict[str, Any]:
        state["weight_version"] = str(body["new_version"])
        return {"success": True, "message": "ok", "new_version": state["weight_version"]}

    @app.api_route("/weights_checker", methods=["GET", "POST"])
    def weights_checker(body: dict[str, Any] = Body(default={})) -> Any:
        action = body.get("action", "checksum")
        options = {
            "selector": body.get("selector", "target"),
            "allow_quant_error": body.get("allow_quant_error", False),
            "skip_tensor_list": body.get("skip_tensor_list"),
        }
        try:
            with lock:
                payloads = [rank.check(action, **options) for rank in ranks]
        except Exception as exc:  # sglang answers a failed check as success=False, HTTP 400
            logger.warning("weights_checker %s failed: %s", action, exc)
            return JSONResponse({"success": False, "message": str(exc)}, status_code=400)
        answer: dict[str, Any] = {"success": True, "message": f"{action} ok"}
        infos = [p for p in payloads if p is not None]
        if infos:
            digest = hashlib.sha256()
            for info in infos:
                digest.update(info["per_gpu_checksum"].encode())
            answer["ranks"] = infos
            answer["per_engine_checksum"] = digest.hexdigest()
        return answer

    return app
