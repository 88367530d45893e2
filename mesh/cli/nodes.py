"""``mesh serve --node URL ...``: a coordinator whose subtasks run on other mesh servers.

Builds the prefix exactly as a node would (same template, project, model, prefix size), so
its hash can be compared with each node's card; no local pool is started (no prefill, no
KV). Messages without explicit subtasks run as one subtask (no planning turn here: the
coordinator has no model); the node runs it as one worker.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from typing import Any

from mesh.cli.preflight import coordinator_config
from mesh.cli.project import build_project_prefix

__all__ = ["build_nodes"]


async def build_nodes(args: argparse.Namespace) -> tuple[Any, Any, None]:
    """(app, node pool, None) for ``serve.run``; raises ValueError naming the fix."""
    import httpx

    from mesh.a2a.app import build_app
    from mesh.a2a.taskboard import TaskBoard
    from mesh.api.capacity import capacity_routes
    from mesh.api.dashboard import (
        DASHBOARD_PUBLIC_PATHS,
        DashboardHistory,
        dashboard_routes,
        poll_nodes,
    )
    from mesh.engine.types import PoolInfo
    from mesh.fleet.node_worker import NodeClient, NodeWorker
    from mesh.fleet.nodes import NodePool, read_node_cards

    if args.peer:
        raise ValueError("--peer with --node is not supported: give the peers to the nodes "
                         "(their prefix then lists them)")
    if args.engine != "llama.cpp":
        raise ValueError("--node and --engine exclude each other: start the nodes with "
                         "--engine instead")
    coord = coordinator_config(args, plan="never")
    built = build_project_prefix(args, want_ids=True)
    template, model, ids = built.template, built.model, built.ids
    assert ids is not None
    prefix_hash = hashlib.sha256(b"".join(t.to_bytes(4, "little") for t in ids)).hexdigest()
    token = os.environ.get("MESH_NODE_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(headers=headers, timeout=10.0) as http:
        nodes = await read_node_cards(args.node, http, prefix_hash)
    pool = NodePool(nodes, max_queue=args.max_queue, token=token)
    client = NodeClient(token=token, origin=coord.name)
    info = PoolInfo(
        model_path=str(model.path), model_name=nodes[0].model, n_ctx=0,
        n_seq_max=0, max_sessions=sum(n.max_sessions for n in nodes),
        session_budget=min(n.session_budget for n in nodes), n_vocab=0,
        prefix_tokens=len(ids), prefix_hash=prefix_hash, warm_started=False, build_s=0.0,
        engine=f"nodes:{len(nodes)}")
    board = TaskBoard()
    history = DashboardHistory(pool)  # the dashboard's last 5 minutes
    dash_http = httpx.AsyncClient(headers=headers, timeout=5.0)  # first used when serving

    async def close_dash() -> None:
        await dash_http.aclose()

    app = build_app(
        coord,
        worker_factory=lambda: NodeWorker(pool, client),
        admission=pool,
        pool_info=info,
        extra_routes=[*capacity_routes(pool),
                      *dashboard_routes(pool, tasks=board, history=history,
                                        nodes=poll_nodes([n.url for n in nodes], dash_http,
                                                         token=token))],
        skills=[s.model_dump() for s in template.manifest.skills],
        task_board=board,
        public_paths=DASHBOARD_PUBLIC_PATHS,
        on_startup=[history.start],
        on_shutdown=[client.aclose, close_dash, history.aclose],
    )
    for n in nodes:
        print(f"node: {n.url} ({n.name}; model {n.model}; engine {n.engine}; prefix "
              f"{n.prefix_hash[:16]} matches)", file=sys.stderr)
    base = args.public_url or f"http://{args.host}:{args.port}"
    print(f"agent card: {base}/.well-known/agent-card.json  (Ctrl-C to stop)", file=sys.stderr)
    return app, pool, None
