"""The done-criterion: the ``openai`` client runs a 3-turn conversation against a real
``mesh serve --model tiny`` process, and each turn's cached tokens cover every turn before."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.reliability.serve_proc import running, small_project

openai = pytest.importorskip("openai")


def test_openai_client_three_turns_against_mesh_serve(tmp_path: Path) -> None:
    project = small_project(tmp_path / "project")
    with running(tmp_path / "data", project, tmp_path / "cache") as served:
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", timeout=60,
                               max_retries=0)
        prefix = httpx.get(served.url + "/v1/prefix", timeout=10).json()
        messages: list[dict[str, str]] = [
            {"role": "system", "content": prefix["system"]},
            {"role": "user", "content": "Which file defines add?"},
        ]
        usages, reasons = [], []
        for turn in range(3):
            out = client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=8, temperature=0)
            assert out.usage is not None and out.usage.prompt_tokens_details is not None
            usages.append(out.usage)
            reasons.append(out.choices[0].finish_reason)
            messages += [{"role": "assistant", "content": out.choices[0].message.content or ""},
                         {"role": "user", "content": f"main.py line {turn + 1}: return a + b"}]
        assert usages[0].prompt_tokens_details.cached_tokens == prefix["prefix_tokens"]
        for i in (1, 2):
            before, now = usages[i - 1], usages[i]
            unseen = 1 if reasons[i - 1] == "length" else 0  # sampled, not yet decoded
            assert now.prompt_tokens_details is not None
            assert now.prompt_tokens_details.cached_tokens == (
                before.prompt_tokens + before.completion_tokens - unseen)
        # Under the strict rule (a ':strict' model name) a wrong system text is refused with
        # the first differing token named; without it, see test_openai_dropin.py.
        with pytest.raises(openai.BadRequestError, match="differ at token"):
            client.chat.completions.create(model="tiny:strict", max_tokens=2, messages=[
                {"role": "system", "content": "something else"},
                {"role": "user", "content": "hi"}])
