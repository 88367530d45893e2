"""``mesh simulate`` and ``mesh sweep``: the seeded scenario harness over real A2A.

``mesh simulate`` starts a coordinator (``mesh serve`` as a subprocess) or targets one at
``--url``, submits K packages at once and writes ``report.json``, ``report.md`` and plots to
``--out``; ``--compare KEY=V1,V2`` runs the same scenario once per value. ``mesh sweep``
runs it at each ``--floors`` value and names the sweet spot; it always starts its own
coordinator, one per floor (the floor is a ``mesh serve`` flag: a running server's cannot
be changed from here), so it takes no ``--url``.

Every request carries the bearer token of ``--token`` (alias ``--auth-token``), else of
``$MESH_TOKEN`` (what ``mesh send`` sends), else the first of ``$MESH_AUTH_TOKEN`` (what a
``mesh serve`` started here with that environment accepts); the token is never written to
a report.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import httpx
from a2a.utils.errors import A2AError

from mesh.cli.client import describe
from mesh.sim.processes import ServerCommand, ServerError, serve_command
from mesh.sim.scenario import (
    POLICIES_HELP,
    SimConfig,
    SimRun,
    add_neighbour_args,
    add_scenario_kind_args,
    idle_config,
    neighbour_config,
    plan_for,
)

if TYPE_CHECKING:
    from mesh.sim.compare import RunOne

__all__ = ["register"]


def _token(args: argparse.Namespace) -> str | None:
    """The bearer token to send (see the module docstring); None: send none. A comma list
    (``mesh serve --auth-token`` takes one: several callers) gives its first token."""
    for value in (args.token, os.environ.get("MESH_TOKEN"), os.environ.get("MESH_AUTH_TOKEN")):
        first = next((t.strip() for t in (value or "").split(",") if t.strip()), None)
        if first:
            return first
    return None


def _scenario_args(p: argparse.ArgumentParser, *, url: bool) -> None:
    p.add_argument("--template", default="light",
                   help="light, heavy or a template folder (default: light)")
    p.add_argument("--packages", type=int, default=None, metavar="K",
                   help="packages submitted at once (default: the template's)")
    p.add_argument("--steps", type=int, default=None, metavar="S",
                   help="generate + tool steps per package (default: the template's)")
    p.add_argument("--tokens-per-step", type=int, default=None, metavar="N",
                   help="tokens generated per step (default: the template's)")
    p.add_argument("--seed", type=int, default=0, help="scenario seed (default: 0)")
    p.add_argument("--plan", action=argparse.BooleanOptionalAction, default=None,
                   help="send each package as plain text so the coordinator plans it "
                        "(planner, real workers, synthesis); default: the template's "
                        "scenario.plan (false)")
    p.add_argument("--policy", default="floor", help=f"gate policy: {POLICIES_HELP}")
    p.add_argument("--pool", choices=("shared", "naive"), default="shared",
                   help="shared prefix (default) or a private copy per worker (baseline)")
    target = p.add_mutually_exclusive_group()
    # mesh sweep starts a coordinator per floor: --url stays out of its --help, and names
    # the reason when given anyway.
    target.add_argument("--url", default=None,
                        help="drive the coordinator at this URL" if url else argparse.SUPPRESS)
    target.add_argument("--model", default=None,
                        help="model for the coordinator started here (GGUF path or 'tiny')")
    p.add_argument("--token", "--auth-token", dest="token", default=None, metavar="T",
                   help="bearer token for a server with auth on (default: $MESH_TOKEN, else "
                        "the first of $MESH_AUTH_TOKEN)")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for the `mesh serve` started here (repeatable)")
    p.add_argument("--startup-timeout", type=float, default=300.0, metavar="S",
                   help="seconds to wait for the started coordinator (default: 300)")
    p.add_argument("--interval", type=float, default=0.25, metavar="S",
                   help="seconds between /capacity samples (default: 0.25)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_neighbour_args(p)
    add_scenario_kind_args(p)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "simulate", help="run the seeded scenario over A2A and report",
        description="Exit status: 0 when every package was delivered, 3 when some were not.")
    _scenario_args(p, url=True)
    p.add_argument("--floor-tps", type=float, default=None, metavar="F",
                   help="floor tokens/s per worker (default: the server's)")
    p.add_argument("--compare", default=None, metavar="KEY=V1,V2",
                   help="run once per value of policy, pool, floor or template")
    p.add_argument("--out", type=Path, default=Path("sim-report"),
                   help="report folder (default: ./sim-report)")
    p.set_defaults(func=run_simulate)

    s = sub.add_parser(
        "sweep", help="run the scenario at several floors; find the sweet spot",
        description="Starts its own coordinator for each floor (the floor is a `mesh serve` "
                    "flag), so it drives no --url.")
    _scenario_args(s, url=False)
    s.add_argument("--floors", default="2,4,6,8,12", help="comma-separated floors (tok/s)")
    s.add_argument("--max-under", type=float, default=0.05, metavar="SHARE",
                   help="most time under the floor the sweet spot may have (default: 0.05)")
    s.add_argument("--out", type=Path, default=Path("sim-sweep"),
                   help="report folder (default: ./sim-sweep)")
    s.set_defaults(func=run_sweep_cmd)


def _config(args: argparse.Namespace, floor: float | None) -> SimConfig:
    serve: tuple[str, ...] = () if args.url else ("--simulation",)
    planned = plan_for(SimConfig(template=args.template, plan=args.plan)).plan
    if planned and not args.url:  # every planned package runs workers (no ask, no answer)
        serve += ("--plan", "auto", "--plan-actions", "delegate")
    config = SimConfig(
        template=args.template, packages=args.packages, steps=args.steps,
        tokens_per_step=args.tokens_per_step, plan=args.plan, seed=args.seed,
        floor_tps=floor, policy=args.policy, pool=args.pool, url=args.url,
        token=_token(args), model=args.model, sample_interval_s=args.interval,
        startup_timeout_s=args.startup_timeout,
        # The server started here runs the scenario, so it honours scenario params.
        serve_args=(*serve, *args.serve_arg), neighbour=neighbour_config(args),
        scenario=args.scenario, idle=idle_config(args))
    config.validate()
    return config


def _watched(config: SimConfig) -> ServerCommand:
    """``serve_command`` that first prints the dashboard URL of the server it starts."""

    def command(port: int, data_dir: Path) -> list[str]:
        print(f"dashboard: http://127.0.0.1:{port}/dashboard", file=sys.stderr, flush=True)
        return serve_command(config, port, data_dir)

    return command


def _harness() -> tuple[ModuleType, ModuleType]:
    """:mod:`mesh.sim.run` and :mod:`mesh.sim.compare`, which plot (matplotlib) and show a
    progress bar (tqdm): the ``sim`` extra, which a plain install (``mesh serve``'s) lacks.
    Without them: ValueError naming the fix."""
    try:
        from mesh.sim import compare, run
    except ImportError as exc:
        raise ValueError(
            f"this command plots its report and needs {exc.name or 'matplotlib'}, which is "
            "not installed: pip install 'mesh[sim]' (in a checkout: bash scripts/install.sh "
            "sim)") from None
    return run, compare


def _runner(args: argparse.Namespace) -> RunOne:
    run, _ = _harness()
    ProgressBar, run_simulation = run.ProgressBar, run.run_simulation

    def run_one(config: SimConfig, label: str) -> SimRun:
        total = len(plan_for(config).packages)
        if config.url is not None and sys.stderr.isatty():  # for a person watching
            print(f"dashboard: {config.url.rstrip('/')}/dashboard", file=sys.stderr, flush=True)
        command = None if config.url is not None else _watched(config)
        with ProgressBar(total, label or "packages", disable=args.no_progress) as bar:
            done: SimRun = run_simulation(config, on_progress=bar, label=label,
                                          server_command=command)
            return done

    return run_one


def _fail(message: str, command: str = "simulate") -> int:
    print(f"mesh {command}: {message}", file=sys.stderr)
    return 1


def _failed(exc: Exception, args: argparse.Namespace, command: str = "simulate") -> int:
    """A server that is not there, refuses or answers 4xx: one line naming the fix (the
    traceback with --debug)."""
    if getattr(args, "debug", False):
        raise exc
    return _fail(describe(exc, args.url), command)


def run_simulate(args: argparse.Namespace) -> int:
    try:
        config = _config(args, args.floor_tps)
        run_one = _runner(args)
        run, compare = _harness()
        if args.compare:
            key, values = compare.parse_compare(args.compare)
            if args.url is not None and key in ("policy", "pool", "floor"):
                return _fail(f"--compare {key} needs a coordinator started here, not --url")
            result = compare.run_compare(config, key, values, args.out, run_one)
            print(result.table.read_text(encoding="utf-8"))
            print(f"reports in {args.out}/", file=sys.stderr)
            return 0
        files = run.write_report(run_one(config, ""), args.out)
    except (ValueError, ServerError) as exc:
        return _fail(str(exc))
    except (A2AError, httpx.HTTPError, OSError) as exc:
        return _failed(exc, args)
    print(files.markdown.read_text(encoding="utf-8").split("\n\n| package")[0])
    print(f"report: {files.json} , {files.markdown} and {len(files.plots)} plots", file=sys.stderr)
    summary = files.summary
    return 0 if summary["delivered"] == summary["submitted"] else 3


def run_sweep_cmd(args: argparse.Namespace) -> int:
    try:
        floors = [float(f) for f in args.floors.split(",") if f.strip()]
        if not floors or any(f <= 0 for f in floors):
            raise ValueError(f"--floors needs positive numbers, got {args.floors!r}")
        if args.url is not None:
            raise ValueError(
                "mesh sweep starts its own coordinator for each floor (a running server's "
                "floor is fixed by its `mesh serve --floor-tps`), so it takes no --url; drop "
                "--url, or run `mesh simulate --url URL` once per server started at a floor")
        config = _config(args, floors[0])
        _, compare = _harness()
        result = compare.run_sweep(config, floors, args.out, _runner(args),
                                   max_under=args.max_under)
    except (ValueError, ServerError) as exc:
        return _fail(str(exc), "sweep")
    except (A2AError, httpx.HTTPError, OSError) as exc:
        return _failed(exc, args, "sweep")
    print(result.table.read_text(encoding="utf-8"))
    return 0
