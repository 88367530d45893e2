"""A throwaway PostgreSQL for the tests and the benches: ``initdb`` into a fresh temporary
folder, ``pg_ctl start`` on a free loopback port, ``pg_ctl stop -m immediate`` and the
folder removed at the end (:func:`throwaway_postgres`).

The binaries are Debian's ``postgresql`` package (``/usr/lib/postgresql/N/bin``, not on
``PATH``) or any ``initdb`` on ``PATH``. ``initdb`` refuses to run as root, so as root the
server runs as the ``postgres`` user the package creates (else ``nobody``), in a folder
that user owns; trust authentication on 127.0.0.1 only, no Unix socket outside the
folder, fsync off (nothing here must survive an OS crash).

Used by ``tests/postgres/conftest.py`` (a session fixture: the tests fail, never skip, when
the binaries are missing) and ``bench/task_store/``.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shlex
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PostgresMissing", "Throwaway", "find_bin_dir", "throwaway_postgres"]

INSTALL_HINT = ("install Debian's postgresql package (apt-get install postgresql; "
                "scripts/test.sh does it when run as root)")


class PostgresMissing(RuntimeError):
    """No ``initdb``/``pg_ctl`` on this machine (the message says how to install them)."""


@dataclass(frozen=True)
class Throwaway:
    """A running throwaway server: ``url`` is ``postgresql://mesh@127.0.0.1:PORT/mesh``."""

    url: str
    port: int
    root: Path

    @property
    def log(self) -> str:
        path = self.root / "server.log"
        return path.read_text(errors="replace") if path.exists() else ""


def find_bin_dir() -> Path:
    """The folder holding ``initdb`` and ``pg_ctl``; :class:`PostgresMissing` if none."""
    on_path = shutil.which("initdb")
    if on_path and shutil.which("pg_ctl"):
        return Path(os.path.realpath(on_path)).parent
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                   key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0)
    if found:
        return Path(found[-1]).parent
    raise PostgresMissing(f"initdb was not found on PATH nor in /usr/lib/postgresql/*/bin; "
                          f"{INSTALL_HINT}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _runner() -> tuple[list[str], int | None, int | None]:
    """The command prefix that runs the server binaries, and the uid/gid to own its
    folder (``None``: this user). Root hands them to ``postgres``, else ``nobody``."""
    if os.geteuid() != 0:
        return [], None, None
    for name in ("postgres", "nobody"):
        try:
            user = pwd.getpwnam(name)
        except KeyError:
            continue
        runuser = shutil.which("runuser")
        prefix = [runuser, "-u", name, "--"] if runuser else ["su", name, "-s", "/bin/sh", "-c"]
        return prefix, user.pw_uid, user.pw_gid
    raise PostgresMissing("running as root and neither a 'postgres' nor a 'nobody' user "
                          "exists for initdb to run as (initdb refuses root); create one")


def _run(prefix: list[str], argv: list[str], *, timeout: float) -> None:
    command = [*prefix, shlex.join(argv)] if prefix[:1] == ["su"] else [
        *prefix, *argv]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:2])} failed ({done.returncode}):\n"
                           f"{done.stdout[-2000:]}{done.stderr[-2000:]}")


@contextlib.contextmanager
def throwaway_postgres(*, timeout_s: float = 120.0) -> Iterator[Throwaway]:
    """Start a fresh PostgreSQL (see the module docstring); stop it and delete it after.
    :class:`PostgresMissing` when the binaries are not installed."""
    bin_dir = find_bin_dir()
    prefix, uid, gid = _runner()
    # The server's user must reach its folder: as root, under /tmp (world-traversable),
    # whatever $TMPDIR says.
    root = Path(tempfile.mkdtemp(prefix="mesh-pg-", dir="/tmp" if uid is not None else None))
    data = root / "data"
    try:
        if uid is not None and gid is not None:
            os.chown(root, uid, gid)
        _run(prefix, [str(bin_dir / "initdb"), "-D", str(data), "-U", "mesh", "-A", "trust",
                      "-E", "UTF8", "--no-locale", "--no-sync"], timeout=timeout_s)
        port = _free_port()
        # fsync off: a commit is in the OS's hands, as SQLite's WAL with synchronous=NORMAL
        # (mesh's default store): both survive the process dying, not the OS.
        options = f"-h 127.0.0.1 -p {port} -k {root} -F -c max_connections=200"
        _run(prefix, [str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(root / "server.log"),
                      "-o", options, "-w", "-t", str(int(timeout_s)), "start"],
             timeout=timeout_s + 10)
        try:
            _run(prefix, [str(bin_dir / "createdb"), "-h", "127.0.0.1", "-p", str(port),
                          "-U", "mesh", "mesh"], timeout=timeout_s)
            yield Throwaway(f"postgresql://mesh@127.0.0.1:{port}/mesh", port, root)
        finally:
            _run(prefix, [str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w",
                          "stop"], timeout=60)
    finally:
        shutil.rmtree(root, ignore_errors=True)
