"""GET /capacity and GET /metrics over FakeEngine and FloorGate."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette

from mesh.api.sessions import api_routes
from mesh.gate.admission import FloorGate
from mesh.gate.config import GateConfig
from mesh.sim.fake import FakeEngine

pytestmark = pytest.mark.anyio


@pytest.fixture
async def setup() -> AsyncIterator[tuple[httpx.AsyncClient, FakeEngine, FloorGate]]:
    engine = FakeEngine(prefix_tokens=100)
    gate = FloorGate(engine, GateConfig.create(floor_tps=3.0, policy="floor", max_queue=5))
    app = Starlette(routes=api_routes(engine, gate))
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://mesh"
    ) as client:
        yield client, engine, gate


async def test_capacity_document(setup: tuple[httpx.AsyncClient, FakeEngine, FloorGate]) -> None:
    client = setup[0]
    r = await client.get("/capacity")
    assert r.status_code == 200
    cap: dict[str, Any] = r.json()
    for key in (
        "floor_tps",
        "policy",
        "sessions",
        "measured_tps",
        "projected_tps_next",
        "headroom",
        "queue_len",
        "kv_cells",
        "retry_after_s",
        "projected_idle_estimate",
    ):
        assert key in cap
    assert cap["floor_tps"] == 3.0 and cap["policy"] == "floor"
    assert set(cap["kv_cells"]) == {"used", "total", "prefix", "naive_equivalent", "reduction"}
    assert set(cap["measured_tps"]) >= {"min", "p50"}
    assert cap["sessions"]["total"] == 0 and cap["headroom"] >= 1


async def test_capacity_follows_the_pool(
    setup: tuple[httpx.AsyncClient, FakeEngine, FloorGate],
) -> None:
    client, _, gate = setup
    before = (await client.get("/capacity")).json()
    for _ in range(3):
        r = await client.post("/v1/sessions", json={})
        assert r.status_code == 201
        sid = r.json()["id"]
        r = await client.post(f"/v1/sessions/{sid}/turns", json={"text": "a b c", "max_tokens": 5})
        assert r.status_code == 200
    after = (await client.get("/capacity")).json()
    assert after["sessions"] == {"total": 3, "prefilling": 0, "decoding": 0, "idle": 3,
                                 "waiting": 0}
    kv = after["kv_cells"]
    assert kv["used"] == 100 + 3 * 8 and kv["naive_equivalent"] == 3 * 108
    assert kv["reduction"] == pytest.approx(kv["naive_equivalent"] / kv["used"])
    assert after["headroom"] < before["headroom"]
    assert after["projected_tps_next"] < before["projected_tps_next"]
    assert gate.num_tickets == 3
    totals = {k: after["pool_totals"][k] - before["pool_totals"][k] for k in before["pool_totals"]}
    assert totals == {"sessions_attached": 3, "prefill_tokens": 3 * 3,  # "a b c" each
                      "sessions_reaped": 0}


async def test_metrics_in_prometheus_text(
    setup: tuple[httpx.AsyncClient, FakeEngine, FloorGate],
) -> None:
    client = setup[0]
    assert (await client.post("/v1/sessions", json={})).status_code == 201
    r = await client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }
    assert samples[("mesh_gate_floor_tps", ())] == 3.0
    assert samples[("mesh_sessions", (("state", "idle"),))] == 1
    assert samples[("mesh_kv_cells", (("kind", "prefix"),))] == 100
    assert samples[("mesh_pool_sessions_attached", ())] == 1
    assert samples[("mesh_pool_prefill_tokens", ())] == 0
    assert samples[("mesh_gate_queue_length", ())] == 0
    assert samples[("mesh_gate_projected_idle_estimate", ())] == 0
    assert ("mesh_session_tps_min", ()) not in samples  # nothing measured yet: no sample
    cap = (await client.get("/capacity")).json()
    assert samples[("mesh_gate_headroom", ())] == cap["headroom"]
    assert samples[("mesh_gate_projected_tps_next", ())] == pytest.approx(cap["projected_tps_next"])
