"""Where mesh keeps downloaded and generated models (no I/O; creates nothing)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["default_cache_dir"]


def default_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """``$XDG_CACHE_HOME/mesh/models`` if that variable holds an absolute path, else
    ``~/.cache/mesh/models``. Creates nothing."""
    env = os.environ if env is None else env
    xdg = env.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "mesh" / "models"
