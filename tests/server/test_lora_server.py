"""F8 through the real HTTP server on the real SmolLM2: a LoRA adapter built with peft over the
dequantized weights; greedy tokens through /completion and /v1/chat/completions equal
transformers + peft with the same adapter and scale; /lora-adapters lists and sets scales."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from mlxcel.config import EngineConfig
from mlxcel.serving.served_model import ServedModel
from mlxcel.server.lifecycle import ServerThread

from .conftest import engine_like

pytestmark = pytest.mark.slow
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

NUM_TOKENS = 6
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def reference(smollm2_reference: Any, smollm2_transformers: Any,
              tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    """(adapter folder, peft model, tokenizer): r=8 on q/v/down of every layer, random B. The base is a copy of
    the session's float32 SmolLM2 (peft wraps the layers of the model it is given)."""
    tokenizer = smollm2_reference
    base = copy.deepcopy(smollm2_transformers)
    torch.manual_seed(0)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                             init_lora_weights=False, lora_dropout=0.0)
    model = peft.get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.12)
    folder = tmp_path_factory.mktemp("smollm2-lora")
    model.save_pretrained(str(folder))
    return folder, model.eval(), tokenizer


@torch.inference_mode()
def peft_greedy(reference: tuple[Path, Any, Any], ids: list[int], scale: float) -> list[int]:
    _, model, _ = reference
    for module in model.modules():
        if isinstance(module, peft.tuners.lora.LoraLayer):
            module.set_scale("default", scale)
    out = list(ids)
    for _ in range(NUM_TOKENS):
        out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


@pytest.fixture(scope="module")
def slot_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lora-slots")


@pytest.fixture(scope="module")
def lora_server(reference: tuple[Path, Any, Any], slot_dir: Path,
                start_server: Callable[..., ServerThread]) -> Iterator[tuple[ServerThread, ServedModel]]:
    from mlxcel.loading import resolve_model
    from mlxcel.serving.chat_model import start_served_model
    from mlxcel.serving.served_model import RuntimeOptions

    options = RuntimeOptions(warmup=False, quantize="off", adapters=((reference[0], 1.0),))
    served = start_served_model(resolve_model(None), options, EngineConfig(
        max_num_seqs=2, ctx_size=2048, decode_step="eager", slot_save_path=str(slot_dir)))
    yield start_server(served), served
    served.close(30)


def complete(http: httpx.Client, ids: list[int], **fields: Any) -> list[int]:
    body = {"prompt": ids, "n_predict": NUM_TOKENS, "temperature": 0, "return_tokens": True, "ignore_eos": True,
            **fields}
    reply = http.post("/completion", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()["tokens"]


def test_f8_completion_tokens_equal_peft_per_request_and_global_scales(
        lora_server: tuple[ServerThread, ServedModel], reference: tuple[Path, Any, Any]) -> None:
    server, _ = lora_server
    ids = reference[2](PROMPT)["input_ids"]
    with httpx.Client(base_url=server.address, timeout=300) as http:
        listed = http.get("/lora-adapters").json()
        assert listed == [{"id": 0, "path": str(reference[0]), "scale": 1.0}]
        assert complete(http, ids) == peft_greedy(reference, ids, 1.0)
        assert complete(http, ids, lora=[{"id": 0, "scale": 0.0}]) == peft_greedy(reference, ids, 0.0)
        assert peft_greedy(reference, ids, 0.0) != peft_greedy(reference, ids, 1.0)
        assert http.post("/lora-adapters", json=[{"id": 0, "scale": 0.5}]).json() == {"success": True}
        assert http.get("/lora-adapters").json()[0]["scale"] == 0.5
        assert complete(http, ids) == peft_greedy(reference, ids, 0.5)
        bad = http.post("/completion", json={"prompt": ids, "n_predict": 1, "lora": [{"id": 3, "scale": 1.0}]})
        assert bad.status_code == 400 and "adapter id 3" in bad.text
        bad = http.post("/lora-adapters", json=[{"id": 1, "scale": 1.0}])
        assert bad.status_code == 400 and "adapter id 1" in bad.text
        assert http.get("/lora-adapters").json()[0]["scale"] == 0.5  # a refused POST changes nothing
        http.post("/lora-adapters", json=[{"id": 0, "scale": 1.0}])


def test_f8_openai_completions_take_the_lora_field(lora_server: tuple[ServerThread, ServedModel],
                                                   reference: tuple[Path, Any, Any]) -> None:
    server, served = lora_server
    ids = reference[2](PROMPT)["input_ids"]
    with httpx.Client(base_url=server.address, timeout=300) as http:
        reply = http.post("/v1/completions", json={"prompt": ids, "max_tokens": NUM_TOKENS, "temperature": 0,
                                                   "ignore_eos": True, "lora": [{"id": 0, "scale": 0.0}]})
    assert reply.status_code == 200, reply.text
    want = served.tokenizer.decode(peft_greedy(reference, ids, 0.0))
    assert reply.json()["choices"][0]["text"] == want


def test_f8_chat_completions_take_the_lora_field(lora_server: tuple[ServerThread, ServedModel]) -> None:
    """A chat request's `lora` gives what the same global scale gives (checked against peft above)."""
    server, _ = lora_server
    messages = [{"role": "user", "content": "Name a colour."}]

    def chat(http: httpx.Client, **fields: Any) -> str:
        body = {"messages": messages, "max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True, **fields}
        reply = http.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["message"]["content"]

    with httpx.Client(base_url=server.address, timeout=300) as http:
        texts = {}
        for scale in (0.0, 1.0):
            texts[scale] = chat(http, lora=[{"id": 0, "scale": scale}])
            http.post("/lora-adapters", json=[{"id": 0, "scale": 1.0 - scale}])
            assert chat(http, lora=[{"id": 0, "scale": scale}]) == texts[scale]  # the global scale is not used
            http.post("/lora-adapters", json=[{"id": 0, "scale": scale}])
            assert chat(http) == texts[scale]
        http.post("/lora-adapters", json=[{"id": 0, "scale": 1.0}])
        assert texts[0.0] != texts[1.0]


def test_f12_slot_files_carry_the_lora_scales_and_restore_only_for_them(
        lora_server: tuple[ServerThread, ServedModel], reference: tuple[Path, Any, Any], slot_dir: Path,
        served: ServedModel, start_server: Callable[..., ServerThread]) -> None:
    """/slots/0?action=save under scale 1 records it; restored, a request at scale 1 reuses the KV and one at
    scale 0 computes its own (both give peft's tokens); a server without the adapter refuses the file (400)."""
    server, _ = lora_server
    ids = reference[2](f"{PROMPT} Paris. The capital of Italy is Rome, and the capital of Spain is")["input_ids"]
    num_cached = (len(ids) - 1) // 16 * 16  # the prompt's full blocks
    with httpx.Client(base_url=server.address, timeout=300) as http:
        assert http.post("/v1/cache/reset").json()["reset"] is True  # no block left by the tests above
        tuned = complete(http, ids, id_slot=0, lora=[{"id": 0, "scale": 1.0}])
        saved = http.post("/slots/0?action=save", json={"filename": "lora.bin"}).json()
        assert saved["lora"] == [{"id": 0, "scale": 1.0}] and saved["n_saved"] >= num_cached > 0
        assert http.post("/slots/0?action=erase").json()["n_erased"] == saved["n_saved"]  # its own blocks
        restored = http.post("/slots/0?action=restore", json={"filename": "lora.bin"}).json()
        assert restored["lora"] == [{"id": 0, "scale": 1.0}] and restored["n_restored"] == saved["n_saved"]
        body = {"prompt": ids, "n_predict": NUM_TOKENS, "temperature": 0, "return_tokens": True, "ignore_eos": True}
        plain = http.post("/completion", json={**body, "lora": [{"id": 0, "scale": 0.0}]}).json()
        assert plain["timings"]["cache_n"] == 0 and plain["tokens"] == peft_greedy(reference, ids, 0.0)
        again = http.post("/completion", json={**body, "lora": [{"id": 0, "scale": 1.0}]}).json()
        assert again["timings"]["cache_n"] == num_cached
        assert again["tokens"] == tuned == peft_greedy(reference, ids, 1.0)
    base = engine_like(served, EngineConfig(max_num_seqs=1, ctx_size=1024, slot_save_path=str(slot_dir)))
    try:
        with httpx.Client(base_url=start_server(base).address, timeout=300) as http:
            refused = http.post("/slots/0?action=restore", json={"filename": "lora.bin"})
    finally:
        base.close(30)
    assert refused.status_code == 400
    assert f"under LoRA adapters 0: {reference[0]} at scale 1, but this server's adapters are none" in refused.text
