"""The shared KV pool engine. Knows nothing of A2A or HTTP.

Importing this package loads no model and no native library: the pool itself lives in
:mod:`mesh.engine.pool` (the only path to ``llama_cpp``, through :mod:`mesh.engine.llama`).
"""
