"""What the OpenAI backend reads off the wire: the engine spec, SSE events, ``/metrics``.

Pure functions, no I/O, so they are tested without a server.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from mesh.engine.interface import ModelError

__all__ = ["backend_counters", "backend_gauges", "check_context", "grammar_fields",
           "parse_engine_spec", "parse_prometheus", "sse_data"]

ENGINE_LOCAL = "llama.cpp"
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_engine_spec(spec: str) -> str | None:
    """``--engine`` value → the backend's base URL, or None for the local pool.

    ``llama.cpp`` (or ``local``) is the local pool; ``openai:URL`` is an OpenAI-compatible
    server at URL (``http://host:port``, with or without a trailing ``/v1``). Raises
    ``ValueError`` naming the fix.
    """
    if spec in (ENGINE_LOCAL, "local"):
        return None
    if not spec.startswith("openai:"):
        raise ValueError(f"--engine must be 'llama.cpp' or 'openai:URL', got {spec!r}")
    url = spec.removeprefix("openai:").rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--engine openai:URL needs an absolute http(s) URL, got {url!r}")
    return url.removesuffix("/v1")


def sse_data(line: str) -> dict[str, Any] | None:
    """The JSON object of one ``data: {...}`` SSE line; None for anything else (comments,
    blank lines, ``[DONE]``, other fields). A ``data:`` line that is not JSON raises
    ``ValueError`` (the backend broke the stream)."""
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if not payload or payload == "[DONE]":
        return None
    doc = json.loads(payload)
    if not isinstance(doc, dict):
        raise ValueError(f"SSE data is not a JSON object: {payload[:80]!r}")
    return doc


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text → ``{name: value}``, samples of one name with several label sets
    summed (a backend serving one model reports one set; summing is right for counts)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        if math.isfinite(value):
            out[m.group(1)] = out.get(m.group(1), 0.0) + value
    return out


def _ratio(metrics: Mapping[str, float], total: str, count: str) -> float | None:
    n = metrics.get(count)
    return metrics[total] / n if n and total in metrics else None


def backend_gauges(metrics: Mapping[str, float]) -> dict[str, float | None]:
    """The few numbers the gate's readers want, from vLLM's, llama-server's or mesh's own
    metric names (whichever the backend exposes; absent ones are None)."""

    def first(*names: str) -> float | None:
        return next((metrics[n] for n in names if n in metrics), None)

    itl = _ratio(metrics, "vllm:time_per_output_token_seconds_sum",
                 "vllm:time_per_output_token_seconds_count")
    if itl is None:
        itl = _ratio(metrics, "vllm:inter_token_latency_seconds_sum",
                     "vllm:inter_token_latency_seconds_count")
    tps = first("llamacpp:predicted_tokens_seconds", "mesh_session_tps_p50")
    if tps is None and itl:
        tps = 1.0 / itl
    return {
        "running": first("vllm:num_requests_running", "llamacpp:requests_processing"),
        "waiting": first("vllm:num_requests_waiting", "llamacpp:requests_deferred",
                         "mesh_gate_queue_length"),
        "inter_token_s": itl,
        "decode_tps": tps,
        "kv_usage": first("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
                          "llamacpp:kv_cache_usage_ratio"),
    }


def backend_counters(metrics: Mapping[str, float]) -> dict[str, float]:
    """The backend's prefix-cache counters since it started, where it counts them (vLLM:
    ``vllm:prefix_cache_queries_total`` / ``hits_total``, in prompt tokens), and the hit
    rate they give: how much of every prompt mesh sent was served from the cache."""
    out: dict[str, float] = {}
    queries = metrics.get("vllm:prefix_cache_queries_total")
    hits = metrics.get("vllm:prefix_cache_hits_total")
    if queries is not None and hits is not None:
        out = {"prefix_cache_queries": queries, "prefix_cache_hits": hits}
        if queries > 0:
            out["prefix_cache_hit_rate"] = hits / queries
    return out


def grammar_fields(owner: str | None, grammar: str) -> dict[str, Any]:
    """The request field that carries a GBNF ``grammar`` to a backend, by who serves the
    model (``owned_by`` in its ``GET /v1/models``). vLLM reads ``structured_outputs.grammar``
    (xgrammar takes GBNF) and silently ignores llama.cpp's ``grammar`` field, so a plan or a
    tool call would go unconstrained there; SGLang reads ``ebnf``; llama.cpp's servers and
    mesh read ``grammar``."""
    if owner == "vllm":
        return {"structured_outputs": {"grammar": grammar}}
    if owner == "sglang":
        return {"ebnf": grammar}
    return {"grammar": grammar}


def check_context(url: str, model_id: str | None, n_prefix: int, session_budget: int,
                  max_model_len: object) -> None:
    """A backend that says its context (vLLM: ``max_model_len`` in ``/v1/models``) must
    hold the prefix plus one full session; otherwise a session would fail mid-turn (HTTP
    400) once it grows past it, so refuse at start, naming the fix (``ModelError``)."""
    if not isinstance(max_model_len, int) or max_model_len <= 0:
        return
    need = n_prefix + session_budget
    if need > max_model_len:
        raise ModelError(
            f"{url} serves {model_id!r} with a context of {max_model_len} tokens; mesh "
            f"needs the {n_prefix}-token prefix plus a {session_budget}-token session = "
            f"{need}: start the backend with a longer context (vLLM: --max-model-len "
            f"{need}) or lower --session-budget to {max_model_len - n_prefix} or less")
