"""Stop strings matched across pushes; no partial stop text is ever emitted."""

from __future__ import annotations

from mlxcel.text.stop import StopMatcher


def _run(stops: list[str], pieces: list[str]) -> tuple[str, str | None, str]:
    matcher = StopMatcher(stops)
    shown: list[str] = []
    matched = None
    for piece in pieces:
        text, stop = matcher.push(piece)
        shown.append(text)
        matched = matched or stop
    return "".join(shown), matched, matcher.flush()


def test_sampling_stop_split_across_pushes_never_leaks() -> None:
    matcher = StopMatcher(["</answer>"])
    assert matcher.push("The answer</") == ("The answer", None)
    assert matcher.push("ans") == ("", None)
    assert matcher.push("wer> trailing") == ("", "</answer>")
    assert matcher.push("more") == ("", None)
    assert matcher.is_stopped and matcher.matched == "</answer>"
    assert matcher.flush() == ""


def test_sampling_stop_false_start_is_released() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.push("a ST") == ("a ", None)
    assert matcher.push("OP") == ("", "STOP")
    matcher = StopMatcher(["STOP"])
    assert matcher.push("a ST") == ("a ", None)
    assert matcher.push("ART") == ("START", None)
    assert matcher.push("S") == ("", None)
    assert matcher.flush() == "S"


def test_sampling_stop_overlapping_prefixes() -> None:
    # "aab" inside "aaab": the held "aa" must not hide the real start one character later.
    assert _run(["aab"], ["a", "a", "a", "b", "c"]) == ("a", "aab", "")
    assert _run(["abc", "bcd"], ["ab", "cd"]) == ("", "abc", "")
    assert _run(["bcd", "abcx"], ["ab", "cd"]) == ("a", "bcd", "")


def test_sampling_stop_multiple_stops_earliest_wins() -> None:
    assert _run(["world", "lo"], ["hello world"]) == ("hel", "lo", "")
    assert _run(["ab", "abc"], ["xabc"]) == ("x", "abc", "")  # same start: the longer one


def test_sampling_stop_at_the_start_and_unmatched_tail() -> None:
    assert _run(["\n\n"], ["\n", "\nrest"]) == ("", "\n\n", "")
    assert _run(["###"], ["text #", "#"]) == ("text ", None, "##")
    assert _run([], ["free ", "text"]) == ("free text", None, "")
    assert _run([""], ["empty stops are ignored"]) == ("empty stops are ignored", None, "")


def test_sampling_stop_unicode() -> None:
    assert _run(["🛑"], ["go 🟢 then ", "🛑 no"]) == ("go 🟢 then ", "🛑", "")
