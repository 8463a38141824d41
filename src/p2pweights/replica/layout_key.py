"""When two engine ranks may share one replica: the layout key. Pure, no sglang import.

The rule: every server argument counts, except those known not to change which
bytes a rank holds or how they are laid out (``NOT_BYTE_RELEVANT``). An argument
sglang adds later, or one this module does not know, therefore keeps two engines
apart until someone classifies it; the cost of a wrong "relevant" is one more
replica, the cost of a wrong "irrelevant" is wrong bytes.

The key also holds what the server arguments do not: the model (the sha256 of
the trainer's copy of its ``config.json``, so the engines' own paths do not
count), the rank's parallelism, the runner (target or draft), and the installed
sglang version. Only ServerArgs fields count: ``/server_info`` also reports
runtime state (``version``, ``startup_time``, ``internal_states``, ...) that is
not an argument, and the caller passes the installed sglang's field names.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from p2pweights.replica.ranks import RankSpec

__all__ = ["ENGINE_LOCAL_ARGS", "NOT_BYTE_RELEVANT", "SAME_MODEL", "LayoutKey", "layout_args"]

ENGINE_LOCAL_ARGS = frozenset(
    {"model_path", "tokenizer_path", "host", "port", "nccl_port", "dist_init_addr", "base_gpu_id"}
)
"""Paths and addresses of the engine's host. Not part of the key, and never passed to the
trainer's sglang: the trainer has its own copy of the model (``EngineEndpoint.model_path``)."""


def _names(text: str) -> frozenset[str]:
    """The whitespace-separated names of ``text``; lines starting with ``#`` are comments."""
    lines = (line.strip() for line in text.splitlines())
    return frozenset(name for line in lines if not line.startswith("#") for name in line.split())


_ADDRESSES = _names(
    """
    # where the engine listens, joins its peers, or fetches from: never the bytes
    gpu_id_step numa_node nnodes node_rank use_ray enable_p2p_check pre_warm_nccl
    gated_launch_port engine_info_bootstrap_port disaggregation_bootstrap_port
    encoder_bootstrap_port disaggregation_ib_device mooncake_ib_device grpc_mode
    grpc_port grpc_worker_threads smg_grpc_mode smg_http_sidecar_port sidecar
    sidecar_args enable_http2 http2_initial_connection_window_size
    http2_max_concurrent_streams enable_http_worker_reuseport fastapi_root_path
    ssl_ca_certs ssl_certfile ssl_keyfile ssl_keyfile_password enable_ssl_refresh
    encoder_urls encoder_register_urls decoupled_spec_bind_endpoint
    decoupled_spec_connect_endpoints weight_cache_socket load_publish_endpoint
    """
)

_STARTUP_IO = _names(
    """
    # how the checkpoint is read at start-up (the same tensors either way) and where
    # local files go; every update overwrites the bytes in place
    download_dir file_storage_path model_checksum weight_loader_disable_mmap
    weight_loader_drop_cache_after_load weight_loader_prefetch_checkpoints
    weight_loader_prefetch_num_threads delete_ckpt_after_loading
    checkpoint_engine_wait_weights_before_ready remote_instance_weight_loader_backend
    remote_instance_weight_loader_seed_instance_ip
    remote_instance_weight_loader_seed_instance_service_port
    remote_instance_weight_loader_send_weights_group_ports
    remote_instance_weight_loader_start_seed_via_transfer_engine
    modelopt_checkpoint_save_path modelopt_export_path skip_server_warmup warmups
    # where released weights wait (RL memory release), not how they are laid out
    enable_memory_saver enable_weights_cpu_backup enable_draft_weights_cpu_backup
    """
)

_OBSERVABILITY = _names(
    """
    log_level log_level_http log_requests log_requests_format log_requests_level
    log_requests_target decode_log_interval show_time_cost enable_metrics
    enable_metrics_for_all_schedulers enable_mfu_metrics enable_forward_pass_metrics
    forward_pass_metrics_ipc_name forward_pass_metrics_worker_id
    enable_request_time_stats_logging enable_cache_report bucket_e2e_request_latency
    bucket_inter_token_latency bucket_time_to_first_token prompt_tokens_buckets
    generation_tokens_buckets extra_metric_labels
    tokenizer_metrics_allowed_custom_labels tokenizer_metrics_custom_labels_header
    export_metrics_to_file export_metrics_to_file_dir stat_loggers enable_trace
    otlp_service_name otlp_traces_endpoint load_snapshot_publish_interval
    kv_events_config uvicorn_access_log_exclude_prefixes crash_dump_folder
    debug_tensor_dump_input_file debug_tensor_dump_layers
    debug_tensor_dump_output_folder kv_canary kv_canary_real_data
    kv_canary_sweep_interval gc_warning_threshold_secs enable_layerwise_nvtx_marker
    expert_distribution_recorder_mode expert_distribution_recorder_buffer_size
    expert_balancedness_report_mode spec_trace_dir
    """
)

_SCHEDULING = _names(
    """
    # which requests run when, and in batches of what size
    schedule_policy schedule_conservativeness schedule_low_priority_values_first
    enable_priority_scheduling priority_scheduling_preemption_threshold
    abort_on_priority_when_disabled default_priority_value disable_priority_preemption
    max_running_requests max_queued_requests max_prefill_tokens prefill_max_requests
    chunked_prefill_size enable_mixed_chunk enable_dynamic_chunking
    num_continuous_decode_steps num_reserved_decode_tokens scheduler_recv_interval
    retraction_policy sleep_on_idle load_balance_method min_free_slots_delay
    optimistic_prefill_attempts batch_notify_size prefill_decode_interval
    prefill_decode_interval_min_bs enable_prefill_delayer
    prefill_delayer_forward_passes_buckets prefill_delayer_max_delay_ms
    prefill_delayer_max_delay_passes prefill_delayer_queue_min_ratio
    prefill_delayer_token_usage_low_watermark prefill_delayer_wait_seconds_buckets
    disable_overlap_schedule pp_async_batch_depth pp_max_micro_batch_size
    stream_interval incremental_streaming_output enable_adaptive_dispatch_to_encoder
    random_seed
    """
)

_MEMORY_AND_CACHES = _names(
    """
    # how much memory the KV cache and prefix caches get, and their policies
    mem_fraction_static max_total_tokens page_size swa_full_tokens_ratio
    _swa_full_tokens_ratio_explicitly_set disable_hybrid_swa_memory
    mamba_full_memory_ratio max_mamba_cache_size disable_radix_cache radix_cache_backend
    radix_eviction_policy radix_eviction_policy_config
    _radix_eviction_policy_explicitly_set enable_session_radix_cache
    enable_hierarchical_cache hicache_host_memory_fraction hicache_host_memory_mode
    hicache_io_backend hicache_mem_layout hicache_ratio hicache_size
    hicache_storage_backend hicache_storage_backend_extra_config
    hicache_storage_prefetch_policy hicache_storage_prefetch_retry_max_attempts
    hicache_storage_prefetch_retry_poll_interval hicache_write_policy enable_lmcache
    lmcache_config_file enable_flexkv flexkv_config_file
    # KV transfer between prefill and decode engines (the mode itself still counts)
    disaggregation_transfer_backend disaggregation_decode_allocation_policy
    disaggregation_decode_enable_offload_kvcache
    disaggregation_decode_enable_radix_cache disaggregation_decode_extra_slots
    disaggregation_decode_host_receive_threshold disaggregation_decode_polling_interval
    disaggregation_decode_retraction_backup disaggregation_enable_kv_checksum
    encoder_transfer_backend
    """
)

_TIMEOUTS = _names(
    """
    watchdog_timeout soft_watchdog_timeout dist_timeout grpc_response_timeout_secs
    weight_cache_timeout elastic_ep_scale_timeout custom_sigquit_handler gc_threshold
    """
)

_EXECUTION_ONLY = _names(
    """
    # CUDA graphs and collectives: how a forward pass runs, never the parameters
    cuda_graph_backend_decode cuda_graph_backend_prefill cuda_graph_bs_decode
    cuda_graph_bs_prefill cuda_graph_config cuda_graph_max_bs_decode
    cuda_graph_max_bs_prefill cuda_graph_max_seq_len_prefill
    cuda_graph_prefill_max_context debug_cuda_graph disable_cuda_graph
    disable_cuda_graph_padding disable_decode_cuda_graph disable_prefill_cuda_graph
    enable_cudagraph_gc enable_profile_cuda_graph torch_compile_max_bs
    enable_torch_compile_debug_mode disable_custom_all_reduce enable_mscclpp
    enable_nccl_nvls
    # sampling and outputs
    sampling_backend sampling_mask_max_tokens enable_custom_logit_processor
    enable_return_hidden_states return_hidden_states_mode enable_return_routed_experts
    speculative_accept_threshold_single speculative_accept_threshold_acc
    """
)

_FRONT_END = _names(
    """
    # the HTTP / tokenizer side of the server, and its identity; weight_version is an
    # argument too, but one each update changes
    api_key admin_api_key served_model_name weight_version tokenizer_mode
    tokenizer_backend tokenizer_worker_num skip_tokenizer_init
    enable_tokenizer_batch_encode disable_tokenizer_batch_decode
    enable_dynamic_batch_tokenizer dynamic_batch_tokenizer_batch_size
    dynamic_batch_tokenizer_batch_timeout detokenizer_worker_num chat_template
    completion_template hf_chat_template_name default_chat_template_kwargs
    trust_request_chat_template reasoning_parser tool_call_parser tool_server
    enable_strict_thinking strip_thinking_cache grammar_backend
    constrained_json_disable_any_whitespace constrained_json_max_whitespace_cnt
    constrained_json_whitespace_pattern allow_auto_truncate preferred_sampling_params
    sampling_defaults return_input_ids return_output_ids
    stream_response_default_include_usage enable_response_store enable_streaming_session
    asr_max_buffer_seconds asr_max_concurrent_sessions
    # multimodal inputs: fetching and preprocessing, not the vision tower
    allowed_media_domains media_url_max_file_size_mb limit_mm_data_per_request
    disable_fast_image_processor image_processor_backend mm_processor_worker_num
    mm_io_worker_num mm_preprocess_cache_size_mb enable_mm_global_cache
    mm_global_cache_backend enable_prefix_mm_cache trust_mm_content_hashes
    enable_broadcast_mm_inputs_process
    """
)

_NGRAM = _names(
    """
    # n-gram speculation has no draft model; these size its lookup tables
    speculative_ngram_capacity speculative_ngram_external_corpus_max_tokens
    speculative_ngram_external_corpus_path speculative_ngram_external_sam_budget
    speculative_ngram_match_type speculative_ngram_max_bfs_breadth
    speculative_ngram_max_trie_depth speculative_ngram_min_bfs_breadth
    """
)

NOT_BYTE_RELEVANT: frozenset[str] = (
    ENGINE_LOCAL_ARGS
    | _ADDRESSES
    | _STARTUP_IO
    | _OBSERVABILITY
    | _SCHEDULING
    | _MEMORY_AND_CACHES
    | _TIMEOUTS
    | _EXECUTION_ONLY
    | _FRONT_END
    | _NGRAM
)
"""Server arguments known not to change a rank's bytes or their layout (sglang 0.5.23).

Left out on purpose, so they stay in the key: attention, GEMM and MoE backends
(some re-lay weights at start-up), quantization and dtypes, every parallel width,
LoRA, speculative decoding, ``load_format``, ``model_impl``, ``json_model_override_args``,
``context_length``, ``enable_torch_compile``, watermarking and anything unclassified.
"""

_MODEL_PATH_ALIASES = ("speculative_draft_model_path",)
"""Arguments that name the engine's own model folder when the draft is the model itself."""

SAME_MODEL = "<the engine's model>"
"""What such an argument reads as in the key: engine-local paths must not count."""


def layout_args(
    server_info: Mapping[str, Any], server_args_names: Collection[str]
) -> tuple[tuple[str, str], ...]:
    """(name, JSON value) of each server argument of ``server_info`` that may change bytes.

    ``server_args_names``: the installed sglang's ServerArgs field names; other keys of
    ``/server_info`` are runtime state. A None value counts as absent (sglang's
    default either way).
    """
    model_path = server_info.get("model_path")
    found = []
    for name in sorted(set(server_info).intersection(server_args_names) - NOT_BYTE_RELEVANT):
        value = server_info[name]
        if value is None:
            continue
        if name in _MODEL_PATH_ALIASES and value == model_path:
            value = SAME_MODEL
        found.append((name, json.dumps(value, sort_keys=True, default=str)))
    return tuple(found)


@dataclass(frozen=True)
class LayoutKey:
    """Engine ranks with equal keys hold the same bytes in the same layout."""

    config_sha256: str
    """Of the trainer's copy of the model's ``config.json``."""
    rank: RankSpec
    role: str
    """``"target"`` or ``"draft"`` (a same-model speculative draft)."""
    sglang_version: str
    """The installed sglang, whose model code the replica runs."""
    server_args: tuple[tuple[str, str], ...]
    """``layout_args`` of the engine's ``/server_info``."""
