"""The neighbour: its seeded schedule, the thread that follows it, and its loads."""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path

import pytest

from mesh.sim.processes import CpuLoad, MeshLoad, Neighbour
from mesh.sim.scenario import NeighbourConfig, SimConfig, parse_schedule, plan_phases


def test_the_schedule_is_a_function_of_the_spec_and_the_seed() -> None:
    a = plan_phases("random:5-15", 7, 300.0)
    assert a == plan_phases("random:5-15", 7, 300.0)
    assert a != plan_phases("random:5-15", 8, 300.0)
    assert [p.on for p in a[:4]] == [False, True, False, True]  # off first: a quiet start
    assert a[0].start == 0.0 and a[-1].end >= 300.0
    assert all(b.start == pytest.approx(p.end, abs=2e-3) for p, b in itertools.pairwise(a))
    assert all(5.0 - 1e-3 <= p.end - p.start <= 15.0 + 1e-3 for p in a)
    # separate on / off ranges
    b = plan_phases("random:2-3/10-11", 1, 100.0)
    assert all((2 <= p.end - p.start <= 3.001) if p.on else (10 <= p.end - p.start <= 11.001)
               for p in b)


def test_an_explicit_schedule_repeats() -> None:
    phases = plan_phases("off:1,on:2", 0, 7.5)
    assert [(p.on, p.start, p.end) for p in phases] == [
        (False, 0.0, 1.0), (True, 1.0, 3.0), (False, 3.0, 4.0), (True, 4.0, 6.0),
        (False, 6.0, 7.0), (True, 7.0, 9.0)]
    assert plan_phases("off:1,on:2", 0, 7.5) == plan_phases("off:1,on:2", 99, 7.5)


@pytest.mark.parametrize("spec", ["", "random:", "random:5-x", "random:9-3", "on:0",
                                  "up:5", "off:5", "on:5,off"])
def test_a_bad_schedule_names_the_forms(spec: str) -> None:
    with pytest.raises(ValueError, match="neighbour schedule"):
        parse_schedule(spec)


def test_config_validation() -> None:
    SimConfig(policy="projection").validate()
    SimConfig(neighbour=NeighbourConfig(kind="cpu", schedule="on:3,off:3")).validate()
    with pytest.raises(ValueError, match="neighbour must be one of"):
        NeighbourConfig(kind="gpu").validate()
    with pytest.raises(ValueError, match="duty"):
        NeighbourConfig(kind="cpu", duty=0).validate()
    with pytest.raises(ValueError, match="neighbour threads must be >= 1"):
        NeighbourConfig(kind="mesh", threads=0).validate()
    with pytest.raises(ValueError, match="neighbour schedule"):
        SimConfig(neighbour=NeighbourConfig(kind="cpu", schedule="sometimes")).validate()


class RecordingLoad:
    def __init__(self) -> None:
        self.calls: list[tuple[str, float]] = []

    def setup(self) -> None:
        self.calls.append(("setup", time.monotonic()))

    def start(self) -> None:
        self.calls.append(("start", time.monotonic()))

    def stop(self) -> None:
        self.calls.append(("stop", time.monotonic()))

    def close(self) -> None:
        self.calls.append(("close", time.monotonic()))


def test_the_neighbour_follows_its_schedule_and_records_its_spans() -> None:
    load = RecordingLoad()
    config = NeighbourConfig(kind="cpu", schedule="off:0.2,on:0.3")
    with Neighbour(config, 0, load=load) as neighbour:
        t0 = time.monotonic()
        neighbour.begin(t0)
        time.sleep(1.1)  # on 0.2-0.5, 0.7-1.0, then on again from 1.2 (not reached)
        spans = neighbour.end()
    kinds = [k for k, _ in load.calls]
    assert kinds == ["setup", "start", "stop", "start", "stop", "close"]
    assert len(spans) == 2
    for span, (lo, hi) in zip(spans, [(0.2, 0.5), (0.7, 1.0)], strict=True):
        assert span.start == pytest.approx(lo, abs=0.15)
        assert span.end == pytest.approx(hi, abs=0.15)
    starts = [t - t0 for k, t in load.calls if k == "start"]
    assert starts[0] >= 0.2  # never early


def test_ending_mid_phase_stops_the_load_and_closes_the_span() -> None:
    load = RecordingLoad()
    neighbour = Neighbour(NeighbourConfig(kind="cpu", schedule="off:0.05,on:30"), 0, load=load)
    neighbour.begin(time.monotonic())
    time.sleep(0.3)
    spans = neighbour.end()
    assert [k for k, _ in load.calls] == ["start", "stop"]
    assert len(spans) == 1 and spans[0].end - spans[0].start < 1.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ")[1].startswith("Z"))


def test_the_cpu_load_burns_a_core_while_on_and_is_gone_after() -> None:
    load = CpuLoad(cores=1, duty=1.0)
    load.start()
    try:
        (proc,) = load._procs
        deadline = time.monotonic() + 10.0
        cpu_s = 0.0
        while cpu_s < 0.5 and time.monotonic() < deadline:  # generous: a shared machine
            time.sleep(0.2)
            stat = Path(f"/proc/{proc.pid}/stat").read_text().split(") ")[1].split()
            cpu_s = (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
        assert cpu_s >= 0.5  # busy, not sleeping
    finally:
        load.stop()
    assert not _alive(proc.pid)


def test_the_mesh_neighbour_serves_its_own_clients(tiny_model_path: Path,
                                                  tmp_path: Path) -> None:
    import httpx

    config = NeighbourConfig(kind="mesh", clients=1, max_tokens=8, threads=1)
    load = MeshLoad(config, str(tiny_model_path), seed=0, startup_timeout_s=120.0,
                    data_dir=tmp_path / "neighbour")
    try:
        load.setup()
        assert "--policy" in (cmd := load.command(1, Path("x"))) and "none" in cmd
        load.start()
        deadline = time.monotonic() + 20.0
        served = 0.0
        while time.monotonic() < deadline and not served:
            time.sleep(0.3)
            cap = httpx.get(load.url + "/capacity").json()
            served = float(cap.get("sessions", {}).get("total") or 0)
        assert served, "the neighbour's client never reached its server"
        client = load._client
        load.stop()
        assert client is not None and client.poll() is not None
    finally:
        load.close()


def test_a_busy_loop_ends_itself_when_its_parent_is_gone() -> None:
    import subprocess
    import sys

    from mesh.sim.processes import _BUSY

    # the parent pid it watches is not its parent: it must exit at once, not burn forever
    proc = subprocess.Popen([sys.executable, "-c", _BUSY, "1.0", "1"])
    try:
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
