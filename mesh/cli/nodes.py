"""``mesh serve --node URL ...``: a coordinator whose subtasks run on other mesh servers.

Builds the prefix exactly as a node would (same template, project, model, prefix size), so
its hash can be compared with each node's card; no local pool is started (no prefill, no
KV). Messages without explicit subtasks run as one subtask (no planning turn here: the
coordinator has no model); the node runs it as one worker.

As on a pool of its own (:mod:`mesh.cli.local`): :func:`nodes_app` checks the flags and
resolves the prefix before any loop; :func:`compose_nodes` runs in the app's lifespan, on
the serving loop: it reads the nodes' cards and builds the node pool, the node client and
the dashboard's poller, and registers them to be closed there.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import sys
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING

from mesh.cli.preflight import coordinator_config
from mesh.cli.project import build_project_prefix

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from mesh.a2a.app import AppParts
    from mesh.a2a.config import CoordinatorConfig
    from mesh.cli.project import ProjectPrefix

__all__ = ["compose_nodes", "nodes_app"]


def nodes_app(args: argparse.Namespace) -> Starlette:
    """The app of a coordinator over ``--node`` servers (nothing live is built yet);
    raises ValueError naming the fix."""
    from mesh.a2a.app import create_app
    from mesh.api.dashboard import DASHBOARD_PUBLIC_PATHS

    if args.peer:
        raise ValueError("--peer with --node is not supported: give the peers to the nodes "
                         "(their prefix then lists them)")
    if args.engine != "llama.cpp":
        raise ValueError("--node and --engine exclude each other: start the nodes with "
                         "--engine instead")
    coord = coordinator_config(args, plan="never")
    built = build_project_prefix(args, want_ids=True)
    return create_app(coord, functools.partial(compose_nodes, args, coord, built),
                      public_paths=DASHBOARD_PUBLIC_PATHS)


async def compose_nodes(args: argparse.Namespace, coord: CoordinatorConfig,
                        built: ProjectPrefix, stack: AsyncExitStack) -> AppParts:
    """Read the nodes' cards (ValueError if one serves another prefix) and build what the
    coordinator routes through, on the running (serving) loop."""
    import httpx

    from mesh.a2a.app import AppParts
    from mesh.a2a.taskboard import TaskBoard
    from mesh.api.capacity import capacity_routes
    from mesh.api.dashboard import dashboard_routes, poll_nodes
    from mesh.api.dashboard_history import DashboardHistory
    from mesh.engine.interface import PoolInfo
    from mesh.fleet.node_cards import read_node_cards
    from mesh.fleet.node_worker import NodeClient, NodeWorker
    from mesh.fleet.nodes import NodePool

    template, model, ids = built.template, built.model, built.ids
    assert ids is not None
    prefix_hash = hashlib.sha256(b"".join(t.to_bytes(4, "little") for t in ids)).hexdigest()
    token = os.environ.get("MESH_NODE_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(headers=headers, timeout=10.0) as http:
        nodes = await read_node_cards(args.node, http, prefix_hash)
    pool = NodePool(nodes, max_queue=args.max_queue, token=token)
    stack.push_async_callback(pool.aclose)
    client = NodeClient(token=token, origin=coord.name)
    stack.push_async_callback(client.aclose)
    dash_http = await stack.enter_async_context(httpx.AsyncClient(headers=headers,
                                                                  timeout=5.0))
    info = PoolInfo(
        model_path=str(model.path), model_name=nodes[0].model, n_ctx=0,
        n_seq_max=0, max_sessions=sum(n.max_sessions for n in nodes),
        session_budget=min(n.session_budget for n in nodes), n_vocab=0,
        prefix_tokens=len(ids), prefix_hash=prefix_hash, warm_started=False, build_s=0.0,
        engine=f"nodes:{len(nodes)}")
    board = TaskBoard()
    history = DashboardHistory(pool)  # the dashboard's last 5 minutes
    for n in nodes:
        print(f"node: {n.url} ({n.name}; model {n.model}; engine {n.engine}; prefix "
              f"{n.prefix_hash[:16]} matches)", file=sys.stderr)
    base = args.public_url or f"http://{args.host}:{args.port}"
    print(f"agent card: {base}/.well-known/agent-card.json  (Ctrl-C to stop)", file=sys.stderr)
    return AppParts(
        worker_factory=lambda: NodeWorker(pool, client),
        admission=pool,
        pool_info=info,
        extra_routes=[*capacity_routes(pool),
                      *dashboard_routes(pool, tasks=board, history=history,
                                        nodes=poll_nodes([n.url for n in nodes], dash_http,
                                                         token=token))],
        skills=[s.model_dump() for s in template.manifest.skills],
        task_board=board,
        on_startup=[history.start],
        on_shutdown=[history.aclose],
    )
