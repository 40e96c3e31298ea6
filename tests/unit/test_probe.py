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
