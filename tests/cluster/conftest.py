"""A local two-node Ray cluster for the cluster tests (one CPU each, small object stores:
CI has two cores), started once for the session and shut down whatever happens."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray  # in the test extra: a missing Ray fails these tests, it never skips them
from ray.cluster_utils import Cluster

from mesh.engine.config import EngineConfig
from mesh.engine.pool import SharedKVPool

OBJECT_STORE = 80 * 1024 * 1024  # bytes per node (Ray's floor is 75 MiB)
PREFIX = "You are one of many agents sharing this prefix. " * 12


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Cluster]:
    """Two nodes with one CPU each; this process is connected as a driver."""
    cluster = Cluster()
    try:
        cluster.add_node(num_cpus=1, object_store_memory=OBJECT_STORE, include_dashboard=False)
        cluster.add_node(num_cpus=1, object_store_memory=OBJECT_STORE)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, namespace="mesh-tests")
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()  # type: ignore[no-untyped-call]


def tiny_config(model: Path) -> EngineConfig:
    return EngineConfig(model_path=str(model), max_sessions=4, session_budget=512,
                        n_threads=1)


def make_pool(model: Path) -> functools.partial[SharedKVPool]:
    """What each pool actor builds: the real pool on the tiny model."""
    return functools.partial(SharedKVPool, tiny_config(model), PREFIX)
