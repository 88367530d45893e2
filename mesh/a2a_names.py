"""Names on the A2A wire that mesh's server (:mod:`mesh.a2a`) and its clients
(:mod:`mesh.fleet`, :mod:`mesh.sim`) share. Constants only, so either side may import it."""

from __future__ import annotations

__all__ = ["CARD_PATH", "LEGACY_CARD_PATH", "POOL_EXTENSION_URI"]

CARD_PATH = "/.well-known/agent-card.json"
LEGACY_CARD_PATH = "/.well-known/agent.json"  # the 0.3 view, for 0.3 clients
POOL_EXTENSION_URI = "urn:mesh:pool:v1"
