"""The dashboard in headless Chromium against a real ``mesh serve --model tiny`` under load.

The server runs with a bearer token, so the page's token form is part of the path; load is
a few threads of session-API turns plus A2A tasks. The numbers on the page are compared
with ``/capacity`` (stable fields) and with the frame the page last drew (live ones).
``REFRESH_DASHBOARD_PNG=1`` also writes the screenshot the README shows, docs/dashboard.png.

Chromium is Debian's ``chromium`` (``scripts/test.sh`` installs it where it is missing and it
runs as root, as in CI); elsewhere the tests are skipped and pytest prints why.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.browser.cdp import CHROMIUM, Browser
from tests.reliability.serve_proc import ServeProc, running, small_project

needs_chromium = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason=f"needs {CHROMIUM} (apt-get install chromium; scripts/test.sh does, as root)"
)

TOKEN = "dash-test-token"
ROOT = Path(__file__).resolve().parents[2]


def _load(url: str, stop: threading.Event, errors: list[str]) -> None:
    """Session-API turns until ``stop``: attach, a few turns, detach, again."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=url, headers=auth, timeout=60) as client:
        while not stop.is_set():
            r = client.post("/v1/sessions", json={})
            if r.status_code != 201:
                stop.wait(0.2)  # 429/503 from the gate under load: fine, try again
                continue
            sid = r.json()["id"]
            for _ in range(10):
                t = client.post(
                    f"/v1/sessions/{sid}/turns",
                    json={"text": "tell me more", "max_tokens": 48, "stop_at_eos": False},
                )
                if t.status_code != 200:
                    errors.append(f"turn: {t.status_code} {t.text[:200]}")
                if stop.is_set():
                    break
            client.delete(f"/v1/sessions/{sid}")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProc]:
    root = tmp_path_factory.mktemp("dash")
    project = small_project(root / "project")
    with running(
        root / "data", project, root / "cache", "--auth-token", TOKEN, "--floor-tps", "50"
    ) as served:
        served.headers["Authorization"] = f"Bearer {TOKEN}"
        yield served


def _with_token(b: Browser, url: str) -> None:
    """Open the page and give it the token through its form (the events answer 401)."""
    b.navigate(url + "/dashboard")
    b.wait_for("!document.getElementById('auth').hidden")
    b.evaluate(
        f"document.getElementById('tokenInput').value = {json.dumps(TOKEN)};"
        "document.getElementById('tokenSubmit').click(); true"
    )


def _dom(b: Browser) -> dict[str, Any]:
    """The page's numbers and its last frame, read in one evaluation (one consistent view)."""
    expr = """(() => {
      const ids = ["policy","floor","verdict","projNext","headroom","queueLen","maxQueue",
        "refused","wPrefilling","wDecoding","wIdle","wTotal","kvPrefix","kvPrivate","kvFree",
        "kvTotal","kvNaive","kvReduction","tasksRunning","tasksQueued","tasksFinished",
        "turnsWaiting","pAttached","pMaxAttached","pResident","pParked","pParkedCells",
        "pParks","pBytes"];
      const text = {};
      for (const id of ids) text[id] = document.getElementById(id).textContent;
      return JSON.stringify({text, last: window.meshDashboard.last,
        frames: window.meshDashboard.frames.length,
        workerRows: document.querySelectorAll("#workersTable tr").length,
        taskRows: document.querySelectorAll("#tasksTable tr").length,
        reasons: document.querySelectorAll("#reasons li").length,
        turnsShown: !document.getElementById("turnsWaiting").hidden,
        status: document.getElementById("status").textContent});
    })()"""
    doc: dict[str, Any] = json.loads(b.evaluate(expr))
    return doc


def _fmt(v: Any) -> str:
    """What the page prints for a number (dashboard.js ``fmt``)."""
    if v is None:
        return "–"
    if isinstance(v, float) and not v.is_integer():
        return f"{v:.2f}"
    return str(int(v)) if isinstance(v, float) else str(v)


@pytest.mark.browser
@needs_chromium
def test_dashboard_draws_the_past_at_load(server: ServeProc) -> None:
    """Work done before the page opens is on its charts before the first live frame.

    First in this module on purpose: no dashboard route has been asked yet, so the samples
    below can only come from the sampler the server starts with itself."""
    stop, errors = threading.Event(), list[str]()
    threads = [
        threading.Thread(target=_load, args=(server.url, stop, errors), daemon=True)
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # a few seconds of sessions decoding
            cap = httpx.get(server.url + "/capacity", headers=server.headers, timeout=10).json()
            if any(w["decodeTps"] for w in cap["workers"]):
                break
            time.sleep(0.2)
        time.sleep(4.0)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not errors, errors[:3]
    opened = time.time()
    history = httpx.get(server.url + "/dashboard/history", headers=server.headers,
                        timeout=10).json()
    past = [s for s in history["samples"] if s["t"] < opened]
    assert len(past) >= 4 and any(s["workers"] for s in past)
    assert all(s["floor"] == 50.0 for s in past)
    with Browser() as b:
        _with_token(b, server.url)
        b.wait_for("window.meshDashboard.historyLoaded !== null", timeout_s=30)
        doc = json.loads(b.evaluate("""JSON.stringify({
          loaded: window.meshDashboard.historyLoaded,
          drawnBeforeLive: window.meshDashboard.drawnBeforeLive,
          oldest: window.meshDashboard.samples[0].t,
          withWorkers: window.meshDashboard.samples.filter(s => s.workers.length).length})"""))
    # The chart drew points from the history alone (drawnBeforeLive is set only while the
    # page has had no live frame), and they reach back before the page was opened.
    assert doc["loaded"] >= len(past)
    assert doc["drawnBeforeLive"]["tps"] >= 2 and doc["drawnBeforeLive"]["load"] >= 8
    assert doc["drawnBeforeLive"]["park"] >= 8  # resident, parked, attached per sample
    assert doc["oldest"] < opened - 3.0
    assert doc["withWorkers"] >= 1


@pytest.mark.browser
@needs_chromium
def test_dashboard_shows_live_numbers_that_match_capacity(server: ServeProc) -> None:
    stop, errors = threading.Event(), list[str]()
    threads = [
        threading.Thread(target=_load, args=(server.url, stop, errors), daemon=True)
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    try:
        for i in range(4):
            server.send(f"summarize main.py, take {i}", immediately=True)
        with Browser() as b:
            b.navigate(server.url + "/dashboard")
            # Without a token the data routes answer 401 and the page asks for one.
            b.wait_for("!document.getElementById('auth').hidden")
            assert b.evaluate("document.getElementById('status').textContent") == "token needed"
            b.evaluate(
                f"document.getElementById('tokenInput').value = {json.dumps(TOKEN)};"
                "document.getElementById('tokenSubmit').click(); true"
            )
            b.wait_for(
                "window.meshDashboard.frames.length >= 3 && "
                "window.meshDashboard.last.capacity.sessions.total >= 1",
                timeout_s=60,
            )
            first = _dom(b)
            b.wait_for(f"window.meshDashboard.last.t > {first['last']['t']}")
            dom = _dom(b)
            cap = httpx.get(server.url + "/capacity", headers=server.headers, timeout=10).json()
            if os.environ.get("REFRESH_DASHBOARD_PNG") == "1":
                # 20 s more of history, so the chart has lines to show.
                b.wait_for(f"window.meshDashboard.last.t > {dom['last']['t'] + 20}", timeout_s=60)
                b.screenshot(ROOT / "docs" / "dashboard.png", 1100, 860)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not errors, errors[:3]
    text, last = dom["text"], dom["last"]
    assert dom["status"] == "live" and dom["last"]["t"] > first["last"]["t"]
    # Fields that do not move under load: the page shows what /capacity serves.
    live_cap = last["capacity"]
    for key in ("floor_tps", "policy", "max_queue"):
        assert live_cap[key] == cap[key], key
    assert text["floor"] == _fmt(cap["floor_tps"]) == "50"
    assert text["policy"] == cap["policy"]
    assert text["maxQueue"] == _fmt(cap["max_queue"])
    assert text["kvTotal"] == _fmt(cap["kv_cells"]["total"])
    assert text["kvPrefix"] == _fmt(cap["kv_cells"]["prefix"])
    assert set(live_cap) == set(cap)
    # Fields that move: the page shows the frame it last received.
    kv, sessions = live_cap["kv_cells"], live_cap["sessions"]
    assert text["verdict"] == live_cap["verdict"]
    assert dom["reasons"] == len(live_cap["reasons"])
    assert text["wTotal"] == _fmt(sessions["total"]) and sessions["total"] >= 1
    for el, state in (("wPrefilling", "prefilling"), ("wDecoding", "decoding"), ("wIdle", "idle")):
        assert text[el] == _fmt(sessions[state])
    assert text["kvPrivate"] == _fmt(kv["used"] - kv["prefix"])
    assert text["kvFree"] == _fmt(kv["total"] - kv["used"])
    assert text["kvNaive"] == _fmt(kv["naive_equivalent"])
    assert text["kvReduction"] == _fmt(kv["reduction"]) and kv["reduction"] > 1.0
    assert text["queueLen"] == _fmt(live_cap["queue_len"])
    # Turns waiting for a decode slot: shown where /capacity reports them, hidden elsewhere.
    turns = live_cap.get("turns")
    assert dom["turnsShown"] == isinstance(turns, dict)
    if isinstance(turns, dict):
        assert text["turnsWaiting"] == _fmt(turns["waiting"])
    assert text["headroom"] == _fmt(live_cap["headroom"])
    # Parking (issue 28): attached = resident + parked, as the frame says.
    parking = live_cap["parking"]
    assert text["pAttached"] == _fmt(sessions["total"])
    assert text["pMaxAttached"] == _fmt(parking["max_attached"])
    assert text["pResident"] == _fmt(parking["resident"])
    assert text["pParked"] == _fmt(parking["parked"])
    assert text["pParkedCells"] == _fmt(parking["parked_tokens"])
    assert text["pParks"] == _fmt(parking["parks"])
    assert text["pBytes"] == _fmt(round(parking["parked_bytes"] / 1e4) / 100)
    assert dom["workerRows"] == len(live_cap["workers"]) >= 1
    tasks = last["tasks"]
    assert text["tasksFinished"] == _fmt(tasks["finishedTotal"])
    assert text["tasksRunning"] == _fmt(tasks["running"])
    assert tasks["running"] + tasks["queued"] + tasks["finishedTotal"] >= 4  # our 4 A2A tasks
    assert dom["taskRows"] == min(30, len(tasks["live"]) + len(tasks["recent"]))


def test_served_page_is_public_and_events_need_the_token(server: ServeProc) -> None:
    assert httpx.get(server.url + "/dashboard", timeout=10).status_code == 200
    assert httpx.get(server.url + "/dashboard/assets/dashboard.js", timeout=10).status_code == 200
    assert httpx.get(server.url + "/dashboard/events", timeout=10).status_code == 401
    with httpx.stream(
        "GET", server.url + "/dashboard/events", headers=server.headers, timeout=10
    ) as r:
        assert r.status_code == 200
        frame = next(line for line in r.iter_lines() if line.startswith("data: {\"t\""))
    doc = json.loads(frame[6:])
    assert doc["capacity"]["floor_tps"] == 50.0 and "nodes" not in doc
