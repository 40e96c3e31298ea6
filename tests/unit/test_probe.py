"""The engine load probe's parser: SGLang and vLLM names, one engine exporting both."""

from __future__ import annotations

from nodeagent.probe import parse_metrics


def test_an_engine_exporting_both_families_is_counted_once() -> None:
    text = "\n".join(
        [
            "# HELP sglang:num_running_reqs Running sequences.",
            'sglang:num_running_reqs{model_name="sim"} 5',
            'sglang:num_queue_reqs{model_name="sim"} 2',
            'vllm:num_requests_running{model_name="sim"} 5',
            'vllm:num_requests_waiting{model_name="sim"} 2',
            "sglang:token_usage 0.25",
            "vllm:kv_cache_usage_perc 0.5",
        ]
    )
    s = parse_metrics(text)
    assert (s.running, s.waiting, s.kv_usage, s.probe_ok) == (5, 2, 0.25, True)


def test_label_sets_of_one_family_are_summed_and_vllm_alone_works() -> None:
    text = 'vllm:num_requests_running{engine="0"} 3\nvllm:num_requests_running{engine="1"} 4\n'
    s = parse_metrics(text)
    assert (s.running, s.waiting, s.probe_ok) == (7, 0, True)
    assert not parse_metrics("other_metric 1\n").probe_ok


def test_sglang_load_endpoints_without_metrics() -> None:
    from nodeagent.probe import parse_get_load, parse_v1_loads

    # /get_load: one entry per data-parallel rank; num_reqs counts running and waiting
    s = parse_get_load([{"dp_rank": 0, "num_reqs": 5, "num_waiting_reqs": 2, "num_tokens": 100},
                        {"dp_rank": 1, "num_reqs": 1, "num_waiting_reqs": 0}])  # fmt: skip
    assert (s.running, s.waiting, s.probe_ok) == (4, 2, True)
    assert not parse_get_load({"unexpected": 1}).probe_ok
    agg = {"aggregate": {"total_running_reqs": 3, "total_waiting_reqs": 1, "avg_token_usage": 0.5}}
    s = parse_v1_loads(agg)
    assert (s.running, s.waiting, s.kv_usage, s.probe_ok) == (3, 1, 0.5, True)
    assert not parse_v1_loads({"loads": []}).probe_ok


def test_load_signal_urls_go_from_metrics_to_what_stock_sglang_serves() -> None:
    from nodeagent.probe import load_signal_urls

    assert load_signal_urls("http://e:1/") == (
        "http://e:1/metrics",
        "http://e:1/v1/loads",
        "http://e:1/get_load",
    )


def test_a_decode_server_s_requests_waiting_for_their_kv_count_as_waiting() -> None:
    """SGLang's decode server holds a request in its prealloc and transfer queues until its KV
    arrives, outside num_queue_reqs: all three are what it holds besides the running ones. vLLM's
    two KV-usage names are one value, not a sum."""
    text = "\n".join(
        [
            'sglang:num_running_reqs{tp_rank="0"} 4',
            'sglang:num_queue_reqs{tp_rank="0"} 1',
            'sglang:num_decode_prealloc_queue_reqs{tp_rank="0"} 2',
            'sglang:num_decode_transfer_queue_reqs{tp_rank="0"} 3',
            "vllm:num_requests_waiting 9",
        ]
    )
    s = parse_metrics(text)
    assert (s.running, s.waiting) == (4, 6)
    s = parse_metrics(
        "vllm:num_requests_running 2\nvllm:kv_cache_usage_perc 0.3\nvllm:gpu_cache_usage_perc 0.3\n"
    )
    assert (s.running, s.waiting, s.kv_usage) == (2, 0, 0.3)


def test_retractions_and_the_kv_pool_from_either_engine() -> None:
    """SGLang: the counter sglang:num_retracted_requests (exposed with _total) and the gauge
    sglang:max_total_num_tokens; vLLM: the counter vllm:num_preemptions (_total) and the info gauge
    vllm:cache_config_info, whose labels give num_gpu_blocks x block_size. SGLang's gauge
    num_retracted_reqs is the last interval's count, not a total: not read."""
    from nodeagent.probe import parse_metrics

    sglang = "\n".join(
        [
            'sglang:num_running_reqs{tp_rank="0"} 4',
            'sglang:num_retracted_reqs{tp_rank="0"} 9',
            'sglang:num_retracted_requests_total{tp_rank="0"} 3',
            'sglang:num_retracted_requests_created{tp_rank="0"} 1.7e9',
            'sglang:max_total_num_tokens{tp_rank="0"} 500000',
        ]
    )
    s = parse_metrics(sglang)
    assert (s.running, s.retractions, s.kv_tokens, s.prefill_backlog_tokens) == (4, 3, 500000, None)
    vllm = "\n".join(
        [
            'vllm:num_requests_running{engine="0",model_name="m"} 2',
            'vllm:num_preemptions_total{engine="0",model_name="m"} 5',
            'vllm:num_preemptions_total{engine="1",model_name="m"} 2',
            'vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",'
            'gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="2048",'
            'prefix_caching_hash_algo="sha256"} 1.0',
        ]
    )
    s = parse_metrics(vllm)
    assert (s.running, s.retractions, s.kv_tokens) == (2, 7, 2048 * 16)
    # before profiling (num_gpu_blocks None) there is no pool; an engine saying nothing has none
    s = parse_metrics('vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1\n')
    assert s.kv_tokens is None and s.retractions is None
    # the wire: set only what is known
    msg = parse_metrics(vllm).to_pb()
    assert msg.HasField("retractions") and msg.retractions == 7
    assert not msg.HasField("prefill_backlog_tokens")
    assert not parse_metrics("vllm:num_requests_running 1\n").to_pb().HasField("retractions")


def test_vllm_pool_from_cache_config_labels() -> None:
    from nodeagent.probe import vllm_pool_tokens

    assert vllm_pool_tokens({"num_gpu_blocks": "100", "block_size": "32"}) == 3200
    assert vllm_pool_tokens({"num_gpu_blocks": "None", "block_size": "32"}) is None
    assert vllm_pool_tokens({"block_size": "32"}) is None
    assert vllm_pool_tokens({"num_gpu_blocks": "0", "block_size": "32"}) is None


def test_sglang_v1_loads_gives_the_pool_too() -> None:
    from nodeagent.probe import EngineSample, parse_v1_loads

    data = {
        "aggregate": {"total_running_reqs": 2, "total_waiting_reqs": 0, "avg_token_usage": 0.1},
        "loads": [{"dp_rank": r, "max_total_num_tokens": 90000} for r in (0, 1)],
    }
    s = parse_v1_loads(data)
    assert isinstance(s, EngineSample) and (s.running, s.kv_tokens) == (2, 90000)
    s = parse_v1_loads({"aggregate": {"total_running_reqs": 1}})
    assert isinstance(s, EngineSample) and s.kv_tokens is None
