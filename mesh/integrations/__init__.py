"""Adapters that let agent frameworks drive pooled sessions (optional extras).

``mesh.integrations.langchain`` needs ``pip install mesh[langchain]``.
"""
