"""Delegation hops on the A2A wire: ``metadata.meshHops`` (hops so far, this one included)
and ``metadata.meshChain`` (the agents the message went through).

The request guard reads them once at the door (:func:`hops_of`, refusing a message past
``--max-hops``); they travel with the task's subtasks as :class:`~mesh.worker.types.Hops`,
and whoever sends a message on (:mod:`.peers`) writes
:func:`hops_metadata` of :meth:`Hops.onward <mesh.worker.types.Hops.onward>`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mesh.worker.types import Hops

__all__ = ["CHAIN_KEY", "HOPS_KEY", "Hops", "hops_metadata", "hops_of"]

HOPS_KEY = "meshHops"
CHAIN_KEY = "meshChain"


def hops_of(metadata: Mapping[str, Any] | None) -> Hops:
    """The hops a message's metadata says; ``Hops()`` when absent or malformed."""
    if not metadata:
        return Hops()
    hops = metadata.get(HOPS_KEY, 0)
    chain = metadata.get(CHAIN_KEY, [])
    if isinstance(hops, float) and hops.is_integer():
        hops = int(hops)
    if not isinstance(hops, int) or isinstance(hops, bool) or hops < 0:
        hops = 0
    names = tuple(str(c) for c in chain) if isinstance(chain, list | tuple) else ()
    return Hops(hops, names)


def hops_metadata(hops: Hops) -> dict[str, Any]:
    """``hops`` as a message's metadata."""
    return {HOPS_KEY: hops.count, CHAIN_KEY: list(hops.chain)}
