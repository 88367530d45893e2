"""Engines that run sessions somewhere else: the :class:`~mesh.engine.interface.Engine` seam
over a serving cluster's OpenAI-compatible API (``mesh serve --engine openai:URL``,
:mod:`.openai`). It may use an HTTP client (httpx) and nothing of A2A, Starlette or the
layers above the engine. Importing it loads no model.
"""
