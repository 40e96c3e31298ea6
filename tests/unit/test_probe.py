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
