"""The cluster plan's pure parts: stages, bytes, bounds, the predicted time and the JSON."""

from __future__ import annotations

import math

import pytest

from p2pweights.errors import ConfigError
from p2pweights.plan.cluster import EngineLoad, RankLoad, pipeline_stage_of, plan_cluster
from p2pweights.plan.cost import (
    GB,
    LinkModel,
    PipelineModel,
    ReceiverLoad,
    SenderLoad,
    broadcast_lower_bound,
    delta_bytes,
    p2p_lower_bound,
    predict,
)
from p2pweights.planner import parse_engine_spec


@pytest.mark.parametrize(
    ("name", "stages", "expected"),
    [
        ("model.embed_tokens.weight", 4, 0),
        ("model.layers.0.self_attn.qkv_proj.weight", 4, 0),
        ("model.layers.7.mlp.experts.w13_weight", 4, 0),  # 8 layers per stage of 32
        ("model.layers.8.mlp.experts.w13_weight", 4, 1),
        ("model.layers.31.mlp.experts.w2_weight", 4, 3),
        ("model.layers.32.eh_proj.weight", 4, 3),  # an MTP layer: the last stage
        ("model.norm.weight", 4, 3),
        ("lm_head.weight", 4, 3),
        ("lm_head.weight", 1, 0),
    ],
)
def test_pipeline_stage_of(name, stages, expected):
    assert pipeline_stage_of(name, 32, stages) == expected


def _engine(tp: int, rank_bytes: int, *, stages: int = 1, tag: str = "") -> EngineLoad:
    share = rank_bytes // stages
    return EngineLoad(
        layout={"tp": tp},
        ranks=tuple(
            RankLoad(layout_key=(tag or tp, r), bytes_by_stage=(share,) * stages) for r in range(tp)
        ),
    )


def test_tp4_beside_tp2_bytes_bounds_and_json():
    # the same 8 GB model: TP 4 ranks hold 2 GB, TP 2 ranks 4 GB; 4 senders
    plan = plan_cluster(
        [_engine(4, 2 * 10**9), _engine(2, 4 * 10**9)],
        num_senders=4,
        broadcast_bytes_by_stage=[8 * 10**9],
    )
    out = plan.to_json()
    assert out["p2p_bytes"] == 16 * 10**9
    assert out["broadcast_bytes"] == 6 * 8 * 10**9  # every engine GPU takes the whole model
    senders = {s["rank"]: s["bytes"] for s in out["senders"]}
    assert sorted(senders.values()) == [4 * 10**9] * 4  # bytes balanced, not target counts
    for engine in out["engines"]:
        for rank in engine["ranks"]:
            assert isinstance(rank["sender"], int)
    written = {}
    for e, engine in enumerate(out["engines"]):
        for rank in engine["ranks"]:
            written[rank["sender"]] = written.get(rank["sender"], 0) + rank["bytes"]
            assert [e, rank["rank"]] in out["senders"][rank["sender"]]["targets"]
    assert written == senders
    # busiest link: 4 GB over one 50 GB/s NIC (a TP 2 rank, or a sender writing 4 GB)
    assert out["lower_bound_s"]["p2p"] == pytest.approx(4 / 50)
    assert "NIC" in out["busiest_link"]["p2p"]["link"]
    # broadcast: 8 GB into 6 GPUs of one node: node ingress 6 x 50 GB/s is the tightest
    assert out["lower_bound_s"]["broadcast"] == pytest.approx(8 / 300)
    assert out["busiest_link"]["broadcast"]["link"] == "engine node ingress (6 NICs)"
    assert out["predicted_s"]["seconds"] >= out["lower_bound_s"]["p2p"]
    assert "rank   0" in plan.render()


def test_pipeline_stages_give_each_rank_one_writer_per_stage():
    engines = [_engine(2, 8 * 10**9, stages=2, tag="a"), _engine(2, 8 * 10**9, stages=2, tag="a")]
    plan = plan_cluster(engines, num_senders=4, num_stages=2, broadcast_bytes_by_stage=[8, 8])
    out = plan.to_json()
    # 2 senders per stage; each loads rank r once and writes it to both engines
    for engine in out["engines"]:
        for r, rank in enumerate(engine["ranks"]):
            assert rank["sender"] == [r, 2 + r]
    assert [s["stage"] for s in out["senders"]] == [0, 0, 1, 1]
    assert {s["bytes"] for s in out["senders"]} == {8 * 10**9}
    assert {s["loaded_bytes"] for s in out["senders"]} == {4 * 10**9}


def test_stages_must_divide_the_senders():
    with pytest.raises(ConfigError, match="multiple of --stages"):
        plan_cluster([_engine(2, 10)], num_senders=3, num_stages=2, broadcast_bytes_by_stage=[1, 1])


def test_host_staging_can_be_the_busiest_link():
    senders = [SenderLoad(rank=0, write_bytes=40 * 10**9, load_bytes=40 * 10**9)]
    receivers = [ReceiverLoad(name="engine 0 rank 0", num_bytes=40 * 10**9)]
    slow_host = LinkModel(host_gbps=20.0)
    bound = p2p_lower_bound(senders, receivers, slow_host)
    assert bound.link == "sender 0 host link (staging)"
    assert bound.seconds == pytest.approx(2.0)
    device = p2p_lower_bound(senders, receivers, LinkModel(host_gbps=20.0, staging="device"))
    assert device.link == "sender 0 NIC (out)" and device.seconds == pytest.approx(0.8)


def test_broadcast_bound_per_stage_source():
    links = LinkModel()
    # one GPU receiving: only its NIC; a single stage source sends over NVLink + NIC
    assert broadcast_lower_bound([10**9], 1, links).seconds == pytest.approx(1 / 50)
    wide = broadcast_lower_bound([10**11, 10**9], 64, links)
    assert wide.link == "engine node ingress (8 NICs)"
    assert wide.seconds == pytest.approx(101 / 400)


def test_predicted_time_by_hand():
    pipeline = PipelineModel(
        buffer_bytes=10**9,
        loader_call_s=1e-4,
        quantize_gbps=100.0,
        quantize_call_s=1e-4,
        flush_overhead_s=1e-3,
        control_call_s=0.01,
        engine_finish_s=0.5,
    )
    links = LinkModel(staging="host")
    sender = SenderLoad(
        rank=0,
        write_bytes=20 * 10**9,  # writes two targets of one layout
        load_bytes=10 * 10**9,
        loader_inputs=1000,
        quantized_bytes=2 * 10**9,  # bf16 in: 0.02 s of GPU time
        quantized_inputs=500,  # 0.05 s of launches: the longer one counts
    )
    prediction = predict([sender], [], 3, links, pipeline)
    load = 10 / 55 + 1000 * 1e-4 + max(2 / 100, 500 * 1e-4)
    write = 20 / 50
    transfer = max(load, write) + min(load, write) / 10 + 10 * 1e-3
    assert prediction.load_s == pytest.approx(load)
    assert prediction.write_s == pytest.approx(write)
    assert prediction.num_flushes == 10
    assert prediction.transfer_s == pytest.approx(transfer)
    assert prediction.control_s == pytest.approx(0.07)  # 7 calls, 3 engines at once
    assert prediction.seconds == pytest.approx(transfer + 0.07 + 0.5)
    # staged on the GPU: its copy rate, and the replay's cost there (one launch a step)
    on_gpu = predict([sender], [], 3, LinkModel(staging="device"), pipeline)
    gpu_load = 10 / 1920 + 1000 * pipeline.device_loader_call_s + max(2 / 100, 500 * 1e-4)
    assert on_gpu.load_s == pytest.approx(gpu_load)


def test_calibrated_defaults_say_where_they_come_from():
    pipeline = PipelineModel()
    # the H200 pipeline run: 0.0198 s for 4 GiB against a 0.0163 s raw write, 16 flushes
    assert pipeline.flush_overhead_s == pytest.approx(0.2e-3, rel=0.1)
    assert pipeline.transport_efficiency == 1.0
    assert LinkModel().host_gbps == 55.0 and LinkModel().nic_gbps == 50.0
    assert math.isclose(pipeline.control_call_s * pipeline.control_calls, 0.059)
    assert GB == 1e9


@pytest.mark.parametrize(
    ("text", "layout", "server_args", "count"),
    [
        ("tp=4", {"tp": 4}, {"tp_size": 4}, 1),
        ("tp=8,ep=8", {"tp": 8, "ep": 8}, {"tp_size": 8, "ep_size": 8}, 1),
        (
            "tp=32,ep=32,dp_attention=4,moe_dense_tp_size=1,count=8",
            {"tp": 32, "ep": 32, "dp_attention": 4, "moe_dense_tp_size": 1},
            {
                "tp_size": 32,
                "ep_size": 32,
                "enable_dp_attention": True,
                "dp_size": 4,
                "moe_dense_tp_size": 1,
            },
            8,
        ),
        (
            "tp=2, enforce_shared_experts_fusion=true",
            {"tp": 2, "enforce_shared_experts_fusion": True},
            {"tp_size": 2, "enforce_shared_experts_fusion": True},
            1,
        ),
    ],
)
def test_engine_specs(text, layout, server_args, count):
    spec = parse_engine_spec(text)
    assert (spec.layout, spec.server_args, spec.count) == (layout, server_args, count)


@pytest.mark.parametrize(
    ("text", "match"),
    [("ep=2", "needs tp"), ("tp=2,ep", "key=value"), ("tp=2,count=0", "count")],
)
def test_bad_engine_specs(text, match):
    with pytest.raises(ConfigError, match=match):
        parse_engine_spec(text)


def test_delta_bytes_per_changed_element_capped_at_full():
    # bf16: an int32 index and a 2-byte value per changed element
    assert delta_bytes({2: 100 * 10**9}, 0.02) == 6 * 10**9
    # fp8 weights with fp32 scales: 5 and 8 bytes per changed element
    assert delta_bytes({1: 10**9, 4: 4 * 10**6}, 0.1) == 5 * 10**8 + 8 * 10**5
    # past a third of bf16 values changed, the full bytes are smaller
    assert delta_bytes({2: 10**9}, 0.5) == 10**9
    assert delta_bytes({2: 10**9}, 0.0) == 0


def test_delta_plan_beside_the_full_one():
    engines = [
        EngineLoad(
            layout={"tp": 2},
            ranks=tuple(
                RankLoad(
                    layout_key=("a", r),
                    bytes_by_stage=(4 * 10**9,),
                    bytes_by_itemsize_by_stage=({2: 4 * 10**9},),
                )
                for r in range(2)
            ),
        )
    ]
    full = plan_cluster(engines, num_senders=2, broadcast_bytes_by_stage=[8 * 10**9])
    assert full.delta is None and "delta" not in full.to_json()
    plan = plan_cluster(
        engines, num_senders=2, broadcast_bytes_by_stage=[8 * 10**9], delta_fraction=0.1
    )
    delta = plan.delta
    assert delta is not None and delta.fraction == 0.1
    assert delta.p2p_bytes == 2 * int(0.1 * 2 * 10**9) * 6  # 10 % of 2e9 elements, 6 B each
    # host staging still stages every byte: its host link, not the NIC, is the bound
    assert delta.p2p_bound.link == "sender 0 host link (staging)"
    assert delta.p2p_bound.seconds == pytest.approx(4 / 55)
    on_gpu = plan_cluster(
        engines,
        num_senders=2,
        broadcast_bytes_by_stage=[8 * 10**9],
        links=LinkModel(staging="device"),
        delta_fraction=0.1,
    ).delta
    assert on_gpu is not None and on_gpu.p2p_bound.seconds == pytest.approx(1.2 / 50)
    # the sender still loads every byte, and compares it with the previous update's
    assert delta.prediction.write_s == pytest.approx(1.2 / 50)
    assert delta.prediction.load_s > plan.prediction.load_s
    out = plan.to_json()["delta"]
    assert out["fraction"] == 0.1 and out["p2p_bytes"] == delta.p2p_bytes
    assert out["bytes_fraction"] == pytest.approx(0.3)
    assert "delta update at 10 % changed" in plan.render()
    with pytest.raises(ConfigError, match="delta fraction"):
        plan_cluster(engines, num_senders=2, broadcast_bytes_by_stage=[1], delta_fraction=1.5)


def test_delta_compare_cost_in_the_load_stage():
    pipeline = PipelineModel(
        delta_host_gbps=2.0,
        delta_host_changed_s=1e-8,
        delta_device_gbps=500.0,
        delta_device_changed_s=1e-11,
    )
    sender = SenderLoad(
        rank=0,
        write_bytes=10**9,
        load_bytes=10**10,
        compared_bytes=10**10,
        changed_elements=10**8,
    )
    plain = SenderLoad(rank=0, write_bytes=10**9, load_bytes=10**10)
    host = predict([sender], [], 1, LinkModel(), pipeline).load_s
    base = predict([plain], [], 1, LinkModel(), pipeline).load_s
    assert host - base == pytest.approx(5.0 + 1.0)
    dev = LinkModel(staging="device")
    gpu = predict([sender], [], 1, dev, pipeline).load_s
    assert gpu - predict([plain], [], 1, dev, pipeline).load_s == pytest.approx(0.02 + 0.001)
