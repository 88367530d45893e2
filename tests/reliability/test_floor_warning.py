"""mesh serve says at start when one worker alone cannot reach the floor (real tiny model)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.reliability.serve_proc import running, small_project


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.mark.parametrize(("floor", "warned"), [("1000000", True), ("0.5", False)])
def test_an_unreachable_floor_is_reported_at_start(
    tmp_path: Path, cache: Path, floor: str, warned: bool
) -> None:
    project = small_project(tmp_path / "project")
    with running(tmp_path / "data", project, cache, "--floor-tps", floor) as served:
        err = served.stderr()
        assert "gate: policy floor" in err
        assert ("below the floor" in err) is warned, err
        if warned:
            assert "lower --floor-tps" in err
        served.stop()
