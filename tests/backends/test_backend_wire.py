"""What the OpenAI backend reads off the wire (pure functions)."""

from __future__ import annotations

import pytest

from mesh.backends.openai import backend_gauges, parse_engine_spec, parse_prometheus, sse_data


def test_engine_spec() -> None:
    assert parse_engine_spec("llama.cpp") is None
    assert parse_engine_spec("local") is None
    assert parse_engine_spec("openai:http://h:8000/v1/") == "http://h:8000"
    assert parse_engine_spec("openai:https://h") == "https://h"
    with pytest.raises(ValueError, match="openai:URL"):
        parse_engine_spec("vllm:http://h")
    with pytest.raises(ValueError, match="absolute"):
        parse_engine_spec("openai:h:8000")


def test_sse_lines() -> None:
    assert sse_data('data: {"choices": [{"text": "a"}]}') == {"choices": [{"text": "a"}]}
    assert sse_data("data: [DONE]") is None
    assert sse_data(": keep-alive") is None
    assert sse_data("") is None
    assert sse_data("event: x") is None
    with pytest.raises(ValueError):
        sse_data("data: {not json")
    with pytest.raises(ValueError, match="not a JSON object"):
        sse_data("data: [1, 2]")


VLLM = """# HELP vllm:num_requests_running Number of requests running.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 3.0
vllm:num_requests_waiting{model_name="m"} 1.0
vllm:kv_cache_usage_perc{model_name="m"} 0.25
vllm:time_per_output_token_seconds_sum{model_name="m"} 2.0
vllm:time_per_output_token_seconds_count{model_name="m"} 100.0
vllm:time_per_output_token_seconds_bucket{le="0.01",model_name="m"} 40.0
"""

LLAMA_SERVER = """llamacpp:requests_processing 2
llamacpp:requests_deferred 0
llamacpp:predicted_tokens_seconds 41.5
llamacpp:kv_cache_usage_ratio NaN
"""


def test_vllm_metrics() -> None:
    g = backend_gauges(parse_prometheus(VLLM))
    assert g == {"running": 3.0, "waiting": 1.0, "inter_token_s": 0.02, "decode_tps": 50.0,
                 "kv_usage": 0.25}


def test_llama_server_metrics_skip_nan() -> None:
    g = backend_gauges(parse_prometheus(LLAMA_SERVER))
    assert g == {"running": 2.0, "waiting": 0.0, "inter_token_s": None, "decode_tps": 41.5,
                 "kv_usage": None}


def test_unknown_metrics_are_none() -> None:
    assert set(backend_gauges(parse_prometheus("other 1\n")).values()) == {None}
