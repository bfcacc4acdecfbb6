"""Issue 42: an MLX 4-bit folder (written by mlx-lm's converter) through the real HTTP server on port 0, on the
CPU default path (`--quantize auto`: each linear packed from the folder's own 4-bit codes): /props and
/v1/models say the format, the bits and the bytes resident, and each completion token is mlx's choice (within
the 4-bit kernel's rounding) and the packed model's own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from tokenizers import Tokenizer

from mlxcel.config import EngineConfig
from mlxcel.loading import load_model, resolve_model
from mlxcel.serving.chat_model import start_served_model
from mlxcel.serving.served_model import RuntimeOptions
from tests.loading.test_quantized_checkpoints import _convert, _packed, _tiny_hf
from tests.models.harness import uncached_logits

pytest.importorskip("mlx_lm")
pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox"
NUM_TOKENS = 8


@pytest.fixture(scope="module")
def mlx_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    hf = tmp_path_factory.mktemp("hf")
    _tiny_hf(hf, vocab_size=96)  # every id a character: the served text gives back the token ids
    return _convert(hf, tmp_path_factory.mktemp("mlx") / "m", 4, 64)


@pytest.fixture
def address(mlx_folder: Path, start_server) -> Iterator[str]:
    model = start_served_model(resolve_model(str(mlx_folder)), RuntimeOptions(warmup=False, quantize="auto"),
                               EngineConfig(max_num_seqs=2, ctx_size=256, decode_step="eager"))
    yield start_server(model).address
    model.close(30)


def test_issue42_mlx_4bit_folder_serves_and_reports_its_weights(address: str, mlx_folder: Path) -> None:
    props = httpx.get(f"{address}/props").json()["weights"]
    assert props["format"] == "mlx" and props["bits"] == 4 and props["group_size"] == 64
    assert props["description"] == "MLX affine 4-bit, groups of 64"
    file_bytes = sum(p.stat().st_size for p in mlx_folder.glob("*.safetensors"))
    assert props["file_bytes"] == file_bytes and 0 < props["resident_bytes"]
    card = httpx.get(f"{address}/v1/models").json()["data"][0]
    assert card["weights"] == props

    client = openai.OpenAI(base_url=f"{address}/v1", api_key="none")
    body = dict(model="m", prompt=PROMPT, max_tokens=NUM_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**body).choices[0].text
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(**body, stream=True)
                       if chunk.choices)
    assert whole == streamed and len(whole) == NUM_TOKENS
    # Each served token is mlx's top choice on the served prefix, or within twice the packed kernel's logit error
    # of it (the 4-bit kernel rounds activations to int8, as llama.cpp does: a near tie may go either way).
    tokenizer = Tokenizer.from_file(str(mlx_folder / "tokenizer.json"))
    prompt, served = tokenizer.encode(PROMPT).ids, tokenizer.encode(whole).ids
    dense = uncached_logits(load_model(mlx_folder).model, prompt + served)[len(prompt) - 1:-1]  # mlx's numbers
    packed = uncached_logits(_packed(mlx_folder), prompt + served)[len(prompt) - 1:-1]
    error = float((packed - dense).abs().max())
    chosen = dense.gather(1, torch.tensor(served)[:, None]).squeeze(1)
    assert bool((chosen >= dense.amax(-1) - 2 * error).all()), (served, dense.argmax(-1).tolist(), error)
    assert served == packed.argmax(-1).tolist()  # the served tokens are the packed model's, step by step
