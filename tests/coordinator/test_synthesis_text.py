"""The synthesis answer's clean-up: repeated paragraphs go, everything else stays."""

from __future__ import annotations

from mesh.agent.synthesis import without_repeats


def test_a_paragraph_repeated_by_a_looping_model_is_kept_once() -> None:
    text = "The weight is checked in parcels.py.\n\nThe file is in a.\n\nThe file is in a.\n\n" \
           "The  file is\nin a.\n\nA 40 kg parcel is refused."
    assert without_repeats(text) == ("The weight is checked in parcels.py.\n\nThe file is in a."
                                     "\n\nA 40 kg parcel is refused.")


def test_distinct_paragraphs_and_their_line_breaks_are_untouched() -> None:
    text = "First line\nsecond line\n\n- a\n- b\n\n```\ncode\n```"
    assert without_repeats(text) == text
    assert without_repeats("  \n\n") == ""
