"""``mesh serve``: one process with the engine pool, the gate and the A2A coordinator.

This is where the objects are built and wired; the library never imports the CLI.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mesh.a2a.config import CoordinatorConfig
from mesh.cli.engine_flags import add_engine_flags, apply_engine_flags
from mesh.cli.engines import add_engine_args, build_engine, prefix_cache_dir
from mesh.cli.nodes import build_nodes
from mesh.cli.preflight import coordinator_config, preflight, print_cache_warnings
from mesh.cli.project import build_project_prefix
from mesh.engine.types import EngineConfig, EngineError

if TYPE_CHECKING:
    from mesh.template.project import ProjectScan

__all__ = ["register"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="serve the A2A coordinator on one shared KV pool")
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
    p.add_argument("--floor-tps", type=float, default=5.0,
                   help="tokens/s every running worker must keep (default 5)")
    p.add_argument("--policy", default="floor", help="floor | legacy | static:N | none")
    p.add_argument("--max-queue", type=int, default=64, help="queued tasks before HTTP 429")
    p.add_argument("--max-queue-per-caller", type=int, default=None,
                   help="queue places one authenticated caller may hold (default: half of "
                        "--max-queue; without --auth-token the one caller may use all)")
    p.add_argument("--max-sessions", type=int, default=16, help="pool session slots")
    p.add_argument("--session-budget", type=int, default=2048,
                   help="most suffix tokens one session may hold")
    p.add_argument("--pool", choices=("shared", "naive"), default="shared",
                   help="naive: every worker prefills its own prefix copy (baseline)")
    p.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: all)")
    p.add_argument("--host", default="127.0.0.1",
                   help="bind address (default 127.0.0.1; anything else needs --auth-token)")
    p.add_argument("--port", type=int, default=8700)
    p.add_argument("--public-url", default=None, help="URL advertised on the agent card")
    p.add_argument("--data-dir", default=".mesh", help="task store and prefix cache")
    p.add_argument("--max-body-bytes", type=int, default=CoordinatorConfig.max_body_bytes,
                   metavar="N", help="largest request body accepted, in bytes; larger "
                                     "ones get 413 (default 1 MiB)")
    p.add_argument("--auth-token", default=os.environ.get("MESH_AUTH_TOKEN"),
                   help="require 'Authorization: Bearer TOKEN' (or set MESH_AUTH_TOKEN)")
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
    add_engine_flags(p)  # --native, --gpu-layers, --flash-attn, --kv-type, --kv-memory
    add_engine_args(p)  # --engine, --prefix-cache
    p.set_defaults(func=run)


def _peer_tokens(specs: list[str]) -> dict[str, str]:
    """Each named peer's token from ``MESH_PEER_TOKEN_<NAME>`` or the file that
    ``MESH_PEER_TOKEN_<NAME>_FILE`` names."""
    from mesh.fleet.peers import parse_peer, peer_token_env

    tokens: dict[str, str] = {}
    for spec in specs:
        name, _ = parse_peer(spec)
        if name is None:
            continue
        env = peer_token_env(name)
        token = os.environ.get(env)
        path = os.environ.get(env + "_FILE")
        if token is None and path:
            token = Path(path).read_text(encoding="utf-8").strip()
        if token:
            tokens[name] = token
    return tokens


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


# Models under this many parameters plan guided by default (--plan-style auto): measured on
# SmolLM2-135M, free plans answered all 43 agent-bench questions without a worker.
GUIDED_BELOW_PARAMS = 1_000_000_000


def plan_style(asked: str, n_params: int) -> str:
    """``--plan-style``: auto is guided for a model known to be under 1B parameters."""
    if asked != "auto":
        return asked
    return "guided" if 0 < n_params < GUIDED_BELOW_PARAMS else "free"


def default_plan_actions(style: str) -> tuple[str, ...]:
    """What a plan may do when ``--plan-actions`` is not given."""
    return ("delegate",) if style == "guided" else ("delegate", "answer", "ask")


def _project_paths(template: Any, project: Path) -> ProjectScan:
    """The project's files and folders as the prefix's scan sees them: the names a plan
    and a worker's tool call may give."""
    from mesh.template.project import scan_project

    spec = template.manifest.prefix
    return scan_project(Path(project).resolve(), tuple(spec.exclude), spec.include_hidden)


def run(args: argparse.Namespace) -> int:
    """Check the flags and folders and bind the port (fast, one line and exit 2 on a
    mistake), then build everything and serve on that very socket."""
    from mesh.a2a.app import run_server

    print_cache_warnings()
    try:
        sock = preflight(args)
    except ValueError as exc:
        print(f"mesh serve: {exc}", file=sys.stderr)
        return 2
    try:
        try:
            built = asyncio.run(build_nodes(args) if args.node else _build(args))
        except (EngineError, ValueError, OSError) as exc:
            print(f"mesh serve: {exc}", file=sys.stderr)
            return 2
        app, pool, peers = built
        try:
            return run_server(app, args.host, args.port, sock=sock)
        finally:
            asyncio.run(_close(pool, peers))
    finally:
        sock.close()


async def _close(pool: Any, peers: Any) -> None:
    if peers is not None:
        await peers.aclose()
    await pool.aclose()


async def _seed_gate(gate: Any, gate_cfg: Any, pool: Any, cache: Path) -> str:
    """Seed the gate's throughput model with a short probe (cached per model and machine),
    so the first admissions are projected from this hardware, not from a prior; it learns
    the rest online. The seed lives beside the prefix snapshots: a shared --prefix-cache
    shares it too. Policies that project nothing (``none``, ``static:N``) seed nothing."""
    from mesh.gate.calibrate import seed_model
    from mesh.gate.config import PolicyKind

    if gate_cfg.policy.kind in (PolicyKind.NONE, PolicyKind.STATIC):
        return "its prior, learned online (this policy needs no seed)"

    def timing() -> None:
        print("gate: timing a few steps of 1, 2 and 4 sessions to seed the throughput model "
              "(first start with this model on this machine; cached after)...",
              file=sys.stderr)

    def corrupt(path: Path, reason: str) -> None:
        print(f"gate: seed at {path} is corrupt ({reason}); rebuilding it", file=sys.stderr)

    source: str = await seed_model(gate.model, pool, cache, announce=timing,
                                   on_corrupt=corrupt)
    return "a probe of this machine" if source == "benchmark" else "cache"


async def _build(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    from mesh.a2a.app import build_app
    from mesh.a2a.push import make_push_url_validator
    from mesh.a2a.taskboard import TaskBoard
    from mesh.agent.task import Agent, AgentConfig
    from mesh.api import SessionAPI, api_routes
    from mesh.api.dashboard import DASHBOARD_PUBLIC_PATHS, DashboardHistory, dashboard_routes
    from mesh.api.openai import OpenAIAPI
    from mesh.fleet.peers import PeerClient
    from mesh.gate import FloorGate, GateConfig
    from mesh.gate.projection import lone_worker_tps
    from mesh.worker import DispatchWorker, ProjectTools, delegate_tool
    from mesh.worker.grammar import ProjectPaths
    from mesh.worker.text import template_texts

    coord = coordinator_config(args)  # preflight checked it, the port and the folders
    gate_cfg = GateConfig.create(policy=args.policy, floor_tps=args.floor_tps,
                                 max_queue=args.max_queue,
                                 max_queue_per_caller=args.max_queue_per_caller)
    gate_cfg.validate()
    built_prefix = build_project_prefix(args)
    template, project, model = built_prefix.template, built_prefix.project, built_prefix.model
    prefix, chat = built_prefix.prefix, built_prefix.chat
    peers = (
        PeerClient(args.peer, tokens=_peer_tokens(args.peer), origin=coord.name,
                   url_validator=make_push_url_validator(args.allow_private_push))
        if args.peer else None
    )
    system_text = prefix.text
    if peers is not None:
        system_text += "\n\n" + await peers.describe()
    prefix_text = chat.prefix_text(system_text)
    data_dir = Path(args.data_dir)  # preflight created it
    cfg = EngineConfig(model_path=str(model.path), max_sessions=args.max_sessions,
                       session_budget=args.session_budget, n_threads=args.threads,
                       cache_dir=prefix_cache_dir(args, data_dir),
                       share_prefix=args.pool == "shared")
    cfg = apply_engine_flags(cfg, args, prefix_text)
    pool = build_engine(args, cfg, prefix_text)

    def progress(done: int, total: int) -> None:
        print(f"\rprefix: {done}/{total} tokens decoded", end="", file=sys.stderr, flush=True)

    print(f"model: {model.name} ({model.source}) {model.path}", file=sys.stderr)
    print(f"chat format: {chat.name}; tool-call grammar: "
          f"{'on' if template.manifest.turns.grammar else 'off'}", file=sys.stderr)
    print(f"template: {template.name}; project: {project} "
          f"({len(prefix.included)} files in the prefix, {len(prefix.skipped)} skipped)",
          file=sys.stderr)
    info = await pool.start(progress)
    print(file=sys.stderr)
    how = "warm-started from cache" if info.warm_started else f"decoded in {info.build_s:.1f}s"
    print(f"prefix: {info.prefix_tokens} tokens, sha256 {info.prefix_hash[:16]}, {how}; "
          f"engine: {info.engine}; pool: {args.pool}, {info.max_sessions} sessions x "
          f"{info.session_budget} tokens, {info.n_ctx} KV cells", file=sys.stderr)
    gate = FloorGate(pool, gate_cfg)
    source = await _seed_gate(gate, gate_cfg, pool, Path(cfg.cache_dir or data_dir) / "gate")
    pool.set_prefill_budget(gate.pool_budget())  # prefill beside decoding keeps the floor
    if (set_turns := getattr(pool, "set_turn_admission", None)) is not None:
        set_turns(gate.decode_gate())  # floor: each turn waits for its step (local pool)
    print(f"gate: policy {gate_cfg.policy}, floor {gate_cfg.floor_tps:g} tok/s, "
          f"throughput model seeded from {source}", file=sys.stderr)
    lone = lone_worker_tps(gate.model, info.prefix_tokens, gate_cfg.new_worker_cells)
    if str(gate_cfg.policy) == "floor" and lone < gate_cfg.floor_tps:
        print(f"warning: one worker alone is projected at {lone:.1f} tok/s on this machine, "
              f"below the floor ({gate_cfg.floor_tps:g} tok/s): the gate will run one worker "
              f"at a time, under the floor; lower --floor-tps (below {lone:.1f}) or pick one "
              f"with `mesh sweep`", file=sys.stderr)
    tools: dict[str, Any] = dict(ProjectTools(project).as_tools())
    if peers is not None:
        tools["delegate"] = delegate_tool(peers.send)
    board = TaskBoard()
    history = DashboardHistory(gate)  # the dashboard's last 5 minutes
    dashboard = dashboard_routes(gate, tasks=board, history=history)
    sessions = SessionAPI(pool, gate, idle_s=args.session_idle_s)
    scan = _project_paths(template, project)
    paths = ProjectPaths.of(scan.files, scan.dirs)
    style = plan_style(args.plan_style, info.n_params)
    actions = args.plan_actions or default_plan_actions(style)
    print(f"planner: {coord.plan}, {style} plans ({', '.join(actions)})"
          + ("; workers' first turn must call a tool" if args.first_turn == "call" else "")
          + (f"; {info.n_params / 1e6:.0f}M parameters" if info.n_params else ""),
          file=sys.stderr)
    agent = Agent(pool, AgentConfig(plan=coord.plan, max_subtasks=min(4, coord.max_subtasks),
                                    text_max=160, actions=actions, style=style,
                                    files=scan.files,
                                    tools=tuple(sorted(tools)),
                                    instructions=tuple(template_texts(template))),
                  # planner and synthesis turns in the model's own chat format
                  render=lambda prompt: chat.continuation(
                      system_text, [{"role": "user", "content": prompt}]))
    openai_api = OpenAIAPI(pool, gate, chat, system_text, tokenize=pool.tokenize)
    app = build_app(
        coord,
        worker_factory=lambda: DispatchWorker(pool, template, tools, chat,
                                              simulation=args.simulation,
                                              paths=paths, first_call=args.first_turn == "call"),
        admission=gate,
        pool_info=info,
        extra_routes=[*api_routes(pool, gate, sessions), *dashboard,
                      *openai_api.routes],
        skills=[s.model_dump() for s in template.manifest.skills],
        task_board=board,
        public_paths=DASHBOARD_PUBLIC_PATHS,
        on_startup=[history.start],
        on_shutdown=[sessions.aclose, openai_api.aclose, history.aclose],
        agent=agent,
    )
    base = args.public_url or f"http://{args.host}:{args.port}"
    print(f"agent card: {base}/.well-known/agent-card.json  (Ctrl-C to stop)", file=sys.stderr)
    print(f"dashboard: {base}/dashboard", file=sys.stderr)
    return app, pool, peers
