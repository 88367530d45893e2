"""Push notifications: a real sender, behind a URL policy.

The SDK stores push configs but sends nothing unless given a sender. The URL policy, checked
when a config is accepted and again before each delivery: ``http``/``https`` URLs with a
host only, whose host resolves to public addresses only (the SDK's
``validate_push_notification_url``) unless ``allow_private`` (``--allow-private-push``).
A refused URL raises ``InvalidParamsError`` (the SDK maps errors by exact class: no
subclass) saying why.

:class:`BackgroundPushSender` delivers in the background: the SDK awaits
``send_notification`` in the task's event consumer, so a slow receiver would hold up every
later event of the task. Events are queued (``max_pending`` in all; past it dropped and
counted) and one loop per task sends them in order, to the address the policy checked (the
URL's host in ``Host`` and SNI: DNS cannot answer differently between check and connect).
5xx, 429, timeouts and connection errors are retried with exponential backoff. A task
pushes its first ``Task``, each change of state, and artifact updates that close an
artifact or are not appends, not the text chunks in between.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections import deque
from urllib.parse import urlparse, urlunparse

import httpx
from a2a.server.events import Event
from a2a.server.tasks import BasePushNotificationSender, PushNotificationConfigStore
from a2a.types import a2a_pb2 as pb
from a2a.utils.errors import InvalidParamsError
from a2a.utils.proto_utils import to_stream_response
from a2a.utils.push_url_validator import validate_push_notification_url
from google.protobuf.json_format import MessageToDict

from mesh.a2a.store import TERMINAL_STATES, PushUrlValidator

__all__ = [
    "ALLOW_PRIVATE_HINT", "BackgroundPushSender", "make_push_url_validator", "pin_address",
]

logger = logging.getLogger(__name__)


#: The fix named by every refusal of a push address.
ALLOW_PRIVATE_HINT = "start the server with --allow-private-push to allow private addresses"


def _shown(url: str) -> str:
    return repr(url if len(url) <= 200 else url[:200] + "...")


def _is_http_url(url: str) -> bool:
    try:
        parsed = urlparse(url)
        _ = parsed.port  # raises ValueError on a bad port
    except ValueError:
        return False
    return parsed.scheme in ("http", "https") and bool(parsed.hostname)


def make_push_url_validator(allow_private: bool) -> PushUrlValidator:
    """The policy for client-supplied push URLs (see the module docstring): True, or
    ``InvalidParamsError`` naming the reason (and ``--allow-private-push`` where it helps)."""

    async def validate(url: str) -> bool:
        if not _is_http_url(url):
            raise InvalidParamsError(
                f"push URL {_shown(url)} refused: it must be an absolute http(s) URL with a host"
            )
        if not allow_private and not await validate_push_notification_url(url):
            raise InvalidParamsError(
                f"push URL {_shown(url)} refused: its host is a loopback, private, link-local "
                f"or metadata address, or does not resolve; {ALLOW_PRIVATE_HINT}"
            )
        return True

    return validate


def _public(ip: str) -> bool:
    """Whether an address is a public unicast destination (IPv4-mapped judged as IPv4)."""
    try:
        addr = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(addr, "ipv4_mapped", None)
    if mapped is not None:
        addr = mapped
    return addr.is_global and not (addr.is_multicast or addr.is_reserved)


async def pin_address(url: str, allow_private: bool) -> tuple[str, str, str] | None:
    """Resolve ``url``'s host once and check the addresses: ``(url with the address as host,
    Host header, SNI name)``, or None if the URL is bad, does not resolve, or (unless
    ``allow_private``) any address is not public."""
    if not _is_http_url(url):
        return None
    parsed = urlparse(url)
    host = parsed.hostname or ""
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return None
    addrs = [str(info[4][0]) for info in infos]
    if not addrs or (not allow_private and not all(_public(a) for a in addrs)):
        return None
    ip = addrs[0]
    netloc_host = f"[{ip}]" if ":" in ip else ip
    netloc = f"{netloc_host}:{parsed.port}" if parsed.port else netloc_host
    host_header = parsed.netloc.rsplit("@", 1)[-1]
    return urlunparse(parsed._replace(netloc=netloc)), host_header, host


_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})


class BackgroundPushSender(BasePushNotificationSender):
    """The SDK's sender, delivering off the event path (see the module docstring)."""

    def __init__(self, client: httpx.AsyncClient, config_store: PushNotificationConfigStore,
                 validator: PushUrlValidator, *, max_pending: int = 10_000,
                 allow_private: bool = False, retries: int = 3, backoff_s: float = 0.5) -> None:
        super().__init__(client, config_store, push_url_validator=validator)
        self.max_pending = max_pending
        self.allow_private = allow_private
        self.retries = retries
        self.backoff_s = backoff_s
        self.num_dropped = 0
        self.num_sent = 0
        self._last_state: dict[str, int] = {}
        self._pending: dict[str, deque[Event]] = {}
        self._loops: dict[str, asyncio.Task[None]] = {}
        self._num_pending = 0

    def _worth_pushing(self, task_id: str, event: Event) -> bool:
        """One push per state change and per closed artifact (see the module docstring)."""
        if isinstance(event, pb.TaskArtifactUpdateEvent):
            return event.last_chunk or not event.append
        if isinstance(event, pb.TaskStatusUpdateEvent | pb.Task):
            state = event.status.state
            if self._last_state.get(task_id) == state:
                return False
            self._last_state[task_id] = state
            if state in TERMINAL_STATES:
                del self._last_state[task_id]  # nothing follows a terminal state
            return True
        return True

    async def send_notification(self, task_id: str, event: Event) -> None:
        if not self._worth_pushing(task_id, event):
            return
        if self._num_pending >= self.max_pending:
            self.num_dropped += 1
            logger.warning("push backlog full (%d events); dropped one for task %s",
                           self.max_pending, task_id)
            return
        self._pending.setdefault(task_id, deque()).append(event)
        self._num_pending += 1
        if task_id not in self._loops:
            self._loops[task_id] = asyncio.get_running_loop().create_task(
                self._deliver(task_id), name=f"push-{task_id}")

    async def _deliver(self, task_id: str) -> None:
        queue = self._pending[task_id]
        try:
            while queue:
                event = queue.popleft()
                self._num_pending -= 1
                try:
                    await super().send_notification(task_id, event)
                except Exception:  # best effort: a receiver's failure stays here
                    logger.exception("push delivery for task %s failed", task_id)
        finally:
            # No await between the last ``while queue`` check and here, so no event can
            # be queued for this task without a loop to send it.
            self._num_pending -= len(queue)
            self._pending.pop(task_id, None)
            self._loops.pop(task_id, None)

    async def _dispatch_notification(
        self, event: Event, push_info: pb.TaskPushNotificationConfig, task_id: str
    ) -> bool:
        """POST one event to one receiver: pinned address, bounded retries with backoff."""
        url = push_info.url
        pinned = await pin_address(url, self.allow_private)
        if pinned is None:
            why = "it does not resolve" if self.allow_private else (
                f"a private address, or it does not resolve; {ALLOW_PRIVATE_HINT}")
            logger.warning("push URL %s for task %s refused by the address policy (%s)",
                           url, task_id, why)
            return False
        target, host, sni = pinned
        headers = {"Host": host}
        if push_info.token:
            headers["X-A2A-Notification-Token"] = push_info.token
        if push_info.HasField("authentication") and push_info.authentication.credentials:
            auth = push_info.authentication
            headers["Authorization"] = f"{auth.scheme} {auth.credentials}"
        body = MessageToDict(to_stream_response(event))
        extensions = {"sni_hostname": sni} if url.startswith("https") else {}
        for attempt in range(self.retries + 1):
            try:
                response = await self._client.post(target, json=body, headers=headers,
                                                   extensions=extensions)
                if response.status_code < 400:
                    self.num_sent += 1
                    return True
                if response.status_code not in _RETRY_STATUS:
                    logger.warning("push to %s answered %d; not retried", url,
                                   response.status_code)
                    return False
            except (httpx.TimeoutException, httpx.TransportError) as exc:
                logger.info("push to %s failed (attempt %d): %s", url, attempt + 1, exc)
            if attempt < self.retries:
                await asyncio.sleep(self.backoff_s * 2**attempt)
        logger.warning("push to %s for task %s failed after %d attempts", url, task_id,
                       self.retries + 1)
        return False

    async def aclose(self) -> None:
        """Stop every delivery loop (events not yet sent are dropped)."""
        loops = list(self._loops.values())
        for loop in loops:
            loop.cancel()
        await asyncio.gather(*loops, return_exceptions=True)

