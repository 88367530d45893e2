"""HTTP routes served by the mesh process beside A2A: ``/capacity`` and ``/metrics``
(:mod:`mesh.api.capacity`), the session API (:mod:`mesh.api.sessions`), the OpenAI-compatible
API (:mod:`mesh.api.openai_api`, its tool grammar in :mod:`mesh.api.openai_tools`), the
dashboard (:mod:`mesh.api.dashboard`), and how each admits its work
(:mod:`mesh.api.admit`). The app mounts :func:`~mesh.api.sessions.api_routes`.
"""
