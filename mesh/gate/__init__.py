"""The floor-tps gate: admit a worker only while every worker keeps the floor.

Pure parts (no I/O, no model): :class:`GateConfig`, :class:`ThroughputModel`, :func:`decide`.
The async face over an engine: :class:`FloorGate` (the :class:`Admission` protocol).
Every caller holds an admission the same way: :func:`admitted` / :class:`Hold`; every
admission queues in one FIFO: :class:`WaiterQueue`.
"""

from mesh.gate.admission import FloorGate, GateTicket
from mesh.gate.config import GateConfig, Policy, PolicyKind
from mesh.gate.decide import Decision, Verdict, decide
from mesh.gate.hold import Hold, admitted
from mesh.gate.model import DEFAULT_PRIOR, StepCost, ThroughputModel
from mesh.gate.projection import GateInput, Projection, WorkerTps, project
from mesh.gate.types import Admission, OnPosition, QueueCheck, QueueFull, Ticket
from mesh.gate.waiters import WaiterQueue

__all__ = [
    "DEFAULT_PRIOR",
    "Admission",
    "Decision",
    "FloorGate",
    "GateConfig",
    "GateInput",
    "GateTicket",
    "Hold",
    "OnPosition",
    "Policy",
    "PolicyKind",
    "Projection",
    "QueueCheck",
    "QueueFull",
    "StepCost",
    "ThroughputModel",
    "Ticket",
    "Verdict",
    "WaiterQueue",
    "WorkerTps",
    "admitted",
    "decide",
    "project",
]
