"""The drop-in prefix rule (issue 29 part 1 a), on chat formats with and without room for
a second system turn: pure rendering, no model."""

from __future__ import annotations

import pytest

from mesh.api.openai_api import Bad, Prompter, is_strict
from mesh.template.chat import ChatFormat

POOL = "You are one agent of a team."

# ChatML (SmolLM2's shape): any number of system turns.
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Gemma 3's shape: the system text goes into the first user turn, and the rest must
# alternate user/assistant (a second system turn raises).
GEMMA = (
    "{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\n\n' %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set first = '' %}"
    "{% set loop_messages = messages %}{% endif %}"
    "{% for m in loop_messages %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ (first if loop.first else '') + m['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def prompter(template: str | None) -> Prompter:
    chat = ChatFormat.plain() if template is None else ChatFormat(template, name="t")
    return Prompter(chat, POOL, lambda text: list(text.encode()))


@pytest.mark.parametrize("template", [None, CHATML, GEMMA])
def test_messages_without_the_pool_system_text_follow_it(template: str | None) -> None:
    p = prompter(template)
    bare = p.chat_rest([{"role": "user", "content": "hi"}], strict=False)
    # Same as a client that sent the pool's system message itself.
    assert bare == p.chat_rest([{"role": "system", "content": POOL},
                                {"role": "user", "content": "hi"}], strict=True)
    own = p.chat_rest([{"role": "system", "content": "Be terse."},
                       {"role": "user", "content": "hi"}], strict=False)
    assert "Be terse." in own and own.index("Be terse.") < own.index("hi")
    assert POOL not in own  # the pool's text is in the prefix, once
    with pytest.raises(Bad) as info:
        p.chat_rest([{"role": "system", "content": "Be terse."},
                     {"role": "user", "content": "hi"}], strict=True)
    assert info.value.code == "prefix_mismatch" and "differ at token" in info.value.message


def test_chatml_client_system_text_leads_the_first_user_turn() -> None:
    """ChatML's prefix ends inside the first user turn (``<|im_start|>user\n``), as every
    format's does, so a client's system text cannot be a turn of its own: it leads the
    user's."""
    own = prompter(CHATML).chat_rest([{"role": "system", "content": "Be terse."},
                                      {"role": "user", "content": "hi"}], strict=False)
    assert own == "Be terse.\n\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_gemma_folds_the_client_system_text_into_the_next_user_turn() -> None:
    own = prompter(GEMMA).chat_rest([{"role": "system", "content": "Be terse."},
                                     {"role": "user", "content": "hi"},
                                     {"role": "assistant", "content": "yes"},
                                     {"role": "system", "content": "Now in French."}],
                                    strict=False)
    assert own.startswith("Be terse.\n\nhi<end_of_turn>")
    assert own.endswith("<start_of_turn>user\nNow in French.<end_of_turn>\n"
                        "<start_of_turn>model\n")


def test_completion_prompts() -> None:
    p = prompter(None)
    assert p.completion_rest("def add(", strict=False) == "def add("
    assert p.completion_rest(p.prefix + "more", strict=False) == "more"
    with pytest.raises(Bad, match="differ at token"):
        p.completion_rest("def add(", strict=True)


def test_strict_by_model_name_or_by_default() -> None:
    assert is_strict("SmolLM2:strict", False) and is_strict("x", True)
    assert not is_strict("SmolLM2", False) and not is_strict("strict", False)
