"""``p2pweights plan``: replicas on meta, no engines; its JSON against the replicas' own layouts.

The command runs in a subprocess: resolving server args publishes sglang's server args
process-wide, which only the CLI process may do.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from p2pweights.replica.registry import replica_for
from p2pweights.testing import write_model_dir


def _plan(*args: str) -> subprocess.CompletedProcess[str]:
    return _Plan(args).done()


class _Plan:
    """``p2pweights plan ARGS`` started now, in a process of its own; ``done()`` waits."""

    def __init__(self, args: tuple[str, ...]) -> None:
        self.args = [sys.executable, "-m", "p2pweights.cli", "--log-level", "WARNING", "plan"]
        self.args += args
        self.process = subprocess.Popen(
            self.args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self._done: subprocess.CompletedProcess[str] | None = None

    def done(self) -> subprocess.CompletedProcess[str]:
        if self._done is None:
            try:
                stdout, stderr = self.process.communicate(timeout=300)
            finally:
                if self.process.poll() is None:
                    self.process.kill()
                    self.process.communicate()
            self._done = subprocess.CompletedProcess(
                self.args, self.process.returncode, stdout, stderr
            )
        return self._done


TP4_TP2 = ("--engine", "tp=4", "--engine", "tp=2", "--senders", "4", "--json")
GLM_AIR = ("--model", "glm-4.5-air-full", "--engine", "tp=4,ep=4", "--engine", "tp=4")
GLM_AIR += ("--senders", "8", "--json")
DELTA = ("--model", "qwen3-tiny", "--engine", "tp=2", "--senders", "1")
DELTA += ("--delta-fraction", "0.1", "--json")


@pytest.fixture(scope="module")
def plan_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir("qwen3-tiny", tmp_path_factory.mktemp("plan") / "qwen3-tiny")


@pytest.fixture(scope="module")
def plans(plan_folder: Path) -> Iterator[dict[str, _Plan]]:
    """The slow commands of this file started at once (each is single-threaded and mostly
    imports and builds replicas: two cores run them side by side); each test waits for its
    own. ``"tp4+tp2"`` plans ``plan_folder``."""
    started = {
        "tp4+tp2": _Plan(("--model", str(plan_folder), *TP4_TP2)),
        "glm-air": _Plan(GLM_AIR),
        "delta": _Plan(DELTA),
    }
    yield started
    for plan in started.values():
        plan.done()


def _written_bytes(folder, tp: int, rank: int, **server_args) -> int:
    """What the update writes to the rank: every parameter its replica registers."""
    info = {"model_path": str(folder), "tp_size": tp, **server_args}
    replica = replica_for(info, rank).peek()  # the process's registry keeps nothing built
    return sum(
        layout.num_bytes
        for name, layout in replica.layouts.items()
        if name not in replica.optional_params
    )


def test_tp4_beside_tp2_bytes_are_the_replicas(plans, plan_folder):
    folder = plan_folder
    done = plans["tp4+tp2"].done()
    assert done.returncode == 0, done.stderr[-3000:]
    # sglang's, megatron's and torch's lines stay out of the terminal: at most the log's path
    assert [line for line in done.stderr.splitlines() if not line.startswith("log (")] == []
    out = json.loads(done.stdout)
    assert [e["layout"] for e in out["engines"]] == [{"tp": 4}, {"tp": 2}]
    for engine, tp in zip(out["engines"], (4, 2), strict=True):
        assert [r["rank"] for r in engine["ranks"]] == list(range(tp))
        for r in engine["ranks"]:
            assert r["bytes"] == _written_bytes(folder, tp, r["rank"])
            assert 0 <= r["sender"] < 4
    ranks = [r for e in out["engines"] for r in e["ranks"]]
    assert out["p2p_bytes"] == sum(r["bytes"] for r in ranks)
    assert out["p2p_bytes"] == sum(s["bytes"] for s in out["senders"])
    # each sender writes what the ranks it is named for receive: one writer per rank
    for s in out["senders"]:
        assert s["bytes"] == sum(r["bytes"] for r in ranks if r["sender"] == s["rank"])
    assert out["broadcast_bytes"] > out["p2p_bytes"]
    assert out["lower_bound_s"]["p2p"] > 0 and out["lower_bound_s"]["broadcast"] > 0
    assert out["predicted_s"]["seconds"] > out["lower_bound_s"]["p2p"]


def test_full_size_moe_with_and_without_expert_parallelism(plans):
    """GLM-4.5-Air (bf16, 106B) at TP 4 / EP 4 beside TP 4 / EP 1, 8 senders."""
    done = plans["glm-air"].done()
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    ranks = [r for e in out["engines"] for r in e["ranks"]]
    assert len(ranks) == 8
    assert sorted(r["sender"] for r in ranks) == list(range(8))  # one each
    whole = out["broadcast_bytes"] / 8  # the checkpoint, which every GPU takes in a broadcast
    assert 210e9 < whole < 220e9
    # an EP rank holds 32 whole experts, a TP rank a quarter of all 128: the same bytes
    sizes = [r["bytes"] for r in ranks]
    assert max(sizes) / min(sizes) < 1.01
    assert sum(sizes[:4]) == pytest.approx(whole, rel=0.01)  # padding aside, one model
    assert out["lower_bound_s"]["p2p"] == pytest.approx(max(sizes) / 50e9)
    # a TP 4 rank takes a quarter of the model over one NIC; a broadcast brings the whole
    # model into the node over its 8 NICs: at this width the broadcast's bound is lower
    assert out["lower_bound_s"]["broadcast"] == pytest.approx(whole / 400e9)


def test_bad_engine_spec_is_refused_before_any_replica():
    done = _plan("--model", "qwen3-tiny", "--engine", "ep=2", "--senders", "1")
    assert done.returncode == 2
    assert "needs tp=T" in done.stderr


def test_a_sender_quantizes_each_tensor_once_for_all_its_ranks() -> None:
    """One conversion per checkpoint format: whatever ranks, EP sizes or engines a sender
    serves, each tensor is quantized once; two senders, one TP rank each, do it apiece,
    each only in the blocks of the expert weights its rank reads."""
    from p2pweights.planner import build_cluster_plan, parse_engine_spec

    def quantized(*specs: str, senders: int = 1) -> list[tuple[int, int]]:
        engines = [parse_engine_spec(spec) for spec in specs]
        plan = build_cluster_plan("deepseek-v3-fp8-tiny", engines, num_senders=senders)
        return [(s.load.quantized_inputs, s.load.quantized_bytes) for s in plan.senders]

    (whole,) = quantized("tp=2")
    assert whole[0] > 0
    # one TP rank each: every tensor, but only the blocks of each expert that rank reads
    rank0, rank1 = quantized("tp=2", senders=2)
    assert rank0 == rank1 and rank0[0] == whole[0] and rank0[1] < whole[1]
    assert quantized("tp=4") == quantized("tp=4,ep=4") == quantized("tp=4,ep=2") == [whole]
    assert quantized("tp=4,ep=4", "tp=2") == [whole]  # two engines, one sender
    # one EP rank reads its own experts only: fewer tensors than the whole checkpoint's
    ep_rank, _ = quantized("tp=2,ep=2", senders=2)
    assert ep_rank[0] < whole[0]


def test_delta_fraction_beside_the_full_update(plans):
    """fp8 weights send 5 bytes per changed element, their float32 scales 8, the rest
    (bf16) 6: the delta's bytes follow each rank's replica dtypes."""
    from p2pweights.planner import build_cluster_plan, parse_engine_spec

    engines = [parse_engine_spec("tp=2")]
    plan = build_cluster_plan("deepseek-v3-fp8-tiny", engines, num_senders=1, delta_fraction=0.02)
    assert plan.delta is not None
    by_size: dict[int, int] = {}
    for engine in plan.engines:
        for rank in engine.ranks:
            assert rank.bytes_by_itemsize_by_stage is not None
            assert sum(rank.bytes_by_itemsize_by_stage[0].values()) == rank.num_bytes
            for size, num in rank.bytes_by_itemsize_by_stage[0].items():
                by_size[size] = by_size.get(size, 0) + num
    assert {1, 2, 4} <= set(by_size)  # fp8 weights, bf16 tensors, fp32 scales
    expected = sum(round(0.02 * (n // s)) * (4 + s) for s, n in by_size.items())
    assert abs(plan.delta.p2p_bytes - expected) <= 16  # rounding per rank and dtype
    done = plans["delta"].done()
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert out["delta"]["fraction"] == 0.1
    assert out["delta"]["bytes_fraction"] == pytest.approx(0.3, rel=0.01)


# -- layouts that cannot shard, idle senders, defaults (issue 41 item 9) ------------------------


def _config_with(tmp_path: Path, **fields: object) -> Path:
    from p2pweights.testing import model_config

    config = {**model_config("qwen3-tiny"), **fields}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def test_heads_that_do_not_divide_by_tp_are_one_line_and_rc_2(tmp_path):
    path = _config_with(tmp_path, num_attention_heads=5, num_key_value_heads=5, hidden_size=160)
    done = _plan("--model", str(path), "--engine", "tp=2", "--senders", "2")
    assert done.returncode == 2, done.stderr
    refusal = [line for line in done.stderr.splitlines() if line.startswith("p2pweights plan:")]
    assert len(refusal) == 1 and "Traceback" not in done.stderr
    assert "num_attention_heads=5 does not divide by the attention TP size 2" in refusal[0]


def test_any_other_dimension_sglang_asserts_on_names_the_module(tmp_path):
    path = _config_with(tmp_path, intermediate_size=509)
    done = _plan("--model", str(path), "--engine", "tp=2", "--senders", "2")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "model.layers.0.mlp.gate_up_proj" in done.stderr
    assert "output_size % tp_size == 0" in done.stderr


def test_the_summary_says_which_senders_write_nothing_and_why(plan_folder):
    done = _plan("--model", str(plan_folder), "--engine", "tp=2", "--senders", "4")
    assert done.returncode == 0, done.stderr
    assert "2 of 4 sender(s) write nothing: each engine rank has one writer" in done.stdout


def test_help_shows_the_defaults():
    done = subprocess.run(
        [sys.executable, "-m", "p2pweights.cli", "plan", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "(default: 50.0)" in done.stdout and "(default: 512MiB)" in done.stdout


def test_fp8_blocks_wider_than_a_ranks_share_name_the_parameter_and_the_way_out():
    """Kimi-K2's 128 x 128 fp8 blocks at tp=32, ep=32 (issue 41 item 8)."""
    done = _plan("--model", "kimi-k2-full", "--engine", "tp=32,ep=32", "--senders", "32")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    refusal = next(line for line in done.stderr.splitlines() if line.startswith("p2pweights"))
    assert "model.layers.0.mlp.gate_up_proj" in refusal
    assert "576 is not divisible by weight quantization block_n = 128" in refusal
    assert "64 x 64" in refusal and "moe_dense_tp_size=1" in refusal


def test_kimi_k2s_own_config_plans_as_the_architecture_sglang_serves(tmp_path):
    """Kimi-K2's config says model_type "kimi_k2" (remote code) and DeepseekV3ForCausalLM
    (issue 41 item 7): the plan reads it as deepseek_v3, as sglang serves it."""
    from p2pweights.testing import model_config

    config = {**model_config("kimi-k2-full"), "model_type": "kimi_k2"}
    config["auto_map"] = {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    done = _plan("--model", str(tmp_path), "--engine", "tp=16,ep=16", "--senders", "16")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "predicted p2p update" in done.stdout


def test_a_model_type_nobody_knows_is_one_short_line(tmp_path):
    config = {**json.loads(json.dumps(_qwen3())), "model_type": "nobody_knows"}
    config["architectures"] = ["NobodyKnowsForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    done = _plan("--model", str(tmp_path), "--engine", "tp=1", "--senders", "1")
    assert done.returncode == 2
    refusal = next(line for line in done.stderr.splitlines() if line.startswith("p2pweights"))
    assert "nobody_knows" in refusal and len(refusal) < 600


def _qwen3() -> dict:
    from p2pweights.testing import model_config

    return model_config("qwen3-tiny")
