"""The native step (native/, loaded by mesh.engine.native) against the Python step, on the
tiny model: same schedule, same tokens, greedy, seeded sampling and grammars."""

from __future__ import annotations

import asyncio
import ctypes
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mesh.engine import native
from mesh.engine.config import EngineConfig, SamplingParams
from mesh.engine.interface import EngineError, SessionFailed
from mesh.engine.pool import SharedKVPool, held_steps

PREFIX = "The shared project prefix: tools, files and notes for every agent. " * 6
LIB, WHY = native.load()
needs_lib = pytest.mark.skipif(
    LIB is None, reason=f"the native step is not built ({WHY}); run python -m native.build")


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def make_pool(model: Path, use_native: bool, **kw: Any) -> SharedKVPool:
    settings: dict[str, Any] = {"max_sessions": 16, "session_budget": 160, "n_threads": 1,
                                "seed": 11}
    settings.update(kw)
    pool = SharedKVPool(EngineConfig(model_path=str(model), native=use_native, **settings),
                        PREFIX)
    await pool.start()
    assert (pool.parts.runner.stepper is not None) is use_native
    return pool


async def schedule(model: Path, use_native: bool, params: list[SamplingParams],
                   threads: int = 0) -> list[tuple[list[int], str, str]]:
    """Every turn starts in the same step (one per entry of ``params``), then a second
    wave of turns joins while the first still decodes (prefill and decode rows mixed).
    ``threads``: the native step samples on that many threads (0: as it chooses)."""
    pool = await make_pool(model, use_native)
    if threads and pool.parts.runner.stepper is not None:
        pool.parts.runner.stepper.threads, pool.parts.runner.stepper.force_threads = threads, True
    try:
        sessions = [await pool.attach() for _ in params]
        half = len(params) // 2

        async def drain(g: Any) -> tuple[list[int], str, str]:
            toks = [p.token async for p in g]
            return toks, g.result.text, g.result.finish_reason

        gens = []
        async with held_steps(pool):
            for i, (s, p) in enumerate(zip(sessions[:half], params[:half], strict=True)):
                s.append(f"session {i} reads the notes and says")
                g = s.generate(p)
                await g.start()
                gens.append(g)
        first = [asyncio.ensure_future(drain(g)) for g in gens]
        await asyncio.sleep(0)
        later = []
        async with held_steps(pool):
            for i, (s, p) in enumerate(zip(sessions[half:], params[half:], strict=True)):
                s.append(f"late session {i} answers")
                g = s.generate(p)
                await g.start()
                later.append(g)
        rest = [await drain(g) for g in later]
        return [*[await f for f in first], *rest]
    finally:
        await pool.aclose()


def both(model: Path, params: list[SamplingParams]) -> list[tuple[list[int], str, str]]:
    py: list[tuple[list[int], str, str]] = run(schedule(model, False, params))
    nat: list[tuple[list[int], str, str]] = run(schedule(model, True, params))
    assert nat == py
    threaded: list[tuple[list[int], str, str]] = run(schedule(model, True, params, threads=3))
    assert threaded == py
    assert all(len(toks) > 0 for toks, _, _ in py)
    return py


@needs_lib
def test_greedy_tokens_match_the_python_step(tiny_model_path: Path) -> None:
    out = both(tiny_model_path, [SamplingParams(max_tokens=16, stop_at_eos=False)] * 8)
    assert all(len(toks) == 16 for toks, _, _ in out)


@needs_lib
def test_seeded_sampling_matches_the_python_step(tiny_model_path: Path) -> None:
    params = [SamplingParams(max_tokens=12, temperature=0.9, top_k=40, top_p=0.95,
                             stop_at_eos=False, seed=(100 + i if i % 2 else None))
              for i in range(6)]
    out = both(tiny_model_path, params)
    assert len({tuple(toks) for toks, _, _ in out}) > 1, "sessions draw different tokens"


@needs_lib
def test_grammar_and_mixed_samplers_match_the_python_step(tiny_model_path: Path) -> None:
    params = [
        SamplingParams(max_tokens=8, stop_at_eos=False, grammar='root ::= "yes" | "no"'),
        SamplingParams(max_tokens=10, stop_at_eos=False),
        SamplingParams(max_tokens=10, temperature=0.7, seed=5, stop_at_eos=False,
                       grammar='root ::= "a" "b"+ "c"'),
        SamplingParams(max_tokens=10, temperature=1.2, top_k=5, seed=9, stop_at_eos=False),
    ]
    out = both(tiny_model_path, params)
    assert out[0][1] in ("yes", "no") and out[0][2] == "stop"
    assert out[2][1].startswith("ab")


@needs_lib
def test_failed_native_decode_fails_its_sessions_and_the_pool_goes_on(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def body() -> None:
        pool = await make_pool(tiny_model_path, True)
        try:
            stepper = pool.parts.runner.stepper
            assert stepper is not None
            real = stepper.step
            calls = {"n": 0}

            def failing(*args: Any) -> tuple[int, list[int], float]:
                calls["n"] += 1
                return (1, [], 0.0) if calls["n"] == 1 else real(*args)

            monkeypatch.setattr(stepper, "step", failing)
            s = await pool.attach()
            s.append("doomed")
            with pytest.raises(SessionFailed, match="no KV slot"):
                _ = [p async for p in s.generate(SamplingParams(max_tokens=4))]
            assert pool.load().sessions == ()
            ok = await pool.attach()
            ok.append("fine")
            toks = [p.token async for p in ok.generate(SamplingParams(max_tokens=5,
                                                                       stop_at_eos=False))]
            assert len(toks) == 5
        finally:
            await pool.aclose()

    run(body())


def test_missing_library_is_an_error_when_asked_for_and_one_line_in_auto(
    tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("MESH_NATIVE_LIB", str(tmp_path / "absent.so"))
    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setattr(native, "_told", False)
    with pytest.raises(EngineError, match=r"python -m native\.build"):
        native.resolve(True)
    assert native.resolve(False) is None
    assert native.resolve(None) is None
    assert native.resolve(None) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "using the Python step" in err[0] and "absent.so" in err[0]

    async def body() -> None:
        pool = SharedKVPool(EngineConfig(model_path=str(tiny_model_path), max_sessions=2,
                                         session_budget=64, n_threads=1), PREFIX)
        await pool.start()
        try:
            assert pool.parts.runner.stepper is None
            s = await pool.attach()
            s.append("still works")
            toks = [p.token async for p in s.generate(SamplingParams(max_tokens=3,
                                                                      stop_at_eos=False))]
            assert len(toks) == 3
        finally:
            await pool.aclose()

    run(body())


def test_a_stale_build_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lib = tmp_path / "libmesh_native.so"
    lib.write_bytes(b"not a library")
    lib.with_suffix(".json").write_text('{"llama_cpp_python": "0.0.1"}')
    monkeypatch.setenv("MESH_NATIVE_LIB", str(lib))
    monkeypatch.setattr(native, "_loaded", None)
    found, why = native.load()
    assert found is None and "built for llama-cpp-python 0.0.1" in why


@needs_lib
@pytest.mark.parametrize("n", [1, 7, 8, 33, 100, 129, 1000, 262_144])
def test_native_argmax_agrees_with_numpy_ties_included(n: int) -> None:
    assert LIB is not None
    rng = np.random.default_rng(n)
    for trial in range(20):
        row = rng.integers(-5, 5, size=n).astype(np.float32)  # many ties
        if trial % 4 == 0:
            row = rng.standard_normal(n).astype(np.float32)
        if trial == 1:
            row[-1] = 100.0  # the maximum in the scalar tail
        ptr = row.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        assert LIB.mesh_argmax(ptr, n) == int(np.argmax(row))


def test_batch_rows_in_one_call_equal_rows_one_by_one() -> None:
    """The decode rows go in with one ``add_rows``; the batch must read as if each row had
    been added alone (indices, logits flags, output count, highest sequence id), and a
    batch that would overflow is refused before anything is written."""
    from mesh.engine.native import NativeBatch

    one, many = NativeBatch(8), NativeBatch(8)
    rows = [(11, 5, 3), (12, 9, 7), (13, 2, 1)]
    idx = [one.add(t, p, s, True) for t, p, s in rows]
    one.add(99, 10, 2, False)
    first = many.add_rows([t for t, _, _ in rows], [p for _, p, _ in rows],
                          [s for _, _, s in rows])
    many.add(99, 10, 2, False)
    assert [first + i for i in range(3)] == idx == [0, 1, 2]
    for field in ("tokens", "pos", "seq", "logits", "n_outputs", "max_seq"):
        assert getattr(many, field) == getattr(one, field), field
    with pytest.raises(ValueError, match="batch is full"):
        many.add_rows([1] * 5, [0] * 5, [1] * 5)
    assert many.n_tokens == 4
