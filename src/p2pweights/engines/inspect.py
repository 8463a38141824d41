"""What one engine publishes, for users debugging a deployment (``p2pweights inspect URL``).

Read-only: the engine's server info (layout, sglang version), every rank's publication
(transport, peer, parameters, bytes), its weight version and, where the engine reports
it, its update state. Whether p2pweights can write it is said the way ``connect``
would refuse it; a rank that cannot be read is reported, not raised.
"""

from __future__ import annotations

from typing import Any

from p2pweights.engines.client import EngineClient
from p2pweights.engines.fleet import num_engine_ranks
from p2pweights.engines.update_state import UPDATING_PREFIX
from p2pweights.errors import EngineError
from p2pweights.replica.speculative import has_model_draft

__all__ = ["LAYOUT_FIELDS", "describe_engine", "inspect_engine", "render_inspection"]

LAYOUT_FIELDS = (
    "model_path",
    "dtype",
    "quantization",
    "tp_size",
    "pp_size",
    "ep_size",
    "dp_size",
    "enable_dp_attention",
    "moe_dense_tp_size",
    "moe_a2a_backend",
    "moe_runner_backend",
    "speculative_algorithm",
)
"""The server-info fields shown as the engine's layout (those present)."""


def inspect_engine(
    url: str, *, timeout_s: float = 10.0, api_key: str | None = None
) -> dict[str, Any]:
    """Everything ``url`` serves about its weights, as a JSON-able dict."""
    client = EngineClient(url, timeout_s=timeout_s, api_key=api_key)
    try:
        return describe_engine(client)
    finally:
        client.close()


def describe_engine(client: EngineClient) -> dict[str, Any]:
    """``inspect_engine`` through an existing client."""
    info = client.server_info()
    found: dict[str, Any] = {
        "url": client.url,
        "sglang_version": info.get("version"),
        "layout": {k: info[k] for k in LAYOUT_FIELDS if info.get(k) is not None},
    }
    problem = None
    try:
        num_ranks = num_engine_ranks(client.url, info)
    except EngineError as exc:  # still show what it publishes, keyed by TP rank
        problem = str(exc)
        num_ranks = int(info.get("tp_size") or 1)
    roles = ["target"]
    try:
        if has_model_draft(client.url, info):
            roles.append("draft")
    except EngineError as exc:  # a draft p2pweights refuses: its target is still shown
        problem = problem or str(exc)
    ranks = [_rank(client, rank, role) for role in roles for rank in range(num_ranks)]
    unreadable = [r for r in ranks if "error" in r]
    if problem is None and unreadable:
        problem = f"{len(unreadable)} rank publication(s) could not be read"
    found.update(
        writable=problem is None,
        problem=problem,
        transport=sorted({r["backend"] for r in ranks if "backend" in r}),
        ranks=ranks,
        bytes=sum(r.get("bytes", 0) for r in ranks),
        weight_version=client.weight_version(),
    )
    found["update_state"] = _update_state(client, found["weight_version"])
    return found


def _rank(client: EngineClient, rank: int, role: str) -> dict[str, Any]:
    entry: dict[str, Any] = {"rank": rank, "role": role}
    try:
        pub = client.publication(rank, role)
    except EngineError as exc:
        entry["error"] = str(exc)
        return entry
    from p2pweights.wire.delta import SCRATCH_NAME
    from p2pweights.wire.landed import flag_names

    weights = {name: pub.regions[name] for name in flag_names(pub.regions)}  # no scratch, flags
    entry.update(
        backend=pub.backend,
        peer=pub.session_id if pub.backend == "mooncake" else pub.agent_name,
        parameters=len(weights),
        bytes=sum(region.num_bytes for region in weights.values()),
    )
    if SCRATCH_NAME in pub.regions:  # delta updates' scratch region, not a weight
        entry["delta_scratch_bytes"] = pub.regions[SCRATCH_NAME].num_bytes
    if pub.mem_type is not None:
        entry["mem_type"] = pub.mem_type
    return entry


def _update_state(client: EngineClient, version: str) -> dict[str, Any]:
    """What the weight version says (a torn update shows ``p2pweights-updating:<v>``) and,
    where the engine reports it, whether it is paused or inside an update session."""
    state: dict[str, Any] = {"mid_update": version.startswith(UPDATING_PREFIX)}
    if state["mid_update"]:
        state["updating_to"] = version[len(UPDATING_PREFIX) :]
    try:
        reported = client.engine_state()
    except EngineError:
        reported = None
    state["reported_by_engine"] = reported is not None
    if reported is not None:
        state.update(reported)
    return state


def render_inspection(found: dict[str, Any]) -> str:
    """``inspect_engine``'s answer for a terminal."""
    layout = ", ".join(f"{k}={v}" for k, v in found["layout"].items())
    state = found["update_state"]
    if state["mid_update"]:
        status = f"mid-update to {state['updating_to']} (weights may be torn)"
    else:
        status = "whole"
    if state["reported_by_engine"]:
        status += f"; paused={state['paused']}, update session open={state['update_open']}"
    lines = [
        f"engine {found['url']} (sglang {found['sglang_version']})",
        f"  layout: {layout}",
        f"  transport: {', '.join(found['transport']) or 'nothing published'}",
        f"  weight version: {found['weight_version']} ({status})",
        "  writable by p2pweights: " + ("yes" if found["writable"] else f"no: {found['problem']}"),
        f"  {len(found['ranks'])} publication(s), {found['bytes'] / 1e9:.3f} GB in all:",
    ]
    for r in found["ranks"]:
        role = "" if r["role"] == "target" else f" ({r['role']})"
        if "error" in r:
            lines.append(f"    rank {r['rank']}{role}: unreadable: {r['error']}")
            continue
        lines.append(
            f"    rank {r['rank']}{role}: {r['backend']} {r['peer']}, {r['parameters']} "
            f"parameters, {r['bytes'] / 1e9:.3f} GB"
        )
    return "\n".join(lines)
