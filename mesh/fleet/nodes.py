"""Pool nodes: a coordinator that routes subtasks to other ``mesh serve`` processes.

``mesh serve --node URL`` (repeatable) builds a :class:`NodePool` instead of a local pool.
It is the coordinator's :class:`~mesh.gate.queue.Admission`:

* At start, :func:`~mesh.fleet.node_cards.read_node_cards` reads each node's card
  (``urn:mesh:pool:v1``: model, prefix hash, engine) and refuses a node whose prefix hash
  differs from the coordinator's own (the error names both hashes): a subtask must see the
  same prefix wherever it runs.
* Each admitted subtask is given the node with the most headroom by the nodes' own
  ``/capacity`` (polled every ``poll_s`` from the first request on, and re-read from a node
  each time one of its subtasks answers). A node whose gate says ``wait`` or
  ``refuse`` is never chosen while another says ``admit``; subtasks given to a node since
  its last poll count against its headroom, so a burst is spread, not piled on one node.
* When no node admits, subtasks wait at the coordinator in the one FIFO of
  :mod:`mesh.gate.queue` (its head given the node :meth:`NodePool.pick` chooses), of
  ``max_queue`` places; past it ``check_queue`` says no (the HTTP 429 at the door). Work
  is never pushed onto a full node.
* A node that fails (transport error, vanished) is marked down (``node_failed``) and gets no
  work until its ``/capacity`` answers again; :meth:`reassign` gives a failing subtask
  another node (ahead of the queue), so the worker can retry it once.

The worker side (the A2A call) is :mod:`mesh.fleet.node_worker`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx

from mesh.fleet.node_cards import Node, read_node_cards
from mesh.gate.queue import (
    OnPosition,
    QueueCheck,
    QueueFull,
    QueueShares,
    Waiter,
    WaiterQueue,
    report_admitted,
)

__all__ = ["Node", "NodePool", "NodeTicket", "read_node_cards"]

_RETRY_AFTER_S = 1.0


@dataclass
class NodeTicket:
    """An admitted subtask and the node it runs on (``node`` changes on a retry)."""

    pool: NodePool
    key: str
    node: Node
    released: bool = False
    tried: list[str] = field(default_factory=list)

    async def release(self) -> None:
        self.release_nowait()

    def release_nowait(self) -> None:
        """Synchronous release (for cleanup paths that cannot await). Idempotent."""
        if not self.released:
            self.released = True
            self.pool.release(self)


class NodePool:
    """Admission over pool nodes (see the module docstring)."""

    def __init__(self, nodes: list[Node], *, max_queue: int = 64, poll_s: float = 0.5,
                 token: str | None = None, timeout_s: float = 5.0) -> None:
        if not nodes:
            raise ValueError("a node pool needs at least one --node URL")
        self.nodes = nodes
        self.max_queue = max_queue
        self.poll_s = poll_s
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout_s = timeout_s
        # Subtasks waiting for a node (no per-caller share yet: each caller may use all).
        self._waiters: WaiterQueue[Node] = WaiterQueue(
            self._choose, self._unreserve, QueueShares(max_queue, max(1, max_queue)),
            head_recheck_s=poll_s, rest_recheck_s=poll_s)
        self._tickets: dict[str, NodeTicket] = {}
        # One client and one poller for the pool's life, on the loop that serves it (mesh
        # serve builds and serves on one loop): made on first use, closed by aclose.
        self._http: httpx.AsyncClient | None = None
        self._closed = False
        self._poller: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self.num_admitted = 0
        self.num_refused = 0
        self.num_retried = 0

    # ------------------------------------------------------------------ polling

    @property
    def http(self) -> httpx.AsyncClient:
        """The pool's one client to the nodes, made on first use (RuntimeError once
        closed)."""
        self._check_open()
        if self._http is None:
            self._http = httpx.AsyncClient(headers=self._headers,
                                           timeout=httpx.Timeout(self._timeout_s))
        return self._http

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the node pool is closed (aclose was called); build a new "
                               "NodePool to route again")

    async def poll(self, node: Node) -> None:
        """Read one node's ``/capacity``; a node that answers is up, one that does not is
        down until it answers again."""
        try:
            r = await self.http.get(node.url + "/capacity")
            r.raise_for_status()
            doc = r.json()
            node.capacity, node.error, node.up = doc, None, True
        except (httpx.HTTPError, ValueError) as exc:
            node.capacity, node.up = None, False
            node.error = f"{type(exc).__name__}: {exc}"
        node.given_since_poll = 0
        node.polled_at = time.monotonic()

    async def poll_all(self) -> None:
        async with anyio.create_task_group() as tg:
            for node in self.nodes:
                tg.start_soon(self.poll, node)
        self._waiters.pump()

    def _ensure_poller(self) -> None:
        """Start the poll (first request or ``/capacity``); RuntimeError outside a running
        loop or once closed."""
        self._check_open()
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll_loop())

    async def _poll_loop(self) -> None:
        while True:  # for the server's life; aclose (or the loop's end) stops it
            await self.poll_all()
            await asyncio.sleep(self.poll_s)

    async def aclose(self) -> None:
        """Stop the poller and the capacity re-reads, close the client. Idempotent; the
        pool admits no more work after it."""
        self._closed = True
        tasks = [t for t in (self._poller, *self._background) if t is not None and not t.done()]
        self._poller = None
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)
            http, self._http = self._http, None
            if http is not None:
                await http.aclose()

    # ------------------------------------------------------------------ admission

    def check_queue(self, *, places: int = 1, caller: str = "") -> QueueCheck:
        # Places count per subtask; ``caller`` is not given a share here yet.
        ok = len(self._waiters) + max(1, min(places, self.max_queue)) <= self.max_queue
        reason = "" if ok else (f"all {len(self.nodes)} nodes are at capacity and "
                                f"{len(self._waiters)} subtasks are queued (max {self.max_queue})")
        return QueueCheck(ok=ok, queue_len=len(self._waiters), retry_after_s=_RETRY_AFTER_S,
                          reason=reason)

    def pick(self, exclude: Iterable[str] = ()) -> Node | None:
        """The admitting node with the most headroom (None: no node admits now)."""
        skip = set(exclude)
        ready = [n for n in self.nodes if n.url not in skip and n.admits()]
        return max(ready, key=lambda n: (n.room(), -n.in_flight), default=None)

    async def admit(self, key: str, on_position: OnPosition | None = None, *,
                    accepted: bool = False, caller: str = "") -> NodeTicket:
        self._ensure_poller()
        if any(n.capacity is None and n.up for n in self.nodes):
            await self.poll_all()  # first use: learn every node's capacity
        node = self.pick() if not self._waiters else None
        reserved = node is None
        if node is None:
            if len(self._waiters) >= self.max_queue and not accepted:
                self.num_refused += 1
                raise QueueFull(self.check_queue().reason, _RETRY_AFTER_S)
            node = await self._waiters.wait(Waiter(key, caller), on_position)
        ticket = NodeTicket(self, key, node)
        self._give(ticket, node, reserved=reserved)
        self.num_admitted += 1
        self._tickets[key] = ticket
        await report_admitted(on_position, ticket.release_nowait)
        return ticket

    async def reassign(self, ticket: NodeTicket, *, on_position: OnPosition | None = None
                       ) -> Node:
        """Move ``ticket`` off its (failed) node to another one, ahead of the queue."""
        old = ticket.node
        old.in_flight -= 1
        ticket.tried.append(old.url)
        self.num_retried += 1
        node = self.pick(exclude=ticket.tried)
        reserved = node is None
        if node is None:
            waiter: Waiter[Node] = Waiter(ticket.key, exclude=frozenset(ticket.tried))
            node = await self._waiters.wait(waiter, on_position, front=True)
        self._give(ticket, node, reserved=reserved)
        return node

    def node_failed(self, node: Node, reason: str) -> None:
        node.up, node.capacity, node.error = False, None, reason
        node.failed += 1

    def assigned(self, key: str) -> NodeTicket:
        ticket = self._tickets.get(key)
        if ticket is None:
            raise RuntimeError(f"subtask {key} was not admitted by the node pool")
        return ticket

    def release(self, ticket: NodeTicket) -> None:
        ticket.node.in_flight -= 1
        self._tickets.pop(ticket.key, None)
        self._waiters.pump()

    def answered(self, node: Node) -> None:
        """A subtask on ``node`` answered: re-read its capacity now, then admit from the
        queue (nothing once closed)."""
        if not self._closed:
            task = asyncio.get_running_loop().create_task(self._refresh(node))
            self._background.add(task)  # held until done (the loop keeps weak refs only)
            task.add_done_callback(self._background.discard)

    async def _refresh(self, node: Node) -> None:
        await self.poll(node)
        self._waiters.pump()

    def _give(self, ticket: NodeTicket, node: Node, *, reserved: bool) -> None:
        ticket.node = node
        node.in_flight += 1
        if not reserved:  # a queued subtask's room was reserved when _choose chose it
            node.given_since_poll += 1
        node.routed += 1

    def _choose(self, head: Waiter[Node]) -> Node | None:
        """The queue's head goes to the admitting node with most room (not one it was
        excluded from), whose room it reserves at once so the next head sees less."""
        node = self.pick(exclude=head.exclude)
        if node is not None:
            node.given_since_poll += 1
        return node

    def _unreserve(self, node: Node) -> None:
        """A node chosen for a waiter that was cancelled before it took it: hand back the
        reserved room and let the next head have it."""
        node.given_since_poll = max(0, node.given_since_poll - 1)
        self._waiters.pump()

    # ------------------------------------------------------------------ reporting

    def capacity(self) -> dict[str, Any]:
        """The coordinator's ``/capacity``: each node (its last capacity, in short) and
        the total."""
        # Outside a loop, or once closed: report what is known, poll nothing.
        with contextlib.suppress(RuntimeError):
            self._ensure_poller()
        rows: list[dict[str, Any]] = []
        for n in self.nodes:
            cap = n.capacity or {}
            sessions = cap.get("sessions", {})
            rows.append({
                "url": n.url, "name": n.name, "model": n.model, "engine": n.engine,
                "prefix_hash": n.prefix_hash, "up": n.up, "error": n.error,
                "verdict": cap.get("verdict"), "headroom": cap.get("headroom"),
                "room": n.room() if n.capacity is not None else None,
                "sessions": sessions.get("total") if isinstance(sessions, dict) else None,
                "queue_len": cap.get("queue_len"),
                "measured_tps_p50": (cap.get("measured_tps") or {}).get("p50"),
                "in_flight": n.in_flight, "routed": n.routed, "failed": n.failed,
                "polled_s_ago": (round(time.monotonic() - n.polled_at, 3)
                                 if math.isfinite(n.polled_at) else None),
            })
        up = [n for n in self.nodes if n.up and n.capacity is not None]
        headroom = sum(max(0, n.room()) for n in up)
        admitting = self.pick() is not None
        verdict = "admit" if admitting and not self._waiters else (
            "wait" if len(self._waiters) < self.max_queue else "refuse")
        return {
            "engine": {"name": f"nodes:{len(self.nodes)}", "backend": None},
            "verdict": verdict,
            "headroom": headroom,
            "queue_len": len(self._waiters),
            "max_queue": self.max_queue,
            "in_flight": sum(n.in_flight for n in self.nodes),
            "admitted_total": self.num_admitted,
            "refused_total": self.num_refused,
            "retried_total": self.num_retried,
            "sessions": {"total": sum(r["sessions"] or 0 for r in rows)},
            "nodes": rows,
            "total": {"nodes": len(rows), "up": len(up), "admitting": sum(
                1 for n in self.nodes if n.admits()), "headroom": headroom,
                "sessions": sum(r["sessions"] or 0 for r in rows),
                "in_flight": sum(n.in_flight for n in self.nodes),
                "routed": sum(n.routed for n in self.nodes)},
            "workers": [],
        }
