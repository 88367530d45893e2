"""A prefix snapshot that cannot be used says so (one warning naming the file and why) and
is rebuilt, on real llama.cpp with the tiny model (issue 27 hole 7)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from mesh.engine.config import EngineConfig
from mesh.engine.pool import SharedKVPool
from tests.engine.test_pool import PREFIX, make_pool, run


def _snapshot(cache: Path) -> Path:
    (snap,) = cache.glob("prefix-*.kv")
    return snap


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "mesh.engine.build" and r.levelno == logging.WARNING]


def test_garbage_snapshot_is_reported_and_rebuilt(
    tiny_model_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def body() -> None:
        await (await make_pool(tiny_model_path, cache_dir=str(tmp_path))).aclose()
        snap = _snapshot(tmp_path)
        good = snap.read_bytes()
        snap.write_bytes(b"garbage")
        with caplog.at_level(logging.WARNING, logger="mesh.engine.build"):
            again = await make_pool(tiny_model_path, cache_dir=str(tmp_path))
        await again.aclose()
        assert not again.info.warm_started
        assert _warnings(caplog) == [
            f"prefix snapshot at {snap} is corrupt (llama.cpp could not load it); "
            "rebuilding it"]
        assert snap.read_bytes() == good, "the snapshot was rebuilt"
        caplog.clear()
        third = await make_pool(tiny_model_path, cache_dir=str(tmp_path))
        await third.aclose()
        assert third.info.warm_started and _warnings(caplog) == []

    run(body())


def test_snapshot_of_another_prefix_is_reported_and_rebuilt(
    tiny_model_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def body() -> None:
        ours, theirs = tmp_path / "ours", tmp_path / "theirs"
        await (await make_pool(tiny_model_path, cache_dir=str(ours))).aclose()
        other = SharedKVPool(EngineConfig(model_path=str(tiny_model_path), max_sessions=16,
                                          session_budget=128, n_threads=1,
                                          cache_dir=str(theirs)), PREFIX[: len(PREFIX) // 2])
        await other.start()
        await other.aclose()
        snap = _snapshot(ours)
        shutil.copyfile(_snapshot(theirs), snap)  # a valid file, the wrong tokens
        with caplog.at_level(logging.WARNING, logger="mesh.engine.build"):
            again = await make_pool(tiny_model_path, cache_dir=str(ours))
        await again.aclose()
        assert not again.info.warm_started
        (line,) = _warnings(caplog)
        assert line.startswith(f"prefix snapshot at {snap} is corrupt (")
        assert "not this prefix's" in line and line.endswith("; rebuilding it")

    run(body())
