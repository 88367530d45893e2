"""Seeding the throughput model at start-up: a short probe, cached per model and machine.

This is the gate's only module with I/O (the engine and one small JSON file); the model
itself stays pure. A seed is a handful of :class:`StepSample`s; :meth:`ThroughputModel.seed`
keeps them for good, so the model can tell fixed cost from per-session cost even before
the pool has seen varied load.

``mesh serve`` seeds from :func:`quick_probe` (a few steps at 1, 2 and 4 sessions: about a
second on the default model on a quiet 2-core machine), and the model learns
the rest online from the pool's own steps, whose live samples soon outweigh the seed; the
model's prior fills in what the probe cannot tell apart. :func:`micro_benchmark` with its
defaults (1 to 16 sessions, 512 private tokens each: a minute or more on a CPU) is the full
measurement ``bench/gate_bench.py`` uses and ``seed_model(..., full=True)`` asks for.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
from collections.abc import Callable, Sequence
from pathlib import Path

import anyio

from mesh.engine.config import SamplingParams
from mesh.engine.interface import Engine, PoolInfo, Session, StepSample
from mesh.gate.model import ThroughputModel

__all__ = ["QUICK_PRIVATE_TOKENS", "QUICK_SIZES", "QUICK_TOKENS", "SeedError", "load_seed",
           "micro_benchmark", "quick_probe", "read_seed", "save_seed", "seed_model",
           "seed_path"]

# 2: sizes up to 16 (a fit on 1, 2, 4 under-estimated the slope at 8+); 3: cells_used, and
# each size also run with private text held (the rows × cells term). A quick probe's seed
# has the same schema (fewer samples), so a full benchmark cached earlier is still read.
_FORMAT = 3

# The start-up probe: 3 sizes × 6 steps (plus each size's prefill step of a few tokens).
# Small on purpose: the slope at 8+ sessions and the cells terms come from the prior, then
# from live steps. No private text: on SmolLM2 (2 busy cores) prefilling 96 private tokens
# per session cost 19 of the probe's 23 s, for a cells term it barely identified.
QUICK_SIZES = (1, 2, 4)
QUICK_TOKENS = 6
QUICK_PRIVATE_TOKENS = (0,)


class SeedError(ValueError):
    """A cached seed exists but cannot be used; the message says why."""


def seed_path(cache_dir: str | os.PathLike[str], info: PoolInfo) -> Path:
    """Where the seed for this model on this machine lives."""
    key = json.dumps(
        {
            "format": _FORMAT,
            "model": info.model_name,
            "model_path": os.path.basename(info.model_path),
            "n_vocab": info.n_vocab,
            "machine": platform.machine(),
            "processor": platform.processor(),
            "node": platform.node(),
            "cpus": os.cpu_count(),
        },
        sort_keys=True,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(cache_dir) / f"gate-seed-{digest}.json"


def read_seed(path: Path) -> tuple[StepSample, ...] | None:
    """The cached samples; None if there is no file; :class:`SeedError` if the file is
    there but unreadable, of another format, or holds no sample."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise SeedError(f"cannot read it: {exc}") from None
    try:
        raw = json.loads(text)
        if raw.get("format") != _FORMAT:
            raise SeedError(f"format {raw.get('format')!r}, this mesh reads {_FORMAT}")
        samples = tuple(
            StepSample(
                num_decode=int(s["num_decode"]),
                num_prefill_tokens=int(s["num_prefill_tokens"]),
                sum_context=int(s["sum_context"]),
                step_s=float(s["step_s"]),
                cells_used=int(s.get("cells_used", 0)),
            )
            for s in raw["samples"]
        )
    except SeedError:
        raise
    except ValueError as exc:  # json.JSONDecodeError is one
        raise SeedError(f"not valid: {exc}") from None
    except (KeyError, TypeError, AttributeError) as exc:
        raise SeedError(f"not a seed file ({type(exc).__name__}: {exc})") from None
    if not samples:
        raise SeedError("it holds no samples")
    return samples


def load_seed(path: Path) -> tuple[StepSample, ...] | None:
    """The cached samples, or None if missing or unreadable (a bad cache is ignored)."""
    try:
        return read_seed(path)
    except SeedError:
        return None


def save_seed(path: Path, samples: Sequence[StepSample]) -> None:
    """Write the samples atomically (temp file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {
        "format": _FORMAT,
        "samples": [
            {
                "num_decode": s.num_decode,
                "num_prefill_tokens": s.num_prefill_tokens,
                "sum_context": s.sum_context,
                "step_s": s.step_s,
                "cells_used": s.cells_used,
            }
            for s in samples
        ],
    }
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(body))
    os.replace(tmp, path)


async def micro_benchmark(
    engine: Engine,
    sizes: Sequence[int] = (1, 2, 4, 8, 16),
    num_tokens: int = 10,
    text: str = "Count slowly from one to twenty:",
    private_tokens: Sequence[int] = (0, 512),
) -> tuple[StepSample, ...]:
    """Run ``num_tokens`` steps with each number of sessions in ``sizes`` decoding together,
    once per entry of ``private_tokens``: each session first holds about that many tokens
    of private text (clamped to half its budget), so the fit sees step time grow with
    rows × cells used, not only with the number of rows.

    Returns the engine's own step samples taken meanwhile; an engine that reports none gets
    one synthesized sample per size (wall time / tokens). Sizes the pool cannot attach are
    skipped. Every session attached here is detached before returning.
    """
    samples: list[StepSample] = []
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, stop_at_eos=False)
    room = max(0, engine.info.session_budget // 2 - num_tokens - 32)
    for size, private in [(n, p) for p in private_tokens for n in sizes]:
        filler = " one" * min(max(private, 0), room)
        sessions: list[Session] = []
        try:
            for _ in range(size):
                if not engine.check_attach().ok:
                    break
                sessions.append(await engine.attach())
            if len(sessions) < size:
                continue
            before = engine.load().recent_steps
            last = before[-1] if before else None
            started = anyio.current_time()
            async with anyio.create_task_group() as tg:
                for s in sessions:
                    s.append(filler + " " + text if filler else text)
                    tg.start_soon(_drain, s, params)
            wall = anyio.current_time() - started
            steps = engine.load().recent_steps
            new = steps
            for i in range(len(steps) - 1, -1, -1):
                if steps[i] is last:
                    new = steps[i + 1 :]
                    break
            if new:
                samples.extend(new)
            else:
                ctx = sum(s.context_len for s in sessions)
                samples.append(StepSample(size, 0, ctx, wall / num_tokens,
                                          engine.load().cells_used))
        finally:
            with anyio.CancelScope(shield=True):
                for s in sessions:
                    await s.detach()
    return tuple(samples)


async def _drain(session: Session, params: SamplingParams) -> None:
    async for _ in session.generate(params):
        pass


async def quick_probe(engine: Engine) -> tuple[StepSample, ...]:
    """The start-up probe: :func:`micro_benchmark` at :data:`QUICK_SIZES` sessions,
    :data:`QUICK_TOKENS` steps each, with :data:`QUICK_PRIVATE_TOKENS` private text."""
    return await micro_benchmark(engine, sizes=QUICK_SIZES, num_tokens=QUICK_TOKENS,
                                 private_tokens=QUICK_PRIVATE_TOKENS)


async def seed_model(
    model: ThroughputModel,
    engine: Engine,
    cache_dir: str | os.PathLike[str] | None,
    *,
    refresh: bool = False,
    announce: Callable[[], None] | None = None,
    on_corrupt: Callable[[Path, str], None] | None = None,
    full: bool = False,
) -> str:
    """Seed ``model`` from the cache, else from a probe (then cached): :func:`quick_probe`
    (seconds), or with ``full`` the whole :func:`micro_benchmark` (a minute or more).

    ``announce`` is called just before a probe runs because there was no seed;
    ``on_corrupt(path, reason)`` instead when there was one that cannot be used (it is
    then replaced; without ``on_corrupt``, ``announce`` is called in that case too).
    Returns where the seed came from: ``"cache"`` or ``"benchmark"``.
    """
    path = seed_path(cache_dir, engine.info) if cache_dir is not None else None
    corrupt: str | None = None
    if path is not None and not refresh:
        try:
            cached = read_seed(path)
        except SeedError as exc:
            cached, corrupt = None, str(exc)
        if cached:
            model.seed(cached)
            return "cache"
    if corrupt is not None and path is not None and on_corrupt is not None:
        on_corrupt(path, corrupt)
    elif announce is not None:
        announce()
    samples = await (micro_benchmark(engine) if full else quick_probe(engine))
    model.seed(samples)
    if path is not None and samples:
        # A read-only cache only costs the next start another probe.
        with contextlib.suppress(OSError):
            save_seed(path, samples)
    return "benchmark"
