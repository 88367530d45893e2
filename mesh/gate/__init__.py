"""The floor-tps gate: admit a worker only while every worker keeps the floor.

Pure parts (no I/O, no model): :class:`~mesh.gate.config.GateConfig`,
:class:`~mesh.gate.model.ThroughputModel`, :func:`~mesh.gate.decide.decide`, the decode
gate (:mod:`mesh.gate.decode_gate`). The async face over an engine:
:class:`~mesh.gate.admission.FloorGate` (the :class:`~mesh.gate.queue.Admission` protocol).
Every caller holds an admission the same way (:mod:`mesh.gate.queue`); every admission
queues in one FIFO (:mod:`mesh.gate.queue`).
"""
