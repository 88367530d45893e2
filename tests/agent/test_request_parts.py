"""A request's parts: the questions and clauses guided planning gives one subtask each."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mesh.agent.plans import request_parts


@pytest.mark.parametrize(("message", "parts"), [
    ("In which file is the parcel weight checked, and what happens to a parcel of 40 kg?",
     ("In which file is the parcel weight checked?", "What happens to a parcel of 40 kg?")),
    ("Which function in routes.py does dispatch() call, which module defines the Parcel "
     "class, and what does a Parcel raise for a weight of 40 kg?",
     ("Which function in routes.py does dispatch() call?",
      "Which module defines the Parcel class?",
      "What does a Parcel raise for a weight of 40 kg?")),
    ("Which file defines the shared KV pool?", ("Which file defines the shared KV pool?",)),
    ("List the files. Then explain what routes.py does; and which test covers it",
     ("List the files.", "Then explain what routes.py does.", "And which test covers it.")),
    ("what is MAX_WEIGHT and how is it used", ("What is MAX_WEIGHT.", "How is it used.")),
    # short clauses join a neighbour, with the words between them kept
    ("Where, and why?", ("Where, and why?",)),
    ("Tell me, what is the limit", ("Tell me, what is the limit.",)),
    # a comma before a verb is not a new question
    ("In parcels.py, does Parcel raise?", ("In parcels.py, does Parcel raise?",)),
    ("  \n\t ", ()),
    ("a\x00b c\nd?", ("A b c d?",)),
])
def test_parts(message: str, parts: tuple[str, ...]) -> None:
    assert request_parts(message, 4) == parts


def test_parts_past_the_limit_join_the_last() -> None:
    message = "Who wrote it? Where is it? Which test runs it? What does it raise?"
    assert request_parts(message, 2) == ("Who wrote it?",
                                         "Where is it? Which test runs it? What does it raise?")
    assert request_parts(message, 1) == (" ".join(message.split()),)
    with pytest.raises(ValueError, match="max_parts"):
        request_parts(message, 0)


_SEPARATORS = {"and", "or", "then", "also"}


@given(st.text(alphabet=st.sampled_from(list("abc WHwhat,;.?!and")), max_size=80),
       st.integers(1, 5))
def test_parts_keep_every_word_in_order(message: str, max_parts: int) -> None:
    parts = request_parts(message, max_parts)
    assert len(parts) <= max_parts
    assert all(p and p[-1] in ".?!" for p in parts)

    def words(text: str) -> list[str]:
        return [w for w in re.findall(r"[A-Za-z]+", text.lower()) if w not in _SEPARATORS]

    assert words(" ".join(parts)) == words(message)
