"""The engine's shape: three places for a step, one owner per piece of state, a few whole
modules (a module per concept, however long; issue 45) and a small pool class. Checked on
the source and on a started tiny pool."""

from __future__ import annotations

import ast
import asyncio
import inspect
from pathlib import Path
from types import MappingProxyType

import pytest

from mesh.engine.pool import SharedKVPool
from tests.engine.test_pool import make_pool, run, tokens_of

ENGINE = Path(__file__).resolve().parents[2] / "mesh" / "engine"
MAX_MODULES = 15
# The Engine protocol's members plus start and the engine-thread seam (call, parts, the
# session's append/turn/park/detach); test and bench tools (held_steps) live beside the class.
MAX_POOL_MEMBERS = 20


def test_the_engine_is_at_most_15_whole_modules_and_re_exports_nothing() -> None:
    modules = sorted(p.relative_to(ENGINE).as_posix() for p in ENGINE.rglob("*.py"))
    assert len(modules) <= MAX_MODULES, f"merge by concept: {modules}"
    init = ast.parse((ENGINE / "__init__.py").read_text(encoding="utf-8"))
    assert all(isinstance(n, ast.Expr) for n in init.body), "mesh.engine re-exports nothing"


def test_the_pool_class_has_at_most_20_members() -> None:
    tree = ast.parse(inspect.getsource(SharedKVPool))
    cls = tree.body[0]
    assert isinstance(cls, ast.ClassDef)
    members = [n.name for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    members += [t.id for n in cls.body if isinstance(n, ast.Assign)
                for t in n.targets if isinstance(t, ast.Name)]  # x = property(...)
    assert len(members) <= MAX_POOL_MEMBERS, members


def _writes_of(name: str) -> list[str]:
    """``file:line`` of every ``X.name[k] = v``, ``del X.name[k]`` or mutating call
    (append, extend, pop, clear, update) on ``X.name`` in mesh/engine (X any expression)."""
    found: list[str] = []
    for path in ENGINE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign | ast.Delete):  # X.name[k] = v, del X.name[k]
                targets = [t.value for t in node.targets if isinstance(t, ast.Subscript)]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in ("append", "extend", "pop", "clear", "update"):
                targets = [node.func.value]
            for t in targets:
                if isinstance(t, ast.Attribute) and t.attr == name:
                    found.append(f"{path.relative_to(ENGINE).as_posix()}:{t.lineno}")
    return found


@pytest.mark.parametrize(("field", "owner"), [("_sessions", "registry.py"),
                                              ("_outbox", "turns.py")])
def test_one_module_writes_the_sessions_dict_and_the_outbox(field: str, owner: str) -> None:
    writers = {w.split(":")[0] for w in _writes_of(field)}
    assert writers == {owner}, _writes_of(field)


def test_the_runner_reads_the_sessions_through_a_read_only_view(
    tiny_model_path: Path,
) -> None:
    async def body() -> None:
        pool = await make_pool(tiny_model_path, max_sessions=2)
        try:
            a = await pool.attach()
            await tokens_of(a, "hello")
            view = pool.parts.scheduler.registry.resident()
            assert isinstance(view, MappingProxyType)
            assert dict(view) == {a.seq_id: a.state}
            with pytest.raises(TypeError):
                view[99] = a.state  # type: ignore[index]
            # The items of a finished turn were taken: the outbox started over.
            assert await pool.call(pool.parts.scheduler.take_items) == []
            await asyncio.wait_for(a.detach(), 10)
            assert dict(view) == {}
        finally:
            await pool.aclose()

    run(body())
