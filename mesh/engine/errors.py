"""The errors the engine raises on purpose (all :class:`EngineError`)."""

from __future__ import annotations

__all__ = ["ContextOverflow", "EngineError", "ModelError", "PoolFull", "SessionFailed"]


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class ModelError(EngineError):
    """The model file is missing, unreadable or not a GGUF llama.cpp can load."""


class PoolFull(EngineError):
    """No sequence id or not enough free KV cells for another session."""


class ContextOverflow(EngineError):
    """A session would grow past its context budget."""


class SessionFailed(EngineError):
    """The session cannot go on (a decode failed, it was detached, or the pool closed)."""
