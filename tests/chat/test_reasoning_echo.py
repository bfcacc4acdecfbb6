"""Reasoning echo (Q): the LRU store, its key, and why it exists (the follow-up prompt renders
the first reply exactly as it was generated, so the prefix cache can serve it)."""

from __future__ import annotations

import os

from mlxcel.text.chat_template import ChatTemplate
from mlxcel.chat.reasoning import ReasoningFormat
from tests.chat.wire import chat_options
from mlxcel.chat.reasoning_echo import (
    KEY_BYTES, ReasoningEcho, echo_applies, template_signature,
)  # fmt: skip

# A template that shows an assistant turn's reasoning, as thinking-model templates do.
TEMPLATE = ChatTemplate(
    "{% for m in messages %}<|{{ m.role }}|>"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content }}<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SIGNATURE = template_signature(TEMPLATE.source, {}, None)
Q1 = [{"role": "user", "content": "What is 6*7?"}]


def remember(echo: ReasoningEcho, messages: list[dict[str, str]], content: str, reasoning: str,
             session: str = "") -> None:
    echo.remember(model="m", signature=SIGNATURE, session=session, messages=messages, content=content,
                  reasoning=reasoning)


def restore(echo: ReasoningEcho, messages: list[dict[str, str]], session: str = "") -> list[dict[str, str]]:
    return echo.restore(messages, model="m", signature=SIGNATURE, session=session)


def test_q_follow_up_prompt_extends_the_generated_text_only_with_echo() -> None:
    echo = ReasoningEcho()
    first_prompt = TEMPLATE.render(Q1)
    generated = "<think>6 times 7 is 42</think>42<|end|>"  # what the model wrote, end token included
    remember(echo, Q1, "42", "6 times 7 is 42")
    follow_up = [*Q1, {"role": "assistant", "content": "42"}, {"role": "user", "content": "And 6*8?"}]
    with_echo = TEMPLATE.render(restore(echo, follow_up))
    without = TEMPLATE.render(follow_up)
    assert with_echo.startswith(first_prompt + generated)  # the whole first exchange is a cached prefix
    assert not without.startswith(first_prompt + generated)


def test_q_the_key_covers_model_signature_session_history_and_content() -> None:
    echo = ReasoningEcho()
    remember(echo, Q1, "42", "r", session="user:alice")
    turn = [*Q1, {"role": "assistant", "content": "42"}]
    assert restore(echo, turn, session="user:alice")[1]["reasoning_content"] == "r"
    assert "reasoning_content" not in restore(echo, turn, session="user:bob")[1]
    assert "reasoning_content" not in restore(echo, [*Q1, {"role": "assistant", "content": "43"}],
                                              session="user:alice")[1]
    other_history = [{"role": "user", "content": "What is 7*6?"}, {"role": "assistant", "content": "42"}]
    assert "reasoning_content" not in restore(echo, other_history, session="user:alice")[1]
    other_model = echo.restore(turn, model="other", signature=SIGNATURE, session="user:alice")
    assert "reasoning_content" not in other_model[1]
    other_tools = echo.restore(turn, model="m", signature=template_signature(TEMPLATE.source, {}, [{"x": 1}]),
                               session="user:alice")
    assert "reasoning_content" not in other_tools[1]


def test_q_client_reasoning_wins_and_tool_call_turns_are_left_alone() -> None:
    echo = ReasoningEcho()
    remember(echo, Q1, "42", "stored")
    own = restore(echo, [*Q1, {"role": "assistant", "content": "42", "reasoning": "mine"}])
    assert own[1] == {"role": "assistant", "content": "42", "reasoning": "mine"}
    calls = restore(echo, [*Q1, {"role": "assistant", "content": "42", "tool_calls": [{"id": "c"}]}])
    assert "reasoning_content" not in calls[1]


def test_q_text_parts_and_extra_fields_key_like_the_plain_message() -> None:
    echo = ReasoningEcho()
    remember(echo, Q1, "42", "r")
    resent = [{"role": "user", "content": [{"type": "text", "text": "What is 6*7?"}]},
              {"role": "assistant", "content": "42", "refusal": None}]
    assert restore(echo, resent)[1]["reasoning_content"] == "r"


def test_q_lru_eviction_by_entries() -> None:
    echo = ReasoningEcho(max_bytes=1 << 20, max_entries=3)
    for i in range(4):
        remember(echo, Q1, f"answer {i}", f"reasoning {i}")
    assert echo.num_entries == 3
    found = [("reasoning_content" in restore(echo, [*Q1, {"role": "assistant", "content": f"answer {i}"}])[1])
             for i in range(4)]
    assert found == [False, True, True, True]


def test_q_lru_eviction_by_bytes_keeps_the_recently_used() -> None:
    reasoning = "x" * 100
    echo = ReasoningEcho(max_bytes=3 * (KEY_BYTES + 100), max_entries=100)
    for i in range(3):
        remember(echo, Q1, f"a{i}", reasoning)
    assert echo.num_bytes == 3 * (KEY_BYTES + 100)
    restore(echo, [*Q1, {"role": "assistant", "content": "a0"}])  # a0 becomes most recent
    remember(echo, Q1, "a3", reasoning)
    present = [("reasoning_content" in restore(echo, [*Q1, {"role": "assistant", "content": f"a{i}"}])[1])
               for i in range(4)]
    assert present == [True, False, True, True]
    assert echo.num_bytes <= echo.max_bytes


def test_q_oversized_entry_and_zero_budget_store_nothing() -> None:
    echo = ReasoningEcho(max_bytes=KEY_BYTES + 10)
    remember(echo, Q1, "42", "y" * 11)
    assert echo.num_entries == 0
    disabled = ReasoningEcho(max_bytes=0)  # MLXCEL_REASONING_ECHO_MAX_BYTES=0
    remember(disabled, Q1, "42", "r")
    assert not disabled.is_enabled and disabled.num_entries == 0


def test_q_only_the_key_and_reasoning_are_held() -> None:
    echo = ReasoningEcho()
    secret = "the user's private question " + os.urandom(4).hex()
    remember(echo, [{"role": "user", "content": secret}], "answer", "r")
    assert echo.num_bytes == KEY_BYTES + 1
    assert secret not in repr(echo._entries)


def test_q_when_the_echo_applies() -> None:
    auto = ReasoningFormat.AUTO
    assert echo_applies(cache_prompt=True, reasoning_format=auto, skip_chat_parsing=False)
    assert not echo_applies(cache_prompt=False, reasoning_format=auto, skip_chat_parsing=False)
    assert not echo_applies(cache_prompt=True, reasoning_format=ReasoningFormat.NONE, skip_chat_parsing=False)
    assert not echo_applies(cache_prompt=True, reasoning_format=ReasoningFormat.DEEPSEEK_LEGACY,
                            skip_chat_parsing=False)
    assert not echo_applies(cache_prompt=True, reasoning_format=auto, skip_chat_parsing=True)


def test_q_session_prefers_prompt_cache_key() -> None:
    assert chat_options({"prompt_cache_key": "k", "user": "u"}).session == "prompt_cache_key:k"
    assert chat_options({"user": "u"}).session == "user:u"
    assert chat_options({}).session == ""
