"""What a simulation runs: the neighbour's seeded schedule, the run's configuration and
records, the flags that set them, and the seeded scenario itself.

**The schedule** of the neighbour (a second tenant on the machine, :mod:`mesh.sim.processes`)
is a pure function of a spec and a seed, so every policy of a comparison sees the same one:

* ``random:LO-HI`` or ``random:ON_LO-ON_HI/OFF_LO-OFF_HI`` — alternating phases, off
  first (a quiet start), each phase's length drawn uniformly from its range (seconds) by
  ``random.Random(seed)``;
* ``off:5,on:10,off:3,...`` — explicit phases, repeated from the start when they run out.

The run starts and stops the load at those times and records when it actually did
(:class:`PhaseRecord`).

**Records** are pure data, JSON-able through ``to_json``. Times are seconds since the run's
start on the harness's own monotonic clock, so samples and task events share one axis.

**The scenario**: K packages, each one A2A task running S scenario steps, a pure function of
the template's ``[scenario]`` table, the seed and the overrides: every package gets a seed
drawn from one ``random.Random(seed)``, and its steps come from the worker's own planner
(:func:`mesh.worker.simulated.plan_schedule`), so what the report says a package did is
exactly what the worker does with the same ``params``.
"""

from __future__ import annotations

import argparse
import itertools
import random
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from mesh.template.loader import ScenarioSpec, load_template
from mesh.worker.simulated import ScenarioParams, StepPlan, plan_schedule

__all__ = [
    "SCENARIOS", "IdleAgentsConfig", "NeighbourConfig", "PackagePlan", "PhaseRecord",
    "PlannedPhase", "Sample", "Scenario", "Schedule", "SimConfig", "SimRun", "TaskEvent",
    "TaskTimeline", "add_neighbour_args", "add_scenario_kind_args", "idle_config",
    "iter_phases", "neighbour_config", "parse_schedule", "plan_for", "plan_phases",
    "plan_scenario"
]


# -------------------- the schedule --------------------------------------------

_HELP = ("--neighbour-schedule random:LO-HI[/LO-HI] (seconds on[/off]) or on:S,off:S,... "
         "(repeated)")


@dataclass(frozen=True)
class Schedule:
    """A parsed spec: ``explicit`` phases, or the ``on`` / ``off`` ranges to draw from."""

    explicit: tuple[tuple[bool, float], ...] = ()  # (on, seconds)
    on: tuple[float, float] = (5.0, 15.0)
    off: tuple[float, float] = (5.0, 15.0)


@dataclass(frozen=True)
class PlannedPhase:
    on: bool
    start: float
    end: float


def _range(text: str, spec: str) -> tuple[float, float]:
    lo, sep, hi = text.partition("-")
    try:
        low = float(lo)
        high = float(hi) if sep else low
    except ValueError:
        raise ValueError(f"bad neighbour schedule {spec!r}; pass {_HELP}") from None
    if not 0 < low <= high:
        raise ValueError(f"neighbour schedule {spec!r}: a range needs 0 < LO <= HI")
    return low, high


def parse_schedule(spec: str) -> Schedule:
    """Parse a schedule spec (see the module docstring); ``ValueError`` names the forms."""
    text = spec.strip().lower()
    if text.startswith("random:"):
        on, _, off = text[len("random:"):].partition("/")
        on_range = _range(on, spec)
        return Schedule(on=on_range, off=_range(off, spec) if off else on_range)
    phases: list[tuple[bool, float]] = []
    for item in text.split(","):
        state, sep, secs = item.strip().partition(":")
        if not sep or state not in ("on", "off"):
            raise ValueError(f"bad neighbour schedule {spec!r}; pass {_HELP}")
        length = _range(secs, spec)[0]
        phases.append((state == "on", length))
    if not any(on for on, _ in phases):
        raise ValueError(f"neighbour schedule {spec!r} is never on; add an on:S phase")
    return Schedule(explicit=tuple(phases))


def iter_phases(spec: str, seed: int) -> Iterator[PlannedPhase]:
    """The phases from 0 on, without end (the caller stops). Pure: the same spec and seed
    give the same phases whatever runs beside them."""
    schedule = parse_schedule(spec)
    rng = random.Random(seed)
    t = 0.0
    for i in itertools.count():
        if schedule.explicit:
            on, length = schedule.explicit[i % len(schedule.explicit)]
        else:
            on = i % 2 == 1  # off first: a quiet start
            lo, hi = schedule.on if on else schedule.off
            length = rng.uniform(lo, hi)
        yield PlannedPhase(on, round(t, 3), round(t + length, 3))
        t += length


def plan_phases(spec: str, seed: int, horizon_s: float) -> list[PlannedPhase]:
    """The phases from 0 to at least ``horizon_s`` (the last one crosses it)."""
    out: list[PlannedPhase] = []
    for phase in iter_phases(spec, seed):
        if phase.start >= horizon_s and out:
            break
        out.append(phase)
    return out

# -------------------- configuration and records -------------------------------

POLICIES_HELP = ("floor, floor-auto (floor with --floor-tps auto), projection, legacy, static:N "
                 "or none")
NEIGHBOURS = ("none", "cpu", "mesh")
# "packages": the template's scenario as it is; "idle-agents": many agents, mostly idle
# (long seeded tool gaps), more of them than the pool has resident slots, so they park.
SCENARIOS = ("packages", "idle-agents")


@dataclass(frozen=True)
class IdleAgentsConfig:
    """The ``idle-agents`` scenario's knobs (issue 28). Each agent is one package: a tool
    loop whose calls last a seeded log-normal ``idle_s`` (median; ``idle_sigma``, clipped to
    ``[idle_min_s, idle_max_s]``). The server started here gets ``resident`` sequence ids,
    room for every agent to stay attached, and parks a session idle for ``park_idle_s``
    (:func:`mesh.sim.processes.parking_args`; ``park_memory_gib`` None: the server's)."""

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
    """A scripted second tenant on the same machine (:mod:`mesh.sim.processes`): ``kind``
    ``none``, ``cpu`` (``cores``, ``duty``) or ``mesh`` (``model``, ``clients``,
    ``max_tokens``, ``threads``), on and off by ``schedule`` (see the module docstring),
    drawn from ``seed`` (None: the run's)."""

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
            raise ValueError(f"neighbour must be one of {', '.join(NEIGHBOURS)}, got "
                             f"{self.kind!r}; pass --neighbour none, cpu or mesh")
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
        out = asdict(self)
        events = out.pop("events")  # last: the long part
        return {**out, "delivery_s": self.delivery_s, "events": events}


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

# -------------------- flags ---------------------------------------------------

def add_scenario_kind_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("idle agents (--scenario idle-agents: more agents than slots, "
                             "parked while idle; docs/parking.md)")
    g.add_argument("--scenario", choices=SCENARIOS, default="packages",
                   help="packages: the template's scenario; idle-agents: --packages agents "
                   "(default 4 x --resident), each a tool loop with long seeded idle gaps, "
                   "on a server with --resident slots that parks idle sessions")
    g.add_argument("--resident", type=int, default=4, metavar="N",
                   help="idle-agents: resident sessions (the server's --max-sessions; "
                   "default: 4)")
    g.add_argument("--idle", type=float, default=8.0, metavar="S",
                   help="idle-agents: median tool gap, log-normal, 1..60 s (default: 8)")
    g.add_argument("--idle-sigma", type=float, default=0.5, metavar="SIGMA",
                   help="idle-agents: spread of the gaps (default: 0.5)")
    g.add_argument("--park-idle", type=float, default=1.0, metavar="S",
                   help="idle-agents: the server parks a session idle this long (default: 1)")
    g.add_argument("--park-memory", type=float, default=None, metavar="GiB",
                   help="idle-agents: host memory for swapped sessions (default: the "
                   "server's; 0: every park recomputes)")


def idle_config(args: argparse.Namespace) -> IdleAgentsConfig:
    """The :class:`IdleAgentsConfig` the flags ask for (validated: ``ValueError``)."""
    config = IdleAgentsConfig(
        resident=args.resident, idle_s=args.idle, idle_sigma=args.idle_sigma,
        idle_min_s=min(1.0, args.idle), park_idle_s=args.park_idle,
        park_memory_gib=args.park_memory)
    config.validate()
    return config


def add_neighbour_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("neighbour (load that comes and goes beside the run)")
    g.add_argument("--neighbour", choices=NEIGHBOURS, default="none",
                   help="cpu: busy-loop processes; mesh: a second `mesh serve` with its own "
                   "clients (default: none)")
    g.add_argument("--neighbour-schedule", default="random:5-15", metavar="SPEC",
                   help="random:LO-HI[/LO-HI] (seeded on[/off] seconds, off first) or "
                   "off:S,on:S,... repeated (default: random:5-15)")
    g.add_argument("--neighbour-seed", type=int, default=None, metavar="N",
                   help="schedule seed (default: --seed)")
    g.add_argument("--neighbour-cores", type=int, default=1, metavar="N",
                   help="cpu: busy processes while on (default: 1)")
    g.add_argument("--neighbour-duty", type=float, default=1.0, metavar="SHARE",
                   help="cpu: busy share of every 100 ms while on (default: 1.0)")
    g.add_argument("--neighbour-model", default=None, metavar="MODEL",
                   help="mesh: its model (default: the run's)")
    g.add_argument("--neighbour-clients", type=int, default=2, metavar="N",
                   help="mesh: concurrent request loops while on (default: 2)")
    g.add_argument("--neighbour-tokens", type=int, default=48, metavar="N",
                   help="mesh: max_tokens per request (default: 48)")
    g.add_argument("--neighbour-threads", type=int, default=None, metavar="N",
                   help="mesh: llama.cpp threads of the neighbour server (default: all)")


def neighbour_config(args: argparse.Namespace) -> NeighbourConfig:
    """The :class:`NeighbourConfig` the flags ask for (validated: ``ValueError``)."""
    config = NeighbourConfig(
        kind=args.neighbour, schedule=args.neighbour_schedule, seed=args.neighbour_seed,
        cores=args.neighbour_cores, duty=args.neighbour_duty, model=args.neighbour_model,
        clients=args.neighbour_clients, max_tokens=args.neighbour_tokens,
        threads=args.neighbour_threads)
    config.validate()
    return config

# -------------------- the scenario --------------------------------------------

# Two parts (";"): a planned package fans out to two workers and a synthesis turn (a plan
# of one subtask answers with its worker alone).
_INSTRUCTIONS = (
    "Package {index}: check the courier code paths this delivery touches; then report "
    "what to change."
)


@dataclass(frozen=True)
class PackagePlan:
    """One package: the subtask ``params`` sent to the coordinator and the steps they imply."""

    index: int  # 0-based
    seed: int
    params: Mapping[str, Any]
    steps: tuple[StepPlan, ...]

    @property
    def num_tokens(self) -> int:
        return sum(s.tokens for s in self.steps)

    def message_text(self) -> str:
        """The package as plain text: what a planned package sends (the coordinator plans
        it; ``params`` do not travel, the planned workers run real turns)."""
        return _INSTRUCTIONS.format(index=self.index)

    def message_data(self) -> dict[str, Any]:
        """The data part of this package's A2A message (the coordinator's fan-out format)."""
        return {"subtasks": [{"id": f"p{self.index}", "instructions": self.message_text(),
                              "params": dict(self.params)}]}

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "seed": self.seed, "params": dict(self.params),
                "steps": [{**asdict(s), "arguments": dict(s.arguments)} for s in self.steps]}


@dataclass(frozen=True)
class Scenario:
    """Every package of one run, in submission order."""

    seed: int
    steps: int
    tokens_per_step: int
    packages: tuple[PackagePlan, ...]
    plan: bool = False  # packages go as plain text, so the coordinator plans each

    @property
    def num_tokens(self) -> int:
        return sum(p.num_tokens for p in self.packages)

    def to_json(self) -> dict[str, Any]:
        return {"seed": self.seed, "steps": self.steps, "tokens_per_step": self.tokens_per_step,
                "plan": self.plan, "packages": [p.to_json() for p in self.packages]}


def plan_scenario(spec: ScenarioSpec, seed: int, *, packages: int | None = None,
                  steps: int | None = None, tokens_per_step: int | None = None,
                  plan: bool | None = None, tool_latency_s: Mapping[str, Any] | None = None
                  ) -> Scenario:
    """The packages of a run; ``None`` overrides take the template's defaults.

    ``tool_latency_s``: a distribution table (as in the manifest) for every step's tool
    call instead of the template's, e.g. the long idle gaps of ``--scenario idle-agents``.

    Raises ``ValueError`` for a count below 1. Pure: same arguments, same scenario.
    """
    num_packages = spec.packages if packages is None else packages
    num_steps = spec.steps if steps is None else steps
    num_tokens = spec.tokens_per_step if tokens_per_step is None else tokens_per_step
    for name, value in (("packages", num_packages), ("steps", num_steps),
                        ("tokens_per_step", num_tokens)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    rng = random.Random(seed)
    defaults = spec.model_dump()
    defaults.pop("packages")
    planned = bool(defaults.pop("plan")) if plan is None else plan
    plans: list[PackagePlan] = []
    for i in range(num_packages):
        package_seed = rng.getrandbits(31)
        params: dict[str, Any] = {
            "scenario": True,
            "steps": num_steps,
            "tokens_per_step": num_tokens,
            "seed": package_seed,
            "package": i,
            # The distributions travel too, so the schedule does not depend on which
            # template the server loaded.
            "tools": list(spec.tools),
            "tool_latency_s": dict(tool_latency_s) if tool_latency_s is not None
            else defaults["tool_latency_s"],
            "tool_output_tokens": defaults["tool_output_tokens"],
        }
        knobs = ScenarioParams.model_validate({**defaults, **params})
        plans.append(PackagePlan(i, package_seed, params, plan_schedule(knobs)))
    return Scenario(seed, num_steps, num_tokens, tuple(plans), planned)


def plan_for(config: SimConfig) -> Scenario:
    """The scenario ``config`` asks for (the template's defaults fill what it leaves out)."""
    spec = load_template(config.template).manifest.scenario
    packages, plan, latency = config.packages, config.plan, None
    if config.idle_agents:  # many agents, long seeded idle gaps, never planned
        packages = packages if packages is not None else config.idle.default_agents()
        plan, latency = False, config.idle.tool_latency()
    return plan_scenario(spec, config.seed, packages=packages, steps=config.steps,
                         tokens_per_step=config.tokens_per_step, plan=plan,
                         tool_latency_s=latency)
