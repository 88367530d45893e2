"""The C hot path of the engine step (``mesh_native.c``); built by ``python -m native.build``."""
