"""Push notifications: a real sender, behind a URL policy.

The SDK stores push configs but sends nothing unless a sender is given; this module builds
the sender (the SDK's ``BasePushNotificationSender`` on a shared ``httpx.AsyncClient``) and
the URL policy used both when a config is accepted and again before each delivery:

* only ``http``/``https`` URLs with a host;
* by default the host must resolve to public addresses only (the SDK's
  ``validate_push_notification_url``: no loopback, private, link-local, metadata...);
* ``allow_private=True`` (operator's choice, and the tests') lifts the address check.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from urllib.parse import urlparse

import httpx
from a2a.server.tasks import BasePushNotificationSender, PushNotificationConfigStore
from a2a.utils.push_url_validator import validate_push_notification_url

__all__ = ["PushUrlValidator", "build_push_sender", "make_push_url_validator"]

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


def build_push_sender(
    client: httpx.AsyncClient,
    config_store: PushNotificationConfigStore,
    validator: PushUrlValidator,
) -> BasePushNotificationSender:
    """A sender that POSTs each task event to every URL registered for the task."""
    return BasePushNotificationSender(client, config_store, push_url_validator=validator)
