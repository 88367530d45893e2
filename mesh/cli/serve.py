"""``mesh serve``: one process with the engine pool, the gate and the A2A coordinator.

Here the flags are declared; what they build is checked and wired in
:mod:`mesh.cli.compose`, inside the app's lifespan.
"""

from __future__ import annotations

import argparse
import os
import sys

from mesh.a2a.config import CoordinatorConfig
from mesh.cli.compose import (
    add_engine_args,
    add_engine_flags,
    floor_arg,
    local_app,
    preflight,
    print_cache_warnings,
)
from mesh.engine.interface import EngineError

__all__ = ["auth_line", "plan_actions", "register", "run"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="serve the A2A coordinator on one shared KV pool")
    _add_prefix_flags(p)
    _add_gate_flags(p)
    _add_pool_flags(p)
    _add_server_flags(p)
    _add_agent_flags(p)
    add_engine_flags(p)  # --native, --gpu-layers, --flash-attn, --kv-type, --kv-memory
    add_engine_args(p)  # --engine, --prefix-cache
    p.set_defaults(func=run)


def _add_prefix_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--project", default=None,
                   help="project directory the prefix describes and tools read "
                        "(default: the current directory if it is a git checkout, "
                        "else the template's sample project)")
    p.add_argument("--template", default="light",
                   help="'light', 'heavy', or a path to a template folder")
    p.add_argument("--prefix-tokens", type=int, default=None,
                   help="target prefix size (default: the template's; heavy scales to 128K)")
    p.add_argument("--model", default=None,
                   help="GGUF path, or smollm2, gemma, tiny (default: $MESH_MODEL, else smollm2)")


def _add_gate_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--floor-tps", type=floor_arg, default=5.0,
                   help="tokens/s every running worker must keep (default 5), or 'auto': "
                        "the gate runs rows while the step's shared part (weights, prefix, "
                        "host work) is still >= 25 %% of the step it measures (the knee), "
                        "re-found as the machine changes")
    p.add_argument("--policy", default="floor",
                   help="floor (the decode gate) | none; the simulation's comparison policies "
                        "projection, legacy and static:N are accepted for measuring against")
    p.add_argument("--max-queue", type=int, default=64, help="queued tasks before HTTP 429")
    p.add_argument("--max-queue-per-caller", type=int, default=None,
                   help="queue places one authenticated caller may hold (default: half of "
                        "--max-queue; without --auth-token the one caller may use all)")


def _add_pool_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-sessions", type=int, default=16, help="pool session slots")
    p.add_argument("--session-budget", type=int, default=2048,
                   help="most suffix tokens one session may hold")
    p.add_argument("--kv-cells", type=int, default=None,
                   help="suffix KV cells all sessions share; each takes what it uses, up to "
                        "--session-budget (default: sized to need, max-sessions x "
                        "min(budget, 512), at least one budget)")
    p.add_argument("--pool", choices=("shared", "naive"), default="shared",
                   help="naive: every worker prefills its own prefix copy (baseline)")
    p.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: all)")


def _add_server_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1",
                   help="bind address (default 127.0.0.1; anything else needs --auth-token)")
    p.add_argument("--port", type=int, default=8700)
    p.add_argument("--public-url", default=None, help="URL advertised on the agent card")
    p.add_argument("--data-dir", default=".mesh", help="task store and prefix cache")
    p.add_argument("--task-store", default=None, metavar="postgresql://...",
                   help="keep tasks in this PostgreSQL database instead of SQLite under "
                        "--data-dir; several coordinators may share one (needs "
                        "mesh[postgres]; see docs/cluster.md)")
    p.add_argument("--max-body-bytes", type=int, default=CoordinatorConfig.max_body_bytes,
                   metavar="N", help="largest request body accepted, in bytes; larger "
                                     "ones get 413 (default 1 MiB)")
    p.add_argument("--auth-token", default=os.environ.get("MESH_AUTH_TOKEN"),
                   help="require 'Authorization: Bearer TOKEN' (or set MESH_AUTH_TOKEN)")


def _add_agent_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peer", action="append", default=[], metavar="NAME=URL",
                   help="another A2A agent workers may delegate to, by NAME (repeatable); "
                        "its token: $MESH_PEER_TOKEN_<NAME> (or a file named by "
                        "$MESH_PEER_TOKEN_<NAME>_FILE)")
    p.add_argument("--max-hops", type=int, default=4,
                   help="refuse a delegated message past this many hops (default 4)")
    p.add_argument("--plan", choices=("auto", "always", "never"), default="auto",
                   help="planning turn for messages without explicit subtasks: auto (an "
                        "unparseable plan runs the message as one subtask), always (it fails "
                        "the task), never (one subtask, as a dispatcher)")
    p.add_argument("--plan-style", choices=("auto", "free", "guided"), default="auto",
                   help="free: the model writes each subtask; guided: one subtask per part "
                        "of the request, the model adds files, tools and detail (for small "
                        "models); auto (default): guided under 1B parameters, else free")
    p.add_argument("--first-turn", choices=("any", "call"), default="any",
                   help="any (default): a worker's first turn may call a tool or answer; "
                        "call: it must call a tool (on SmolLM2 this did not raise the agent "
                        "benchmark's success: 1/32 vs 2/32)")
    p.add_argument("--plan-actions", default=None, type=plan_actions,
                   help="what a plan may do, comma-separated from delegate, answer, ask "
                        "(default: all three for free plans, delegate for guided ones: a "
                        "small model answers about files it cannot see)")
    p.add_argument("--allow-private-push", action="store_true",
                   help="allow push-notification URLs on loopback/private networks")
    p.add_argument("--session-idle-s", type=float, default=300.0,
                   help="expire a /v1/sessions session idle this long (default 300)")
    p.add_argument("--simulation", action="store_true",
                   help="honour (bounded) scenario params in subtasks: the load harness; "
                        "`mesh simulate` turns it on for the server it starts")


def plan_actions(text: str) -> tuple[str, ...]:
    """``--plan-actions``: known names, at least one, in the planner's order."""
    from mesh.agent.plans import ACTIONS

    asked = {a.strip() for a in text.split(",") if a.strip()}
    unknown = sorted(asked - set(ACTIONS))
    if unknown or not asked:
        raise argparse.ArgumentTypeError(
            f"{', '.join(unknown) or 'nothing'} is not one of {', '.join(ACTIONS)}; "
            "e.g. --plan-actions delegate,answer")
    return tuple(a for a in ACTIONS if a in asked)


def auth_line(args: argparse.Namespace, tokens: tuple[str, ...]) -> str:
    """The start-up log's line on authentication: on, with how many bearer ``tokens``
    (never the tokens), or off, with who may then call."""
    if tokens:
        n = len(tokens)
        return (f"auth: on ({n} bearer token{'s' if n != 1 else ''}; callers send "
                "'Authorization: Bearer TOKEN', mesh commands --token or MESH_TOKEN)")
    return (f"auth: off (anyone who can reach {args.host}:{args.port} may call; "
            "--auth-token T or MESH_AUTH_TOKEN turns it on)")


def run(args: argparse.Namespace) -> int:
    """Check the flags and folders and bind the port (fast, one line and exit 2 on a
    mistake), resolve the prefix (a bad ``--model`` fails here, the same way), then serve
    on that very socket: the app's lifespan builds the pool, the gate and the rest on the
    loop that serves them, and closes them there when a signal stops the server."""
    from mesh.a2a.app import run_server

    print_cache_warnings()
    try:
        sock, checked = preflight(args)
    except ValueError as exc:
        print(f"mesh serve: {exc}", file=sys.stderr)
        return 2
    try:
        app = local_app(args, checked)
        print(auth_line(args, checked.coordinator.tokens), file=sys.stderr)
        return run_server(app, args.host, args.port, sock=sock)
    except (EngineError, ValueError, OSError) as exc:
        # A start-up error (model, prefix, Ray, engine) is one line and exit 2, whether
        # found here or in the lifespan before anything was served.
        print(f"mesh serve: {exc}", file=sys.stderr)
        return 2
    finally:
        sock.close()
