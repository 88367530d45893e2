"""Joining a Ray cluster, or starting one on this machine: ``mesh serve --ray auto|ADDRESS``.

* ``auto``: join the cluster this machine already runs (``$RAY_ADDRESS``, or the latest
  ``ray start`` here); with none, start a local one (this process is its head; it stops
  with mesh).
* ``ADDRESS`` (``host:port`` of the head's GCS, as ``ray start --head`` prints it, or
  ``ray://host:port`` of a Ray Client server): join that cluster.

Ray retries an unreachable address for minutes; :func:`connect` first opens a TCP
connection to it (a few seconds at most), so a wrong address fails at start in one line
naming ``--ray``.
"""

from __future__ import annotations

import signal
import socket
import threading
from dataclasses import dataclass

import ray

__all__ = ["RayAddress", "connect", "disconnect", "parse_ray_address"]

PROBE_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class RayAddress:
    """A parsed ``--ray`` value: ``auto`` or a host and port (``client``: ``ray://``)."""

    value: str
    host: str = ""
    port: int = 0
    client: bool = False

    @property
    def is_auto(self) -> bool:
        return self.value == "auto"


def parse_ray_address(value: str) -> RayAddress:
    """``--ray`` → :class:`RayAddress`; ValueError naming the fix. Does no I/O."""
    value = value.strip()
    if value == "auto":
        return RayAddress("auto")
    client = value.startswith("ray://")
    rest = value.removeprefix("ray://")
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--ray must be 'auto' or the head's HOST:PORT (as `ray start --head` "
                         f"prints it; ray://HOST:PORT for Ray Client), got {value!r}")
    return RayAddress(value, host.strip("[]"), int(port), client)


def _probe(address: RayAddress) -> None:
    try:
        with socket.create_connection((address.host, address.port), timeout=PROBE_TIMEOUT_S):
            pass
    except OSError as exc:
        raise ValueError(
            f"--ray {address.value}: no Ray cluster answers at {address.host}:{address.port} "
            f"({exc.strerror or exc}); start its head with `ray start --head --port "
            f"{address.port}` there, or use --ray auto to start one here") from None


def connect(address: RayAddress, *, namespace: str = "mesh") -> str:
    """Join (or, for ``auto`` with none running, start) the cluster; returns a line
    saying which. ValueError naming ``--ray`` when it cannot be reached."""
    if ray.is_initialized():
        return "Ray: already connected in this process"
    if not address.is_auto:
        _probe(address)
    started = False
    # ray.init sets a SIGTERM handler that exits at once (sys.exit): the server's own
    # handler (uvicorn's graceful shutdown, which closes the pools) is put back after it.
    on_term = (signal.getsignal(signal.SIGTERM)
               if threading.current_thread() is threading.main_thread() else None)
    try:
        try:
            ctx = ray.init(address="auto" if address.is_auto else address.value,
                           namespace=namespace, log_to_driver=False, configure_logging=False)
        except ConnectionError:
            if not address.is_auto:
                raise
            # auto, and no cluster runs here: start one (this process is its head)
            ctx = ray.init(address="local", include_dashboard=False, namespace=namespace,
                           log_to_driver=False, configure_logging=False)
            started = True
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ValueError(f"--ray {address.value}: cannot join the Ray cluster ({exc}); check "
                         "that its Ray version matches this one "
                         f"({ray.__version__})") from None
    finally:
        if on_term is not None:
            signal.signal(signal.SIGTERM, on_term)
    nodes = [n for n in ray.nodes() if n.get("Alive")]  # type: ignore[no-untyped-call]
    where = getattr(ctx, "address_info", {}).get("gcs_address") or address.value
    how = "started a local cluster at" if started else "joined"
    return f"Ray {ray.__version__}: {how} {where} ({len(nodes)} nodes alive)"


def disconnect() -> None:
    """Leave the cluster (and stop it, if this process started it)."""
    if ray.is_initialized():
        ray.shutdown()
