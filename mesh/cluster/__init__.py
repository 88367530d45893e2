"""Pools as Ray actors (``mesh serve --ray auto|ADDRESS``): :mod:`.pools` is where a
session goes, joining or starting the cluster and the engine the coordinator runs on;
:mod:`.pool_actor` the pool in its actor.

Only ``mesh serve --ray`` imports this package (and Ray with it): without the flag nothing
of Ray is loaded. Install with ``pip install mesh[cluster]``.
"""
