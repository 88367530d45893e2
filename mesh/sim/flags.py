"""The ``--neighbour*`` flags of ``mesh simulate`` and ``mesh sweep`` (and
``bench/gate_bench.py``): a second tenant on the same machine (:mod:`mesh.sim.neighbour`);
and ``--scenario`` with the ``idle-agents`` knobs (many agents, mostly idle, parked)."""

from __future__ import annotations

import argparse

from mesh.sim.types import NEIGHBOURS, SCENARIOS, IdleAgentsConfig, NeighbourConfig

__all__ = ["add_neighbour_args", "add_scenario_kind_args", "idle_config", "neighbour_config"]


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
        park_memory_gib=args.park_memory,
    )
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
        threads=args.neighbour_threads,
    )
    config.validate()
    return config
