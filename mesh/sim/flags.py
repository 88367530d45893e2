"""The ``--neighbour*`` flags of ``mesh simulate`` and ``mesh sweep`` (and
``bench/gate_bench.py``): a second tenant on the same machine (:mod:`mesh.sim.neighbour`)."""

from __future__ import annotations

import argparse

from mesh.sim.types import NEIGHBOURS, NeighbourConfig

__all__ = ["add_neighbour_args", "neighbour_config"]


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
