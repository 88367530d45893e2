"""Everything ``mesh serve`` builds from its flags, in the order it builds it:

* **Engine flags**: the native step, GPU offload, attention, the KV cache type, and the KV
  tier picked from a memory size (``--kv-memory GiB|auto``).
* **The engine**: the local pool, pools as Ray actors (``--ray``) or ``--engine openai:URL``.
* **The project prefix**: template, project, model, prefix size, chat format (the model's
  vocabulary only, no weights). A default prefix that, with one session, does not fit the
  model's trained context is scaled down to fit (an explicit ``--prefix-tokens`` is kept).
* **Preflight**: every check that needs no model; each operator mistake is a ``ValueError``
  naming the flag that fixes it. The listening socket is bound here, before the slow work,
  and handed to uvicorn: a port in use fails in milliseconds and nothing can take it after.
* **Composition**: :func:`local_app` runs before any event loop and returns the app of
  :func:`mesh.a2a.app.create_app`, whose lifespan runs :func:`compose_local` on the serving
  loop. What compose opens that lifespan closes, once.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import functools
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mesh.a2a.config import CoordinatorConfig
from mesh.engine.config import (
    FLASH_ATTN,
    GIB,
    KV_TYPES,
    PREFIX_ATTENTION,
    EngineConfig,
    KVShape,
    Tier,
    choose_tier,
)
from mesh.engine.llama import LlamaModel
from mesh.gate.config import POLICIES, GateConfig
from mesh.gate.decide import WorkerRule

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from mesh.a2a.app import AppParts
    from mesh.agent.task import Agent
    from mesh.engine.models import ResolvedModel
    from mesh.fleet.peers import PeerClient
    from mesh.gate.admission import FloorGate
    from mesh.template.chat import ChatFormat
    from mesh.template.loader import Template
    from mesh.template.prefix import Prefix, ProjectScan


# -------------------- engine flags --------------------------------------------

_HEADROOM = 1.0  # GiB left for compute buffers when --kv-memory auto reads the GPU


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--native", choices=("auto", "on", "off"), default="auto",
                   help="the native step (native/, built at install): auto uses it when "
                        "built, on requires it, off runs the Python step")
    p.add_argument("--gpu-layers", type=int, default=-1,
                   help="model layers to offload to the GPU (-1: all; 0: none; needs "
                        "llama-cpp-python built with a GPU backend)")
    p.add_argument("--flash-attn", choices=FLASH_ATTN, default="auto",
                   help="llama.cpp flash attention (default auto: the path measured "
                        "fastest for the device, KV type, prefix length and --max-sessions)")
    p.add_argument("--prefix-attention", choices=PREFIX_ATTENTION, default="auto",
                   help="decode rows attend the shared prefix together (mesh's llama.cpp "
                        "patch, CPU): shared requires it and turns flash attention on; off "
                        "keeps llama.cpp's path; auto (default): shared where the patch is "
                        "built and the pool runs on the CPU")
    from mesh.engine.models import WEIGHT_CHOICES

    p.add_argument("--weights", choices=WEIGHT_CHOICES, default="auto",
                   help="the weights the engine loads (default auto: a type without a fast "
                        "CPU kernel, SmolLM2's Q4_1, is converted once to Q8_0 and cached; "
                        "as-is: the file unchanged; q4_0: faster still, less accurate)")
    p.add_argument("--kv-type", choices=KV_TYPES, default=None,
                   help="KV cache element type (default f16, or what --kv-memory picks)")
    p.add_argument("--max-attached", type=int, default=None,
                   help="sessions that may be attached at once, parked ones included "
                        "(default 4 x --max-sessions); idle sessions are parked off the KV "
                        "cache when a session needs room and come back before their next turn")
    p.add_argument("--park-idle", type=float, default=None, metavar="SECONDS",
                   help="also park a session idle this long (default: only when room is "
                        "needed)")
    p.add_argument("--park-memory", type=float, default=1.0, metavar="GiB",
                   help="host memory for parked sessions' KV (swap: exact, ~20 ms a resume "
                        "here); past it, or at 0, a parked session is re-prefilled (default 1)")
    p.add_argument("--kv-memory", default=None, metavar="GiB|auto",
                   help="memory the KV cache may use: picks the KV type (f16 > q8_0 > "
                        "q4_0) at which --max-sessions sessions fit, and as many session "
                        "slots as fit; auto: free GPU memory (nvidia-smi) less the model")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig keyword arguments from the flags (before any tier)."""
    native = {"auto": None, "on": True, "off": False}[args.native]
    if args.park_memory < 0:
        raise ValueError(f"--park-memory must be >= 0 GiB, got {args.park_memory:g}")
    return {"native": native, "n_gpu_layers": args.gpu_layers, "flash_attn": args.flash_attn,
            "prefix_attention": args.prefix_attention, "kv_type": args.kv_type or "f16",
            "weights": args.weights, "max_attached": args.max_attached,
            "park_idle_s": args.park_idle, "park_memory": int(args.park_memory * GIB)}


def free_gpu_bytes() -> int | None:
    """Free memory of the first NVIDIA GPU, from nvidia-smi (None without one)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
        return int(out.split()[0]) * 1024 * 1024
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def kv_memory_bytes(spec: str, model_path: str) -> int:
    """``--kv-memory``: GiB as a number, or ``auto`` (free GPU memory less the model file
    and 1 GiB of headroom). ValueError naming the fix."""
    if spec == "auto":
        free = free_gpu_bytes()
        if free is None:
            raise ValueError("--kv-memory auto found no GPU (nvidia-smi); pass --kv-memory "
                             "GiB, the memory the KV cache may use")
        return int(free - Path(model_path).stat().st_size - _HEADROOM * GIB)
    try:
        gib = float(spec)
    except ValueError:
        raise ValueError(f"--kv-memory takes GiB (e.g. 12) or auto, got {spec!r}") from None
    if gib <= 0:
        raise ValueError(f"--kv-memory must be positive, got {spec}")
    return int(gib * GIB)


def pick_tier(args: argparse.Namespace, model_path: str, prefix_tokens: int,
              shape: KVShape) -> Tier:
    """The tier for ``--kv-memory``. An explicit ``--kv-type`` is kept: only the session
    slots are sized then."""
    memory = kv_memory_bytes(args.kv_memory, model_path)
    types = (args.kv_type,) if args.kv_type is not None else KV_TYPES
    tier = choose_tier(shape, memory, prefix_tokens=prefix_tokens,
                       session_budget=args.session_budget, want_sessions=args.max_sessions,
                       types=types)
    if tier.kv_type != "f16" and args.flash_attn == "off":
        raise ValueError(f"--kv-memory picked a {tier.kv_type} cache, which needs flash "
                         "attention; drop --flash-attn off or pass --kv-type f16")
    return tier


def apply_engine_flags(cfg: EngineConfig, args: argparse.Namespace,
                       prefix_text: str) -> EngineConfig:
    """``cfg`` with the engine flags applied; with ``--kv-memory``, the tier it picks
    (KV type, session slots, cells), printed with the capacity it gives."""
    cfg = dataclasses.replace(cfg, **engine_options(args))
    if args.kv_memory is None:
        return cfg
    vocab = LlamaModel(cfg.model_path, vocab_only=True)
    try:
        prefix = len(vocab.tokenize(prefix_text, add_bos=vocab.add_bos))
        layers, kv_heads, head_k, head_v, _ = vocab.kv_shape()
    finally:
        vocab.close()
    shape = KVShape(layers=layers, kv_heads=kv_heads, head_k=head_k, head_v=head_v)
    tier = pick_tier(args, cfg.model_path, prefix, shape)
    print(tier.describe(), file=sys.stderr)
    return dataclasses.replace(cfg, kv_type=tier.kv_type, max_sessions=tier.sessions,
                               n_ctx=tier.n_ctx)

# -------------------- the engine ----------------------------------------------

def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", default="llama.cpp", metavar="llama.cpp|openai:URL",
                   help="llama.cpp: the local shared KV pool (default); openai:URL: run "
                        "sessions on an OpenAI-compatible /v1/completions server (vLLM, "
                        "SGLang, llama-server, another mesh) at URL; --model then names the "
                        "same model's GGUF, for its tokenizer and chat format; the backend's "
                        "key: $MESH_BACKEND_API_KEY")
    p.add_argument("--backend-model", default=None,
                   help="model id to request from --engine openai:URL (default: the first "
                        "GET /v1/models lists)")
    p.add_argument("--ray", default=None, metavar="auto|ADDRESS",
                   help="run the pools as Ray actors (pip install mesh[cluster]): auto joins "
                        "this machine's Ray cluster or starts one; ADDRESS (HOST:PORT of the "
                        "head, as `ray start --head` prints it) joins that cluster. Each pool "
                        "is one actor with --max-sessions sessions; --model and --prefix-cache "
                        "must be readable at the same paths on every node")
    p.add_argument("--ray-pools", type=int, default=2, metavar="N",
                   help="pool actors to place with --ray (default 2)")
    p.add_argument("--ray-gpus", type=float, default=0.0, metavar="G",
                   help="GPUs each pool actor asks Ray for (default 0; 1 for a pool per GPU)")
    p.add_argument("--ray-memory", type=float, default=0.0, metavar="GIB",
                   help="RAM (GiB) each pool actor reserves on its node (default: none)")
    p.add_argument("--prefix-cache", default=None, metavar="DIR",
                   help="prefix snapshot directory, shareable between machines (snapshots are "
                        "keyed by model file hash, prefix hash and context shape; default "
                        "DATA_DIR/prefix-cache)")


def build_engine(args: argparse.Namespace, cfg: EngineConfig, prefix_text: str) -> Any:
    """The engine ``args.engine`` names, not started (``await engine.start(progress)``)."""
    from mesh.backends.openai import BackendConfig, OpenAIEngine, parse_engine_spec

    url = parse_engine_spec(args.engine)
    if url is None and args.ray:
        return _ray_pools(args, cfg, prefix_text)
    if url is None:
        from mesh.engine.pool import SharedKVPool

        return SharedKVPool(cfg, prefix_text)
    vocab = LlamaModel(cfg.model_path, vocab_only=True)
    backend = BackendConfig(url=url, model=args.backend_model, max_sessions=cfg.max_sessions,
                            session_budget=cfg.session_budget,
                            api_key=os.environ.get("MESH_BACKEND_API_KEY"))
    return OpenAIEngine(backend, prefix_text,
                        tokenize=lambda text: vocab.tokenize(text, add_bos=False),
                        prefix_ids=vocab.tokenize(prefix_text, add_bos=vocab.add_bos),
                        on_close=vocab.close)


def _ray_pools(args: argparse.Namespace, cfg: EngineConfig, prefix_text: str) -> Any:
    """``--ray``: join or start the cluster (ValueError naming ``--ray`` when it cannot be
    reached), then the pools as actors, not started. Paths become absolute: an actor runs in
    Ray's own working directory."""
    from mesh.cluster.pools import PoolPlacement, RayPools, connect, parse_ray_address
    from mesh.engine.pool import SharedKVPool

    print(connect(parse_ray_address(args.ray)), file=sys.stderr)
    cfg = dataclasses.replace(
        cfg, model_path=str(Path(cfg.model_path).resolve()),
        cache_dir=str(Path(cfg.cache_dir).resolve()) if cfg.cache_dir else cfg.cache_dir)
    vocab = LlamaModel(cfg.model_path, vocab_only=True)
    placement = PoolPlacement(num_cpus=float(cfg.n_threads or 1), num_gpus=args.ray_gpus,
                              memory=int(args.ray_memory * 2**30))
    return RayPools(functools.partial(SharedKVPool, cfg, prefix_text),
                    num_pools=args.ray_pools, placement=placement,
                    tokenize=lambda text: vocab.tokenize(text, add_bos=False),
                    on_close=vocab.close)


def prefix_cache_dir(args: argparse.Namespace, data_dir: Path) -> str:
    """``--prefix-cache DIR`` or ``DATA_DIR/prefix-cache``."""
    return str(Path(args.prefix_cache) if args.prefix_cache else data_dir / "prefix-cache")

# -------------------- the project prefix --------------------------------------

_CHAT_MARGIN = 256  # tokens the chat format's markup may add around the built prefix


@dataclass
class ProjectPrefix:
    template: Template
    project: Path
    model: ResolvedModel
    prefix: Prefix
    chat: ChatFormat  # resolved against the model's vocabulary


def build_project_prefix(args: argparse.Namespace) -> ProjectPrefix:
    """Build from ``args`` (``--template``, ``--project``, ``--model``, ``--prefix-tokens``,
    ``--session-budget``); raises ValueError naming the fix."""
    from mesh.engine.models import resolve_model
    from mesh.template.chat import ChatFormat
    from mesh.template.loader import default_project_dir, load_template
    from mesh.template.prefix import build_prefix

    template = load_template(args.template)
    project = Path(args.project) if args.project else default_project_dir()
    if not project.is_dir():
        raise ValueError(f"project directory not found: {project}; pass --project DIR")
    model = resolve_model(args.model)
    vocab = LlamaModel(str(model.path), vocab_only=True)
    try:
        target = args.prefix_tokens
        trained = vocab.n_ctx_train or vocab.kv_shape()[4]  # a vocab-only load reports 0
        room = trained - args.session_budget - _CHAT_MARGIN
        if target is None and 0 < room < template.manifest.prefix.target_tokens:
            # The template's default size does not fit this model's trained context: scale
            # the prefix down to fit rather than refuse.
            target = max(64, room)
            print(f"prefix: the {template.manifest.name} template's "
                  f"{template.manifest.prefix.target_tokens} tokens plus a "
                  f"{args.session_budget}-token session pass the {trained}-token "
                  f"context {model.name} was trained for; building {target} tokens "
                  "(--prefix-tokens sets it)", file=sys.stderr)
        prefix = build_prefix(template, project,
                              lambda text: len(vocab.tokenize(text, add_bos=False)),
                              target_tokens=target)
        # The template bound to this prefix: workers see the outline's matching lines.
        template = dataclasses.replace(template, outline=prefix.outlined)
        # The model's own chat format; one that breaks the token-prefix rule falls back.
        chat = ChatFormat.from_gguf(model.path, model_name=model.name).resolve(
            lambda text: vocab.tokenize(text, add_bos=vocab.add_bos),
            lambda msg: print(msg, file=sys.stderr))
    finally:
        vocab.close()
    return ProjectPrefix(template, project, model, prefix, chat)

# -------------------- preflight -----------------------------------------------

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def coordinator_config(args: argparse.Namespace) -> CoordinatorConfig:
    """The coordinator's config from ``mesh serve``'s flags, validated (ValueError)."""
    coord = CoordinatorConfig(host=args.host, port=args.port, public_url=args.public_url,
                              data_dir=args.data_dir, auth_token=args.auth_token,
                              peers=tuple(args.peer),
                              allow_private_push=args.allow_private_push,
                              simulation=args.simulation, max_hops=args.max_hops,
                              plan=args.plan, max_body_bytes=args.max_body_bytes,
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
    gate: GateConfig
    rule: WorkerRule | None


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
        from mesh.cluster.pools import parse_ray_address
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


def print_cache_warnings() -> None:
    """Print the warm-start cache's warnings (a corrupt prefix snapshot: a warm start that
    became a cold one, and why) as one stderr line each; idempotent."""
    log = logging.getLogger("mesh.engine.build")
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

# -------------------- composition ---------------------------------------------

# Models under this many parameters plan guided by default (--plan-style auto): measured on
# SmolLM2-135M, free plans answered all 43 agent-bench questions without a worker.
GUIDED_BELOW_PARAMS = 1_000_000_000


def plan_style(asked: str, n_params: int) -> str:
    """``--plan-style``: auto is guided for a model known to be under 1B parameters."""
    if asked != "auto":
        return asked
    return "guided" if 0 < n_params < GUIDED_BELOW_PARAMS else "free"


def default_plan_actions(style: str) -> tuple[str, ...]:
    """What a plan may do when ``--plan-actions`` is not given."""
    return ("delegate",) if style == "guided" else ("delegate", "answer", "ask")


def peer_tokens(specs: list[str]) -> dict[str, str]:
    """Each named peer's token from ``MESH_PEER_TOKEN_<NAME>`` or the file that
    ``MESH_PEER_TOKEN_<NAME>_FILE`` names."""
    from mesh.fleet.peers import parse_peer, peer_token_env

    tokens: dict[str, str] = {}
    for spec in specs:
        name, _ = parse_peer(spec)
        if name is None:
            continue
        env = peer_token_env(name)
        token = os.environ.get(env)
        path = os.environ.get(env + "_FILE")
        if token is None and path:
            token = Path(path).read_text(encoding="utf-8").strip()
        if token:
            tokens[name] = token
    return tokens


def local_app(args: argparse.Namespace, checked: Checked) -> Starlette:
    """The app ``mesh serve`` serves on its own pool (nothing live is built yet), from the
    configuration :func:`~mesh.cli.compose.preflight` built; raises ValueError naming
    the fix."""
    from mesh.a2a.app import create_app
    from mesh.api.dashboard import DASHBOARD_PUBLIC_PATHS

    compose = functools.partial(compose_local, args, checked.coordinator, checked.gate,
                                checked.rule, build_project_prefix(args))
    return create_app(checked.coordinator, compose, public_paths=DASHBOARD_PUBLIC_PATHS)


async def _seed_gate(gate: FloorGate, pool: Any, cache: Path) -> str:
    """Seed the gate's throughput model with a short probe (cached per model and machine),
    so the first turns are gated on this hardware's step shape, not a prior; it learns
    the rest online. The seed lives beside the prefix snapshots: a shared --prefix-cache
    shares it too. Policies that read no model (``none``, ``static:N``) seed nothing."""
    from mesh.gate.model import seed_model

    if gate.config.policy == "none" or (gate.rule is not None and not gate.rule.needs_seed):
        return "its prior, learned online (this policy needs no seed)"

    def timing() -> None:
        print("gate: timing a few steps of 1, 2 and 4 sessions to seed the throughput model "
              "(first start with this model on this machine; cached after)...",
              file=sys.stderr)

    def corrupt(path: Path, reason: str) -> None:
        print(f"gate: seed at {path} is corrupt ({reason}); rebuilding it", file=sys.stderr)

    source: str = await seed_model(gate.model, pool, cache, announce=timing,
                                   on_corrupt=corrupt)
    return "a probe of this machine" if source == "benchmark" else "cache"


def _project_paths(built: ProjectPrefix) -> ProjectScan:
    """The project's files and folders as the prefix's scan sees them: the names a plan
    and a worker's tool call may give."""
    from mesh.template.prefix import scan_project

    spec = built.template.manifest.prefix
    return scan_project(built.project.resolve(), tuple(spec.exclude), spec.include_hidden)


def _progress(done: int, total: int) -> None:
    print(f"\rprefix: {done}/{total} tokens decoded", end="", file=sys.stderr, flush=True)


async def _start_pool(args: argparse.Namespace, built: ProjectPrefix, prefix_text: str,
                      stack: AsyncExitStack) -> tuple[Any, EngineConfig]:
    """The engine the flags name, started (prefix decoded or restored), closed last of all
    on ``stack``; its start-up lines printed."""
    data_dir = Path(args.data_dir)  # preflight created it
    cfg = EngineConfig(model_path=str(built.model.path), max_sessions=args.max_sessions,
                       session_budget=args.session_budget, n_threads=args.threads,
                       kv_cells=args.kv_cells, cache_dir=prefix_cache_dir(args, data_dir),
                       share_prefix=args.pool == "shared")
    cfg = apply_engine_flags(cfg, args, prefix_text)
    pool = build_engine(args, cfg, prefix_text)
    stack.push_async_callback(pool.aclose)  # closed last of all: after the A2A side
    model, prefix = built.model, built.prefix
    print(f"model: {model.name} ({model.source}) {model.path}", file=sys.stderr)
    print(f"chat format: {built.chat.name}; tool-call grammar: "
          f"{'on' if built.template.manifest.turns.grammar else 'off'}", file=sys.stderr)
    print(f"template: {built.template.name}; project: {built.project} "
          f"({len(prefix.included)} files in the prefix, {len(prefix.skipped)} skipped)",
          file=sys.stderr)
    info = await pool.start(_progress)
    print(file=sys.stderr)
    how = "warm-started from cache" if info.warm_started else f"decoded in {info.build_s:.1f}s"
    print(f"prefix: {info.prefix_tokens} tokens, sha256 {info.prefix_hash[:16]}, {how}; "
          f"engine: {info.engine}; pool: {args.pool}, {info.max_sessions} sessions x "
          f"{info.session_budget} tokens, {info.n_ctx} KV cells", file=sys.stderr)
    if info.weights:
        print(f"weights: {info.weights} (--weights {cfg.weights})", file=sys.stderr)
    if info.flash_attn:  # what --flash-attn / --prefix-attention auto chose (llama.cpp)
        print(f"attention: flash {info.flash_attn} (--flash-attn {cfg.flash_attn}), "
              f"shared prefix {info.prefix_attention} (--prefix-attention "
              f"{cfg.prefix_attention})", file=sys.stderr)
    return pool, cfg


async def _start_gate(pool: Any, gate_cfg: GateConfig, rule: WorkerRule | None,
                      cache: Path) -> FloorGate:
    """The gate on ``pool``, its throughput model seeded (cached under ``cache``) and
    installed; its start-up lines printed, with a warning when one worker alone is
    projected under a fixed floor."""
    from mesh.gate.admission import FloorGate
    from mesh.gate.decide import lone_worker_tps

    gate = FloorGate(pool, gate_cfg, rule=rule)
    source = await _seed_gate(gate, pool, cache)
    gate.install()  # floor: each turn waits for room in its step; prefill keeps the floor
    floor = ("auto (the knee of measured tokens/s)" if gate_cfg.auto_floor
             else f"{gate_cfg.floor_tps:g} tok/s")
    print(f"gate: policy {gate_cfg.policy}, floor {floor}, "
          f"throughput model seeded from {source}", file=sys.stderr)
    info = pool.info
    lone = lone_worker_tps(gate.model, info.prefix_tokens, gate_cfg.new_worker_cells)
    if gate_cfg.policy == "floor" and not gate_cfg.auto_floor and lone < gate_cfg.floor_tps:
        print(f"warning: one worker alone is projected at {lone:.1f} tok/s on this machine, "
              f"below the floor ({gate_cfg.floor_tps:g} tok/s): the gate will run one worker "
              f"at a time, under the floor; lower --floor-tps (below {lone:.1f}) or pick one "
              f"with `mesh sweep`", file=sys.stderr)
    return gate


async def compose_local(args: argparse.Namespace, coord: CoordinatorConfig,
                        gate_cfg: GateConfig, rule: WorkerRule | None, built: ProjectPrefix,
                        stack: AsyncExitStack) -> AppParts:
    """Build and start everything ``mesh serve`` serves, on the running (serving) loop;
    each thing with a life is registered on ``stack`` as soon as it exists."""
    peers = _open_peers(args, coord, stack)
    system_text = built.prefix.text
    if peers is not None:
        system_text += "\n\n" + await peers.describe()
    pool, cfg = await _start_pool(args, built, built.chat.prefix_text(system_text), stack)
    gate = await _start_gate(pool, gate_cfg, rule, Path(cfg.cache_dir or args.data_dir) / "gate")
    tools = _tools(built, peers)
    scan = _project_paths(built)
    agent = _agent(args, coord, built, pool, tools, system_text, scan.files)
    base = args.public_url or f"http://{args.host}:{args.port}"
    print(f"agent card: {base}/.well-known/agent-card.json  (Ctrl-C to stop)", file=sys.stderr)
    print(f"dashboard: {base}/dashboard", file=sys.stderr)
    return _app_parts(args, built, pool, gate, tools, system_text, agent, scan)


def _open_peers(args: argparse.Namespace, coord: CoordinatorConfig,
                stack: AsyncExitStack) -> PeerClient | None:
    """The client of ``--peer`` agents (None without one), closed on ``stack``."""
    if not args.peer:
        return None
    from mesh.a2a.push import make_push_url_validator
    from mesh.fleet.peers import PeerClient

    peers = PeerClient(args.peer, tokens=peer_tokens(args.peer), origin=coord.name,
                       url_validator=make_push_url_validator(args.allow_private_push))
    stack.push_async_callback(peers.aclose)
    return peers


def _tools(built: ProjectPrefix, peers: PeerClient | None) -> dict[str, Any]:
    """The workers' tools: the project's, and ``delegate`` when there are peers."""
    from mesh.worker.tools import ProjectTools, delegate_tool

    tools: dict[str, Any] = dict(ProjectTools(built.project).as_tools())
    if peers is not None:
        tools["delegate"] = delegate_tool(peers.send)
    return tools


def _agent(args: argparse.Namespace, coord: CoordinatorConfig, built: ProjectPrefix,
           pool: Any, tools: dict[str, Any], system_text: str,
           files: tuple[str, ...]) -> Agent:
    """The planning agent, its plan style and actions printed."""
    from mesh.agent.task import Agent, AgentConfig
    from mesh.worker.text import template_texts

    info, chat = pool.info, built.chat
    style = plan_style(args.plan_style, info.n_params)
    actions = args.plan_actions or default_plan_actions(style)
    print(f"planner: {coord.plan}, {style} plans ({', '.join(actions)})"
          + ("; workers' first turn must call a tool" if args.first_turn == "call" else "")
          + (f"; {info.n_params / 1e6:.0f}M parameters" if info.n_params else ""),
          file=sys.stderr)
    config = AgentConfig(plan=coord.plan, max_subtasks=min(4, coord.max_subtasks),
                         text_max=160, actions=actions, style=style,
                         files=files, tools=tuple(sorted(tools)),
                         instructions=tuple(template_texts(built.template)))
    # planner and synthesis turns in the model's own chat format
    return Agent(pool, config, render=lambda prompt: chat.continuation(
        system_text, [{"role": "user", "content": prompt}]))


def _app_parts(args: argparse.Namespace, built: ProjectPrefix, pool: Any, gate: FloorGate,
               tools: dict[str, Any], system_text: str, agent: Agent,
               scan: ProjectScan) -> AppParts:
    """The workers, the session, OpenAI and dashboard routes, and the agent, as the app
    takes them."""
    from mesh.a2a.app import AppParts
    from mesh.a2a.store import TaskBoard
    from mesh.api.dashboard import DashboardHistory, dashboard_routes
    from mesh.api.openai_api import OpenAIAPI
    from mesh.api.sessions import SessionAPI, api_routes
    from mesh.worker.dispatch import DispatchWorker
    from mesh.worker.grammar import ProjectPaths

    template, chat = built.template, built.chat
    board = TaskBoard()
    history = DashboardHistory(gate)  # the dashboard's last 5 minutes
    sessions = SessionAPI(pool, gate, idle_s=args.session_idle_s)
    paths = ProjectPaths.of(scan.files, scan.dirs)
    openai_api = OpenAIAPI(pool, gate, chat, system_text, tokenize=pool.tokenize)
    return AppParts(
        worker_factory=lambda: DispatchWorker(pool, template, tools, chat,
                                              simulation=args.simulation,
                                              paths=paths, first_call=args.first_turn == "call"),
        admission=gate,
        pool_info=pool.info,
        extra_routes=[*api_routes(pool, gate, sessions),
                      *dashboard_routes(gate, tasks=board, history=history),
                      *openai_api.routes],
        skills=[s.model_dump() for s in template.manifest.skills],
        task_board=board,
        on_startup=[history.start],
        on_shutdown=[sessions.aclose, openai_api.aclose, history.aclose],
        agent=agent,
    )
