"""The engine's public vocabulary: configuration, sampling, load snapshots, errors, seams.

Nothing here touches llama.cpp, so the gate, the worker and the HTTP layers can import
these types (and build honest fakes of the engine) without loading a model. The names live
in four modules by concept and are re-exported here, so ``from mesh.engine.types import X``
keeps working:

* :mod:`mesh.engine.errors`: :class:`EngineError` and its kinds;
* :mod:`mesh.engine.config`: :class:`EngineConfig` and :class:`SamplingParams`;
* :mod:`mesh.engine.records`: results and the load snapshot (:class:`Piece`,
  :class:`TurnResult`, :class:`PoolInfo`, :class:`PoolLoad`, ...);
* :mod:`mesh.engine.protocols`: the seams (:class:`Engine`, :class:`Session`,
  :class:`Generation`, :class:`PrefillBudget`, :class:`TurnAdmission`).
"""

from __future__ import annotations

from mesh.engine.config import FLASH_ATTN, KV_TYPES, EngineConfig, SamplingParams
from mesh.engine.errors import ContextOverflow, EngineError, ModelError, PoolFull, SessionFailed
from mesh.engine.protocols import Engine, Generation, PrefillBudget, Session, TurnAdmission
from mesh.engine.records import (
    AttachCheck,
    Piece,
    PoolInfo,
    PoolLoad,
    SessionLoad,
    SessionState,
    StepSample,
    TurnResult,
)

__all__ = [
    "FLASH_ATTN",
    "KV_TYPES",
    "AttachCheck",
    "ContextOverflow",
    "Engine",
    "EngineConfig",
    "EngineError",
    "Generation",
    "ModelError",
    "Piece",
    "PoolFull",
    "PoolInfo",
    "PoolLoad",
    "PrefillBudget",
    "SamplingParams",
    "Session",
    "SessionFailed",
    "SessionLoad",
    "SessionState",
    "StepSample",
    "TurnAdmission",
    "TurnResult",
]
