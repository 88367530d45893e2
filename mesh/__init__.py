"""mesh: an A2A agent mesh whose workers are sessions in one shared llama.cpp KV pool."""

__version__ = "0.1.0"

__all__ = ["__version__"]
