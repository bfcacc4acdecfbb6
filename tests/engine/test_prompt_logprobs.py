"""Prompt logprobs (issue 27 point 2) in the engine: every prompt position's logits, chunked or not,
equal a whole-prompt forward's log-softmax; no prefix-cache read skips them; max_tokens 0 ends
after the prompt; the in-process logits sink sees each position once."""

from __future__ import annotations

import asyncio

import torch

from mlxcel.layers.attention import AttentionContext, SequenceSlice
from mlxcel.types import FinishReason, Request, SamplingParams, TokenEvent

from .conftest import collect, greedy, make_engine, run
from .test_engine import PROMPTS


def reference_logprobs(model, prompt: list[int]) -> torch.Tensor:  # noqa: ANN001
    """log_softmax of a whole-prompt forward with no cache: row p scores token p + 1."""
    with torch.inference_mode():
        n = len(prompt)
        h = model(torch.tensor(prompt), torch.arange(n), AttentionContext([SequenceSlice(0, n, n)]))
        return torch.log_softmax(model.compute_logits(h).float(), dim=-1)


async def events_of(client, request: Request) -> list[TokenEvent]:  # noqa: ANN001
    return [event async for event in client.generate(request)]


def first_prompt_logprobs(events: list[TokenEvent]):  # noqa: ANN201
    carrying = [e for e in events if e.prompt_logprobs is not None]
    assert len(carrying) == 1  # carried once
    return carrying[0].prompt_logprobs


def check_against_reference(model, prompt: list[int], entries, num_top: int) -> None:  # noqa: ANN001
    ref = reference_logprobs(model, prompt)
    assert len(entries) == len(prompt) and entries[0] is None
    for p, entry in enumerate(entries[1:], start=1):
        assert entry.token_id == prompt[p]
        assert abs(entry.logprob - float(ref[p - 1, prompt[p]])) < 1e-4
        assert entry.rank == int((ref[p - 1] > ref[p - 1, prompt[p]]).sum()) + 1
        values, ids = torch.topk(ref[p - 1], num_top)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert all(abs(a - b) < 1e-4 for (_, a), b in zip(entry.top, values.tolist()))


def test_prompt_logprobs_match_a_whole_prompt_forward_chunked_and_batched(tiny_model) -> None:
    client = make_engine(tiny_model, max_num_batched_tokens=7)  # every prompt below is cut in chunks
    try:
        async def main():
            return await asyncio.gather(*(events_of(client, Request(f"p{i}", p, greedy(2, prompt_logprobs=3)))
                                          for i, p in enumerate(PROMPTS[3:])))
        results = run(main())
    finally:
        client.core.stop(10)
    for prompt, events in zip(PROMPTS[3:], results):
        check_against_reference(tiny_model, prompt, first_prompt_logprobs(events), 3)
        assert events[0].prompt_logprobs is not None and events[0].token_ids  # with the first token


def test_a_cached_prefix_is_not_read_for_prompt_logprobs_but_may_be_donated(engine, tiny_model) -> None:
    prompt = PROMPTS[6]
    run(collect(engine, Request("warm", prompt, greedy(2))))  # donates the prompt's blocks
    events = run(events_of(engine, Request("lp", prompt, greedy(2, prompt_logprobs=0))))
    assert events[-1].num_cached_tokens == 0
    check_against_reference(tiny_model, prompt, first_prompt_logprobs(events), 0)
    _, last = run(collect(engine, Request("after", prompt, greedy(2))))
    assert last.num_cached_tokens > 0  # a plain request still hits


def test_max_tokens_zero_ends_after_the_prompt_with_no_token(engine, tiny_model) -> None:
    events = run(events_of(engine, Request("z", PROMPTS[4], greedy(0, prompt_logprobs=1))))
    assert [e.token_ids for e in events] == [()]
    assert events[0].finish_reason is FinishReason.LENGTH
    check_against_reference(tiny_model, PROMPTS[4], events[0].prompt_logprobs, 1)
    assert engine.stats().slots[0].is_processing is False


def test_the_logits_sink_sees_each_prompt_position_once_under_preemption(tiny_model) -> None:
    """A preempted request is recomputed from position 0; its sink is not fed twice."""
    client = make_engine(tiny_model, ctx_size=8 * 32, max_num_batched_tokens=128)
    client.core.kv.pool.__init__(24, 4, enable_caching=True)  # fewer blocks than 8 sequences need
    seen: dict[int, list[tuple[int, torch.Tensor]]] = {i: [] for i in range(8)}
    prompts = [p[:10] for p in PROMPTS]

    def sink(i: int):  # noqa: ANN202
        return lambda first, logits: seen[i].append((first, logits.clone()))
    try:
        async def main():
            return await asyncio.gather(*(collect(client, Request(f"s{i}", p, greedy(8), prompt_logits=sink(i)))
                                          for i, p in enumerate(prompts)))
        run(main())
        assert client.core.scheduler.num_completed == 8
    finally:
        client.core.stop(10)
    for i, prompt in enumerate(prompts):
        firsts = [first for first, _ in seen[i]]
        assert firsts == sorted(firsts) and firsts[0] == 0
        logits = torch.cat([lg for _, lg in seen[i]])
        assert logits.shape == (len(prompt) - 1, 97)
        ref = reference_logprobs(tiny_model, prompt)[:-1]
        assert torch.allclose(torch.log_softmax(logits, dim=-1), ref, atol=1e-4)


def test_no_prompt_logprobs_unless_asked(engine) -> None:
    events = run(events_of(engine, Request("n", PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=2))))
    assert all(e.prompt_logprobs is None for e in events)
