"""``mesh serve`` on a pool of its own: what it builds, in two steps.

:func:`local_app` runs in the CLI, before any event loop: it checks the gate's flags and
resolves the prefix (template, project, model, chat format; the model's vocabulary only),
so a bad ``--model`` fails with one line before anything is served. It returns the app of
:func:`mesh.a2a.app.create_app`, whose lifespan runs :func:`compose_local` on the loop that
serves it: the peer clients, the pool (started: prefix decoded or restored), the gate and
its seed, the tools, the session and OpenAI APIs, the dashboard's history, the agent.
What compose opens is closed in that lifespan, on that loop, once.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from contextlib import AsyncExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mesh.cli.preflight import Checked
from mesh.cli.project import build_project_prefix

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from mesh.a2a.app import AppParts
    from mesh.a2a.config import CoordinatorConfig
    from mesh.cli.project import ProjectPrefix
    from mesh.gate.admission import FloorGate
    from mesh.gate.config import GateConfig
    from mesh.gate.decide import WorkerRule
    from mesh.template.project import ProjectScan

__all__ = ["GUIDED_BELOW_PARAMS", "compose_local", "default_plan_actions", "local_app",
           "peer_tokens", "plan_style"]

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


def peer_tokens(specs: list[str]) -> dict[str, str]:
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


def local_app(args: argparse.Namespace, checked: Checked) -> Starlette:
    """The app ``mesh serve`` serves on its own pool (nothing live is built yet), from the
    configuration :func:`~mesh.cli.preflight.preflight` built; raises ValueError naming
    the fix."""
    from mesh.a2a.app import create_app
    from mesh.api.dashboard import DASHBOARD_PUBLIC_PATHS

    coord, gate_cfg, rule = checked.coordinator, checked.gate, checked.rule
    assert gate_cfg is not None, "preflight builds the gate's configuration"
    built = build_project_prefix(args)
    return create_app(coord, functools.partial(compose_local, args, coord, gate_cfg, rule, built),
                      public_paths=DASHBOARD_PUBLIC_PATHS)


async def _seed_gate(gate: FloorGate, pool: Any, cache: Path) -> str:
    """Seed the gate's throughput model with a short probe (cached per model and machine),
    so the first turns are gated on this hardware's step shape, not a prior; it learns
    the rest online. The seed lives beside the prefix snapshots: a shared --prefix-cache
    shares it too. Policies that read no model (``none``, ``static:N``) seed nothing."""
    from mesh.gate.model import seed_model

    if gate.config.policy == "none" or (gate.rule is not None and not gate.rule.needs_seed):
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


def _project_paths(template: Any, project: Path) -> ProjectScan:
    """The project's files and folders as the prefix's scan sees them: the names a plan
    and a worker's tool call may give."""
    from mesh.template.project import scan_project

    spec = template.manifest.prefix
    return scan_project(Path(project).resolve(), tuple(spec.exclude), spec.include_hidden)


def _progress(done: int, total: int) -> None:
    print(f"\rprefix: {done}/{total} tokens decoded", end="", file=sys.stderr, flush=True)


async def compose_local(args: argparse.Namespace, coord: CoordinatorConfig,
                        gate_cfg: GateConfig, rule: WorkerRule | None, built: ProjectPrefix,
                        stack: AsyncExitStack) -> AppParts:
    """Build and start everything ``mesh serve`` serves, on the running (serving) loop;
    each thing with a life is registered on ``stack`` as soon as it exists."""
    from mesh.a2a.app import AppParts
    from mesh.a2a.push import make_push_url_validator
    from mesh.a2a.store import TaskBoard
    from mesh.agent.config import AgentConfig
    from mesh.agent.task import Agent
    from mesh.api.dashboard import DashboardHistory, dashboard_routes
    from mesh.api.openai_api import OpenAIAPI
    from mesh.api.sessions import SessionAPI, api_routes
    from mesh.cli.engine_flags import apply_engine_flags
    from mesh.cli.engines import build_engine, prefix_cache_dir
    from mesh.engine.config import EngineConfig
    from mesh.fleet.peers import PeerClient
    from mesh.gate.admission import FloorGate
    from mesh.gate.decide import lone_worker_tps
    from mesh.worker.dispatch import DispatchWorker
    from mesh.worker.grammar import ProjectPaths
    from mesh.worker.text import template_texts
    from mesh.worker.tools import ProjectTools, delegate_tool

    template, project, model = built.template, built.project, built.model
    prefix, chat = built.prefix, built.chat
    peers = None
    if args.peer:
        peers = PeerClient(args.peer, tokens=peer_tokens(args.peer), origin=coord.name,
                           url_validator=make_push_url_validator(args.allow_private_push))
        stack.push_async_callback(peers.aclose)
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
    stack.push_async_callback(pool.aclose)  # closed last of all: after the A2A side

    print(f"model: {model.name} ({model.source}) {model.path}", file=sys.stderr)
    print(f"chat format: {chat.name}; tool-call grammar: "
          f"{'on' if template.manifest.turns.grammar else 'off'}", file=sys.stderr)
    print(f"template: {template.name}; project: {project} "
          f"({len(prefix.included)} files in the prefix, {len(prefix.skipped)} skipped)",
          file=sys.stderr)
    info = await pool.start(_progress)
    print(file=sys.stderr)
    how = "warm-started from cache" if info.warm_started else f"decoded in {info.build_s:.1f}s"
    print(f"prefix: {info.prefix_tokens} tokens, sha256 {info.prefix_hash[:16]}, {how}; "
          f"engine: {info.engine}; pool: {args.pool}, {info.max_sessions} sessions x "
          f"{info.session_budget} tokens, {info.n_ctx} KV cells", file=sys.stderr)
    if info.flash_attn:  # what --flash-attn / --prefix-attention auto chose (llama.cpp)
        print(f"attention: flash {info.flash_attn} (--flash-attn {cfg.flash_attn}), "
              f"shared prefix {info.prefix_attention} (--prefix-attention "
              f"{cfg.prefix_attention})", file=sys.stderr)
    gate = FloorGate(pool, gate_cfg, rule=rule)
    source = await _seed_gate(gate, pool, Path(cfg.cache_dir or data_dir) / "gate")
    gate.install()  # floor: each turn waits for room in its step; prefill keeps the floor
    floor = ("auto (the knee of measured tokens/s)" if gate_cfg.auto_floor
             else f"{gate_cfg.floor_tps:g} tok/s")
    print(f"gate: policy {gate_cfg.policy}, floor {floor}, "
          f"throughput model seeded from {source}", file=sys.stderr)
    lone = lone_worker_tps(gate.model, info.prefix_tokens, gate_cfg.new_worker_cells)
    if gate_cfg.policy == "floor" and not gate_cfg.auto_floor and lone < gate_cfg.floor_tps:
        print(f"warning: one worker alone is projected at {lone:.1f} tok/s on this machine, "
              f"below the floor ({gate_cfg.floor_tps:g} tok/s): the gate will run one worker "
              f"at a time, under the floor; lower --floor-tps (below {lone:.1f}) or pick one "
              f"with `mesh sweep`", file=sys.stderr)
    tools: dict[str, Any] = dict(ProjectTools(project).as_tools())
    if peers is not None:
        tools["delegate"] = delegate_tool(peers.send)
    board = TaskBoard()
    history = DashboardHistory(gate)  # the dashboard's last 5 minutes
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
    base = args.public_url or f"http://{args.host}:{args.port}"
    print(f"agent card: {base}/.well-known/agent-card.json  (Ctrl-C to stop)", file=sys.stderr)
    print(f"dashboard: {base}/dashboard", file=sys.stderr)
    return AppParts(
        worker_factory=lambda: DispatchWorker(pool, template, tools, chat,
                                              simulation=args.simulation,
                                              paths=paths, first_call=args.first_turn == "call"),
        admission=gate,
        pool_info=info,
        extra_routes=[*api_routes(pool, gate, sessions),
                      *dashboard_routes(gate, tasks=board, history=history),
                      *openai_api.routes],
        skills=[s.model_dump() for s in template.manifest.skills],
        task_board=board,
        on_startup=[history.start],
        on_shutdown=[sessions.aclose, openai_api.aclose, history.aclose],
        agent=agent,
    )
