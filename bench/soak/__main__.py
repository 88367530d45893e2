"""Soak: one ``mesh serve`` under a long, seeded mix of every API; nothing may leak.

Spawns ``mesh serve --model smollm2`` on a free loopback port with a short
``--session-idle-s`` (or drives a running one with ``--url``, which it never kills) and runs
``--clients`` concurrent clients for ``--minutes`` (default 30), bounded by ``--max-requests``
and by time, stopping by itself. Each client picks its next action from a seeded random
mix (``--seed``):

* A2A over JSON-RPC (``A2A-Version: 1.0``): blocking ``SendMessage``; ``SendStreamingMessage``
  read to the end; send with ``returnImmediately`` then ``CancelTask`` 0-3 s later; a stream
  dropped mid-way and re-attached with ``SubscribeToTask`` (read to the end); ``ListTasks``;
  ``GetTask`` of unknown ids (must be a JSON-RPC error);
* the session API: create, turns (some streamed), delete; and abandoned sessions (never
  deleted: the server's ``--session-idle-s`` expires them);
* the OpenAI API, ``/v1/chat/completions`` with and without ``stream``;
* malformed input (bad JSON, wrong types, bodies past ``--max-body-bytes``, unknown methods
  and routes): each must get a 4xx (on ``POST /``, JSON-RPC's own error object);
* ``/capacity``, ``/metrics``, ``/healthz`` and the agent card.

A2A tasks and generating turns are each capped in flight (``--tasks-in-flight``,
``--turns-in-flight``): a 135M model on 2 cores answers a task in 5-20 s alone.

The run is cut into segments (one per ~5 minutes, at least two); each ends in a **quiet
period**: no new requests, then (bounded) every task the soak started must be terminal, the
server's expiries it is owed must pass (``--session-idle-s`` since the last session-API
request, the OpenAI API's idle-conversation TTL since the last chat reply: plain chat
requests are therefore sent early in a segment), and ``/capacity`` must show the idle
baseline: no pool session, no admission ticket, KV cells used == the prefix's cells. In the
middle of the run the server is killed with SIGKILL and restarted on the same data dir:
tasks that were running must read back FAILED (the restart sweep), finished ones unchanged.

Figures: tasks sent / completed / cancelled / failed / rejected / lost (never answered, or
missing or not terminal in ``GetTask`` at the end), 5xx answers, requests without an answer
within 30 s (a stream's answer is its first event; a non-streamed generation -- a blocking
send, a session turn, a chat completion -- answers when done and may queue behind the gate:
300 s, those past 30 s counted as slow), the baseline per quiet period, ``sessions_reaped``,
the server's RSS after warm-up and its open file descriptors over time; every action kind
runs once first (the warm-up), so each is covered. On a failed goal each server's log is
copied beside the JSON. Each goal is a PASS/FAIL line; the exit
status is 1 if any fails. Prints a table and writes ``bench/soak/results/soak.json`` (or ``--out``);
a progress line on stderr while it runs.

    python -m bench.soak                       # 30 minutes
    python -m bench.soak --minutes 3 --seed 1  # the quick form tests/reliability/test_soak.py runs
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import json
import os
import platform
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from bench.common.servers import free_port, stop, wait_healthy
from bench.load.__main__ import TERMINAL, rpc, rss_mb, send_params

ANSWER_LIMIT_S = 30.0  # every request's answer (a stream's: its first event)
TASK_LIMIT_S = 300.0  # a non-streamed generation's answer (it may queue), a stream's end
QUIET_TASK_LIMIT_S = 300.0  # a quiet period's wait for every task to be terminal
BASELINE_GRACE_S = 30.0  # after the owed expiries: their sweeps (<= 5 s) and the pool reaper
SEGMENT_S = 300.0  # one quiet period per ~5 minutes
MAX_RSS_GROWTH = 0.10  # of the RSS after warm-up
FD_SLACK = 24  # open descriptors above the post-warm-up count (client connections come, go)
MAX_ATTEMPTS = 10  # per request, 429 retries included
SAMPLE_S = 5.0
DEFAULT_MAX_BODY = 1024 * 1024
A2A_HEADERS = {"A2A-Version": "1.0"}
A2A_KINDS = ("send", "stream", "cancel", "resubscribe")
TURN_KINDS = ("session", "abandon", "openai", "openai_stream")
CHEAP_KINDS = ("list", "get_unknown", "malformed", "probe")
WEIGHTS = {"send": 3, "stream": 3, "cancel": 3, "resubscribe": 2,
           "session": 3, "abandon": 1, "openai": 2, "openai_stream": 2,
           "list": 2, "get_unknown": 2, "malformed": 4, "probe": 1}
QUESTIONS = (
    "Which file defines Parcel?",
    "What happens to a parcel of 40 kg?",
    "List the project files.",
    "Which test covers the routes?",
    "What does dispatch.py do?",
    "Summarize the README.",
    "Where is the weight limit checked?",
    "Which function plans a route?",
)


def _openai_idle_ttl_s() -> float:
    """The OpenAI API's idle-conversation TTL (``OpenAIAPI(idle_ttl_s=...)``'s default: a
    finished chat keeps its pool session that long for a follow-up)."""
    from mesh.api.openai_api import OpenAIAPI

    default = inspect.signature(OpenAIAPI.__init__).parameters["idle_ttl_s"].default
    return float(default)


def rss_of(pid: int) -> float:
    """:func:`rss_mb`, 0 when the process is gone."""
    try:
        return rss_mb(pid)
    except OSError:
        return 0.0


def fd_count(pid: int) -> int:
    """Open file descriptors of ``pid`` (0 if it is gone)."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def pid_listening_on(port: int) -> int | None:
    """The process with a socket listening on ``port`` (loopback or any), if one of ours."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{cols[9]}]")
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                if os.readlink(fd) in inodes:
                    return int(proc.name)
    return None


def pctl(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))], 2)


# --------------------------------------------------------------------------- records


@dataclass
class TaskRec:
    """One A2A task the soak sent: its own contextId finds it when no answer named it."""

    kind: str
    context_id: str
    epoch: int
    task_id: str | None = None
    state: str | None = None
    answered: bool = False  # an answer named the task (or refused it)
    rejected: bool = False  # refused at the door (429 after retries) or an error answer
    cut: bool = False  # its request was cut by the kill before an answer
    missing: bool = False  # GetTask: not found
    not_stored: bool = False  # cut, and the restarted server never heard of it


@dataclass
class Instance:
    """One server process: the first, and the one after the restart."""

    pid: int
    up_at: float
    startup_s: float
    warm_until: float
    rss_base_mb: float | None = None
    fds_base: int | None = None
    rss_peak_mb: float = 0.0
    fds_max: int = 0
    sessions_reaped: int | None = None
    log: Path | None = None


@dataclass
class Tally:
    requests: Counter[str] = field(default_factory=Counter)  # per action kind
    statuses: Counter[int] = field(default_factory=Counter)
    num_5xx: int = 0
    fivexx: list[str] = field(default_factory=list)
    unanswered: list[str] = field(default_factory=list)
    slow: Counter[str] = field(default_factory=Counter)  # generations answered past 30 s
    cut_by_kill: int = 0
    num_429: int = 0
    num_429_without_retry_after: int = 0
    unexpected: list[str] = field(default_factory=list)
    malformed: Counter[str] = field(default_factory=Counter)  # case -> sent
    malformed_wrong: list[str] = field(default_factory=list)
    malformed_statuses: dict[str, Counter[int]] = field(default_factory=dict)
    unknown_gets: int = 0
    unknown_gets_wrong: list[str] = field(default_factory=list)
    cancels_asked: int = 0
    cancel_answers: Counter[str] = field(default_factory=Counter)
    resubscribed: Counter[str] = field(default_factory=Counter)
    sessions_created: int = 0
    sessions_deleted: int = 0
    sessions_abandoned: int = 0
    session_refused: int = 0
    openai_ok: int = 0
    openai_refused: int = 0
    latencies: dict[str, list[float]] = field(default_factory=dict)

    def latency(self, kind: str, seconds: float) -> None:
        self.latencies.setdefault(kind, []).append(seconds)


class NoAnswer(Exception):
    """A request got no answer (recorded already: unanswered, or cut by the kill)."""


@dataclass
class Sse:
    status: int
    events: list[tuple[str, Any]]  # (event name, parsed data) per SSE event
    body: Any = None  # a JSON answer instead of a stream
    dropped: bool = False


# --------------------------------------------------------------------------- the soak


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.url: str = (args.url or "").rstrip("/")
        self.spawned = not args.url
        self.proc: subprocess.Popen[bytes] | None = None
        self.instances: list[Instance] = []
        self.epoch = 0
        self.up = asyncio.Event()
        self.dead = False
        self.tally = Tally()
        self.tasks: list[TaskRec] = []
        self.quiet: list[dict[str, Any]] = []
        self.samples: list[dict[str, Any]] = []
        self.restart: dict[str, Any] | None = None
        self.num_requests = 0
        self.a2a_in_flight = 0
        self.turns_in_flight = 0
        self.last_session_touch = 0.0  # monotonic, on the current instance
        self.last_chat_touch = 0.0
        self.t0 = time.monotonic()
        self.phase = "starting"
        self.segment = 0
        self.capacity: dict[str, Any] = {}
        self.openai_ttl_s = _openai_idle_ttl_s()
        minutes = args.minutes
        total = minutes * 60.0
        self.num_segments = max(2, round(total / SEGMENT_S))
        self.segment_s = total / self.num_segments
        # a quiet period takes about the session expiry plus the last tasks' ends
        self.quiet_reserve_s = min(self.segment_s / 2, args.session_idle_s + 15.0)
        self.load_s = self.segment_s - self.quiet_reserve_s
        self.warmup_s = min(60.0, max(15.0, 0.1 * total))
        # every kind once first (chat first: its TTL is owed from the reply), then the mix
        rest = [k for k in WEIGHTS if not k.startswith("openai")]
        random.Random(args.seed).shuffle(rest)
        self.first_kinds = [*reversed(rest), "openai_stream", "openai"]  # popped from the end
        self.kill_segment = self.num_segments // 2
        self.kill_offset_s = 0.4 * self.load_s
        self.tmp = tempfile.TemporaryDirectory(prefix="mesh-soak-")
        self.data_dir = Path(args.data_dir or Path(self.tmp.name) / "data")
        self.port = urlsplit(self.url).port if self.url else free_port()

    # ------------------------------------------------------------------ server

    def serve_argv(self) -> list[str]:
        from mesh.template.loader import sample_project_dir

        a = self.args
        return [sys.executable, "-m", "mesh", "serve", "--model", a.model,
                "--data-dir", str(self.data_dir), "--port", str(self.port),
                "--host", "127.0.0.1", "--project", str(sample_project_dir()),
                "--session-idle-s", f"{a.session_idle_s:g}",
                "--max-body-bytes", str(a.max_body_bytes), *shlex.split(a.serve_args)]

    def start_server(self) -> Instance:
        env = dict(os.environ)
        env.pop("MESH_AUTH_TOKEN", None)
        env.pop("MESH_MODEL", None)
        log = Path(self.tmp.name) / f"serve-{len(self.instances) + 1}.log"
        with log.open("wb") as out:
            self.proc = subprocess.Popen(self.serve_argv(), stdout=out, stderr=subprocess.STDOUT,
                                         env=env)
        self.url = f"http://127.0.0.1:{self.port}"
        startup = wait_healthy(self.url, self.proc, limit_s=300.0, log=log, name="mesh serve")
        now = time.monotonic()
        inst = Instance(self.proc.pid, now, round(startup, 1), now + self.warmup_s, log=log)
        self.instances.append(inst)
        return inst

    def attach_running(self) -> Instance:
        pid = self.args.pid or (pid_listening_on(self.port) if self.port else None)
        now = time.monotonic()
        inst = Instance(pid or 0, now, 0.0, now + self.warmup_s)
        self.instances.append(inst)
        return inst

    @property
    def inst(self) -> Instance:
        return self.instances[-1]

    # ------------------------------------------------------------------ one request

    def _no_answer(self, kind: str, epoch: int, what: str) -> NoAnswer:
        if epoch != self.epoch or not self.up.is_set():
            self.tally.cut_by_kill += 1
        else:
            self.tally.unanswered.append(f"{kind}: {what}"[:300])
        return NoAnswer(what)

    def _count(self, kind: str, method: str, path: str, status: int, text: str) -> None:
        self.tally.statuses[status] += 1
        if status >= 500:
            self.tally.num_5xx += 1
            self.tally.fivexx.append(f"{kind}: {method} {path} -> {status} {text[:300]}")

    async def _backoff(self, response: httpx.Response, rng: random.Random) -> None:
        self.tally.num_429 += 1
        retry = response.headers.get("retry-after")
        if retry is None:
            self.tally.num_429_without_retry_after += 1
        await asyncio.sleep(min(float(retry or 1), 5.0) * rng.uniform(1.0, 1.5))

    async def call(self, http: httpx.AsyncClient, kind: str, method: str, path: str,
                   rng: random.Random, *, body: Any = None, content: bytes | None = None,
                   headers: dict[str, str] | None = None, limit: float = ANSWER_LIMIT_S,
                   retry_429: bool = True, follow: bool = False) -> httpx.Response:
        """One request, its whole answer read within ``limit``; 429s retried after their
        Retry-After. Raises NoAnswer (already counted) when no answer came."""
        epoch = self.epoch
        response: httpx.Response | None = None
        for _ in range(MAX_ATTEMPTS):
            self.num_requests += 1
            t = time.monotonic()
            try:
                response = await asyncio.wait_for(http.request(
                    method, self.url + path, json=body, content=content, headers=headers,
                    timeout=httpx.Timeout(limit + 5, connect=10), follow_redirects=follow),
                    limit)
            except (TimeoutError, httpx.TimeoutException):
                raise self._no_answer(kind, epoch, f"{method} {path}: no answer within "
                                                   f"{limit:g} s") from None
            except httpx.TransportError as exc:
                raise self._no_answer(kind, epoch, f"{method} {path}: {type(exc).__name__} "
                                                   f"{exc}") from None
            elapsed = time.monotonic() - t
            self.tally.latency(kind, elapsed)
            if elapsed > ANSWER_LIMIT_S:
                self.tally.slow[kind] += 1
            for hop in [*response.history, response]:
                self._count(kind, method, path, hop.status_code, hop.text)
            if response.status_code == 429 and retry_429:
                await self._backoff(response, rng)
                continue
            return response
        assert response is not None
        return response

    async def sse(self, http: httpx.AsyncClient, kind: str, path: str, body: Any,
                  rng: random.Random, *, drop_after: int | None = None,
                  on_event: Callable[[str, Any], None] | None = None) -> Sse:
        """POST ``body`` and read the SSE answer: the first event within ANSWER_LIMIT_S,
        the end within TASK_LIMIT_S (or drop the connection after ``drop_after`` events).
        Raises NoAnswer (already counted) when no answer came."""
        epoch = self.epoch
        for _ in range(MAX_ATTEMPTS):
            self.num_requests += 1
            t = time.monotonic()
            request = http.build_request("POST", self.url + path, json=body,
                                         timeout=httpx.Timeout(TASK_LIMIT_S, connect=10))
            try:
                response = await asyncio.wait_for(http.send(request, stream=True),
                                                  ANSWER_LIMIT_S)
            except (TimeoutError, httpx.TimeoutException):
                raise self._no_answer(kind, epoch, f"POST {path}: no answer within "
                                                   f"{ANSWER_LIMIT_S:g} s") from None
            except httpx.TransportError as exc:
                raise self._no_answer(kind, epoch, f"POST {path}: {type(exc).__name__} "
                                                   f"{exc}") from None
            try:
                if response.status_code == 429:
                    await response.aread()
                    self._count(kind, "POST", path, 429, response.text)
                    await self._backoff(response, rng)
                    continue
                if not response.headers.get("content-type", "").startswith(
                        "text/event-stream"):
                    await asyncio.wait_for(response.aread(), ANSWER_LIMIT_S)
                    self._count(kind, "POST", path, response.status_code, response.text)
                    self.tally.latency(kind, time.monotonic() - t)
                    try:
                        doc = response.json()
                    except ValueError:
                        doc = response.text
                    return Sse(response.status_code, [], body=doc)
                self._count(kind, "POST", path, response.status_code, "")
                return await self._read_events(response, kind, path, t, epoch, drop_after,
                                               on_event)
            except (TimeoutError, httpx.TimeoutException):
                raise self._no_answer(kind, epoch, f"POST {path}: stream silent past its "
                                                   "limit") from None
            except httpx.TransportError as exc:
                raise self._no_answer(kind, epoch, f"POST {path}: stream broke: "
                                                   f"{type(exc).__name__} {exc}") from None
            finally:
                await response.aclose()
        raise self._no_answer(kind, epoch, f"POST {path}: still 429 after {MAX_ATTEMPTS} tries")

    async def _read_events(self, response: httpx.Response, kind: str, path: str, t: float,
                           epoch: int, drop_after: int | None,
                           on_event: Callable[[str, Any], None] | None) -> Sse:
        events: list[tuple[str, Any]] = []
        name = "message"
        lines = response.aiter_lines()
        while True:
            limit = (t + (ANSWER_LIMIT_S if not events else TASK_LIMIT_S)) - time.monotonic()
            try:
                line = await asyncio.wait_for(anext(lines), max(0.1, limit))
            except StopAsyncIteration:
                break
            except TimeoutError:
                what = "no first event" if not events else "stream not ended"
                raise self._no_answer(kind, epoch, f"POST {path}: {what} within its limit") \
                    from None
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data = line[5:].strip()
                if not events:
                    self.tally.latency(kind + " first event", time.monotonic() - t)
                try:
                    events.append((name, json.loads(data)))
                except ValueError:
                    events.append((name, data))
                if on_event is not None:
                    on_event(*events[-1])
                name = "message"
                if drop_after is not None and len(events) >= drop_after:
                    return Sse(response.status_code, events, dropped=True)
        self.tally.latency(kind + " to end", time.monotonic() - t)
        return Sse(response.status_code, events)

    def unexpected(self, what: str) -> None:
        self.tally.unexpected.append(what[:400])

    # ------------------------------------------------------------------ A2A actions

    def new_task(self, kind: str) -> TaskRec:
        rec = TaskRec(kind, f"soak-{uuid.uuid4().hex}", self.epoch)
        self.tasks.append(rec)
        return rec

    @staticmethod
    def message(rec: TaskRec, rng: random.Random, immediately: bool = False) -> dict[str, Any]:
        params = send_params(rng.choice(QUESTIONS), immediately=immediately)
        params["message"]["contextId"] = rec.context_id
        if rng.random() < 0.3:  # explicit subtasks: no planning turn
            params["message"]["parts"].append(
                {"data": {"subtasks": [{"instructions": rng.choice(QUESTIONS)}]}})
        return params

    def _task_answer(self, rec: TaskRec, doc: Any, what: str) -> dict[str, Any] | None:
        """The task in a SendMessage answer; a refusal marks ``rec`` rejected."""
        rec.answered = True
        task = doc.get("result", {}).get("task") if isinstance(doc, dict) else None
        if isinstance(task, dict) and task.get("id"):
            rec.task_id = task["id"]
            rec.state = task.get("status", {}).get("state")
            return task
        rec.rejected = True
        error = doc.get("error") if isinstance(doc, dict) else None
        if not (isinstance(error, dict) and error.get("code") == -32000):  # -32000: queue full
            self.unexpected(f"{what}: answered without a task: {json.dumps(doc)[:300]}")
        return None

    @staticmethod
    def _learn(rec: TaskRec, doc: Any) -> None:
        """The task id and state an A2A stream event carries."""
        result = doc.get("result") if isinstance(doc, dict) else None
        if not isinstance(result, dict):
            return
        task = result.get("task")
        if isinstance(task, dict):
            rec.task_id = rec.task_id or task.get("id")
            rec.state = task.get("status", {}).get("state", rec.state)
        update = result.get("statusUpdate") or result.get("artifactUpdate")
        if isinstance(update, dict):
            rec.task_id = rec.task_id or update.get("taskId")
            if "status" in update:
                rec.state = update["status"].get("state", rec.state)

    def _from_events(self, rec: TaskRec, events: list[tuple[str, Any]]) -> None:
        for _, doc in events:
            if isinstance(doc, dict) and "error" in doc:
                self.unexpected(f"{rec.kind}: error event {json.dumps(doc)[:300]}")
            self._learn(rec, doc)

    async def act_send(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        rec = self.new_task("send")
        try:
            r = await self.call(http, "send", "POST", "/", rng,
                                body=rpc("SendMessage", self.message(rec, rng)),
                                limit=TASK_LIMIT_S)
        except NoAnswer:
            rec.cut = self.epoch != rec.epoch
            raise
        self._task_answer(rec, r.json(), "SendMessage")

    async def act_stream(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        rec = self.new_task("stream")
        await self._stream(http, rng, rec, drop_after=None)

    async def _stream(self, http: httpx.AsyncClient, rng: random.Random, rec: TaskRec,
                      drop_after: int | None) -> Sse:
        try:
            answer = await self.sse(http, rec.kind, "/",
                                    rpc("SendStreamingMessage", self.message(rec, rng)), rng,
                                    drop_after=drop_after,
                                    on_event=lambda name, doc: self._learn(rec, doc))
        except NoAnswer:
            rec.cut = self.epoch != rec.epoch
            raise
        if answer.body is not None:
            self._task_answer(rec, answer.body, "SendStreamingMessage")
            return answer
        rec.answered = True
        self._from_events(rec, answer.events)
        if rec.task_id is None:
            self.unexpected(f"{rec.kind}: the stream never named its task "
                            f"({len(answer.events)} events)")
        elif not answer.dropped and rec.state not in TERMINAL:
            self.unexpected(f"{rec.kind}: stream of {rec.task_id} ended at {rec.state}")
        return answer

    async def act_resubscribe(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        rec = self.new_task("resubscribe")
        first = await self._stream(http, rng, rec, drop_after=rng.randint(1, 6))
        if not first.dropped or rec.task_id is None:
            self.tally.resubscribed["ended before the drop"] += 1
            return
        await asyncio.sleep(rng.uniform(0.0, 1.5))
        answer = await self.sse(http, "resubscribe", "/",
                                rpc("SubscribeToTask", {"id": rec.task_id}), rng,
                                on_event=lambda name, doc: self._learn(rec, doc))
        if answer.body is not None:  # a JSON answer: the task ended meanwhile (-32004)
            error = answer.body.get("error", {}) if isinstance(answer.body, dict) else {}
            if error.get("code") == -32004:
                self.tally.resubscribed["terminal before the re-attach"] += 1
            else:
                self.unexpected(f"SubscribeToTask {rec.task_id}: {json.dumps(answer.body)[:300]}")
            return
        self._from_events(rec, answer.events)
        self.tally.resubscribed["re-attached, read to the end"] += 1
        if rec.state not in TERMINAL:
            self.unexpected(f"SubscribeToTask {rec.task_id}: stream ended at {rec.state}")

    async def act_cancel(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        rec = self.new_task("cancel")
        try:
            r = await self.call(http, "cancel", "POST", "/", rng,
                                body=rpc("SendMessage", self.message(rec, rng, True)))
        except NoAnswer:
            rec.cut = self.epoch != rec.epoch
            raise
        if self._task_answer(rec, r.json(), "SendMessage(returnImmediately)") is None:
            return
        await asyncio.sleep(rng.uniform(0.0, 3.0))
        self.tally.cancels_asked += 1
        r = await self.call(http, "cancel", "POST", "/", rng,
                            body=rpc("CancelTask", {"id": rec.task_id}))
        doc = r.json()
        if "result" in doc:
            self.tally.cancel_answers["canceled"] += 1
            rec.state = doc["result"].get("status", {}).get("state", rec.state)
        elif doc.get("error", {}).get("code") == -32002:  # finished first: not cancelable
            self.tally.cancel_answers["already terminal (-32002)"] += 1
        else:
            self.tally.cancel_answers["other"] += 1
            self.unexpected(f"CancelTask {rec.task_id}: {json.dumps(doc)[:300]}")

    async def act_list(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        params: dict[str, Any] = {"pageSize": rng.randint(1, 50)}
        known = [t for t in self.tasks[-50:] if t.task_id]
        if known and rng.random() < 0.5:
            params["contextId"] = rng.choice(known).context_id
        r = await self.call(http, "list", "POST", "/", rng, body=rpc("ListTasks", params))
        doc = r.json()
        if not isinstance(doc.get("result", {}).get("tasks"), list):
            self.unexpected(f"ListTasks {params}: {r.status_code} {r.text[:300]}")

    async def act_get_unknown(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        self.tally.unknown_gets += 1
        task_id = str(uuid.UUID(int=rng.getrandbits(128)))
        r = await self.call(http, "get_unknown", "POST", "/", rng,
                            body=rpc("GetTask", {"id": task_id}))
        try:
            doc = r.json()
        except ValueError:
            doc = {}
        if r.status_code >= 500 or not isinstance(doc.get("error"), dict):
            self.tally.unknown_gets_wrong.append(f"{r.status_code} {r.text[:200]}")

    # ------------------------------------------------------------------ sessions, OpenAI

    def touch_session(self) -> None:
        self.last_session_touch = time.monotonic()

    async def act_session(self, http: httpx.AsyncClient, rng: random.Random,
                          abandon: bool = False) -> None:
        kind = "abandon" if abandon else "session"
        self.touch_session()
        r = await self.call(http, kind, "POST", "/v1/sessions", rng,
                            body={"key": "soak", "max_wait_s": 20.0})  # else 429
        self.touch_session()
        if r.status_code == 429:
            self.tally.session_refused += 1
            return
        if r.status_code != 201:
            self.unexpected(f"POST /v1/sessions: {r.status_code} {r.text[:300]}")
            return
        self.tally.sessions_created += 1
        sid = r.json()["id"]
        try:
            for n in range(rng.randint(0, 1) if abandon else rng.randint(1, 3)):
                body = {"text": f" {rng.choice(QUESTIONS)}" if n else rng.choice(QUESTIONS),
                        "max_tokens": rng.randint(4, 24), "temperature": 0.7,
                        "seed": rng.randint(0, 2**31)}
                path = f"/v1/sessions/{sid}/turns"
                if rng.random() < 0.4:
                    answer = await self.sse(http, kind, path, {**body, "stream": True}, rng)
                    ok = answer.status == 200 and any(e == "done" for e, _ in answer.events)
                    status, text = answer.status, json.dumps(answer.body)
                else:
                    r = await self.call(http, kind, "POST", path, rng, body=body,
                                        limit=TASK_LIMIT_S)
                    ok, status, text = r.status_code == 200, r.status_code, r.text
                self.touch_session()
                if not ok:
                    self.unexpected(f"turn of {sid}: {status} {text[:300]}")
                    break
        finally:
            self.touch_session()
        if abandon:
            self.tally.sessions_abandoned += 1
            return
        r = await self.call(http, kind, "DELETE", f"/v1/sessions/{sid}", rng)
        self.touch_session()
        if r.status_code == 204:
            self.tally.sessions_deleted += 1
        else:
            self.unexpected(f"DELETE /v1/sessions/{sid}: {r.status_code} {r.text[:300]}")

    async def act_abandon(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        await self.act_session(http, rng, abandon=True)

    async def act_openai(self, http: httpx.AsyncClient, rng: random.Random,
                         stream: bool = False) -> None:
        kind = "openai_stream" if stream else "openai"
        body = {"model": "mesh", "max_tokens": rng.randint(8, 32), "temperature": 0.7,
                "seed": rng.randint(0, 2**31),
                "messages": [{"role": "user", "content": rng.choice(QUESTIONS)}]}
        self.last_chat_touch = time.monotonic()
        try:
            if stream:
                answer = await self.sse(http, kind, "/v1/chat/completions",
                                        {**body, "stream": True}, rng)
                status = answer.status
                ok = status == 200 and bool(answer.events) and answer.events[-1][1] == "[DONE]"
                text = json.dumps(answer.body) if answer.body is not None else ""
            else:
                r = await self.call(http, kind, "POST", "/v1/chat/completions", rng, body=body,
                                    limit=TASK_LIMIT_S)
                status, text = r.status_code, r.text
                ok = status == 200 and bool(r.json().get("choices"))
        finally:
            self.last_chat_touch = time.monotonic()  # the conversation is kept from here
        if ok:
            self.tally.openai_ok += 1
        elif status == 429:
            self.tally.openai_refused += 1
        else:
            self.unexpected(f"{kind}: {status} {text[:300]}")

    async def act_openai_stream(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        await self.act_openai(http, rng, stream=True)

    # ------------------------------------------------------------------ malformed, probes

    def malformed_cases(self) -> dict[str, Callable[[httpx.AsyncClient, random.Random],
                                                   Awaitable[tuple[int, str]]]]:
        json_ct = {"content-type": "application/json"}

        def post(path: str, content: bytes, headers: dict[str, str] | None = None
                 ) -> Callable[[httpx.AsyncClient, random.Random], Awaitable[tuple[int, str]]]:
            async def run(http: httpx.AsyncClient, rng: random.Random) -> tuple[int, str]:
                r = await self.call(http, "malformed", "POST", path, rng, content=content,
                                    headers=headers or json_ct, retry_429=False)
                return r.status_code, r.text
            return run

        def rpc_body(method: str, params: Any) -> bytes:
            return json.dumps(rpc(method, params)).encode()

        def oversized(path: str) -> Callable[[httpx.AsyncClient, random.Random],
                                             Awaitable[tuple[int, str]]]:
            async def run(http: httpx.AsyncClient, rng: random.Random) -> tuple[int, str]:
                declared = self.args.max_body_bytes + 1 + rng.randint(0, 1 << 20)
                return await self.raw_post(path, declared)
            return run

        async def unknown_get(http: httpx.AsyncClient, rng: random.Random) -> tuple[int, str]:
            r = await self.call(http, "malformed", "GET", f"/soak-{rng.getrandbits(32):x}",
                                rng, follow=True, retry_429=False)
            return r.status_code, r.text

        async def wrong_method(http: httpx.AsyncClient, rng: random.Random) -> tuple[int, str]:
            r = await self.call(http, "malformed", "PUT", "/capacity", rng, content=b"{}",
                                retry_429=False)
            return r.status_code, r.text

        return {
            "rpc: bad JSON": post("/", b'{"jsonrpc": "2.0", "id": 1, "method": "SendMe'),
            "rpc: not UTF-8": post("/", b"\xff\xfe\x00{"),
            "rpc: not an object": post("/", b"[1, 2, 3]"),
            "rpc: unknown method": post("/", rpc_body("TasksExplode", {})),
            "rpc: message is a string": post("/", rpc_body("SendMessage", {"message": "hi"})),
            "rpc: id is a number": post("/", rpc_body("GetTask", {"id": 42})),
            "rpc: pageSize is a string": post("/", rpc_body("ListTasks", {"pageSize": "ten"})),
            "rpc: body past the limit": oversized("/"),
            "rest: text/plain": post("/a2a/message:send", b"hello",
                                     {"content-type": "text/plain"}),
            "rest: bad JSON": post("/a2a/message:send", b"{bad"),
            "rest: message is a number": post("/a2a/message:send", b'{"message": 5}'),
            "rest: body past the limit": oversized("/a2a/message:send"),
            "sessions: bad JSON": post("/v1/sessions", b"{bad"),
            "sessions: key is a number": post("/v1/sessions", b'{"key": 5}'),
            "sessions: unknown session's turn": post("/v1/sessions/s-soak-none/turns",
                                                     b'{"text": "x"}'),
            "sessions: body past the limit": oversized("/v1/sessions"),
            "openai: bad JSON": post("/v1/chat/completions", b"{bad"),
            "openai: messages is a string": post("/v1/chat/completions",
                                                 b'{"model": "m", "messages": "hi"}'),
            "openai: max_tokens is a string": post(
                "/v1/chat/completions",
                b'{"model": "m", "max_tokens": "ten", '
                b'"messages": [{"role": "user", "content": "hi"}]}'),
            "openai: body past the limit": oversized("/v1/chat/completions"),
            "unknown route (POST)": post("/v1/soak-nope", b"{}"),
            "unknown route (GET)": unknown_get,
            "wrong method": wrong_method,
        }

    async def raw_post(self, path: str, declared: int) -> tuple[int, str]:
        """A POST announcing ``declared`` body bytes and sending none: the server must
        answer (413) before reading the body. Raw socket: httpx would send the body."""
        epoch = self.epoch
        self.num_requests += 1
        host, port = urlsplit(self.url).hostname or "127.0.0.1", urlsplit(self.url).port or 80
        head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                f"Content-Type: application/json\r\nA2A-Version: 1.0\r\n"
                f"Content-Length: {declared}\r\n\r\n").encode()

        async def exchange() -> bytes:
            reader, writer = await asyncio.open_connection(host, port)
            try:
                writer.write(head)
                await writer.drain()
                chunks = []
                while chunk := await reader.read(65536):
                    chunks.append(chunk)
                    if b"\r\n\r\n" in b"".join(chunks):
                        break  # the head is all we need
                return b"".join(chunks)
            finally:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()

        try:
            answer = await asyncio.wait_for(exchange(), ANSWER_LIMIT_S)
        except TimeoutError:
            raise self._no_answer("malformed", epoch, f"POST {path} ({declared} bytes "
                                                      "announced): no answer") from None
        except OSError as exc:
            raise self._no_answer("malformed", epoch, f"POST {path}: {exc}") from None
        try:
            status = int(answer.split(b" ", 2)[1])
        except (IndexError, ValueError):
            raise self._no_answer("malformed", epoch,
                                  f"POST {path}: not HTTP: {answer[:80]!r}") from None
        text = answer.decode(errors="replace")
        self._count("malformed", "POST", path, status, text)
        return status, text

    async def act_malformed(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        cases = self.malformed_cases()
        name = rng.choice(sorted(cases))
        self.tally.malformed[name] += 1
        status, text = await cases[name](http, rng)
        self.tally.malformed_statuses.setdefault(name, Counter())[status] += 1
        ok = 400 <= status < 500
        if name.startswith("rpc:") and status == 200:  # JSON-RPC: the error is in the body
            with contextlib.suppress(ValueError):
                ok = isinstance(json.loads(text).get("error"), dict)
        if not ok:
            self.tally.malformed_wrong.append(f"{name}: {status} {text[:200]}")

    async def act_probe(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        path = rng.choice(["/capacity", "/metrics", "/healthz", "/.well-known/agent-card.json",
                           "/v1/sessions", "/v1/models"])
        r = await self.call(http, "probe", "GET", path, rng)
        if r.status_code != 200:
            self.unexpected(f"GET {path}: {r.status_code} {r.text[:200]}")

    # ------------------------------------------------------------------ clients

    def chat_allowed(self, now: float, seg_start: float, load_end: float) -> bool:
        """A chat reply keeps its pool session for the OpenAI TTL: send them where the
        quiet period need not wait for it, and in each segment's first quarter anyway."""
        early = now < seg_start + max(15.0, 0.25 * self.load_s)
        return early or now + self.openai_ttl_s + 10.0 <= load_end

    def pick(self, rng: random.Random, seg_start: float, load_end: float) -> str:
        kinds = list(WEIGHTS)
        kind = rng.choices(kinds, weights=[WEIGHTS[k] for k in kinds])[0]
        busy = ((kind in A2A_KINDS and self.a2a_in_flight >= self.args.tasks_in_flight)
                or (kind in TURN_KINDS and self.turns_in_flight >= self.args.turns_in_flight)
                or (kind.startswith("openai")
                    and not self.chat_allowed(time.monotonic(), seg_start, load_end)))
        if busy:
            kind = rng.choices(CHEAP_KINDS, weights=[WEIGHTS[k] for k in CHEAP_KINDS])[0]
        return kind

    async def client(self, n: int, rng: random.Random, seg_start: float,
                     load_end: float) -> None:
        actions: dict[str, Callable[[httpx.AsyncClient, random.Random], Awaitable[None]]] = {
            "send": self.act_send, "stream": self.act_stream, "cancel": self.act_cancel,
            "resubscribe": self.act_resubscribe, "session": self.act_session,
            "abandon": self.act_abandon, "openai": self.act_openai,
            "openai_stream": self.act_openai_stream, "list": self.act_list,
            "get_unknown": self.act_get_unknown, "malformed": self.act_malformed,
            "probe": self.act_probe,
        }
        async with httpx.AsyncClient(headers=A2A_HEADERS) as http:
            while True:
                await self.up.wait()
                if (self.dead or time.monotonic() >= load_end
                        or self.num_requests >= self.args.max_requests):
                    return
                kind = (self.first_kinds.pop() if self.first_kinds
                        else self.pick(rng, seg_start, load_end))
                self.tally.requests[kind] += 1
                a2a, turn = kind in A2A_KINDS, kind in TURN_KINDS
                self.a2a_in_flight += a2a
                self.turns_in_flight += turn
                try:
                    await actions[kind](http, rng)
                except NoAnswer:
                    pass  # counted where it happened
                except Exception as exc:  # the soak's own mistake: keep it visible
                    self.unexpected(f"{kind}: client error {type(exc).__name__}: {exc}")
                finally:
                    self.a2a_in_flight -= a2a
                    self.turns_in_flight -= turn
                await asyncio.sleep(rng.uniform(0.2, 1.5))

    # ------------------------------------------------------------------ kill -9, restart

    async def get_task(self, http: httpx.AsyncClient, task_id: str) -> dict[str, Any] | None:
        """GetTask: the task, or None when the server does not know it."""
        rng = random.Random(0)
        r = await self.call(http, "monitor", "POST", "/", rng,
                            body=rpc("GetTask", {"id": task_id}))
        doc = r.json()
        result = doc.get("result")
        return result if isinstance(result, dict) else None

    async def list_recent(self, http: httpx.AsyncClient) -> dict[str, str]:
        """The 100 tasks updated last (ListTasks): id -> state."""
        r = await self.call(http, "monitor", "POST", "/", random.Random(0),
                            body=rpc("ListTasks", {"pageSize": 100}))
        tasks = r.json().get("result", {}).get("tasks", [])
        return {t["id"]: t["status"]["state"] for t in tasks}

    @staticmethod
    def fingerprint(task: dict[str, Any] | None) -> tuple[str, int, int] | None:
        """A finished task as GetTask reads it: state, number of artifacts, their hash."""
        if task is None:
            return None
        artifacts = task.get("artifacts", [])
        digest = hash(json.dumps(artifacts, sort_keys=True))
        return task["status"]["state"], len(artifacts), digest

    async def kill_and_restart(self, at: float) -> None:
        """SIGKILL the server at ``at`` (waiting up to 30 s for a task to be running, so the
        kill hits some), restart it on the same data dir, then read back the tasks that
        were running (they must be FAILED) and a sample of finished ones (unchanged)."""
        try:
            await self._kill_and_restart(at)
        except Exception as exc:  # no server to go on with: the goals say so
            self.dead = True
            self.restart = {"error": f"{type(exc).__name__}: {exc}"[-2000:]}
        finally:
            self.up.set()

    async def _kill_and_restart(self, at: float) -> None:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        before: dict[str, str] = {}
        finished: dict[str, tuple[str, int, int] | None] = {}
        async with httpx.AsyncClient(headers=A2A_HEADERS) as http:
            for task_id in [t.task_id for t in self.tasks if t.state in TERMINAL][-20:]:
                with contextlib.suppress(NoAnswer):
                    if task_id is not None:
                        finished[task_id] = self.fingerprint(await self.get_task(http, task_id))
            deadline = time.monotonic() + 30.0
            while True:
                with contextlib.suppress(NoAnswer, ValueError):
                    before = await self.list_recent(http)
                if (any(state not in TERMINAL for state in before.values())
                        or time.monotonic() > deadline):
                    break
                await asyncio.sleep(0.5)
        working = sorted(k for k, v in before.items() if v not in TERMINAL)
        assert self.proc is not None
        self.phase = "kill -9"
        self.up.clear()
        self.epoch += 1
        killed_at = time.monotonic()
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.last_session_touch = self.last_chat_touch = 0.0  # the new process owes nothing
        inst = await asyncio.to_thread(self.start_server)
        self.phase = "load"
        after: dict[str, dict[str, Any] | None] = {}
        async with httpx.AsyncClient(headers=A2A_HEADERS) as http:
            for task_id in [*working, *finished]:
                with contextlib.suppress(NoAnswer):
                    after[task_id] = await self.get_task(http, task_id)
        self.up.set()

        def state(task_id: str) -> str | None:
            task = after.get(task_id)
            return task["status"]["state"] if task else None

        interrupted = [t for t in working if state(t) == "TASK_STATE_FAILED"]
        reason = ""
        if interrupted:
            message = (after[interrupted[0]] or {}).get("status", {}).get("message", {})
            reason = "".join(p.get("text", "") for p in message.get("parts", []))
        changed = [f"{t}: {finished[t]} -> {self.fingerprint(after.get(t))}" for t in finished
                   if finished[t] is None or self.fingerprint(after.get(t)) != finished[t]]
        self.restart = {
            "at_s": round(killed_at - self.t0, 1),
            "restart_s": inst.startup_s,
            "working_at_kill": len(working),
            "failed_by_sweep": len(interrupted),
            # not terminal (or gone) after the restart: the sweep missed them
            "still_open": {t: state(t) for t in working if state(t) not in TERMINAL},
            # ended in the instant between the listing and the kill
            "ended_otherwise": {t: state(t) for t in working
                                if state(t) in TERMINAL and state(t) != "TASK_STATE_FAILED"},
            "sweep_reason": reason[:200],
            "finished_checked": len(finished),
            "finished_changed": changed,
        }

    # ------------------------------------------------------------------ quiet periods

    async def refresh(self, http: httpx.AsyncClient, recs: list[TaskRec]) -> None:
        """Bring ``recs``' states up to date (GetTask; ListTasks by contextId for those no
        answer named)."""
        rng = random.Random(0)
        for rec in recs:
            with contextlib.suppress(NoAnswer):
                if rec.task_id is None:
                    r = await self.call(http, "monitor", "POST", "/", rng,
                                        body=rpc("ListTasks", {"contextId": rec.context_id}))
                    found = r.json().get("result", {}).get("tasks", [])
                    if found:
                        rec.task_id = found[0]["id"]
                        rec.state = found[0]["status"]["state"]
                    elif rec.cut:
                        rec.not_stored = True
                    else:
                        rec.missing = True  # never answered, and the server never heard of it
                    continue
                task = await self.get_task(http, rec.task_id)
                if task is None:
                    rec.missing = True
                else:
                    rec.missing = False
                    rec.state = task["status"]["state"]

    def open_tasks(self) -> list[TaskRec]:
        return [t for t in self.tasks if not t.rejected and not t.not_stored and not t.missing
                and (t.task_id is None or t.state not in TERMINAL)]

    async def capacity_doc(self, http: httpx.AsyncClient) -> dict[str, Any]:
        r = await self.call(http, "monitor", "GET", "/capacity", random.Random(0))
        doc: dict[str, Any] = r.json()
        return doc

    @staticmethod
    def at_baseline(cap: dict[str, Any]) -> bool:
        kv = cap.get("kv_cells", {})
        return bool(cap.get("sessions", {}).get("total") == 0
                    and kv.get("used") == kv.get("prefix")
                    and cap.get("tickets", 0) == 0 and cap.get("queue_len", 0) == 0)

    async def quiet_period(self, index: int) -> None:
        self.phase = f"quiet {index + 1}"
        start = time.monotonic()
        row: dict[str, Any] = {"index": index + 1, "at_s": round(start - self.t0, 1)}
        async with httpx.AsyncClient(headers=A2A_HEADERS) as http:
            deadline = start + QUIET_TASK_LIMIT_S
            while True:
                pending = self.open_tasks()
                await self.refresh(http, pending)
                pending = self.open_tasks()
                if not pending or time.monotonic() > deadline:
                    break
                await asyncio.sleep(1.0)
            row["tasks_open"] = len(pending)
            row["tasks_terminal_after_s"] = round(time.monotonic() - start, 1)
            session_due = (self.last_session_touch + self.args.session_idle_s
                           if self.last_session_touch else 0.0)
            chat_due = self.last_chat_touch + self.openai_ttl_s if self.last_chat_touch else 0.0
            owed = max(session_due, chat_due)
            row["expiries_owed_s"] = round(max(0.0, owed - time.monotonic()), 1)
            await asyncio.sleep(max(0.0, owed - time.monotonic()))
            until = max(time.monotonic(), owed) + BASELINE_GRACE_S
            cap: dict[str, Any] = {}
            while True:
                with contextlib.suppress(NoAnswer):
                    cap = await self.capacity_doc(http)
                if (cap and self.at_baseline(cap)) or time.monotonic() > until:
                    break
                await asyncio.sleep(0.5)
            listed = None
            if cap and not self.at_baseline(cap):
                with contextlib.suppress(NoAnswer, ValueError):
                    r = await self.call(http, "monitor", "GET", "/v1/sessions", random.Random(0))
                    listed = r.json()
        kv = cap.get("kv_cells", {})
        reaped = cap.get("pool_totals", {}).get("sessions_reaped")
        self.inst.sessions_reaped = reaped
        pid = self.inst.pid
        row.update({
            "waited_s": round(time.monotonic() - start, 1),
            "sessions": cap.get("sessions", {}).get("total"),
            "cells_used": kv.get("used"),
            "prefix_cells": kv.get("prefix"),
            "tickets": cap.get("tickets"),
            "queue_len": cap.get("queue_len"),
            "sessions_reaped": reaped,
            "restored": bool(cap) and self.at_baseline(cap) and not pending,
            "rss_mb": round(rss_of(pid), 1) if pid else None,
            "fds": fd_count(pid) if pid else None,
            "server": len(self.instances),
        })
        if not row["restored"]:
            row["left"] = {"workers": cap.get("workers"), "session_api": listed,
                           "open_tasks": [(t.kind, t.task_id, t.state) for t in pending][:20]}
        self.quiet.append(row)
        self.sample()

    # ------------------------------------------------------------------ sampling, progress

    def sample(self) -> None:
        inst = self.inst
        if not inst.pid:
            return
        now = time.monotonic()
        rss, fds = rss_of(inst.pid), fd_count(inst.pid)
        if inst.rss_base_mb is None and now >= inst.warm_until:
            inst.rss_base_mb, inst.fds_base = rss, fds
        if inst.rss_base_mb is not None:
            inst.rss_peak_mb = max(inst.rss_peak_mb, rss)
            inst.fds_max = max(inst.fds_max, fds)
        cap = self.capacity
        turns = cap.get("turns") or {}
        self.samples.append({"t_s": round(now - self.t0, 1), "server": len(self.instances),
                             "phase": self.phase, "rss_mb": round(rss, 1), "fds": fds,
                             "sessions": cap.get("sessions", {}).get("total"),
                             "cells_used": cap.get("kv_cells", {}).get("used"),
                             # the decode gate's view: a stall shows here
                             "turns_running": turns.get("running"),
                             "turns_waiting": turns.get("waiting"),
                             "step_s": turns.get("measured_step_s"),
                             "queue_len": cap.get("queue_len")})

    def progress(self) -> str:
        t = self.tally
        states = Counter(r.state for r in self.tasks)
        kv = self.capacity.get("kv_cells", {})
        inst = self.inst if self.instances else None
        rss = rss_of(inst.pid) if inst and inst.pid else 0.0
        elapsed, total = int(time.monotonic() - self.t0), int(self.args.minutes * 60)
        return (f"soak {elapsed // 60:02d}:{elapsed % 60:02d}/{total // 60:02d}:{total % 60:02d} "
                f"seg {self.segment + 1}/{self.num_segments} "
                f"{self.phase} | req {self.num_requests} tasks {len(self.tasks)} "
                f"(done {states['TASK_STATE_COMPLETED']} canc {states['TASK_STATE_CANCELED']} "
                f"fail {states['TASK_STATE_FAILED']}) | 5xx {t.num_5xx} "
                f"unanswered {len(t.unanswered)} odd {len(t.unexpected)} | "
                f"pool {self.capacity.get('sessions', {}).get('total', '?')} sess "
                f"{kv.get('used', '?')}/{kv.get('prefix', '?')} cells | rss {rss:.0f} MB "
                f"fds {fd_count(inst.pid) if inst and inst.pid else '?'}")

    async def monitor(self) -> None:
        tty = sys.stderr.isatty()
        last_sample = last_line = 0.0
        async with httpx.AsyncClient() as http:
            while True:
                now = time.monotonic()
                if now - last_sample >= SAMPLE_S and self.up.is_set() and not self.dead:
                    last_sample = now
                    with contextlib.suppress(NoAnswer, ValueError):
                        self.capacity = await self.capacity_doc(http)
                    self.sample()
                if tty:
                    print("\r" + self.progress()[:200], end="", file=sys.stderr, flush=True)
                elif now - last_line >= 15.0:
                    last_line = now
                    print(self.progress(), file=sys.stderr, flush=True)
                await asyncio.sleep(1.0)

    # ------------------------------------------------------------------ the run

    async def run(self) -> dict[str, Any]:
        if self.spawned:
            self.phase = "starting the server"
            await asyncio.to_thread(self.start_server)
        else:
            self.attach_running()
        self.up.set()
        self.t0 = time.monotonic()
        monitor = asyncio.create_task(self.monitor())
        rngs = [random.Random(f"{self.args.seed}:{n}") for n in range(self.args.clients)]
        try:
            for seg in range(self.num_segments):
                self.segment = seg
                self.phase = "load"
                seg_start = time.monotonic()
                load_end = seg_start + self.load_s
                jobs = [self.client(n, rngs[n], seg_start, load_end)
                        for n in range(self.args.clients)]
                if seg == self.kill_segment and self.spawned:
                    jobs.append(self.kill_and_restart(seg_start + self.kill_offset_s))
                await asyncio.gather(*jobs)
                if self.dead:
                    break
                await self.quiet_period(seg)
        finally:
            monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await monitor
            if sys.stderr.isatty():
                print(file=sys.stderr)
        return await self.finish()

    async def finish(self) -> dict[str, Any]:
        wall = time.monotonic() - self.t0
        if not self.dead:
            async with httpx.AsyncClient(headers=A2A_HEADERS) as http:
                await self.refresh(http, [t for t in self.tasks
                                          if not t.rejected and not t.not_stored])
        t = self.tally
        lost = [r for r in self.tasks if not r.rejected and not r.not_stored and (
            (not r.answered and not r.cut) or r.task_id is None or r.missing
            or r.state not in TERMINAL)]
        states = Counter(r.state for r in self.tasks if r.task_id and not r.missing)
        tasks = {
            "sent": len(self.tasks),
            "by_kind": dict(Counter(r.kind for r in self.tasks)),
            "acknowledged": sum(1 for r in self.tasks if r.task_id),
            "completed": states["TASK_STATE_COMPLETED"],
            "cancelled": states["TASK_STATE_CANCELED"],
            "failed": states["TASK_STATE_FAILED"],
            "rejected": states["TASK_STATE_REJECTED"] + sum(r.rejected for r in self.tasks),
            "lost": len(lost),
            "lost_detail": [{"kind": r.kind, "task_id": r.task_id, "context_id": r.context_id,
                             "state": r.state, "answered": r.answered, "missing": r.missing}
                            for r in lost[:20]],
            "cut_by_kill_never_stored": sum(r.not_stored for r in self.tasks),
        }
        servers = []
        for n, inst in enumerate(self.instances):
            base = inst.rss_base_mb
            servers.append({
                "server": n + 1, "pid": inst.pid, "startup_s": inst.startup_s,
                "rss_base_mb": round(base, 1) if base is not None else None,
                "rss_peak_mb": round(inst.rss_peak_mb, 1) if base is not None else None,
                "rss_growth_pct": round(100 * (inst.rss_peak_mb - base) / base, 1)
                if base else None,
                "fds_base": inst.fds_base, "fds_max": inst.fds_max if base is not None else None,
                "sessions_reaped": inst.sessions_reaped,
                "log_errors": log_errors(inst.log),
            })
        malformed_total = sum(t.malformed.values())
        result: dict[str, Any] = {
            "bench": "soak",
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                        "python": platform.python_version()},
            "config": {
                "minutes": self.args.minutes, "seed": self.args.seed,
                "clients": self.args.clients, "tasks_in_flight": self.args.tasks_in_flight,
                "turns_in_flight": self.args.turns_in_flight,
                "max_requests": self.args.max_requests,
                "server": shlex.join(self.serve_argv()[1:]) if self.spawned else self.url,
                "session_idle_s": self.args.session_idle_s,
                "openai_idle_ttl_s": self.openai_ttl_s,
                "segments": self.num_segments, "load_s_per_segment": round(self.load_s, 1),
                "warmup_s": self.warmup_s,
            },
            "wall_s": round(wall, 1),
            "requests": {
                "total": self.num_requests,
                "actions": dict(sorted(t.requests.items())),
                "statuses": {str(k): v for k, v in sorted(t.statuses.items())},
                "num_5xx": t.num_5xx, "fivexx": t.fivexx[:20],
                "unanswered": len(t.unanswered), "unanswered_detail": t.unanswered[:20],
                "cut_by_kill": t.cut_by_kill,
                # non-streamed generations (blocking send, turn, chat) answered after 30 s
                "slow_answers": dict(t.slow),
                "num_429": t.num_429,
                "num_429_without_retry_after": t.num_429_without_retry_after,
                "unexpected": len(t.unexpected), "unexpected_detail": t.unexpected[:30],
            },
            "tasks": tasks,
            "cancel": {"asked": t.cancels_asked, "answers": dict(t.cancel_answers)},
            "resubscribe": dict(t.resubscribed),
            "sessions": {"created": t.sessions_created, "deleted": t.sessions_deleted,
                         "abandoned": t.sessions_abandoned, "refused_429": t.session_refused},
            "openai": {"answered": t.openai_ok, "refused_429": t.openai_refused},
            "malformed": {"sent": malformed_total, "wrong": t.malformed_wrong[:20],
                          "by_case": {k: {str(s): n for s, n in sorted(v.items())}
                                      for k, v in sorted(t.malformed_statuses.items())}},
            "unknown_gets": {"sent": t.unknown_gets, "wrong": t.unknown_gets_wrong[:20]},
            "latency_s": {k: {"n": len(v), "p50": pctl(v, 0.5), "p95": pctl(v, 0.95),
                              "max": pctl(v, 1.0)}
                          for k, v in sorted(t.latencies.items()) if k != "monitor"},
            "quiet_periods": self.quiet,
            "restart": self.restart,
            "servers": servers,
            "samples": self.samples,
        }
        result["goals"] = goals(result, self.spawned, self.dead)
        return result


def log_errors(log: Path | None, limit: int = 40) -> list[str]:
    """Lines of a server log that name an error (tracebacks, ERROR, a 5xx access line)."""
    if log is None or not log.exists():
        return []
    keys = ("Traceback", "ERROR", "Exception", "CRITICAL", '" 500', '" 502', '" 503')
    lines = [ln for ln in log.read_text(errors="replace").splitlines()
             if any(k in ln for k in keys)]
    return lines[:limit]


def goals(r: dict[str, Any], spawned: bool, dead: bool) -> dict[str, dict[str, Any]]:
    """Each goal: pass (True / False; None: not measured in this mode), value, expected."""
    req, tasks, servers = r["requests"], r["tasks"], r["servers"]
    quiet = r["quiet_periods"]
    actions = r["requests"]["actions"]
    growth = [s["rss_growth_pct"] for s in servers if s["rss_growth_pct"] is not None]
    fds_over = [s["fds_max"] - s["fds_base"] for s in servers if s["fds_base"] is not None]
    measured = bool(growth)

    def goal(ok: bool | None, value: Any, expected: str) -> dict[str, Any]:
        return {"pass": ok, "value": value, "expected": expected}

    restart = r["restart"] or {}
    out = {
        "server_stayed_up": goal(not dead, "restart failed" if dead else "up", "up"),
        "lost": goal(tasks["lost"] == 0, tasks["lost"], "0"),
        "5xx": goal(req["num_5xx"] == 0, req["num_5xx"], "0"),
        "unanswered": goal(req["unanswered"] == 0, req["unanswered"],
                           f"0 (within {ANSWER_LIMIT_S:g} s; a non-streamed generation "
                           f"{TASK_LIMIT_S:g} s)"),
        "unexpected_answers": goal(req["unexpected"] == 0, req["unexpected"], "0"),
        "malformed_all_4xx": goal(not r["malformed"]["wrong"] and r["malformed"]["sent"] > 0,
                                  f"{r['malformed']['sent'] - len(r['malformed']['wrong'])}/"
                                  f"{r['malformed']['sent']}", "all"),
        "unknown_get_is_jsonrpc_error": goal(
            not r["unknown_gets"]["wrong"] and r["unknown_gets"]["sent"] > 0,
            f"{r['unknown_gets']['sent'] - len(r['unknown_gets']['wrong'])}/"
            f"{r['unknown_gets']['sent']}", "all"),
        "baseline_every_quiet_period": goal(
            bool(quiet) and all(q["restored"] for q in quiet),
            f"{sum(q['restored'] for q in quiet)}/{len(quiet)}",
            "all: 0 sessions, 0 tickets, cells used == prefix"),
        "every_action_ran": goal(all(actions.get(k, 0) > 0 for k in WEIGHTS),
                                 sorted(k for k in WEIGHTS if not actions.get(k)) or "all",
                                 "all kinds"),
        "rss_growth_within_10pct": goal(
            (max(growth) <= 100 * MAX_RSS_GROWTH) if measured else None,
            max(growth) if growth else None, f"<= {100 * MAX_RSS_GROWTH:g} %"),
        "fds_flat": goal((max(fds_over) <= FD_SLACK) if fds_over else None,
                         max(fds_over) if fds_over else None, f"<= +{FD_SLACK}"),
        "restart_running_tasks_failed": goal(
            (restart.get("failed_by_sweep", 0) > 0 and not restart.get("still_open"))
            if spawned else None,
            f"{restart.get('failed_by_sweep')}/{restart.get('working_at_kill')}",
            "every task working at the kill FAILED after the restart (at least one)"),
        "restart_finished_tasks_readable": goal(
            (restart.get("finished_checked", 0) > 0 and not restart.get("finished_changed"))
            if spawned else None,
            f"{restart.get('finished_checked', 0) - len(restart.get('finished_changed', []))}/"
            f"{restart.get('finished_checked')}", "all unchanged"),
    }
    return out


def table(r: dict[str, Any]) -> str:
    t, req = r["tasks"], r["requests"]
    rows = [
        ("wall s", r["wall_s"]),
        ("requests (actions)", f"{req['total']} ({sum(req['actions'].values())})"),
        ("tasks sent / acknowledged", f"{t['sent']} / {t['acknowledged']}"),
        ("completed / cancelled / failed / rejected",
         f"{t['completed']} / {t['cancelled']} / {t['failed']} / {t['rejected']}"),
        ("lost", t["lost"]),
        ("cut by the kill before an answer (never stored)",
         f"{req['cut_by_kill']} ({t['cut_by_kill_never_stored']})"),
        ("5xx", req["num_5xx"]),
        ("unanswered (30 s; a non-streamed generation 300 s)", req["unanswered"]),
        ("non-streamed generations answered after 30 s (slow, not lost)",
         sum(req["slow_answers"].values())),
        ("unexpected answers", req["unexpected"]),
        ("429 (without Retry-After)", f"{req['num_429']} ({req['num_429_without_retry_after']})"),
        ("malformed sent / wrong", f"{r['malformed']['sent']} / {len(r['malformed']['wrong'])}"),
        ("unknown GetTask / wrong",
         f"{r['unknown_gets']['sent']} / {len(r['unknown_gets']['wrong'])}"),
        ("cancels asked", f"{r['cancel']['asked']} {r['cancel']['answers']}"),
        ("re-subscribes", r["resubscribe"]),
        ("sessions created / deleted / abandoned",
         f"{r['sessions']['created']} / {r['sessions']['deleted']} / "
         f"{r['sessions']['abandoned']}"),
        ("OpenAI answered / 429", f"{r['openai']['answered']} / {r['openai']['refused_429']}"),
    ]
    for key in ("send", "stream to end", "cancel", "session", "openai", "openai_stream to end"):
        lat = r["latency_s"].get(key)
        if lat:
            rows.append((f"latency {key} p50 / p95 / max s",
                         f"{lat['p50']} / {lat['p95']} / {lat['max']} (n={lat['n']})"))
    for q in r["quiet_periods"]:
        rows.append((f"quiet {q['index']} at {q['at_s']} s (server {q['server']})",
                     f"{'restored' if q['restored'] else 'NOT restored'}: sessions "
                     f"{q['sessions']}, cells {q['cells_used']}/{q['prefix_cells']} prefix, "
                     f"tickets {q['tickets']}, reaped {q['sessions_reaped']}, waited "
                     f"{q['waited_s']} s, rss {q['rss_mb']} MB, fds {q['fds']}"))
    rs = r["restart"]
    if rs:
        rows.append(("kill -9 / restart", json.dumps({k: v for k, v in rs.items()
                                                       if k != "sweep_reason"})[:300]))
    for s in r["servers"]:
        rows.append((f"server {s['server']} RSS base / peak MB (growth)",
                     f"{s['rss_base_mb']} / {s['rss_peak_mb']} ({s['rss_growth_pct']} %)"))
        rows.append((f"server {s['server']} fds base / max", f"{s['fds_base']} / {s['fds_max']}"))
        rows.append((f"server {s['server']} sessions_reaped", s["sessions_reaped"]))
    lines = ["| figure | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    lines.append("")
    for name, g in r["goals"].items():
        verdict = {True: "PASS", False: "FAIL", None: "n/a "}[g["pass"]]
        lines.append(f"{verdict} {name}: {g['value']} (expected {g['expected']})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__package__}",
                                     description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clients", type=int, default=5)
    parser.add_argument("--tasks-in-flight", type=int, default=2,
                        help="A2A tasks running at once (default 2)")
    parser.add_argument("--turns-in-flight", type=int, default=2,
                        help="session-API and OpenAI requests at once (default 2)")
    parser.add_argument("--max-requests", type=int, default=None,
                        help="stop sending after this many (default 400 a minute)")
    parser.add_argument("--url", default=None,
                        help="a running mesh serve (never killed; no restart check)")
    parser.add_argument("--pid", type=int, default=None,
                        help="with --url: its process id (default: found by its port)")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--session-idle-s", type=float, default=20.0,
                        help="the server's --session-idle-s (passed to the one spawned)")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY,
                        help="the server's --max-body-bytes (passed to the one spawned)")
    parser.add_argument("--serve-args", default="", help="more mesh serve flags, one string")
    parser.add_argument("--data-dir", default=None, help="the server's data dir (default: temp)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "soak.json"))
    args = parser.parse_args(argv)
    if args.max_requests is None:
        args.max_requests = int(400 * args.minutes)
    soak = Soak(args)
    out = Path(args.out)
    # SIGTERM (a test's timeout, a CI job's end) unwinds like Ctrl-C: the server is stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    failed: list[str] = []
    try:
        result = asyncio.run(soak.run())
        failed = [k for k, g in result["goals"].items() if g["pass"] is False]
    finally:
        if soak.proc is not None:
            stop(soak.proc)
        out.parent.mkdir(parents=True, exist_ok=True)
        if failed:  # the evidence: each server's whole log, beside the JSON
            for inst in soak.instances:
                if inst.log is not None and inst.log.exists():
                    shutil.copy(inst.log, out.with_name(f"{out.stem}-{inst.log.name}"))
        soak.tmp.cleanup()
    print(table(result))
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    if failed:
        print(f"FAILED: {', '.join(failed)} (server logs: {out.stem}-serve-N.log beside it)",
              file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
