"""Reasoning ("thinking") markers: which a model uses, and splitting reasoning from the answer.

`infer_think_tokens` finds the marker pair in the vocabulary (single-token `<think>`/`</think>`,
`<longcat_think>`/`</longcat_think>`, Gemma 4's two-token `<|channel>thought` / `<channel|>`).
`ReasoningSplitter` works on streamed text (the adapters' side); `ThinkTracker` on token ids
(the reasoning budget and the grammar gate, on the engine thread).

`--reasoning-format` follows llama-server:
  none             reasoning stays in the content, markers and all
  deepseek, auto   reasoning goes to `reasoning_content` (streamed as reasoning deltas)
  deepseek-legacy  content keeps the `<think>` block as text; the final reply also carries
                   `reasoning_content`; streaming sends it inline in content only
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from mlxcel.chat.events import ContentDelta, ReasoningDelta

_SPACE = " \t\n\r"
# (start, end) strings in the order they are tried; the start's first token must be a vocab token.
THINK_MARKER_CANDIDATES: tuple[tuple[str, str], ...] = (
    ("<think>", "</think>"),
    ("<longcat_think>", "</longcat_think>"),
    ("<|channel>thought", "<channel|>"),  # Gemma 4
    ("<|channel|>analysis<|message|>", "<|end|>"),  # gpt-oss (harmony; chat/harmony.py splits its replies)
)


class ReasoningFormat(str, enum.Enum):
    NONE = "none"
    AUTO = "auto"
    DEEPSEEK = "deepseek"
    DEEPSEEK_LEGACY = "deepseek-legacy"

    @classmethod
    def parse(cls, value: str) -> ReasoningFormat:
        """--reasoning-format's value; a ValueError names the allowed ones."""
        try:
            return cls(value.strip().lower())
        except ValueError:
            allowed = ", ".join(f.value for f in cls)
            raise ValueError(f"--reasoning-format must be one of {allowed}, not {value!r}") from None

    @property
    def is_parsed(self) -> bool:
        """Whether reasoning is split from the content at all."""
        return self is not ReasoningFormat.NONE


class Encoder(Protocol):
    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def token_to_id(self, token: str) -> int | None: ...


@dataclass(frozen=True, slots=True)
class ThinkTokens:
    """A model's reasoning markers as text and as token ids."""

    start: str
    end: str
    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]


def infer_think_tokens(tokenizer: Encoder) -> ThinkTokens | None:
    """The reasoning marker pair this vocabulary has, or None for a model without one."""
    for start, end in THINK_MARKER_CANDIDATES:
        first = start.split(">", 1)[0] + ">" if ">" in start else start
        if tokenizer.token_to_id(first) is None or tokenizer.token_to_id(end) is None:
            continue
        start_ids = tuple(tokenizer.encode(start, add_special_tokens=False))
        end_ids = tuple(tokenizer.encode(end, add_special_tokens=False))
        if start_ids and end_ids:
            return ThinkTokens(start, end, start_ids, end_ids)
    return None


def is_primed(prompt_text: str, think: ThinkTokens | None) -> bool:
    """Whether the rendered prompt leaves the model inside a reasoning block (a template whose
    generation prompt ends in `<think>\\n`): then its first tokens are reasoning."""
    return think is not None and prompt_text.rstrip(_SPACE).endswith(think.start)


# --- text: the adapters' side -----------------------------------------------------------------


class Phase(enum.Enum):
    START = enum.auto()  # nothing but whitespace yet; a start marker may come
    REASONING = enum.auto()
    CONTENT = enum.auto()


SplitEvent = ReasoningDelta | ContentDelta


class ReasoningSplitter:
    """Splits a streamed reply into reasoning and content deltas.

    Only a block that opens the reply is reasoning (or, when `starts_in_reasoning`, the text
    up to the end marker). Whitespace around the reasoning is trimmed, as llama-server does,
    and text that could be part of a marker is held until it is decided. With
    deepseek-legacy every delta is content (the raw text, the block inline) and the reasoning
    is only collected, for the final reply's `reasoning_content`.
    """

    def __init__(
        self,
        markers: tuple[str, str] | None,
        *,
        reasoning_format: ReasoningFormat = ReasoningFormat.AUTO,
        starts_in_reasoning: bool = False,
    ) -> None:
        self._markers = markers if reasoning_format.is_parsed else None
        self.is_legacy = reasoning_format is ReasoningFormat.DEEPSEEK_LEGACY and self._markers is not None
        self._phase = Phase.START
        if self._markers is None:
            self._phase = Phase.CONTENT
        elif starts_in_reasoning:
            self._phase = Phase.REASONING
        self._buffer = ""
        # Legacy content shows the block whole: a start marker that was in the prompt comes first.
        self._legacy_prefix = self._markers[0] if self.is_legacy and starts_in_reasoning and self._markers else ""
        self._is_reasoning_started = False  # leading whitespace of the reasoning is dropped
        self._is_content_started = False  # likewise for the content after the reasoning
        self.reasoning: list[str] = []  # everything classified as reasoning (for the final reply)

    @property
    def reasoning_text(self) -> str:
        return "".join(self.reasoning)

    def feed(self, text: str) -> list[SplitEvent]:
        """Add streamed text; return the deltas it decided."""
        if self._markers is None:
            return [ContentDelta(text)] if text else []
        self._buffer += text
        out: list[SplitEvent] = []
        while self._buffer and self._step(out, is_final=False):
            pass
        return self._legacy(text, out)

    def finish(self) -> list[SplitEvent]:
        """The held text at the end of the reply."""
        out: list[SplitEvent] = []
        while self._buffer and self._step(out, is_final=True):
            pass
        return self._legacy("", out)

    def _legacy(self, raw: str, out: list[SplitEvent]) -> list[SplitEvent]:
        if not self.is_legacy:
            return out
        raw, self._legacy_prefix = self._legacy_prefix + raw, ""
        return [ContentDelta(raw)] if raw else []

    def _step(self, out: list[SplitEvent], *, is_final: bool) -> bool:
        if self._phase is Phase.START:
            return self._step_start(is_final)
        if self._phase is Phase.REASONING:
            return self._step_reasoning(out, is_final)
        self._emit_content(out)
        return False

    def _step_start(self, is_final: bool) -> bool:
        assert self._markers is not None
        start = self._markers[0]
        head = self._buffer.lstrip(_SPACE)
        if head.startswith(start):
            self._phase, self._buffer = Phase.REASONING, head[len(start) :]
            return True
        if not is_final and start.startswith(head):
            return False  # empty or a prefix of the start marker: still undecided
        self._phase = Phase.CONTENT
        return True

    def _step_reasoning(self, out: list[SplitEvent], is_final: bool) -> bool:
        assert self._markers is not None
        end = self._markers[1]
        at = self._buffer.find(end)
        if at >= 0:
            self._emit_reasoning(self._buffer[:at].rstrip(_SPACE), out)
            self._buffer = self._buffer[at + len(end) :]
            self._phase = Phase.CONTENT
            return True
        keep = len(self._buffer) if is_final else _safe_reasoning_len(self._buffer, end)
        self._emit_reasoning(self._buffer[:keep], out)
        self._buffer = self._buffer[keep:]
        return False

    def _emit_reasoning(self, text: str, out: list[SplitEvent]) -> None:
        if not self._is_reasoning_started:
            text = text.lstrip(_SPACE)
        if not text:
            return
        self._is_reasoning_started = True
        self.reasoning.append(text)
        out.append(ReasoningDelta(text))

    def _emit_content(self, out: list[SplitEvent]) -> None:
        text, self._buffer = self._buffer, ""
        if not self._is_content_started:
            text = text.lstrip(_SPACE)
        if text:
            self._is_content_started = True
            out.append(ContentDelta(text))


def _safe_reasoning_len(buffer: str, end: str) -> int:
    """How much of `buffer` is surely reasoning: not a possible end-marker start, and not
    trailing whitespace (dropped if the end marker follows it)."""
    hold = 0
    for size in range(min(len(end) - 1, len(buffer)), 0, -1):
        if buffer.endswith(end[:size]):
            hold = size
            break
    kept = buffer[: len(buffer) - hold]
    return len(kept.rstrip(_SPACE))


# --- token ids: the engine side -----------------------------------------------------------------


class ThinkTracker:
    """Follows a reply's token ids through its reasoning block.

    BEFORE: nothing yet (the start marker may come); REASONING: inside the block;
    AFTER: the block closed, or the reply began without one.
    """

    BEFORE, REASONING, AFTER = "before", "reasoning", "after"

    def __init__(self, think: ThinkTokens, *, starts_in_reasoning: bool) -> None:
        self.think = think
        self.phase = self.REASONING if starts_in_reasoning else self.BEFORE
        self.num_start_matched = 0  # start-marker tokens seen so far (BEFORE)
        self.num_end_matched = 0  # end-marker tokens seen so far (REASONING)
        self._num_reasoning_seen = 0  # every token inside the block, end-marker prefix included

    @property
    def num_reasoning_tokens(self) -> int:
        """Tokens inside the block, the markers not counted."""
        return self._num_reasoning_seen - self.num_end_matched

    @property
    def next_end_token(self) -> int:
        return self.think.end_ids[self.num_end_matched]

    def advance(self, token_id: int) -> bool:
        """Follow one sampled token; True when it belongs to the block or its markers."""
        if self.phase == self.BEFORE:
            return self._advance_before(token_id)
        if self.phase == self.REASONING:
            self._advance_reasoning(token_id)
            return True
        return False

    def _advance_before(self, token_id: int) -> bool:
        start = self.think.start_ids
        if token_id != start[self.num_start_matched]:
            self.phase = self.AFTER
            return False
        self.num_start_matched += 1
        if self.num_start_matched == len(start):
            self.phase = self.REASONING
        return True

    def _advance_reasoning(self, token_id: int) -> None:
        end = self.think.end_ids
        self._num_reasoning_seen += 1
        if token_id == end[self.num_end_matched]:
            self.num_end_matched += 1
        else:
            self.num_end_matched = 1 if token_id == end[0] else 0
        if self.num_end_matched == len(end):
            self.phase = self.AFTER


def strip_think_blocks(text: str, markers: Sequence[str]) -> str:
    """`text` without complete `start...end` blocks (and without a leading `...end` when the
    start was in the prompt); whitespace after a removed block is dropped too."""
    start, end = markers[0], markers[1]
    while True:
        at = text.find(start)
        close = text.find(end, at + len(start)) if at >= 0 else -1
        if at < 0 or close < 0:
            break
        text = text[:at] + text[close + len(end) :].lstrip(_SPACE)
    close = text.find(end)
    if close >= 0 and start not in text[:close]:
        text = text[close + len(end) :].lstrip(_SPACE)
    return text
