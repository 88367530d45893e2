"""``--engine openai:URL`` against a third-party server: ``llama_cpp.server`` (llama-cpp-python's
OpenAI-compatible server) on the tiny model, on loopback, with its default settings.

That server differs from mesh's own ``/v1/completions``: it checks nothing about the prompt,
sends no ``usage`` in a stream, has no ``/metrics``, runs one request at a time, and cuts a
running stream (``[DONE]`` without a ``finish_reason``) the moment another request arrives.
So here the prefix-first prompt is proven by decoding: a greedy turn must equal the
server's own non-streamed completion of ``prefix + history``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from mesh.backends.openai import OpenAIEngine
from mesh.engine.config import SamplingParams
from mesh.engine.interface import Session, SessionFailed, TurnResult
from tests.backends.conftest import simulate
from tests.backends.llama_server import LlamaServer
from tests.backends.tiny_engine import tiny_openai_engine
from tests.reliability.serve_proc import TERMINAL, ServeProc, message, running, text_of

pytestmark = pytest.mark.anyio
N = 16
GREEDY = SamplingParams(max_tokens=N, temperature=0.0, stop_at_eos=False)
PREFIX = ("system: you are a worker agent of the project. Each task names a file; read "
          "the file, write the code, test the result, and answer in one short line.\n") * 3


def started(
    server: LlamaServer, cache: Path
) -> contextlib.AbstractAsyncContextManager[OpenAIEngine]:
    """An :class:`OpenAIEngine` on ``server`` with the tiny model's tokenizer."""
    return tiny_openai_engine(server.url, PREFIX, cache)


@pytest.fixture
async def engine(llama_backend: LlamaServer, cache: Path) -> AsyncIterator[OpenAIEngine]:
    async with started(llama_backend, cache) as eng:
        yield eng


@dataclass
class Turn:
    result: TurnResult
    pieces: list[str]  # the text of each piece streamed


async def turn(session: Session, text: str, params: SamplingParams = GREEDY) -> Turn:
    session.append(text)
    gen = session.generate(params)
    pieces = [p.text async for p in gen]
    assert gen.result is not None
    assert "".join(pieces) == gen.result.text
    return Turn(gen.result, pieces)


async def completion(server: LlamaServer, prompt: str, max_tokens: int = N,
                     **sampler: float) -> dict[str, Any]:
    """The server's own greedy, non-streamed completion of ``prompt``; by default with the
    local pool's sampler (no repetition penalty, no min-p), ``sampler`` overrides."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "repeat_penalty": 1.0, "min_p": 0.0, **sampler}
    async with httpx.AsyncClient(timeout=60) as http:
        r = await http.post(server.url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice: dict[str, Any] = r.json()["choices"][0]
    return choice


async def test_turns_send_the_prefix_then_the_history(engine: OpenAIEngine,
                                                      llama_backend: LlamaServer) -> None:
    long = SamplingParams(max_tokens=24, temperature=0.0, stop_at_eos=False)
    s = await engine.attach()
    first = await turn(s, "\nuser: list the files\nassistant:", long)
    ask = PREFIX + "\nuser: list the files\nassistant:"
    expect = await completion(llama_backend, ask, 24)
    assert first.result.text == expect["text"]
    assert first.result.finish_reason == ("length" if expect["finish_reason"] == "length"
                                          else "eos")
    assert len(first.pieces) > 1  # streamed, not one block
    # The server's default sampler (repeat_penalty 1.1) decodes this prompt otherwise:
    # the backend switched it off, as the pool has none.
    default = await completion(llama_backend, ask, 24, repeat_penalty=1.1, min_p=0.05)
    assert default["text"] != first.result.text
    history = engine.sessions[s.id].history
    second = await turn(s, "\nuser: and then?\nassistant:")
    expect = await completion(llama_backend, PREFIX + history + "\nuser: and then?\nassistant:")
    assert second.result.text == expect["text"]
    assert engine.sessions[s.id].history == history + (
        "\nuser: and then?\nassistant:" + second.result.text)
    await s.detach()


async def test_a_multi_token_stop_string_is_held_back_and_cut(engine: OpenAIEngine) -> None:
    a = await engine.attach()
    plain = await turn(a, "\nuser: count\nassistant:")
    await a.detach()
    pieces = plain.pieces
    assert len(pieces) >= 4 and all(pieces[:4]), pieces
    # A stop string that starts inside the 2nd streamed chunk and ends inside the 3rd.
    stop = pieces[1][-2:] + pieces[2][:2]
    at = plain.result.text.index(stop)
    assert at <= len(pieces[0]) + len(pieces[1]), (pieces, stop)
    b = await engine.attach()
    stopped = await turn(b, "\nuser: count\nassistant:",
                         SamplingParams(max_tokens=N, temperature=0.0, stop_at_eos=False,
                                        stop=("never-appears-xyz", stop)))
    assert stopped.result.finish_reason == "stop"
    assert stopped.result.stop == stop
    assert stopped.result.text == plain.result.text[:at]
    assert "".join(stopped.pieces) == plain.result.text[:at]  # nothing of the stop leaked
    assert engine.sessions[b.id].history.endswith(plain.result.text[:at] + stop)
    await b.detach()


ASKS = [f"\nuser: task {i}: read the file\nassistant:" for i in range(3)]


async def concurrent_turns(eng: OpenAIEngine) -> list[Turn]:
    sessions = [await eng.attach() for _ in ASKS]
    turns = await asyncio.gather(*(turn(s, ask) for s, ask in zip(sessions, ASKS, strict=True)))
    for s in sessions:
        await s.detach()
    return list(turns)


async def test_concurrent_sessions_survive_interrupted_streams(engine: OpenAIEngine) -> None:
    """By default the server cuts a running stream whenever another request arrives
    (``[DONE]``, no finish reason). Every turn still runs to its token limit: the cut
    stream is resumed after the text streamed so far, never reported finished short."""
    turns = await concurrent_turns(engine)
    assert engine.resumed_streams > 0  # the server did interrupt
    for t in turns:
        assert t.result.finish_reason == "length", t.result
        assert t.result.num_generated == N, t.result
        assert t.result.text, t.result
    assert not engine.sessions and engine.check_attach().ok


async def test_concurrent_sessions_on_a_serial_server_decode_as_alone(
        llama_backend_serial: LlamaServer, cache: Path) -> None:
    """With ``--interrupt_requests False`` requests queue: each concurrent turn is exactly
    the server's own solo completion of its prompt, with nothing resumed."""
    async with started(llama_backend_serial, cache) as eng:
        turns = await concurrent_turns(eng)
        assert eng.resumed_streams == 0
    for t, ask in zip(turns, ASKS, strict=True):
        expect = await completion(llama_backend_serial, PREFIX + ask)
        assert t.result.text == expect["text"]
        if expect["finish_reason"] == "length":
            assert t.result.finish_reason == "length"
            assert t.result.num_generated == N


async def test_a_session_past_the_servers_context_fails_naming_it(
        llama_backend_serial: LlamaServer, cache: Path) -> None:
    async with started(llama_backend_serial, cache) as eng:
        s = await eng.attach()
        s.append(" the" * 240)  # within mesh's budget (256), past the server's 384 cells
        with pytest.raises(SessionFailed, match="exceeds its --n_ctx"):
            await turn(s, "")
        assert not eng.sessions  # detached, as the pool detaches a failed session
        ok = await eng.attach()
        assert (await turn(ok, "\nuser: hi\nassistant:")).result.finish_reason == "length"
    # The server failed that request (llama-cpp-python raises inside its stream) and
    # dropped the kept-alive connection; the next session's turn went through regardless.
    assert "Exception in ASGI application" in llama_backend_serial.output(10**7)


async def test_no_metrics_endpoint_degrades_to_streamed_tokens(engine: OpenAIEngine) -> None:
    s = await engine.attach()
    await turn(s, "\nuser: go\nassistant:")
    assert engine.backend_metrics() is None
    task = engine._metrics_task
    assert task is not None
    for _ in range(50):
        if task.done():
            break
        await asyncio.sleep(0.05)
    assert task.done() and task.exception() is None  # a 404 ends the poll, quietly
    load = engine.load()
    assert load.sessions[0].decode_tps and load.agg_tps > 0 and load.recent_steps
    await s.detach()


def wait_settled(front: ServeProc, task_id: str, timeout: float = 180) -> dict[str, Any]:
    """The task once it is terminal or waits for the user (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        task = front.get(task_id)
        if task["status"]["state"] in TERMINAL | {"TASK_STATE_INPUT_REQUIRED"}:
            return task
        assert time.monotonic() < deadline, f"task {task_id} stayed {task['status']}"
        time.sleep(0.05)


def test_coordinator_tasks_and_simulation_on_llama_cpp_server(
        llama_backend: LlamaServer, tmp_path: Path, cache: Path, project: Path) -> None:
    """``mesh serve --engine openai:URL`` on llama_cpp.server: planned and explicit-subtask
    tasks complete with an answer; card and /capacity name the engine; the simulation
    delivers every package."""
    url = llama_backend.url
    with running(tmp_path / "data", project, cache, "--engine", f"openai:{url}",
                 "--max-sessions", "4", "--simulation") as front:
        card = httpx.get(front.url + "/.well-known/agent-card.json", timeout=10).json()
        (ext,) = [e for e in card["capabilities"]["extensions"]
                  if e["uri"] == "urn:mesh:pool:v1"]
        assert ext["params"]["engine"] == f"openai:{url}"
        planned = front.send("Say hello to the project", immediately=True)
        msg = message("context")
        msg["parts"].append({"data": {"subtasks": [
            {"instructions": "list the files"}, {"instructions": "read main.py"}]}})
        explicit = front.rpc("SendMessage", {"message": msg,
                                             "configuration": {"returnImmediately": True}})
        done = wait_settled(front, explicit["result"]["task"]["id"])
        assert done["status"]["state"] == "TASK_STATE_COMPLETED", done["status"]
        assert any(a["name"] == "answer" for a in done["artifacts"])
        # The random-weight planner may answer, delegate or ask back (its grammar allows
        # all three): each is a settled, valid end of a planned task.
        done = wait_settled(front, planned["id"])
        state = done["status"]["state"]
        if state == "TASK_STATE_INPUT_REQUIRED":
            assert text_of(done["status"]["message"]["parts"]).strip(), done["status"]
        else:
            assert state == "TASK_STATE_COMPLETED", done["status"]
            assert any(a["name"] == "answer" for a in done["artifacts"])
        cap = httpx.get(front.url + "/capacity", timeout=10).json()
        assert cap["engine"]["name"] == f"openai:{url}"
        assert cap["engine"]["backend"] is None  # no /metrics there: no gauges, no error
        assert simulate(front.url, tmp_path / "sim", cache) == 0
        log = front.stderr()
    assert "Traceback" not in log, log[-3000:]
    assert "POST /v1/completions HTTP/1.1\" 200" in llama_backend.output(10**7)
