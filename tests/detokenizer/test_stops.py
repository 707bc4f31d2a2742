"""Stop strings over streamed text: held back while they might match, cut where they do."""

from __future__ import annotations

import pytest

from services.detokenizer.stops import StopStrings


def run(stops: list[str], pieces: list[str]) -> tuple[list[str], str | None, str]:
    s = StopStrings(stops)
    out: list[str] = []
    for p in pieces:
        text, matched = s.feed(p)
        out.append(text)
        if matched is not None:
            return out, matched, ""
    return out, None, s.flush()


def test_stop_inside_one_piece() -> None:
    assert run(["END"], ["abcENDxyz"]) == (["abc"], "END", "")


def test_stop_split_across_pieces_is_held_then_cut() -> None:
    out, matched, _ = run(["END"], ["ab", "cE", "N", "Dzz"])
    assert out == ["ab", "c", "", ""]
    assert matched == "END"


def test_partial_match_released_when_it_breaks() -> None:
    out, matched, rest = run(["END"], ["xE", "Nx", "y"])
    assert matched is None
    assert out == ["x", "ENx", "y"]
    assert rest == ""


def test_held_text_flushed_at_the_end() -> None:
    out, matched, rest = run(["\n\n"], ["line\n"])
    assert (out, matched, rest) == (["line"], None, "\n")


def test_earliest_of_several_stops_wins() -> None:
    assert run(["world", "o w"], ["hello world"]) == (["hell"], "o w", "")


@pytest.mark.parametrize("stops", [[], [""]])
def test_no_stops_passes_everything(stops: list[str]) -> None:
    assert run(stops, ["a", "b"]) == (["a", "b"], None, "")


def test_concatenation_equals_text_before_stop() -> None:
    text = "The answer is 42.\nObservation: done"
    for size in range(1, 7):
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        out, matched, _ = run(["Observation:"], pieces)
        assert matched == "Observation:"
        assert "".join(out) == "The answer is 42.\n"


def test_a_stop_regex_ends_the_output_right_after_its_match() -> None:
    s = StopStrings([], [r"[0-9]{3}"])
    assert s.feed("ab 12") == ("ab 12", None)  # no match yet: released at once
    assert s.feed("34 more") == ("3", r"[0-9]{3}")  # matched across the deltas: "123" kept


def test_the_first_match_to_end_wins_across_regexes() -> None:
    s = StopStrings([], [r"c+d", r"\bb"])
    assert s.feed("xx bcc") == ("xx b", r"\bb")


def test_stop_strings_are_dropped_and_regexes_kept() -> None:
    s = StopStrings(["END"], [r"!"])
    assert s.feed("hi END") == ("hi ", "END")
    s = StopStrings(["END"], [r"!"])
    assert s.feed("hi! x END") == ("hi!", r"!")  # the regex matched first


def test_text_passed_through_under_min_tokens_is_still_searched_later() -> None:
    s = StopStrings([], [r"abc"])
    assert s.pass_through("xab") == "xab"  # min_new_tokens not reached: no stop
    assert s.feed("cd") == ("c", "abc")


def test_no_stop_trim_keeps_the_matched_stop_string() -> None:
    s = StopStrings(["END"], keep=True)
    assert s.feed("hi E") == ("hi ", None)  # "E" may still become the stop string
    assert s.feed("ND and more") == ("END", "END")  # what follows it is dropped
