"""What one simulation run collects: its config, ``/capacity`` samples, task timelines.

Pure data, JSON-able through ``to_json``. Times are seconds since the run's start on the
harness's own monotonic clock (client-side timestamps), so samples and task events share
one axis.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from mesh.sim.schedule import parse_schedule

__all__ = ["SCENARIOS", "IdleAgentsConfig", "NeighbourConfig", "PhaseRecord", "Sample",
           "SimConfig", "SimRun", "TaskEvent", "TaskTimeline"]

POLICIES_HELP = ("floor, floor-auto (floor with --floor-tps auto), projection, legacy, static:N "
                 "or none")
NEIGHBOURS = ("none", "cpu", "mesh")
# "packages": the template's scenario as it is; "idle-agents": many agents, mostly idle
# (long seeded tool gaps), more of them than the pool has resident slots, so they park.
SCENARIOS = ("packages", "idle-agents")


@dataclass(frozen=True)
class IdleAgentsConfig:
    """The ``idle-agents`` scenario's knobs (issue 28; :mod:`mesh.sim.idle`).

    Each agent is one package: a multi-turn tool loop whose tool calls last a seeded
    log-normal ``idle_s`` (median; ``idle_sigma``, clipped to ``[idle_min_s, idle_max_s]``).
    The server started here gets ``resident`` sequence ids (``--max-sessions``), room for
    every agent to stay attached (``--max-attached``) and parks a session idle for
    ``park_idle_s`` (``--park-idle``); ``park_memory_gib`` None keeps the server's
    ``--park-memory`` (0: every park recomputes).
    """

    resident: int = 4
    idle_s: float = 8.0
    idle_sigma: float = 0.5
    idle_min_s: float = 1.0
    idle_max_s: float = 60.0  # the worker's bound (SCENARIO_BOUNDS["tool_latency_s"])
    park_idle_s: float = 1.0
    park_memory_gib: float | None = None

    def validate(self) -> None:
        if self.resident < 1:
            raise ValueError(f"idle-agents resident must be >= 1, got {self.resident}; "
                             "fix --resident")
        if not 0 < self.idle_min_s <= self.idle_s <= self.idle_max_s <= 60.0:
            raise ValueError(
                f"idle-agents needs 0 < idle min ({self.idle_min_s:g}) <= --idle "
                f"({self.idle_s:g}) <= idle max ({self.idle_max_s:g}) <= 60 s")
        if self.idle_sigma < 0:
            raise ValueError(f"idle-agents sigma must be >= 0, got {self.idle_sigma:g}")
        if not self.park_idle_s > 0:
            raise ValueError(f"--park-idle must be > 0 s, got {self.park_idle_s:g}")
        if self.park_memory_gib is not None and self.park_memory_gib < 0:
            raise ValueError(f"--park-memory must be >= 0 GiB, got {self.park_memory_gib:g}")

    def tool_latency(self) -> dict[str, Any]:
        """The tool-latency distribution every agent's steps are drawn from."""
        return {"dist": "lognormal", "median": self.idle_s, "sigma": self.idle_sigma,
                "min": self.idle_min_s, "max": self.idle_max_s}

    def default_agents(self) -> int:
        """Agents when ``--packages`` is not given: four per resident slot."""
        return 4 * self.resident


@dataclass(frozen=True)
class NeighbourConfig:
    """A scripted second tenant on the same machine (:mod:`mesh.sim.neighbour`).

    ``kind``: ``none``, ``cpu`` (``cores`` busy-loop processes, each busy ``duty`` of every
    100 ms while on) or ``mesh`` (a second ``mesh serve`` of ``model``, driven by
    ``clients`` streaming chat requests of ``max_tokens`` while on). ``schedule``:
    ``random:LO-HI[/LO-HI]`` (seeded on/off durations in seconds, off first) or an explicit
    ``off:5,on:10,...`` (repeated to the end of the run). ``seed`` None: the run's seed.
    """

    kind: str = "none"
    schedule: str = "random:5-15"
    seed: int | None = None
    cores: int = 1
    duty: float = 1.0
    model: str | None = None  # mesh: None means the run's model
    clients: int = 2
    max_tokens: int = 48
    threads: int | None = None  # mesh: llama.cpp threads of the neighbour server

    @property
    def enabled(self) -> bool:
        return self.kind != "none"

    def validate(self) -> None:
        if self.kind not in NEIGHBOURS:
            raise ValueError(
                f"neighbour must be one of {', '.join(NEIGHBOURS)}, got {self.kind!r}; "
                "pass --neighbour none, cpu or mesh"
            )
        if not 0.0 < self.duty <= 1.0:
            raise ValueError(f"neighbour duty must be in (0, 1], got {self.duty}; "
                             "pass --neighbour-duty 1.0 for a whole core")
        flags = {"cores": "--neighbour-cores", "clients": "--neighbour-clients",
                 "max_tokens": "--neighbour-tokens", "threads": "--neighbour-threads"}
        for key, flag in flags.items():
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"neighbour {key} must be >= 1, got {value}; fix {flag}")
        parse_schedule(self.schedule)


@dataclass(frozen=True)
class SimConfig:
    """One scenario run. ``url`` set: drive that coordinator; else start ``mesh serve``."""

    template: str = "light"
    packages: int | None = None  # None: the template's scenario default
    steps: int | None = None
    tokens_per_step: int | None = None
    plan: bool | None = None  # None: the template's scenario.plan
    seed: int = 0
    floor_tps: float | None = None  # None: the server's default
    policy: str = "floor"
    pool: str = "shared"  # "shared" | "naive"
    url: str | None = None
    # The bearer token sent with every request (the server's --auth-token); never written
    # to a report (to_json leaves it out, and masks an --auth-token in serve_args).
    token: str | None = field(default=None, repr=False)
    model: str | None = None  # GGUF path or "tiny"; None: the server's default
    sample_interval_s: float = 0.25
    startup_timeout_s: float = 300.0
    task_timeout_s: float = 1800.0
    max_retries: int = 20  # per package, on HTTP 429
    serve_args: tuple[str, ...] = ()  # extra `mesh serve` arguments
    neighbour: NeighbourConfig = field(default_factory=NeighbourConfig)
    scenario: str = "packages"  # one of SCENARIOS
    idle: IdleAgentsConfig = field(default_factory=IdleAgentsConfig)  # "idle-agents" only

    @property
    def idle_agents(self) -> bool:
        return self.scenario == "idle-agents"

    def validate(self) -> None:
        if self.scenario not in SCENARIOS:
            raise ValueError(f"scenario must be one of {', '.join(SCENARIOS)}, got "
                             f"{self.scenario!r}; pass --scenario packages or idle-agents")
        if self.idle_agents:
            self.idle.validate()
            if self.plan:
                raise ValueError("--scenario idle-agents runs scripted tool loops; drop --plan")
        if self.pool not in ("shared", "naive"):
            raise ValueError(f"pool must be 'shared' or 'naive', got {self.pool!r}")
        if self.floor_tps is not None and not self.floor_tps > 0:
            raise ValueError(f"floor_tps must be > 0, got {self.floor_tps}")
        name, _, arg = self.policy.partition(":")
        known = ("floor", "floor-auto", "projection", "legacy", "static", "none")
        if name not in known or (name == "static") != bool(arg):
            raise ValueError(f"policy must be {POLICIES_HELP}, got {self.policy!r}")
        if not self.sample_interval_s > 0:
            raise ValueError(f"sample_interval_s must be > 0, got {self.sample_interval_s}")
        for key in ("packages", "steps", "tokens_per_step"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"{key} must be >= 1, got {value}")
        self.neighbour.validate()

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        del out["token"]
        out["serve_args"] = _masked(self.serve_args)
        return out


def _masked(argv: tuple[str, ...]) -> list[str]:
    """``argv`` with the value of every ``--auth-token`` replaced (a report is no place for
    a secret)."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] == "--auth-token":
            arg = "***"
        elif arg.startswith("--auth-token="):
            arg = "--auth-token=***"
        out.append(arg)
    return out


@dataclass(frozen=True)
class Sample:
    """One ``GET /capacity`` answer, at ``t`` seconds into the run."""

    t: float
    capacity: dict[str, Any]


@dataclass(frozen=True)
class TaskEvent:
    """One streamed event of a task, as the client saw it.

    ``kind``: ``submitted`` (request sent), ``task`` (the task object arrived), ``queued``,
    ``admitted``, ``turn_started``, ``tool_call``, ``tool_result``, ``plan`` (a planned
    package's plan is published), ``text`` (artifact chunk), ``paused`` (the decode gate
    paused a running turn and let it run again), ``status`` (other),
    ``rejected_429``, then a terminal ``completed`` / ``failed`` / ``rejected`` /
    ``canceled`` / ``input_required`` (nobody answers it here) / ``error``.
    ``subtask`` is the key the coordinator named (``plan``, ``synthesis``, a subtask id).
    """

    t: float
    kind: str
    turn: int = 0
    queue_position: int | None = None
    text: str = ""
    subtask: str = ""
    chars: int = 0  # ``text``: characters of the streamed chunk (its tokens are estimated)
    wait_s: float | None = None  # the turn's decode-gate wait, where the event carries it


@dataclass
class TaskTimeline:
    """Everything the client saw of one package's task."""

    package: int
    task_id: str = ""
    events: list[TaskEvent] = field(default_factory=list)
    state: str = "pending"  # final: completed | failed | rejected | canceled | error
    submitted_t: float | None = None  # first request sent
    done_t: float | None = None  # terminal event received
    num_generated: int = 0  # from the answer artifact
    num_retries: int = 0  # 429s before the coordinator took the task
    error: str = ""

    @property
    def is_delivered(self) -> bool:
        return self.state == "completed"

    @property
    def delivery_s(self) -> float | None:
        if not self.is_delivered or self.submitted_t is None or self.done_t is None:
            return None
        return self.done_t - self.submitted_t

    def first(self, kind: str) -> float | None:
        return next((e.t for e in self.events if e.kind == kind), None)

    def turn_rates(self, tokens_per_step: int) -> list[tuple[int, float, float, float]]:
        """``(turn, start_t, end_t, tokens/s)`` per turn: from ``turn_started`` to the
        turn's ``tool_call`` (the generation of ``tokens_per_step`` tokens, plus the
        prefill of the previous tool result, as the client observed it)."""
        starts = {e.turn: e.t for e in self.events if e.kind == "turn_started"}
        out: list[tuple[int, float, float, float]] = []
        for e in self.events:
            if e.kind == "tool_call" and e.turn in starts and e.t > starts[e.turn]:
                start = starts[e.turn]
                out.append((e.turn, start, e.t, tokens_per_step / (e.t - start)))
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "package": self.package,
            "task_id": self.task_id,
            "state": self.state,
            "submitted_t": self.submitted_t,
            "done_t": self.done_t,
            "delivery_s": self.delivery_s,
            "num_generated": self.num_generated,
            "num_retries": self.num_retries,
            "error": self.error,
            "events": [asdict(e) for e in self.events],
        }


@dataclass
class SimRun:
    """One run: its config, the scenario it drove and what was observed."""

    config: SimConfig
    scenario: dict[str, Any]  # Scenario.to_json()
    tokens_per_step: int
    samples: list[Sample] = field(default_factory=list)
    tasks: list[TaskTimeline] = field(default_factory=list)
    wall_s: float = 0.0
    server: dict[str, Any] = field(default_factory=dict)  # url, card name, started here
    label: str = ""  # the compare/sweep value this run stands for
    # The neighbour's "on" spans as they happened (run clock); empty without a neighbour.
    neighbour_phases: list[PhaseRecord] = field(default_factory=list)


@dataclass(frozen=True)
class PhaseRecord:
    """One span in which the neighbour ran: started at ``start``, stopped at ``end``
    (seconds on the run clock, as recorded when the load was started and stopped)."""

    start: float
    end: float
