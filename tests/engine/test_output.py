"""The turn output unit alone: incremental UTF-8, held-back stop prefixes, exact cuts."""

from __future__ import annotations

import pytest

from mesh.engine.session import TurnOutput


def feed_all(out: TurnOutput, chunks: list[str]) -> list[str]:
    pieces = [out.feed(c.encode()) for c in chunks]
    if out.matched is None:
        pieces.append(out.finish())
    return pieces


def test_without_stops_text_passes_straight_through() -> None:
    out = TurnOutput()
    assert feed_all(out, ["a", "b c", "d"]) == ["a", "b c", "d", ""]
    assert out.text == "ab cd" and out.matched is None


def test_a_utf8_character_split_over_tokens_is_released_whole() -> None:
    out = TurnOutput()
    data = "é€".encode()
    assert [out.feed(data[i : i + 1]) for i in range(len(data))] == ["", "é", "", "", "€"]
    assert out.finish() == ""


def test_a_truncated_character_at_the_end_becomes_a_replacement() -> None:
    out = TurnOutput()
    assert out.feed("€".encode()[:2]) == ""
    assert out.finish() == "\ufffd"


def test_a_stop_over_three_tokens_is_cut_whole() -> None:
    out = TurnOutput(("</call>",))
    pieces = feed_all(out, ["x)", "</", "call", ">", "more"])
    assert pieces == ["x)", "", "", "", ""]
    assert out.text == "x)" and out.matched == "</call>"
    assert out.feed(b"after") == "", "nothing is accepted after a match"


def test_a_false_start_is_released_in_order() -> None:
    out = TurnOutput(("</call>",))
    assert out.feed(b"a</") == "a"
    assert out.held == "</"
    assert out.feed(b"cat") == "</cat"
    assert out.feed(b"<") == ""
    assert out.finish() == "<"
    assert out.text == "a</cat<" and out.matched is None


def test_a_stop_inside_one_token_cuts_mid_token() -> None:
    out = TurnOutput(("STOP",))
    assert out.feed(b"abSTOPcd") == "ab"
    assert out.matched == "STOP" and out.text == "ab"


def test_overlapping_stops_the_earliest_start_wins() -> None:
    out = TurnOutput(("bcd", "abc"))
    assert feed_all(out, ["a", "b", "cd"]) == ["", "", ""]
    assert out.matched == "abc" and out.text == ""


def test_overlapping_stops_the_first_completed_wins() -> None:
    out = TurnOutput(("abcdef", "cd"))
    assert feed_all(out, ["x", "ab", "c", "d"]) == ["x", "", "", "ab"]
    assert out.matched == "cd" and out.text == "xab"


def test_same_start_the_shorter_wins() -> None:
    out = TurnOutput(("</", "</call>"))
    assert out.feed(b"a</call>") == "a"
    assert out.matched == "</"


def test_stop_at_the_very_first_token() -> None:
    out = TurnOutput(("<end>",))
    assert out.feed(b"<end>tail") == ""
    assert out.matched == "<end>" and out.text == ""


def test_held_text_is_a_proper_prefix_only() -> None:
    out = TurnOutput(("abab",))
    assert out.feed(b"aba") == ""
    assert out.feed(b"c") == "abac"
    assert out.feed(b"ababab") == ""
    assert out.matched == "abab"


def test_empty_stop_is_refused() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        TurnOutput(("",))
