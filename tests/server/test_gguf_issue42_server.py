"""Issue 42: the real HTTP server on a GGUF whose linears are MXFP4, I-quants, ternary and Q5_K/Q3_K/Q2_K
(tests/models/test_gguf_issue42_model.py's tiny llama): greedy text equal to the widened (dequantized
float) model's, and /props and /v1/models naming the format, its types, bits a weight and bytes resident."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from mlxcel.config import EngineConfig
from mlxcel.layers import paged_attention
from mlxcel.loading import ResolvedModel, load_model
from mlxcel.server.config import ServerConfig
from mlxcel.server.lifecycle import ServerThread
from mlxcel.server.state import ServerState
from mlxcel.serving.chat_model import start_served_model
from mlxcel.serving.served_model import RuntimeOptions
from tests.models.harness import PagedSequences
from tests.models.test_gguf_issue42_model import write_mixed_gguf


def greedy_without(model: torch.nn.Module, prompt: list[int], num_tokens: int, banned: list[int]) -> list[int]:
    """Greedy continuation through the paged cache with `banned` tokens never picked."""
    seqs = PagedSequences(model, num_blocks=(len(prompt) + num_tokens) // 4 + 2)
    feed, generated = prompt, []
    while len(generated) < num_tokens:
        logits = seqs.step({0: feed})[0][-1].clone()
        logits[banned] = float("-inf")
        generated.append(int(logits.argmax()))
        feed = generated[-1:]
    return generated


@pytest.mark.slow
@pytest.mark.skipif(not paged_attention.available(), reason="no C++ compiler for the CPU kernels")
def test_issue42_server_generates_from_an_iq_mxfp4_gguf_and_reports_its_weights(tmp_path: Path) -> None:
    path = write_mixed_gguf(tmp_path / "mixed.gguf")
    served = start_served_model(ResolvedModel(path, "mixed-iq", "test"), RuntimeOptions(warmup=False),
                                EngineConfig(max_num_seqs=2, ctx_size=512))
    server = ServerThread(ServerState(ServerConfig(port=0, endpoint_props=True), served)).start()
    try:
        prompt = "hello world"
        # ignore_eos bans the end-of-generation tokens (llama-server's meaning), which this random model favours
        body = {"prompt": prompt, "n_predict": 6, "temperature": 0, "ignore_eos": True, "return_tokens": True}
        reply = httpx.post(server.address + "/completion", json=body, timeout=120).json()
        props = httpx.get(server.address + "/props", timeout=30).json()
        card = httpx.get(server.address + "/v1/models", timeout=30).json()["data"][0]
        tokenizer = served.tokenizer
    finally:
        server.stop()
        served.close()
    widened = load_model(path).model  # every tensor dequantized by the gguf package
    want = greedy_without(widened, tokenizer.encode(prompt), 6, banned=sorted(tokenizer.eos_token_ids | {0, 1}))
    assert reply["tokens"] == want and reply["content"] == tokenizer.decode(want)
    weights = props["weights"]
    assert weights["format"] == "gguf" and {"MXFP4", "IQ4_XS", "IQ2_XXS", "Q2_K", "TQ1_0"} <= set(weights["tensor_types"])
    assert 2.0 < weights["bits_per_weight"] < 6.0
    # Resident: the stored codes (int8, or 6 bits where they fit) with their scales, the float embedding table
    # (269 x 256) and the tied head's per-row int8 and bfloat16 copies: within a few times the file's bytes.
    assert weights["tensor_bytes"] < weights["resident_bytes"] < 4 * weights["tensor_bytes"]
    assert card["weights"]["tensor_types"] == weights["tensor_types"]
