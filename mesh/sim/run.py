"""Running one simulation: the live progress line (a tqdm bar on stderr), the driver that
submits every package over real A2A and samples ``/capacity``, and the run that writes the
report.

The driver sends each package as one ``SendStreamingMessage`` through the a2a-sdk client;
every streamed event is stamped on arrival with the harness clock
(:class:`~mesh.sim.scenario.TaskEvent`). A refusal (HTTP 429) is recorded and retried after
its ``Retry-After``, so a package is slowed, never dropped. Nothing here starts or stops a
server (:mod:`mesh.sim.processes`).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import httpx
from a2a.client import A2ACardResolver, A2AClientError, Client, ClientConfig, ClientFactory
from a2a.helpers.proto_helpers import new_data_message, new_text_message
from a2a.types import a2a_pb2 as pb
from google.protobuf.json_format import MessageToDict
from tqdm import tqdm

from mesh.sim.plots import parking_plots, write_plots
from mesh.sim.processes import Neighbour, ServerCommand, ServerProcess
from mesh.sim.report import Summary, report_document, summarize, write_json, write_markdown
from mesh.sim.scenario import (
    PackagePlan,
    Sample,
    Scenario,
    SimConfig,
    SimRun,
    TaskEvent,
    TaskTimeline,
    plan_for,
)

__all__ = [
    "OnProgress", "ProgressBar", "ReportFiles", "drive", "run_simulation", "write_report"
]


# -------------------- progress ------------------------------------------------

class ProgressBar:
    """Pass as ``on_progress``; it is called on every task end and every sample."""

    def __init__(self, total: int, desc: str = "packages", *, file: TextIO | None = None,
                 disable: bool = False) -> None:
        self._bar: tqdm[Any] = tqdm(total=total, desc=desc, unit="pkg", leave=True,
                                    file=file or sys.stderr, disable=disable)
        self._done = 0

    def __call__(self, run: SimRun) -> None:
        figures: dict[str, Any] = {"delivered": sum(t.is_delivered for t in run.tasks)}
        if run.samples:
            cap = run.samples[-1].capacity
            figures["workers"] = cap.get("tickets", cap.get("sessions", {}).get("total"))
            figures["queue"] = cap.get("queue_len")
            slowest = cap.get("measured_tps", {}).get("min")
            figures["min_tps"] = f"{slowest:.1f}" if isinstance(slowest, int | float) else "–"
        finished = sum(t.done_t is not None for t in run.tasks)
        self._bar.set_postfix(figures, refresh=finished == self._done)
        if finished > self._done:
            self._bar.update(finished - self._done)  # refreshes
            self._done = finished

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

# -------------------- the driver ----------------------------------------------

OnProgress = Callable[[SimRun], None]

_TERMINAL = {
    pb.TaskState.TASK_STATE_COMPLETED: "completed",
    pb.TaskState.TASK_STATE_FAILED: "failed",
    pb.TaskState.TASK_STATE_REJECTED: "rejected",
    pb.TaskState.TASK_STATE_CANCELED: "canceled",
    # a planner that asks the user: nobody answers in a simulation
    pb.TaskState.TASK_STATE_INPUT_REQUIRED: "input_required",
}
_STEP_EVENTS = ("queued", "admitted", "turn_started", "tool_call", "tool_result", "plan")
_TEXT_MAX = 200


class _Clock:
    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def __call__(self) -> float:
        return round(time.monotonic() - self.t0, 4)


def _retry_after(exc: BaseException) -> float | None:
    """Seconds to wait if ``exc`` (or its cause) is an HTTP 429, else None."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, httpx.HTTPStatusError) and cause.response.status_code == 429:
            try:
                return max(0.1, float(cause.response.headers.get("retry-after", "1")))
            except ValueError:
                return 1.0
        cause = cause.__cause__
    return None


def _status_event(t: float, update: pb.TaskStatusUpdateEvent) -> TaskEvent:
    # The coordinator's step metadata may ride on the event or on its status message.
    meta: dict[str, Any] = {}
    if update.status.message.HasField("metadata"):
        meta.update(MessageToDict(update.status.message.metadata))
    if update.HasField("metadata"):
        meta.update(MessageToDict(update.metadata))
    text = " ".join(p.text for p in update.status.message.parts if p.HasField("text"))
    kind = str(meta.get("event", ""))
    if update.status.state in _TERMINAL:
        kind = _TERMINAL[update.status.state]
    elif "paused_s" in meta or "pausedS" in meta:  # the decode gate paused a turn
        kind = "paused"
    elif kind not in _STEP_EVENTS:
        kind = "status"
    position = meta.get("queue_position")
    wait = meta.get("wait_s", meta.get("waitS"))  # a turn's gate wait, where it is sent
    return TaskEvent(t=t, kind=kind, turn=int(meta.get("turn", 0) or 0),
                     queue_position=int(position) if position is not None else None,
                     text=text[:_TEXT_MAX],
                     subtask=str(meta.get("subtask", "")).rsplit("/", 1)[-1],
                     wait_s=float(wait) if isinstance(wait, int | float) else None)


def _answer_tokens(artifact: pb.Artifact) -> int:
    total = 0
    for part in artifact.parts:
        if part.HasField("data"):
            data: Any = MessageToDict(part.data)
            if isinstance(data, dict):
                for sub in data.get("subtasks", []):
                    total += int(sub.get("tokens") or 0)
    return total


@dataclass
class _Driver:
    client: Client
    config: SimConfig
    run: SimRun
    clock: _Clock
    on_progress: OnProgress | None
    planned: bool = False

    def progress(self) -> None:
        if self.on_progress is not None:
            self.on_progress(self.run)

    async def package(self, plan: PackagePlan, timeline: TaskTimeline) -> None:
        for attempt in range(self.config.max_retries + 1):
            timeline.submitted_t = timeline.submitted_t or self.clock()
            timeline.events.append(TaskEvent(self.clock(), "submitted"))
            try:
                await asyncio.wait_for(self._stream(plan, timeline), self.config.task_timeout_s)
            except A2AClientError as exc:
                wait = _retry_after(exc)
                if wait is not None and attempt < self.config.max_retries:
                    timeline.num_retries += 1
                    timeline.events.append(TaskEvent(self.clock(), "rejected_429", text=str(exc)))
                    await asyncio.sleep(wait)
                    continue
                self._finish(timeline, "error", f"{type(exc).__name__}: {exc}")
            except TimeoutError:
                self._finish(timeline, "error", f"no end within {self.config.task_timeout_s} s")
            if timeline.done_t is None:
                self._finish(timeline, "error", "the stream ended before a terminal state")
            return

    def _finish(self, timeline: TaskTimeline, state: str, error: str = "") -> None:
        if timeline.done_t is not None:
            return
        timeline.done_t = self.clock()
        timeline.state = state
        timeline.error = error
        if state == "error":
            timeline.events.append(TaskEvent(timeline.done_t, "error", text=error[:_TEXT_MAX]))
        self.progress()

    async def _stream(self, plan: PackagePlan, timeline: TaskTimeline) -> None:
        if self.planned:
            message = new_text_message(plan.message_text(), role=pb.Role.ROLE_USER)
        else:
            message = new_data_message(plan.message_data(), role=pb.Role.ROLE_USER)
        request = pb.SendMessageRequest(message=message)
        async for event in self.client.send_message(request):
            t = self.clock()
            if event.HasField("task"):
                timeline.task_id = event.task.id
                timeline.events.append(TaskEvent(t, "task"))
                state = event.task.status.state
                if state in _TERMINAL:  # a non-streaming answer, or an already-ended task
                    timeline.events.append(TaskEvent(t, _TERMINAL[state]))
                    for artifact in event.task.artifacts:
                        timeline.num_generated += _answer_tokens(artifact)
                    self._finish(timeline, _TERMINAL[state])
            elif event.HasField("status_update"):
                timeline.task_id = timeline.task_id or event.status_update.task_id
                ev = _status_event(t, event.status_update)
                timeline.events.append(ev)
                if ev.kind in _TERMINAL.values():
                    self._finish(timeline, ev.kind, "" if ev.kind == "completed" else ev.text)
            elif event.HasField("artifact_update"):
                artifact = event.artifact_update.artifact
                if artifact.name == "answer":
                    timeline.num_generated += _answer_tokens(artifact)
                else:
                    chars = sum(len(p.text) for p in artifact.parts if p.HasField("text"))
                    timeline.events.append(TaskEvent(t, "text", chars=chars))
            if timeline.done_t is not None:
                return


async def _sample(http: httpx.AsyncClient, url: str, run: SimRun, clock: _Clock,
                  interval_s: float, on_sample: Callable[[], None]) -> None:
    """Append one ``/capacity`` sample every ``interval_s`` until cancelled."""
    next_at = time.monotonic()
    while True:
        t = clock()
        try:
            response = await http.get(url.rstrip("/") + "/capacity")
            if response.status_code == 200:
                run.samples.append(Sample(t, response.json()))
                on_sample()
        except (httpx.HTTPError, ValueError):
            pass  # a missed sample is a gap in the plot, not a failed run
        next_at += interval_s
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))


async def drive(url: str, config: SimConfig, scenario: Scenario, *,
                on_progress: OnProgress | None = None,
                neighbour: Neighbour | None = None) -> SimRun:
    """Submit every package of ``scenario`` to the coordinator at ``url`` at once and
    collect the run (samples and timelines). Returns when every task has ended. Every
    request carries ``config.token`` as its bearer token (when set); a server that refuses
    it raises ``httpx.HTTPStatusError`` (401/403) before any package is sent.

    ``neighbour`` (set up already) follows its schedule from the run clock's zero and is
    stopped when the run ends; its "on" spans land in ``run.neighbour_phases``."""
    run = SimRun(config, scenario.to_json(), scenario.tokens_per_step)
    run.tasks = [TaskTimeline(p.index) for p in scenario.packages]
    limits = httpx.Limits(max_connections=len(scenario.packages) + 8)
    timeout = httpx.Timeout(30.0, read=None)  # a queued task may be silent for long
    headers = {"Authorization": f"Bearer {config.token}"} if config.token else {}
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as http:
        factory = ClientFactory(ClientConfig(streaming=True, httpx_client=http))
        card = await A2ACardResolver(http, url).get_agent_card()
        # A refused token (401/403 on /capacity, behind the same auth as A2A) is one clear
        # error before any package is sent; other answers pass (a missed sample is a gap).
        response = await http.get(url.rstrip("/") + "/capacity")
        if response.status_code in (401, 403):
            response.raise_for_status()
        client = factory.create(card)
        run.server = {"url": url, "name": card.name, "version": card.version}
        clock = _Clock()
        driver = _Driver(client, config, run, clock, on_progress, scenario.plan)
        sampler = asyncio.create_task(
            _sample(http, url, run, clock, config.sample_interval_s, driver.progress))
        if neighbour is not None:
            neighbour.begin(clock.t0)
        try:
            await asyncio.gather(*(driver.package(p, tl)
                                   for p, tl in zip(scenario.packages, run.tasks, strict=True)))
            run.wall_s = clock()
        finally:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
            if neighbour is not None:  # joins a thread that wakes at once
                run.neighbour_phases = neighbour.end()
            await client.close()
    return run

# -------------------- the run -------------------------------------------------

@dataclass(frozen=True)
class ReportFiles:
    json: Path
    markdown: Path
    plots: tuple[Path, ...]
    summary: Summary


def run_simulation(config: SimConfig, *, on_progress: OnProgress | None = None,
                   server_command: ServerCommand | None = None, label: str = "") -> SimRun:
    """Run ``config`` once: against ``config.url``, or a ``mesh serve`` started for it.

    Raises ``ValueError`` for a bad config and :class:`~mesh.sim.processes.ServerError` if
    the server does not come up; the server is stopped in every case.
    """
    config.validate()
    scenario = plan_for(config)
    with contextlib.ExitStack() as stack:
        neighbour = None
        if config.neighbour.enabled:  # before the server: its start-up is not the run's
            neighbour = stack.enter_context(Neighbour(
                config.neighbour, config.seed, config.model,
                startup_timeout_s=config.startup_timeout_s))
        url = config.url if config.url is not None else stack.enter_context(
            ServerProcess(config, command=server_command))
        run = asyncio.run(drive(url, config, scenario, on_progress=on_progress,
                                neighbour=neighbour))
    run.server["started_here"] = config.url is None
    run.label = label
    return run


def write_report(run: SimRun, out_dir: Path) -> ReportFiles:
    """``report.json``, ``report.md`` and the plots of one run, in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(run)
    plots = write_plots([run], out_dir) + parking_plots([run], out_dir)
    json_path = write_json(out_dir / "report.json", report_document(run, summary))
    md_path = write_markdown(out_dir / "report.md", run, summary, plots)
    return ReportFiles(json_path, md_path, tuple(plots), summary)
