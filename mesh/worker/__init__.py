"""Workers: a subtask run as a multi-turn agent loop on one pool session.

:class:`AgentWorker` runs the template's turn loop with real tools (:class:`ProjectTools`,
:func:`delegate_tool`); :class:`ScenarioWorker` runs a seeded scenario (real generation,
scripted tool calls). Both implement :class:`~mesh.worker.types.Worker`.
"""
