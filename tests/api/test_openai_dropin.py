"""Issue 29 part 1: stock OpenAI clients against a real ``mesh serve --model tiny``,
unchanged: the plain ``openai`` SDK and LangChain's ``ChatOpenAI`` (langchain-openai),
with and without a system message of their own, with tools. No client fetches
``/v1/prefix``: mesh puts the pool's system text first (the ``:strict`` model keeps the old
400)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.reliability.serve_proc import ServeProc, running, small_project

openai = pytest.importorskip("openai")

TINY_NAME = "mesh-tiny-llama (random weights)"  # the tiny GGUF's general.name
READ = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the project.",
    "parameters": {"type": "object", "required": ["path"], "properties": {
        "path": {"type": "string"}, "lines": {"type": "integer"}}}}}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProc]:
    root = tmp_path_factory.mktemp("dropin")
    with running(root / "data", small_project(root / "project"), root / "cache") as proc:
        yield proc


@pytest.fixture(scope="module")
def prefix_tokens(served: ServeProc) -> int:
    return int(httpx.get(served.url + "/v1/prefix", timeout=10).json()["prefix_tokens"])


def client(served: ServeProc) -> Any:
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", timeout=60,
                         max_retries=0)


def test_models_name_the_gguf(served: ServeProc) -> None:
    models = client(served).models.list().data
    assert [m.id for m in models] == [TINY_NAME, TINY_NAME + ":strict"]
    raw = httpx.get(served.url + "/v1/models", timeout=10).json()["data"][0]
    assert raw["root"].startswith("mesh-tiny-llama") and raw["root"].endswith(".gguf")
    out = client(served).chat.completions.create(
        model=models[0].id, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert out.model == TINY_NAME


def test_sdk_without_and_with_a_system_message(served: ServeProc, prefix_tokens: int) -> None:
    oa = client(served)
    # No system message at all: served on the pool's prefix, which was already in the pool.
    out = oa.chat.completions.create(
        model=TINY_NAME, messages=[{"role": "user", "content": "Which file defines add?"}],
        max_tokens=6, temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    assert out.usage.prompt_tokens_details.cached_tokens == prefix_tokens
    # A system message of the client's own follows the pool's; a second turn continues
    # the cached conversation (everything the first turn read and wrote is reused).
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a terse code reviewer."},
        {"role": "user", "content": "Is main.py fine?"}]
    first = oa.chat.completions.create(model=TINY_NAME, messages=messages, max_tokens=6,
                                       temperature=0)
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == prefix_tokens
    messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                 {"role": "user", "content": "And README.md?"}]
    second = oa.chat.completions.create(model=TINY_NAME, messages=messages, max_tokens=6,
                                        temperature=0)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    unseen = 1 if first.choices[0].finish_reason == "length" else 0
    assert second.usage.prompt_tokens_details.cached_tokens == (
        first.usage.prompt_tokens + first.usage.completion_tokens - unseen)
    # The strict rule is one model name away.
    with pytest.raises(openai.BadRequestError, match="differ at token"):
        oa.chat.completions.create(model=TINY_NAME + ":strict", max_tokens=2, messages=[
            {"role": "system", "content": "something else"}, {"role": "user", "content": "hi"}])


def test_sdk_completion_of_a_bare_prompt(served: ServeProc, prefix_tokens: int) -> None:
    out = client(served).completions.create(model=TINY_NAME, prompt="def add(a, b):",
                                            max_tokens=4, temperature=0)
    assert out.usage is not None and out.usage.prompt_tokens > prefix_tokens
    with pytest.raises(openai.BadRequestError, match="differ at token"):
        client(served).completions.create(model=TINY_NAME + ":strict", prompt="def add(",
                                          max_tokens=2)


def test_sdk_with_tools_and_the_tool_result(served: ServeProc) -> None:
    oa = client(served)
    messages: list[Any] = [{"role": "system", "content": "You use tools."},
                           {"role": "user", "content": "Read main.py."}]
    out = oa.chat.completions.create(model=TINY_NAME, messages=messages, tools=[READ],
                                     tool_choice="required", max_tokens=120, seed=3)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.function.name == "read_file"
    assert isinstance(json.loads(call.function.arguments)["path"], str)
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "def add(a, b): ..."}]
    out = oa.chat.completions.create(model=TINY_NAME, messages=messages, tools=[READ],
                                     tool_choice="none", max_tokens=6)
    assert out.choices[0].finish_reason in ("stop", "length")


def test_langchain_chat_openai(served: ServeProc) -> None:
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, SystemMessage

    chat = lc.ChatOpenAI(base_url=served.url + "/v1", api_key="unused", model=TINY_NAME,
                         max_tokens=6, temperature=0, max_retries=0, timeout=60)
    for messages in ([HumanMessage("Which file defines add?")],
                     [SystemMessage("You answer in one word."), HumanMessage("Which file?")]):
        reply = chat.invoke(messages)
        assert isinstance(reply.content, str)
        assert reply.usage_metadata is not None and reply.usage_metadata["input_tokens"] > 0
    tools = chat.model_copy(update={"max_tokens": 120}).bind_tools([READ],
                                                                  tool_choice="required")
    reply = tools.invoke([SystemMessage("You use tools."), HumanMessage("Read main.py.")])
    assert reply.tool_calls and reply.tool_calls[0]["name"] == "read_file"
    assert isinstance(reply.tool_calls[0]["args"].get("path"), str)
