"""The shared KV pool on real llama.cpp, with the tiny random-weight models."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from mesh.engine.config import EngineConfig, SamplingParams
from mesh.engine.interface import ContextOverflow, PoolFull, SessionFailed, SessionState
from mesh.engine.llama import Batch, LlamaContext, LlamaModel
from mesh.engine.pool import SharedKVPool, held_steps
from mesh.engine.session import PooledSession

PREFIX = "The shared project prefix: tools, files and notes for every agent. " * 6
GREEDY = SamplingParams(max_tokens=12, stop_at_eos=False)


def run(coro: Awaitable[Any]) -> Any:
    async def main() -> Any:
        return await coro

    return asyncio.run(main())


async def make_pool(model: Path, **kw: Any) -> SharedKVPool:
    settings: dict[str, Any] = {"max_sessions": 16, "session_budget": 128, "n_threads": 1}
    settings.update(kw)
    pool = SharedKVPool(EngineConfig(model_path=str(model), **settings), PREFIX)
    await pool.start()
    return pool


async def tokens_of(
    session: PooledSession, text: str, params: SamplingParams = GREEDY
) -> list[int]:
    session.append(text)
    gen = session.generate(params)
    return [p.token async for p in gen]


async def check_cells(pool: SharedKVPool) -> None:
    """The pool's accounting equals llama.cpp's own view of every sequence."""
    load = pool.load()
    prefix = pool.info.prefix_tokens
    assert load.cells_used == prefix + sum(s.private_cells for s in load.sessions)
    ranges = await pool.call(pool.parts.seq_pos_ranges)
    prefix_lo, prefix_hi = ranges[0]
    assert prefix_hi == prefix - 1
    # 0 after a prefill; after a warm start of an iSWA model, the window's first position.
    assert prefix_lo == 0 or pool.info.warm_started
    by_seq = {st.seq: st for st in pool.parts.scheduler.registry.resident().values()}
    for seq, (lo, hi) in ranges.items():
        if seq == 0:
            continue
        assert lo == prefix_lo, "every session starts with the shared prefix"
        assert hi - prefix + 1 == by_seq[seq].private
    census = await pool.call(pool.parts.cell_census)
    assert census is not None, "llama.cpp's serialized cache could not be parsed"
    assert census.cells == load.cells_used
    if pool.config.share_prefix and not pool.info.warm_started:
        assert census.seq_refs == load.naive_cells + prefix  # + the prefix's own sequence


@pytest.mark.parametrize("n", [1, 2, 5, 16])
def test_cells_equal_prefix_plus_suffixes_at_every_turn(tiny_model_path: Path, n: int) -> None:
    async def body() -> None:
        pool = await make_pool(tiny_model_path)
        try:
            sessions = [await pool.attach() for _ in range(n)]
            await check_cells(pool)
            for round_ in range(2):
                await asyncio.gather(*(tokens_of(s, f"task {i} round {round_}: go")
                                       for i, s in enumerate(sessions)))
                await check_cells(pool)
            load = pool.load()
            assert len(load.sessions) == n
            assert load.naive_cells == load.cells_used + (n - 1) * pool.info.prefix_tokens
            if n > 1:
                assert load.reduction > 1.0
        finally:
            await pool.aclose()

    run(body())


def test_detach_frees_exactly_the_private_cells(tiny_model_path: Path) -> None:
    async def body() -> None:
        pool = await make_pool(tiny_model_path)
        try:
            a, b = await pool.attach(), await pool.attach()
            await tokens_of(a, "alpha beta gamma")
            await tokens_of(b, "delta")
            before = pool.load()
            private_a = next(s.private_cells for s in before.sessions if s.id == a.id)
            assert private_a > 0
            await a.detach()
            after = pool.load()
            assert after.cells_used == before.cells_used - private_a
            assert [s.id for s in after.sessions] == [b.id]
            ranges = await pool.call(pool.parts.seq_pos_ranges)
            assert a.seq_id not in ranges
            assert pool.parts.built.ctx.seq_pos_range(a.seq_id) == (-1, -1)
            await check_cells(pool)
            await a.detach()  # idempotent
            with pytest.raises(SessionFailed):
                a.append("more")
        finally:
            await pool.aclose()

    run(body())


def test_session_after_others_matches_running_alone(tiny_model_path: Path) -> None:
    async def body() -> tuple[list[int], list[int]]:
        pool = await make_pool(tiny_model_path)
        try:
            others = [await pool.attach() for _ in range(3)]
            await asyncio.gather(*(tokens_of(s, f"other {i}") for i, s in enumerate(others)))
            for s in others:
                await s.detach()
            late = await pool.attach()  # reuses a freed sequence id and freed cells
            after_others = await tokens_of(late, "the same question")
        finally:
            await pool.aclose()
        fresh = await make_pool(tiny_model_path)
        try:
            alone = await tokens_of(await fresh.attach(), "the same question")
        finally:
            await fresh.aclose()
        return after_others, alone

    after_others, alone = run(body())
    assert len(alone) == GREEDY.max_tokens
    assert after_others == alone


def _from_scratch(model_path: Path, prompt_tokens: list[int], n: int) -> list[int]:
    """Greedy generation on a fresh single-sequence context, no pool involved."""
    import numpy as np

    model = LlamaModel(model_path)
    ctx = LlamaContext(model, n_ctx=1024, n_seq_max=1, n_batch=512, n_outputs_max=1,
                       n_threads=1, swa_full=True)
    batch = Batch(512)
    try:
        for i, tok in enumerate(prompt_tokens):
            batch.add(tok, i, 0, i == len(prompt_tokens) - 1)
        assert ctx.decode(batch) == 0
        out: list[int] = []
        pos = len(prompt_tokens)
        row = batch.n_tokens - 1
        for _ in range(n):
            tok = int(np.argmax(ctx.logits_row(row)))
            out.append(tok)
            batch.clear()
            batch.add(tok, pos, 0, True)
            pos += 1
            row = 0
            assert ctx.decode(batch) == 0
        return out
    finally:
        batch.close()
        ctx.close()
        model.close()


@pytest.mark.parametrize("variant", ["llama", "gemma3"])
def test_one_pooled_session_equals_from_scratch(
    tiny_model_path: Path, tiny_gemma3_path: Path, variant: str
) -> None:
    path = tiny_model_path if variant == "llama" else tiny_gemma3_path

    async def body() -> tuple[list[int], list[int]]:
        pool = await make_pool(path, prefill_chunk=512)
        try:
            s = await pool.attach()
            prompt = pool.parts.built.prefix + pool.tokenize("one question")
            return await tokens_of(s, "one question"), prompt
        finally:
            await pool.aclose()

    pooled, prompt = run(body())
    assert pooled == _from_scratch(path, prompt, GREEDY.max_tokens)


async def _sampled_run(model: Path) -> list[list[int]]:
    pool = await make_pool(model, seed=7)
    try:
        sessions = [await pool.attach() for _ in range(4)]
        params = SamplingParams(max_tokens=10, temperature=0.9, top_k=40, top_p=0.95,
                                stop_at_eos=False)
        gens = []
        async with held_steps(pool):  # every turn starts in the same step: same schedule
            for i, s in enumerate(sessions):
                s.append(f"session {i} says")
                g = s.generate(params)
                await g.start()
                gens.append(g)

        async def drain(g: Any) -> list[int]:
            return [p.token async for p in g]

        return list(await asyncio.gather(*(drain(g) for g in gens)))
    finally:
        await pool.aclose()


def test_pooled_runs_are_deterministic_for_same_seed_and_schedule(tiny_model_path: Path) -> None:
    first = run(_sampled_run(tiny_model_path))
    second = run(_sampled_run(tiny_model_path))
    assert first == second
    assert len({tuple(t) for t in first}) > 1, "different sessions draw different tokens"


def test_warm_started_pool_generates_what_the_original_did(
    tiny_gemma3_path: Path, tmp_path: Path
) -> None:
    async def body() -> None:
        cold = await make_pool(tiny_gemma3_path, cache_dir=str(tmp_path))
        try:
            assert not cold.info.warm_started
            want = await tokens_of(await cold.attach(), "continue")
        finally:
            await cold.aclose()
        assert list(tmp_path.glob("prefix-*.kv")), "the prefix snapshot was saved"
        warm = await make_pool(tiny_gemma3_path, cache_dir=str(tmp_path))
        try:
            assert warm.info.warm_started
            assert warm.info.prefix_hash == cold.info.prefix_hash
            assert await tokens_of(await warm.attach(), "continue") == want
            await check_cells(warm)
        finally:
            await warm.aclose()

    run(body())


def test_corrupt_snapshot_is_rebuilt(tiny_model_path: Path, tmp_path: Path) -> None:
    async def body() -> None:
        pool = await make_pool(tiny_model_path, cache_dir=str(tmp_path))
        await pool.aclose()
        (snap,) = tmp_path.glob("prefix-*.kv")
        snap.write_bytes(b"garbage")
        again = await make_pool(tiny_model_path, cache_dir=str(tmp_path))
        try:
            assert not again.info.warm_started
            await check_cells(again)
        finally:
            await again.aclose()

    run(body())


def test_attach_beyond_max_sessions_is_refused_with_reason(tiny_model_path: Path) -> None:
    async def body() -> None:  # max_attached = max_sessions: no parking
        pool = await make_pool(tiny_model_path, max_sessions=2, max_attached=2)
        try:
            await pool.attach()
            await pool.attach()
            check = pool.check_attach()
            assert not check.ok and "2 session slots" in check.reason
            with pytest.raises(PoolFull, match="session slots are in use"):
                await pool.attach()
        finally:
            await pool.aclose()

    run(body())


def test_context_budget_is_a_clear_error_not_a_crash(tiny_model_path: Path) -> None:
    async def body() -> None:
        pool = await make_pool(tiny_model_path, session_budget=24)
        try:
            s = await pool.attach()
            with pytest.raises(ContextOverflow, match=r"suffix tokens"):
                s.append("word " * 100)
            s.append("short")
            gen = s.generate(SamplingParams(max_tokens=100, stop_at_eos=False))
            _ = [p async for p in gen]
            assert gen.result is not None and gen.result.finish_reason == "context_full"
            await check_cells(pool)
            with pytest.raises(ContextOverflow):
                s.append("word " * 30)
        finally:
            await pool.aclose()

    run(body())


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        ({"max_sessions": 0}, "max_sessions"),
        ({"max_sessions": 300, "n_batch": 512}, "limit of 255"),
        ({"session_budget": 4}, "session_budget"),
        ({"n_batch": 8, "max_sessions": 16}, "n_batch"),
        ({"model_path": ""}, "--model"),
    ],
)
def test_bad_engine_config_is_a_clear_error(tiny_model_path: Path, kw: dict[str, Any],
                                            msg: str) -> None:
    cfg: dict[str, Any] = {"model_path": str(tiny_model_path), **kw}
    with pytest.raises(ValueError, match=msg):
        SharedKVPool(EngineConfig(**cfg), PREFIX)


def test_bad_sampling_params_are_refused(tiny_model_path: Path) -> None:
    async def body() -> None:
        pool = await make_pool(tiny_model_path)
        try:
            s = await pool.attach()
            for bad in (SamplingParams(max_tokens=0), SamplingParams(temperature=-1),
                        SamplingParams(top_p=0), SamplingParams(stop=("",))):
                with pytest.raises(ValueError):
                    s.generate(bad)
            with pytest.raises(ValueError, match="append text first"):
                _ = [p async for p in s.generate(GREEDY)]
        finally:
            await pool.aclose()

    run(body())


def test_stop_strings_end_the_turn_and_trim_the_text(tiny_model_path: Path) -> None:
    async def body() -> None:
        pool = await make_pool(tiny_model_path)
        try:
            s = await pool.attach()
            free = await tokens_of(s, "ab")
            s2 = await pool.attach()
            s2.append("ab")
            g = s2.generate(GREEDY)
            text = "".join([p.text async for p in g])
            assert g.result is not None and text == g.result.text and len(free) == 12
            stop = text[len(text) // 2 : len(text) // 2 + 1]
            if not stop.strip():
                pytest.skip("random model produced whitespace only")
            s3 = await pool.attach()
            s3.append("ab")
            g3 = s3.generate(SamplingParams(max_tokens=12, stop=(stop,), stop_at_eos=False))
            text3 = "".join([p.text async for p in g3])
            assert g3.result is not None and g3.result.finish_reason == "stop"
            assert stop not in text3 and text.startswith(text3)
        finally:
            await pool.aclose()

    run(body())


def test_failed_decode_fails_its_sessions_and_the_pool_goes_on(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def body() -> None:
        # The Python step calls ctx.decode (tests/engine/test_native.py fails the native one).
        pool = await make_pool(tiny_model_path, native=False)
        try:
            s = await pool.attach()
            assert pool.parts.built.ctx is not None
            real = pool.parts.built.ctx.decode
            calls = {"n": 0}

            def failing(batch: Batch) -> int:
                calls["n"] += 1
                return 1 if calls["n"] == 1 else real(batch)

            monkeypatch.setattr(pool.parts.built.ctx, "decode", failing)
            s.append("doomed")
            with pytest.raises(SessionFailed, match="no KV slot"):
                _ = [p async for p in s.generate(GREEDY)]
            assert pool.load().sessions == ()
            await check_cells(pool)
            ok = await pool.attach()
            assert len(await tokens_of(ok, "fine")) == GREEDY.max_tokens
        finally:
            await pool.aclose()

    run(body())


def test_closing_a_generation_early_keeps_the_session_usable(tiny_model_path: Path) -> None:
    async def body() -> None:
        pool = await make_pool(tiny_model_path)
        try:
            s = await pool.attach()
            s.append("start")
            gen = s.generate(SamplingParams(max_tokens=100, stop_at_eos=False))
            seen = 0
            async for _ in gen:
                seen += 1
                if seen == 3:
                    break
            await gen.aclose()
            for _ in range(50):
                if pool.load().sessions[0].state is SessionState.IDLE:
                    break
                await asyncio.sleep(0.01)
            assert pool.load().sessions[0].state is SessionState.IDLE
            assert len(await tokens_of(s, " next")) == GREEDY.max_tokens
            await check_cells(pool)
        finally:
            await pool.aclose()

    run(body())


def test_load_snapshot_reports_states_and_rates(tiny_model_path: Path) -> None:
    async def body() -> None:
        pool = await make_pool(tiny_model_path)
        try:
            a, b = await pool.attach(), await pool.attach()
            await asyncio.gather(tokens_of(a, "x"), tokens_of(b, "y"))
            load = pool.load()
            assert load.count(SessionState.IDLE) == 2
            assert all(s.decode_tps and s.decode_tps > 0 for s in load.sessions)
            assert all(s.num_generated == GREEDY.max_tokens for s in load.sessions)
            assert load.step_ms is not None and load.step_ms > 0
            assert load.recent_steps and max(s.num_decode for s in load.recent_steps) == 2
            assert load.free_seq_ids == 14
        finally:
            await pool.aclose()

    run(body())


def test_missing_model_names_the_fix(tmp_path: Path) -> None:
    from mesh.engine.interface import ModelError

    cfg = EngineConfig(model_path=str(tmp_path / "nope.gguf"))

    async def body(fn: Callable[[], Awaitable[Any]]) -> Any:
        return await fn()

    pool = SharedKVPool(cfg, PREFIX)
    with pytest.raises(ModelError, match="pass --model PATH or set MESH_MODEL"):
        run(body(pool.start))


def test_naive_baseline_holds_a_private_prefix_per_session(tiny_model_path: Path) -> None:
    async def body() -> None:
        shared = await make_pool(tiny_model_path)
        naive = await make_pool(tiny_model_path, share_prefix=False)
        try:
            outs = []
            for pool in (shared, naive):
                first = await pool.attach()
                outs.append(await tokens_of(first, "same input"))  # alone in its steps
                for _ in range(2):
                    await tokens_of(await pool.attach(), "other")
            p = shared.info.prefix_tokens
            s_load, n_load = shared.load(), naive.load()
            assert s_load.prefix_cells == p and n_load.prefix_cells == 0
            assert n_load.cells_used == s_load.cells_used + 2 * p
            assert n_load.cells_used == n_load.naive_cells == s_load.naive_cells
            assert n_load.reduction == 1.0 and s_load.reduction > 1.0
            ranges = await naive.call(naive.parts.seq_pos_ranges)
            assert all(hi >= p - 1 for seq, (lo, hi) in ranges.items() if seq != 0)
            assert outs[0] == outs[1], "one session alone in its step: same greedy tokens"
        finally:
            await shared.aclose()
            await naive.aclose()

    run(body())
