"""The coordinator's configuration: one frozen object, validated without I/O."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlparse

from mesh.fleet.peers import parse_peer

__all__ = ["CoordinatorConfig"]

_MIB = 1024 * 1024
_PG_SCHEMES = ("postgresql", "postgres", "postgresql+asyncpg")


@dataclass(frozen=True)
class CoordinatorConfig:
    """How the A2A coordinator is served.

    ``auth_token`` turns bearer authentication on. It may hold several tokens separated by
    commas; each token is one caller, and a caller sees only the tasks it created.
    ``public_url`` is the base URL written on the agent card (default: ``http://host:port``).
    ``rest_prefix`` is where the HTTP+JSON binding lives; JSON-RPC is always at ``/``.
    ``allow_private_push`` lets push notifications go to loopback/private addresses
    (tests and single-host setups); by default such URLs are refused.
    ``simulation`` honours ``params.scenario`` in subtasks (bounded; off by default).
    ``task_store`` is a ``postgresql://`` URL to keep tasks in PostgreSQL (several
    coordinators may share it, :mod:`mesh.a2a.postgres`); ``None`` keeps them in SQLite
    under ``data_dir``.
    """

    name: str = "mesh"
    description: str = "An A2A coordinator whose workers share one llama.cpp KV pool."
    version: str = "0.1.0"
    host: str = "127.0.0.1"
    port: int = 8700
    public_url: str | None = None
    data_dir: str = ".mesh"
    auth_token: str | None = None
    max_body_bytes: int = _MIB
    max_parts: int = 64
    max_message_chars: int = 200_000
    max_subtasks: int = 32
    max_json_depth: int = 64
    allow_private_push: bool = False
    simulation: bool = False
    max_hops: int = 4  # a delegated message past this many hops is refused at the door
    peers: tuple[str, ...] = ()
    rest_prefix: str = "/a2a"
    card_max_age_s: int = 60
    text_flush_s: float = 0.05  # coalesce streamed text pieces into chunks this often
    plan: str = "auto"  # auto | always | never: planning turn for messages w/o subtasks
    task_store: str | None = None  # postgresql://... ; None: SQLite under data_dir

    @property
    def base_url(self) -> str:
        """The URL clients reach this coordinator at (no trailing slash)."""
        if self.public_url:
            return self.public_url.rstrip("/")
        return f"http://{self.host}:{self.port}"

    @property
    def tokens(self) -> tuple[str, ...]:
        """The accepted bearer tokens (empty: authentication is off)."""
        if not self.auth_token:
            return ()
        return tuple(t.strip() for t in self.auth_token.split(",") if t.strip())

    def validate(self) -> None:
        """Raise ``ValueError`` naming the fix for the first bad field. Does no I/O."""
        if not self.name.strip():
            raise ValueError("name is empty; pass --name NAME")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if not self.host:
            raise ValueError("host is empty; pass --host 127.0.0.1 (or 0.0.0.0 to listen on all)")
        if self.public_url is not None:
            parsed = urlparse(self.public_url)
            if parsed.scheme not in ("http", "https") or not parsed.netloc:
                raise ValueError(
                    f"public_url must be an absolute http(s) URL, got {self.public_url!r}"
                )
        if not self.data_dir:
            raise ValueError("data_dir is empty; pass --data-dir DIR")
        if self.auth_token is not None:
            if not self.tokens:
                raise ValueError("auth_token is set but empty; pass --auth-token TOKEN or omit it")
            if any(len(t) < 8 for t in self.tokens):
                raise ValueError("every auth token must be at least 8 characters long")
        for name, lo in (("max_body_bytes", 1024), ("max_parts", 1), ("max_message_chars", 1),
                         ("max_subtasks", 1), ("card_max_age_s", 0), ("text_flush_s", 0),
                         ("max_hops", 1)):
            if getattr(self, name) < lo:
                raise ValueError(f"{name} must be >= {lo}, got {getattr(self, name)}")
        if not 4 <= self.max_json_depth <= 512:
            raise ValueError(f"max_json_depth must be in 4..512, got {self.max_json_depth}")
        if not self.rest_prefix.startswith("/") or self.rest_prefix == "/":
            raise ValueError(
                f"rest_prefix must start with '/' and not be '/', got {self.rest_prefix!r}"
            )
        if self.rest_prefix.endswith("/"):
            raise ValueError(f"rest_prefix must not end with '/', got {self.rest_prefix!r}")
        if self.plan not in ("auto", "always", "never"):
            raise ValueError(f"plan must be auto, always or never, got {self.plan!r}")
        if self.task_store is not None and urlparse(self.task_store).scheme not in _PG_SCHEMES:
            raise ValueError(
                "task_store must be a postgresql:// URL, got one starting "
                f"{self.task_store.partition(':')[0]!r}; pass "
                "--task-store postgresql://USER:PASSWORD@HOST:PORT/DB, or leave it out to "
                "keep tasks in SQLite under --data-dir"
            )
        for peer in self.peers:
            _, url = parse_peer(peer)  # raises ValueError naming the fix
            if not urlparse(url).netloc:
                raise ValueError(f"peer must be NAME=URL with an http(s) URL, got {peer!r}")
