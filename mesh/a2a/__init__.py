"""The A2A coordinator: the official a2a-sdk's routes and request handler around an
``AgentExecutor`` that sends subtasks through the gate to pooled workers.

The app is built by :func:`mesh.a2a.app.create_app` (its lifespan composes the parts) and
served by :func:`mesh.a2a.app.run_server`; requests are checked before the SDK sees them
(:mod:`mesh.a2a.validation`), tasks persist in SQLite or PostgreSQL (:mod:`mesh.a2a.store`,
:mod:`mesh.a2a.postgres`), push notifications go out through :mod:`mesh.a2a.push`.
"""
