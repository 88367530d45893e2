"""What ``mesh serve`` checks before any slow start-up work (prefix, model, gate seed).

Every operator mistake found here is a ``ValueError`` whose one-line message names the
flag that fixes it; ``mesh serve`` prints it and exits 2. The listening socket is bound
here too, first of all the slow work, and handed to uvicorn later: a port in use fails in
milliseconds, and nothing can take the port between the check and the serving.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import re
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from mesh.a2a.config import CoordinatorConfig
from mesh.gate.config import POLICIES, GateConfig
from mesh.gate.decide import WorkerRule

__all__ = ["Checked", "bind_listener", "check_data_dir", "check_template",
           "coordinator_config", "floor_arg", "gate_config", "preflight", "print_cache_warnings"]

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def coordinator_config(args: argparse.Namespace, *, plan: str | None = None) -> CoordinatorConfig:
    """The coordinator's config from ``mesh serve``'s flags, validated (ValueError)."""
    coord = CoordinatorConfig(host=args.host, port=args.port, public_url=args.public_url,
                              data_dir=args.data_dir, auth_token=args.auth_token,
                              peers=tuple(args.peer),
                              allow_private_push=args.allow_private_push,
                              simulation=args.simulation, max_hops=args.max_hops,
                              plan=plan or args.plan, max_body_bytes=args.max_body_bytes,
                              task_store=args.task_store)
    coord.validate()
    return coord


def check_data_dir(path: Path, flag: str = "--data-dir") -> Path:
    """Create ``path`` if missing; ValueError naming ``flag`` if it is a file, sits under a
    file, or cannot be written."""
    fix = f"pass {flag} DIR (a folder, created if missing)"
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path} is a file, not a folder; {fix}")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        under = next((p for p in path.parents if p.exists() and not p.is_dir()), path)
        raise ValueError(f"{flag} {path} cannot be created: {under} is a file; {fix}") from None
    except PermissionError:
        raise ValueError(f"{flag} {path} cannot be created: permission denied; "
                         f"pass {flag} DIR in a folder you can write") from None
    except OSError as exc:
        raise ValueError(f"{flag} {path} cannot be created: {exc.strerror or exc}; "
                         f"{fix}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path} is not writable; pass {flag} DIR you can write")
    return path


def check_template(name: str) -> None:
    """Load the template once (cheap: a TOML file and a dry render); ValueError naming
    ``--template`` and the valid names if it is neither a shipped name nor a good folder."""
    from mesh.template.loader import BUILTIN_TEMPLATES, load_template

    names = " or ".join(BUILTIN_TEMPLATES)
    if name not in BUILTIN_TEMPLATES and not Path(name).expanduser().is_dir():
        raise ValueError(f"unknown --template {name!r}: pass --template {names}, or the "
                         "path of a template folder (`mesh serve --help`)")
    try:
        load_template(name)
    except ValueError as exc:
        raise ValueError(f"--template {name}: {exc}; fix the folder, or pass --template "
                         f"{names}") from None


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``, as uvicorn would bind it (SO_REUSEADDR, IPv6 when
    the host has a colon); ValueError naming ``--port`` or ``--host`` when it cannot be had.

    It listens at once: the port is held from here on, and a client that connects during
    the rest of the start-up waits in the backlog instead of being refused.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.set_inheritable(True)
    except OSError as exc:
        sock.close()
        raise ValueError(_bind_error(host, port, exc)) from None
    return sock


def _bind_error(host: str, port: int, exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return (f"port {port} on {host} is already in use (another mesh serve?); "
                "pass --port N with a free port, or stop what holds it")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return (f"port {port} on {host} needs privileges this user lacks; "
                "pass --port N with N >= 1024")
    if exc.errno == errno.EADDRNOTAVAIL:
        return (f"--host {host} is not an address of this machine; pass --host 127.0.0.1 "
                "(or 0.0.0.0 to listen on all, with --auth-token)")
    if isinstance(exc, socket.gaierror):
        return (f"--host {host} does not resolve ({exc.strerror}); pass --host 127.0.0.1 "
                "or an address of this machine")
    return f"cannot listen on {host}:{port} ({exc.strerror or exc}); pass another --port or --host"


# Config fields a flag sets, as the configs' messages name them: an operator reads the flag.
_FLAGS = {name: "--" + name.replace("_", "-") for name in (
    "public_url", "max_hops", "max_body_bytes", "floor_tps", "max_queue_per_caller",
    "max_queue", "auth_token", "task_store")}
_FIELD = re.compile(r"\b(" + "|".join(_FLAGS) + r")\b")


def _flagged(message: str) -> str:
    """``message`` with config field names written as the flags that set them."""
    message = _FIELD.sub(lambda m: _FLAGS[m.group(1)], message)
    return re.sub(r"^port must", "--port must", message).replace("gate policy", "--policy")


@dataclass(frozen=True)
class Checked:
    """The configuration ``mesh serve``'s flags make, built once by :func:`preflight`
    and passed down: the coordinator's, and the gate's with the rule of a comparison
    policy."""

    coordinator: CoordinatorConfig
    gate: GateConfig | None = None
    rule: WorkerRule | None = None


def preflight(args: argparse.Namespace) -> tuple[socket.socket, Checked]:
    """Every check that needs no model, then the bound socket and the configuration.
    Raises ValueError naming the flag to change. Order: warnings, flags, folders,
    template, then the port."""
    if args.host not in _LOOPBACK and not args.auth_token:
        print(f"warning: binding {args.host} without --auth-token: anyone who can reach "
              "this address can use the agent", file=sys.stderr)
    try:
        checked = Checked(coordinator_config(args), *gate_config(args))
        if args.ray:
            check_ray(args)
    except ValueError as exc:
        raise ValueError(_flagged(str(exc))) from None
    check_data_dir(Path(args.data_dir))
    if args.prefix_cache:
        check_data_dir(Path(args.prefix_cache), "--prefix-cache")
    if args.project and not Path(args.project).is_dir():
        raise ValueError(f"project directory not found: {args.project}; pass --project DIR")
    check_template(args.template)
    return bind_listener(args.host, args.port), checked


def check_ray(args: argparse.Namespace) -> None:
    """``--ray`` and its companions, before anything is built (no I/O: the cluster is
    reached when the pools are). Imports Ray only when ``--ray`` is given."""
    if args.engine != "llama.cpp":
        raise ValueError("--ray runs llama.cpp pools as Ray actors; it excludes "
                         f"--engine {args.engine}")
    if args.ray_pools < 1:
        raise ValueError(f"--ray-pools must be at least 1, got {args.ray_pools}")
    if args.ray_gpus < 0 or args.ray_memory < 0:
        raise ValueError("--ray-gpus and --ray-memory must not be negative")
    try:
        from mesh.cluster.connect import parse_ray_address
    except ImportError:
        raise ValueError("--ray needs Ray: pip install 'mesh[cluster]'") from None
    parse_ray_address(args.ray)


class _StderrLine(logging.Handler):
    """One line on the *current* ``sys.stderr`` per record (what a test captures, too)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(self.format(record), file=sys.stderr, flush=True)
        except Exception:  # a logging handler must never raise
            self.handleError(record)


# Loggers whose warnings an operator must see at start-up (a warm start that became a
# cold one, and why).
_START_UP_LOGGERS = ("mesh.engine.build",)


def print_cache_warnings() -> None:
    """Print the warm-start cache's warnings (a corrupt prefix snapshot) as one stderr
    line each; idempotent."""
    for name in _START_UP_LOGGERS:
        log = logging.getLogger(name)
        if not any(isinstance(h, _StderrLine) for h in log.handlers):
            log.addHandler(_StderrLine(logging.WARNING))
            log.propagate = False


def floor_arg(text: str) -> float | str:
    """``--floor-tps``: a number of tokens/s, or ``auto``."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected tokens/s (a number) or 'auto', got {text!r}") from None


def gate_config(args: argparse.Namespace) -> tuple[GateConfig, WorkerRule | None]:
    """The gate's configuration from the flags, and the rule of a comparison policy
    (``--policy projection|legacy|static:N``: :mod:`mesh.sim.policies`, imported only
    then; None for the product's ``floor`` and ``none``). Checked; ValueError names the fix."""
    auto = args.floor_tps == "auto"
    policy = args.policy.strip().lower()
    rule = None
    if policy not in POLICIES:
        from mesh.sim.policies import parse_rule

        rule = parse_rule(policy)
        policy = rule.name
    config = GateConfig.create(policy=policy, floor_tps=5.0 if auto else args.floor_tps,
                               auto_floor=auto, max_queue=args.max_queue,
                               max_queue_per_caller=args.max_queue_per_caller)
    return config, rule
