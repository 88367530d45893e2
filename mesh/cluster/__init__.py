"""Pools as Ray actors (``mesh serve --ray auto|ADDRESS``): :mod:`.pools` is the engine
the coordinator runs on, :mod:`.pool_actor` the pool in its actor, :mod:`.routing` where a
session goes, :mod:`.connect` joining or starting the cluster.

Only ``mesh serve --ray`` imports this package (and Ray with it): without the flag nothing
of Ray is loaded. Install with ``pip install mesh[cluster]``.
"""
