"""The A2A coordinator: the official a2a-sdk's routes and request handler around an
``AgentExecutor`` that sends subtasks through the gate to pooled workers.

Build the app with :func:`create_app` (its lifespan composes the parts; :func:`build_app`
for parts built beforehand), serve it with :func:`run_server`; talk to other A2A
agents with :class:`PeerClient`.
"""

from mesh.a2a.app import AppParts, Compose, Coordinator, build_app, create_app
from mesh.a2a.card import Skill, build_agent_card
from mesh.a2a.config import CoordinatorConfig
from mesh.a2a.executor import CoordinatorExecutor
from mesh.a2a.serving import run_server
from mesh.a2a.store import INTERRUPTED_REASON
from mesh.a2a_names import POOL_EXTENSION_URI
from mesh.agent.events import ANSWER_ARTIFACT
from mesh.agent.fanout import WorkerFactory
from mesh.fleet.peers import PeerClient, PeerError, PeerInfo, answer_text

__all__ = [
    "ANSWER_ARTIFACT",
    "INTERRUPTED_REASON",
    "POOL_EXTENSION_URI",
    "AppParts",
    "Compose",
    "Coordinator",
    "CoordinatorConfig",
    "CoordinatorExecutor",
    "PeerClient",
    "PeerError",
    "PeerInfo",
    "Skill",
    "WorkerFactory",
    "answer_text",
    "build_agent_card",
    "build_app",
    "create_app",
    "run_server",
]
