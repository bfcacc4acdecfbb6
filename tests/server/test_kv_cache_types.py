"""Quantized KV caches on the real model through the real server (spec N2, issue 11 point 5).

SmolLM2 (head size 64) answers a chat at temperature 0 from a q8_0 cache and from a turbo4 cache;
the figures printed (pytest -s) are how many of its greedy tokens (up to 48) equal the bf16 cache's.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from mlxcel.config import EngineConfig
from mlxcel.serving.served_model import ServedModel
from mlxcel.server.lifecycle import ServerThread

from .conftest import ENGINE, chat_body, engine_like

QUESTION = "What is the capital of France? Answer in one sentence, then name two famous places there."


def greedy_answer(server: ServerThread) -> tuple[str, list[int]]:
    body = chat_body(QUESTION, max_tokens=48, logprobs=True)
    reply = httpx.post(f"{server.address}/v1/chat/completions", json=body, timeout=300).json()
    choice = reply["choices"][0]
    return choice["message"]["content"], [t["token"] for t in choice["logprobs"]["content"]]


@pytest.mark.slow
@pytest.mark.parametrize("settings", [{"cache_type_k": "q8_0", "cache_type_v": "q8_0"},
                                      {"kv_cache_mode": "turbo4"}], ids=["q8_0", "turbo4"])
def test_n2_quantized_kv_serves_the_real_model(served: ServedModel, start_server: Callable[..., ServerThread],
                                               settings: dict) -> None:
    dense = start_server(engine_like(served, ENGINE))
    quantized_model = engine_like(served, EngineConfig(max_num_seqs=ENGINE.max_num_seqs, ctx_size=ENGINE.ctx_size,
                                                       **settings))
    quantized = start_server(quantized_model)
    reference_text, reference = greedy_answer(dense)
    text, tokens = greedy_answer(quantized)
    same = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))
    print(f"{settings}: first {same} of {len(reference)} greedy tokens equal the bf16 cache's; {text!r}")
    assert "Paris" in text
    assert same >= min(len(reference), 16 if "cache_type_k" in settings else 4)
    props = httpx.get(f"{quantized.address}/props").json()
    assert props["total_slots"] == ENGINE.max_num_seqs
    quantized_model.close(10)
