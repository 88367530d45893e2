"""Push notifications: a real sender, behind a URL policy.

The SDK stores push configs but sends nothing unless a sender is given; this module builds
the sender (the SDK's ``BasePushNotificationSender`` on a shared ``httpx.AsyncClient``) and
the URL policy used both when a config is accepted and again before each delivery:

* only ``http``/``https`` URLs with a host;
* by default the host must resolve to public addresses only (the SDK's
  ``validate_push_notification_url``: no loopback, private, link-local, metadata...);
* ``allow_private=True`` (operator's choice, and the tests') lifts the address check.

Delivery is in the background: the SDK awaits ``send_notification`` inside the task's
event consumer, so a receiver that is slow (or a connect that hangs until the client's
timeout) would hold up every later event of the task, and a blocking ``SendMessage``
with it. :class:`BackgroundPushSender` queues each event and returns at once; one
delivery loop per task sends that task's events in order. The backlog is bounded
(``max_pending`` events in all); past it, events are dropped and counted.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from urllib.parse import urlparse

import httpx
from a2a.server.events import Event
from a2a.server.tasks import BasePushNotificationSender, PushNotificationConfigStore
from a2a.utils.push_url_validator import validate_push_notification_url

__all__ = [
    "BackgroundPushSender",
    "PushUrlValidator",
    "build_push_sender",
    "make_push_url_validator",
]

logger = logging.getLogger(__name__)

PushUrlValidator = Callable[[str], Awaitable[bool]]


def _is_http_url(url: str) -> bool:
    try:
        parsed = urlparse(url)
        _ = parsed.port  # raises ValueError on a bad port
    except ValueError:
        return False
    return parsed.scheme in ("http", "https") and bool(parsed.hostname)


def make_push_url_validator(allow_private: bool) -> PushUrlValidator:
    """The policy for client-supplied push URLs (see the module docstring)."""

    async def validate(url: str) -> bool:
        if not _is_http_url(url):
            return False
        if allow_private:
            return True
        return await validate_push_notification_url(url)

    return validate


class BackgroundPushSender(BasePushNotificationSender):
    """The SDK's sender, delivering off the event path (see the module docstring)."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        config_store: PushNotificationConfigStore,
        validator: PushUrlValidator,
        *,
        max_pending: int = 10_000,
    ) -> None:
        super().__init__(client, config_store, push_url_validator=validator)
        self.max_pending = max_pending
        self.num_dropped = 0
        self._pending: dict[str, deque[Event]] = {}
        self._loops: dict[str, asyncio.Task[None]] = {}
        self._num_pending = 0

    @property
    def num_pending(self) -> int:
        """Events queued and not yet handed to the SDK's sender."""
        return self._num_pending

    async def send_notification(self, task_id: str, event: Event) -> None:
        if self._num_pending >= self.max_pending:
            self.num_dropped += 1
            logger.warning("push backlog full (%d events); dropped one for task %s",
                           self.max_pending, task_id)
            return
        self._pending.setdefault(task_id, deque()).append(event)
        self._num_pending += 1
        if task_id not in self._loops:
            self._loops[task_id] = asyncio.get_running_loop().create_task(
                self._deliver(task_id), name=f"push-{task_id}"
            )

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

    async def aclose(self) -> None:
        """Stop every delivery loop (events not yet sent are dropped)."""
        loops = list(self._loops.values())
        for loop in loops:
            loop.cancel()
        await asyncio.gather(*loops, return_exceptions=True)


def build_push_sender(
    client: httpx.AsyncClient,
    config_store: PushNotificationConfigStore,
    validator: PushUrlValidator,
) -> BackgroundPushSender:
    """A sender that POSTs each task event to every URL registered for the task, in the
    background (a slow receiver never holds up the task)."""
    return BackgroundPushSender(client, config_store, validator)
