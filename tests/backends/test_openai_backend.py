"""``--engine openai:URL`` against a real OpenAI-compatible server on loopback.

The server is mesh's own ``/v1/completions`` (``mesh serve --model tiny``: llama.cpp
decoding behind the OpenAI wire). It refuses, with a 400, any prompt that does not start
with its prefix byte for byte, and it reports in ``usage.prompt_tokens_details`` how many
prompt tokens it already held: so a passing turn proves the prefix went first, exactly, and
a cache hit on turn two proves the history went after it unchanged.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mesh.backends.openai import BackendConfig, OpenAIEngine
from mesh.engine.config import SamplingParams
from mesh.engine.interface import ContextOverflow, ModelError, Session, SessionState
from tests.backends.conftest import simulate
from tests.backends.tiny_engine import tiny_openai_engine
from tests.reliability.serve_proc import ServeProc, free_port, message, running

pytestmark = pytest.mark.anyio
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, stop_at_eos=False)


@pytest.fixture
async def engine(backend: ServeProc, cache: Path) -> AsyncIterator[OpenAIEngine]:
    prefix = httpx.get(backend.url + "/v1/prefix", timeout=10).json()
    async with tiny_openai_engine(backend.url, prefix["prefix_text"], cache) as eng:
        yield eng


async def turn(session: Session, text: str, params: SamplingParams = GREEDY) -> Any:
    session.append(text)
    gen = session.generate(params)
    pieces = [p.text async for p in gen]
    assert gen.result is not None
    assert "".join(pieces) == gen.result.text
    return gen


async def test_the_prefix_hash_is_the_local_pools(engine: OpenAIEngine,
                                                  backend: ServeProc) -> None:
    prefix = httpx.get(backend.url + "/v1/prefix", timeout=10).json()
    assert engine.info.prefix_hash == prefix["prefix_hash"]
    assert engine.info.prefix_tokens == prefix["prefix_tokens"]
    assert engine.info.engine == f"openai:{backend.url}"


async def test_history_stays_on_mesh_and_hits_the_backend_cache(engine: OpenAIEngine) -> None:
    s = await engine.attach()
    first = await turn(s, "\nuser: list the files\nassistant:")
    assert first.result.finish_reason == "length"
    assert first.result.num_generated == GREEDY.max_tokens
    cached_before = first.usage["prompt_tokens_details"]["cached_tokens"]
    second = await turn(s, "\nuser: and then?\nassistant:")
    cached = second.usage["prompt_tokens_details"]["cached_tokens"]
    # Turn two continued turn one's conversation on the backend: the prefix, turn one's
    # text and its generated tokens were already there.
    assert cached > cached_before + GREEDY.max_tokens, (cached_before, cached)
    assert engine.sessions[s.id].history.endswith("and then?\nassistant:" + second.result.text)
    await s.detach()
    assert s.id not in engine.sessions


async def test_stop_strings_cut_exactly_as_the_pool(engine: OpenAIEngine) -> None:
    a = await engine.attach()
    plain = (await turn(a, "\nuser: count\nassistant:")).result.text
    await a.detach()
    assert len(plain) > 6, plain
    stop = plain[3:6]
    cut = plain[: plain.index(stop)]
    b = await engine.attach()
    stopped = await turn(b, "\nuser: count\nassistant:",
                         SamplingParams(max_tokens=24, temperature=0.0, stop_at_eos=False,
                                        stop=(stop, "never-appears-xyz")))
    assert stopped.result.finish_reason == "stop"
    assert stopped.result.stop == stop
    assert stopped.result.text == cut
    # As in the pool, the stop string stays in the session's context.
    assert engine.sessions[b.id].history.endswith(cut + stop)
    await b.detach()


async def test_load_is_measured_from_streamed_tokens(engine: OpenAIEngine) -> None:
    s = await engine.attach()
    assert engine.load().sessions[0].decode_tps is None
    await turn(s, "\nuser: go\nassistant:")
    load = engine.load()
    (row,) = load.sessions
    assert row.state is SessionState.IDLE
    assert row.decode_tps is not None and row.decode_tps > 0
    assert row.num_generated == GREEDY.max_tokens
    assert load.recent_steps and all(st.step_s > 0 for st in load.recent_steps)
    assert load.agg_tps > 0
    assert load.cells_used == engine.info.prefix_tokens + row.private_cells
    await s.detach()


async def test_budgets_and_slots(engine: OpenAIEngine) -> None:
    s = await engine.attach()
    with pytest.raises(ContextOverflow, match="budget of 256"):
        s.append(" one" * 300)
    s.append(" one" * 240)
    gen = s.generate(SamplingParams(max_tokens=64, temperature=0.0, stop_at_eos=False))
    _ = [p async for p in gen]
    assert gen.result is not None and gen.result.finish_reason == "context_full"
    assert gen.result.num_generated <= 256 - 240
    others = [await engine.attach() for _ in range(3)]
    assert not engine.check_attach().ok
    assert "4 session slots" in engine.check_attach().reason
    for o in [s, *others]:
        await o.detach()
    assert engine.check_attach().ok


async def test_an_unreachable_backend_names_the_fix() -> None:
    eng = OpenAIEngine(BackendConfig(url=f"http://127.0.0.1:{free_port()}"), "prefix")
    with pytest.raises(ModelError, match="is the OpenAI-compatible server running"):
        await eng.start()
    await eng.aclose()


def test_coordinator_tasks_run_on_the_backend(backend: ServeProc, tmp_path: Path,
                                              cache: Path, project: Path) -> None:
    """A coordinator on ``--engine openai:URL`` runs planned and explicit-subtask tasks;
    every turn is a request the backend served; card and /capacity name the engine."""
    before = httpx.get(backend.url + "/capacity", timeout=10).json()["admitted_total"]
    with running(tmp_path / "data", project, cache, "--engine", f"openai:{backend.url}",
                 "--max-sessions", "4", "--simulation") as front:
        card = httpx.get(front.url + "/.well-known/agent-card.json", timeout=10).json()
        (ext,) = [e for e in card["capabilities"]["extensions"]
                  if e["uri"] == "urn:mesh:pool:v1"]
        back_card = httpx.get(backend.url + "/.well-known/agent-card.json", timeout=10).json()
        (back_ext,) = back_card["capabilities"]["extensions"]
        assert ext["params"]["engine"] == f"openai:{backend.url}"
        assert back_ext["params"]["engine"] == "llama.cpp"
        assert ext["params"]["prefix_hash"] == back_ext["params"]["prefix_hash"]
        planned = front.send("Say hello to the project", immediately=True)
        msg = message("context")
        msg["parts"].append({"data": {"subtasks": [
            {"instructions": "list the files"}, {"instructions": "read main.py"}]}})
        explicit = front.rpc("SendMessage", {"message": msg,
                                             "configuration": {"returnImmediately": True}})
        for task_id in (planned["id"], explicit["result"]["task"]["id"]):
            done = front.wait_terminal(task_id, timeout=180)
            assert done["status"]["state"] == "TASK_STATE_COMPLETED", done["status"]
            assert any(a["name"] == "answer" for a in done["artifacts"])
        cap = httpx.get(front.url + "/capacity", timeout=10).json()
        assert cap["engine"]["name"] == f"openai:{backend.url}"
        # The backend (a mesh) serves /metrics: its gauges show under engine.backend.
        assert cap["engine"]["backend"] is not None, cap["engine"]
        assert cap["engine"]["backend"]["waiting"] == 0.0
        assert simulate(front.url, tmp_path / "sim", cache) == 0
    after = httpx.get(backend.url + "/capacity", timeout=10).json()["admitted_total"]
    # warm-up + the gate's seed benchmark + planner + 1..n worker turns + synthesis
    assert after - before >= 5, (before, after)
    assert "engine: openai:" in front.stderr(), front.stderr()[-2000:]

