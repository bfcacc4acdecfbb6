"""Stop strings matched across token boundaries, without leaking a partial stop into the stream.

The engine stops on token ids; stop *strings* are matched here, on the text, because a stop
string can span several tokens and one token can hold the end of a stop plus more text.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Feeds streamed text through a set of stop strings.

    `push` returns the text that is safe to show now and the stop string matched, if any. A
    suffix that could still grow into a stop string is held back; everything from a match on
    is dropped, and after a match every push returns ("", None).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(dict.fromkeys(s for s in stops if s))  # unique, non-empty, in order
        self.matched: str | None = None
        self._held = ""

    @property
    def is_stopped(self) -> bool:
        return self.matched is not None

    def push(self, text: str) -> tuple[str, str | None]:
        """Add streamed text; return (text to emit, the stop string matched now or None)."""
        if self.is_stopped:
            return "", None
        buffer = self._held + text
        hit = self._first_match(buffer)
        if hit is not None:
            at, stop = hit
            self.matched, self._held = stop, ""
            return buffer[:at], stop
        keep = self._partial_suffix_len(buffer)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep], None

    def flush(self) -> str:
        """The held-back text at the end of generation (a prefix of a stop that never completed)."""
        held, self._held = self._held, ""
        return "" if self.is_stopped else held

    def _first_match(self, buffer: str) -> tuple[int, str] | None:
        # The earliest occurrence wins; at the same position, the longer stop string.
        best: tuple[int, str] | None = None
        for stop in self.stops:
            at = buffer.find(stop)
            if at >= 0 and (best is None or (at, -len(stop)) < (best[0], -len(best[1]))):
                best = (at, stop)
        return best

    def _partial_suffix_len(self, buffer: str) -> int:
        """Length of the longest end of `buffer` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:size]):
                    longest = size
                    break
        return longest
