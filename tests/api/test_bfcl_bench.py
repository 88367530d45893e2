"""bench/bfcl/: bfcl-eval's own data, handler and AST checker, wired right (a scripted
reply of the ground truth passes, a wrong one fails as BFCL says), and the whole path against a
real ``mesh serve --model tiny`` (no HTTP error, a verdict per entry; the random-weight
model's accuracy means nothing and is not asserted). bfcl-eval comes from
``scripts/install.sh test`` (with --no-deps); nothing here needs the network."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("bfcl_eval", reason="bfcl-eval: run `bash scripts/install.sh test`")
openai = pytest.importorskip("openai")

from bench.bfcl import __main__ as bfcl_bench  # noqa: E402
from tests.reliability.serve_proc import running, small_project  # noqa: E402


@pytest.fixture(scope="module")
def bfcl() -> bfcl_bench.Bfcl:
    return bfcl_bench.load_bfcl()


class ScriptedCompletions:
    """Stands in for ``client.chat.completions``: answers each request with the next reply
    and keeps the request."""

    def __init__(self, replies: list[dict[str, Any]]) -> None:
        self.replies = replies
        self.requests: list[dict[str, Any]] = []

    def create(self, **kwargs: Any) -> Any:
        self.requests.append(kwargs)
        message = dict(self.replies.pop(0))
        usage = None if message.pop("no_usage", False) else {
            "prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        return openai.types.chat.ChatCompletion.model_validate({
            "id": "x", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "finish_reason": "stop", "message": {
                "role": "assistant", **message}}],
            "usage": usage})


class ScriptedClient:
    api_key, base_url = "unused", "http://127.0.0.1:9/v1"

    def __init__(self, replies: list[dict[str, Any]]) -> None:
        self.completions = ScriptedCompletions(replies)
        self.chat = self


def call(name: str, arguments: dict[str, Any], n: int = 0) -> dict[str, Any]:
    return {"id": f"call_{n}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}


def test_checker_wiring_gives_bfcls_verdicts(bfcl: bfcl_bench.Bfcl) -> None:
    # simple_python_1's function is 'math.factorial': BFCL's tool conversion sends it as
    # 'math_factorial', and the checker maps it back only if the bench's entry in its model
    # table says underscore_to_dot.
    replies: list[dict[str, Any]] = [
        {"content": None, "tool_calls": [call("math_factorial", {"number": 5})]},
        {"content": None, "tool_calls": [call("math_factorial", {"number": 6})]},
        {"content": "The factorial of 5 is 120."},
        {"content": None, "tool_calls": [call("math_factorial", {"number": 5}, 0),
                                         call("math_factorial", {"number": 5}, 1)]},
        # A reply BFCL's handler cannot read (no usage): recorded, the run goes on.
        {"content": None, "tool_calls": [call("math_factorial", {"number": 5})],
         "no_usage": True},
    ]
    client = ScriptedClient(replies)
    handler = bfcl_bench.make_handler(bfcl, client, "m", tool_choice="required",
                                      max_tokens=77, temperature=0.0)
    entry = next(e for e in bfcl.load_entries("simple_python", include_prereq=False)
                 if e["id"] == "simple_python_1")
    plain = next(e for e in bfcl.load_entries("simple_python", include_prereq=False,
                                              include_language_specific_hint=False)
                 if e["id"] == "simple_python_1")
    answer = next(a for a in bfcl.load_answers("simple_python") if a["id"] == "simple_python_1")
    verdicts = [bfcl_bench.check_entry(bfcl, handler, entry, plain, answer, "simple_python")
                for _ in range(5)]
    assert [v["valid"] for v in verdicts] == [True, False, False, False, False]
    assert [v["error_type"] for v in verdicts] == [
        None, "value_error:others", "ast_decoder:decoder_failed",
        "simple_function_checker:wrong_count", "inference_error"]
    assert [v["calls"] for v in verdicts] == [1, 1, 0, 2, 0]
    assert all(v["http_error"] is None for v in verdicts)
    sent = client.completions.requests[0]
    assert sent["tool_choice"] == "required" and sent["max_tokens"] == 77
    assert [t["function"]["name"] for t in sent["tools"]] == ["math_factorial"]
    assert sent["messages"] == entry["question"][0]


def test_sample_is_seeded_per_category() -> None:
    entries = [{"id": str(i)} for i in range(50)]
    a = bfcl_bench.sample_entries(entries, 5, 3, "multiple")
    assert a == bfcl_bench.sample_entries(entries, 5, 3, "multiple")
    assert a != bfcl_bench.sample_entries(entries, 5, 4, "multiple")
    assert [int(e["id"]) for e in a] == sorted(int(e["id"]) for e in a)  # file order kept
    assert bfcl_bench.sample_entries(entries, None, 3, "multiple") == entries


def test_bench_against_mesh_serve_tiny(tmp_path: Path) -> None:
    out = tmp_path / "bfcl_tiny.json"
    with running(tmp_path / "data", small_project(tmp_path / "project"),
                 tmp_path / "cache") as served:
        rc = bfcl_bench.main(["--url", served.url, "--sample", "2", "--seed", "7",
                              "--max-tokens", "96", "--temperature", "0", "--quiet",
                              "--out", str(out)])
    assert rc == 0  # no HTTP error
    doc = json.loads(out.read_text())
    assert doc["model"] == "mesh-tiny-llama (random weights)"
    assert doc["server"]["prefix_tokens"] > 0 and doc["complete"] is True
    assert sorted(doc["accuracy_mean"]) == ["auto", "required"]
    results = doc["results"]
    assert sorted(results) == ["auto", "required"]
    for choice in results.values():
        assert list(choice) == list(bfcl_bench.CATEGORIES)
        for summary in choice.values():
            assert summary["entries"] == 2 and summary["http_errors"] == 0
            assert summary["p50_latency_s"] is not None
            for v in summary["verdicts"]:  # a verdict per entry: valid, or BFCL's reason
                assert v["http_error"] is None and isinstance(v["valid"], bool)
                assert v["valid"] or v["error_type"]
    ids = {c: [v["id"] for v in s["verdicts"]] for c, s in results["auto"].items()}
    assert ids == {c: [v["id"] for v in s["verdicts"]] for c, s in results["required"].items()}
