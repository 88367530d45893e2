"""What a coordinator knows of each pool node: :class:`Node`, read from the node's card by
:func:`read_node_cards` at start and refreshed from its ``/capacity`` by the
:class:`~mesh.fleet.nodes.NodePool`."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import httpx

from mesh.a2a_names import CARD_PATH, POOL_EXTENSION_URI

__all__ = ["Node", "read_node_cards"]


@dataclass
class Node:
    """One node as the coordinator sees it."""

    url: str
    name: str = ""
    model: str = ""
    prefix_hash: str = ""
    engine: str = ""
    max_sessions: int = 0
    session_budget: int = 0
    capacity: dict[str, Any] | None = None
    error: str | None = None
    up: bool = True
    in_flight: int = 0
    given_since_poll: int = 0
    routed: int = 0
    failed: int = 0
    polled_at: float = -math.inf

    def admits(self) -> bool:
        return self.up and self.capacity is not None and self.room() > 0 and (
            self.capacity.get("verdict") == "admit")

    def room(self) -> int:
        """The node's headroom less what it was given since it last said so."""
        cap = self.capacity or {}
        head = cap.get("headroom")
        head = int(head) if isinstance(head, int | float) and math.isfinite(head) else 0
        return head - self.given_since_poll


async def read_node_cards(urls: Iterable[str], http: httpx.AsyncClient,
                          expected_hash: str) -> list[Node]:
    """Each node's card facts; ``ValueError`` for a node that cannot be read, has no pool
    extension, or whose prefix hash differs from ``expected_hash`` (both named)."""
    nodes: list[Node] = []
    for url in urls:
        url = url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--node needs an absolute http(s) URL, got {url!r}")
        try:
            r = await http.get(url + CARD_PATH)
            r.raise_for_status()
            card = r.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise ValueError(f"cannot read the agent card of node {url} ({exc}); is "
                             "`mesh serve` running there?") from exc
        exts = [e for e in card.get("capabilities", {}).get("extensions", [])
                if e.get("uri") == POOL_EXTENSION_URI]
        if not exts:
            raise ValueError(f"node {url} has no {POOL_EXTENSION_URI} extension on its "
                             "card: it is not a mesh pool node")
        params = exts[0].get("params", {})
        got = str(params.get("prefix_hash", ""))
        if got != expected_hash:
            raise ValueError(
                f"node {url} serves prefix {got[:16] or '(none)'}, this coordinator "
                f"{expected_hash[:16]} (sha256 of the prefix tokens): start every node with "
                "the same --model, --template, --project and --prefix-tokens")
        nodes.append(Node(url=url, name=str(card.get("name", "")),
                          model=str(params.get("model_name", "")), prefix_hash=got,
                          engine=str(params.get("engine", "")),
                          max_sessions=int(params.get("max_sessions", 0)),
                          session_budget=int(params.get("session_budget", 0))))
    return nodes
