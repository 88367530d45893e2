"""The agent card: what this coordinator tells the world about itself.

Built once from the config, the template's skills and the pool's facts (prefix tokens and
hash, model, session limits: the params of the agent extension ``POOL_EXTENSION_URI``, as
1.0 cards have no free-form metadata). :func:`card_routes` serves the plain A2A 1.0 card at
``/.well-known/agent-card.json``; a 0.3 client gets it with the 0.3 fields merged in (the
SDK's compat view) at ``/.well-known/agent.json``, or at the 1.0 path with
``A2A-Version: 0.3``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from a2a.server.request_handlers.response_helpers import agent_card_to_dict
from a2a.types import a2a_pb2 as pb
from a2a.utils.constants import PROTOCOL_VERSION_0_3, PROTOCOL_VERSION_1_0, TransportProtocol
from google.protobuf.json_format import MessageToDict
from google.protobuf.struct_pb2 import Struct
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from mesh.a2a.config import CoordinatorConfig
from mesh.a2a_names import CARD_PATH, LEGACY_CARD_PATH, POOL_EXTENSION_URI
from mesh.engine.interface import PoolInfo

__all__ = ["BEARER_SCHEME", "Skill", "build_agent_card", "card_routes"]

BEARER_SCHEME = "bearer"


@dataclass(frozen=True)
class Skill:
    """One skill on the card, as a template declares it."""

    id: str
    name: str
    description: str
    tags: tuple[str, ...] = ()
    examples: tuple[str, ...] = ()

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> Skill:
        """Build from a template's skill table (``id``, ``name``, ``description``, ...)."""
        missing = [k for k in ("id", "name", "description") if not data.get(k)]
        if missing:
            raise ValueError(f"skill {dict(data)!r} lacks {', '.join(missing)}")
        return cls(str(data["id"]), str(data["name"]), str(data["description"]),
                   tags=tuple(str(t) for t in data.get("tags", ())),
                   examples=tuple(str(e) for e in data.get("examples", ())))


DEFAULT_SKILL = Skill(
    id="delegate", name="Delegated work", tags=("agent", "fan-out"),
    description="Send plain text for one task, or a data part {'subtasks': [{'instructions': "
                "..., 'params': {...}}, ...]} to fan work out to pooled workers.")


def _pool_params(info: PoolInfo) -> Struct:
    params = Struct()
    params.update({name: getattr(info, name) for name in (
        "model_name", "prefix_tokens", "prefix_hash", "max_sessions", "session_budget", "n_ctx",
        "engine", "weights")})
    return params


def build_agent_card(config: CoordinatorConfig, skills: Sequence[Skill | Mapping[str, Any]] = (),
                     pool_info: PoolInfo | None = None) -> pb.AgentCard:
    """The public card: interfaces (JSON-RPC at ``/``, HTTP+JSON under the REST prefix,
    1.0 and 0.3), capabilities, skills, and the bearer scheme when auth is on."""
    base = config.base_url
    rest = base + config.rest_prefix
    interfaces = [
        pb.AgentInterface(url=url, protocol_binding=binding.value, protocol_version=version)
        for url, binding, version in (
            (base + "/", TransportProtocol.JSONRPC, PROTOCOL_VERSION_1_0),
            (rest, TransportProtocol.HTTP_JSON, PROTOCOL_VERSION_1_0),
            (base + "/", TransportProtocol.JSONRPC, PROTOCOL_VERSION_0_3),
        )
    ]
    capabilities = pb.AgentCapabilities(streaming=True, push_notifications=True)
    if pool_info is not None:
        capabilities.extensions.append(pb.AgentExtension(
            uri=POOL_EXTENSION_URI, required=False, params=_pool_params(pool_info),
            description="The shared KV pool behind this agent: its immutable prefix."))
    resolved = [s if isinstance(s, Skill) else Skill.from_mapping(s) for s in skills]
    resolved = resolved or [DEFAULT_SKILL]
    modes = ["text/plain", "application/json"]
    card = pb.AgentCard(
        name=config.name, description=config.description, version=config.version,
        supported_interfaces=interfaces, capabilities=capabilities,
        default_input_modes=modes, default_output_modes=modes,
        skills=[pb.AgentSkill(id=s.id, name=s.name, description=s.description,
                              tags=list(s.tags) or ["general"], examples=list(s.examples))
                for s in resolved])
    if config.tokens:
        card.security_schemes[BEARER_SCHEME].http_auth_security_scheme.CopyFrom(
            pb.HTTPAuthSecurityScheme(
                scheme="Bearer",
                description="Pass the coordinator's token as 'Authorization: Bearer TOKEN'."))
        requirement = pb.SecurityRequirement()
        requirement.schemes[BEARER_SCHEME].CopyFrom(pb.StringList())
        card.security_requirements.append(requirement)
    return card


def card_routes(card: pb.AgentCard, cache_control: str) -> list[BaseRoute]:
    """The card's routes (see the module docstring), each with an ETag (304 on a match)."""
    v1 = MessageToDict(card)
    v03 = agent_card_to_dict(card)

    def answer(request: Request, body: dict[str, Any]) -> Response:
        etag = '"' + hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:32]
        headers = {"ETag": etag + '"', "Cache-Control": cache_control, "Vary": "A2A-Version"}
        match = request.headers.get("if-none-match", "")
        if headers["ETag"] in (m.strip() for m in match.split(",")) or match.strip() == "*":
            return Response(status_code=304, headers=headers)
        return JSONResponse(body, headers=headers)

    async def current(request: Request) -> Response:
        version = request.headers.get("a2a-version", "").strip()
        return answer(request, v03 if version.startswith("0.") else v1)

    async def legacy(request: Request) -> Response:
        return answer(request, v03)

    return [
        Route(CARD_PATH, current, methods=["GET"]),
        Route(LEGACY_CARD_PATH, legacy, methods=["GET"]),
    ]
