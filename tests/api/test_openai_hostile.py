"""Issue 27 hole 1 on the real server: a tools schema built to blow up grammar building
(``"type"`` lists of 200 entries nested three levels deep, 27 KB) is refused with a 400
naming the limit, and ``/healthz`` keeps answering within 100 ms throughout, while several
such bodies and a legitimate request at the limits are in flight at once.

Before the fix the grammar was built on the event loop first (5-36 s per body: cost grew
with entries squared times optional properties cubed), so ``/healthz`` waited that long."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from mesh.api.openai_tools import MAX_TYPE_LIST
from tests.reliability.serve_proc import running, small_project

HEALTH_BOUND_S = 0.1


def hostile_tool(entries: int = 200, depth: int = 3, props: int = 3) -> dict[str, Any]:
    """The issue's body: every level a ``type`` list of ``entries`` and ``props``
    optional properties, ``depth`` levels deep."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": ["object"] * entries,
                  "properties": {f"p{i}": schema for i in range(props)}}
    return {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": schema}}}}


def wide_tool(n: int = 16) -> dict[str, Any]:
    """A legitimate tool: every property optional, a type list each (its description
    fits the tiny model's 2,048-token session budget)."""
    props = {f"k{i}": {"type": ["string", "null"]} for i in range(n)}
    return {"type": "function", "function": {"name": "wide", "parameters": {
        "type": "object", "properties": props}}}


class HealthPoller:
    """Polls ``/healthz`` and records each answer's latency. A new connection each time
    (``Connection: close``): on a kept-alive one the answer's second segment waits for the
    client's delayed ACK (~40 ms of Nagle, whatever the server does)."""

    def __init__(self, url: str) -> None:
        self.url, self.latencies, self.errors = url, [], []  # type: ignore[var-annotated]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30, headers={"Connection": "close"}) as client:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                try:
                    status = client.get(self.url + "/healthz").status_code
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))
                    continue
                self.latencies.append(time.perf_counter() - t0)
                if status != 200:
                    self.errors.append(f"status {status}")
                self._stop.wait(0.01)

    def __enter__(self) -> HealthPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


def test_hostile_tools_schema_is_refused_and_healthz_stays_fast(tmp_path: Path) -> None:
    """The bound is checked on up to three bursts, and holds if one burst keeps it: on a
    shared, loaded machine a process can go unscheduled for 100 ms whatever it runs; the
    old code held the loop for seconds in every burst."""
    project = small_project(tmp_path / "project")
    worsts: list[float] = []
    bursts: list[list[httpx.Response]] = []
    with running(tmp_path / "data", project, tmp_path / "cache") as served:
        # The pool's own system message first, so that the old code reached the grammar.
        system = httpx.get(served.url + "/v1/prefix", timeout=10).json()["system"]
        body = {"model": "tiny", "max_tokens": 8, "tool_choice": "required",
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": "call f"}],
                "tools": [hostile_tool()]}
        assert 20_000 < len(json.dumps(body["tools"])) < 40_000  # the 27 KB
        legit = {**body, "tools": [wide_tool()], "max_tokens": 4}

        def post(doc: dict[str, Any]) -> httpx.Response:
            return httpx.post(served.url + "/v1/chat/completions", json=doc, timeout=120)

        for _ in range(3):
            with HealthPoller(served.url) as poller:
                time.sleep(0.3)  # a baseline before the bodies arrive
                with ThreadPoolExecutor(5) as pool:
                    answers = list(pool.map(post, [body, body, body, body, legit]))
                time.sleep(0.3)
            assert not poller.errors, poller.errors
            assert len(poller.latencies) >= 10
            worsts.append(max(poller.latencies))
            bursts.append(answers)
            if worsts[-1] < HEALTH_BOUND_S:
                break
    assert min(worsts) < HEALTH_BOUND_S, (
        f"/healthz took {[round(w * 1000) for w in worsts]} ms at worst in each burst "
        f"(bound {HEALTH_BOUND_S * 1000:.0f} ms)")
    for answers in bursts:
        for r in answers[:4]:
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["code"] == "invalid_tools"
            assert "'type' list" in err["message"]
            assert f"limit of {MAX_TYPE_LIST}" in err["message"]
            assert err["param"].endswith(".type")
        assert answers[4].status_code == 200, answers[4].text  # a legitimate one: served
