"""Issue 42: LoRA, KV quantization, speculative decoding and the disk prefix cache on top of every quantized format.

Tiny folders of one random qwen3, each written by the tool (or the tool's own layout) people get it from: MLX 4-bit
(mlx-lm's converter), GPTQ 4-bit (AutoGPTQ's packing), compressed-tensors W4A16 and FP8 block (compressed-tensors'
ModelCompressor). Each runs in the real engine, on the CPU default path (each linear packed from its stored codes),
with a peft LoRA adapter, `--cache-type-k/v q8_0`, prompt-lookup drafting and the disk prefix cache:
- the adapter's update over the packed model is peft's over the weights the folder encodes (transformers + peft);
- each served token (adapter on and off) is the packed model's own top choice without a KV cache, within the q8_0
  cache's rounding, and the adapter changes the tokens;
- drafted streams at temperature 0 equal the same engine's plain streams (drafts were verified);
- after a graceful stop, a new engine on the same cache folder serves the prompt from disk with the same tokens.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from mlxcel.config import EngineConfig, SpeculativeConfig
from mlxcel.layers.lora import apply_adapters, load_adapter
from mlxcel.loading import ResolvedModel, load_model
from mlxcel.serving.chat_model import start_served_model
from mlxcel.serving.served_model import RuntimeOptions, ServedModel
from mlxcel.types import Request, SamplingParams
from tests.layers.peft_adapters import make_adapter, set_peft_scale
from tests.layers.test_lora import our_logits
from tests.loading.test_quantized_checkpoints import (
    CT_SCHEMES, _convert, _packed, _tiny_hf, _write_compressed, gptq_folder,
)

peft = pytest.importorskip("peft")
pytest.importorskip("mlx_lm")
pytest.importorskip("compressed_tensors")
pytestmark = pytest.mark.slow

# Printable-ASCII ids of the tiny tokenizer, repeating: prompt lookup finds its n-grams and drafts.
PROMPT = [40, 72, 69, 0, 81, 85, 73, 67, 75, 0, 66, 82, 40, 72, 69, 0, 81, 85, 73, 67, 75, 0, 66, 82, 40, 72, 69]
OTHER = [50, 51, 52, 53, 50, 51, 52, 53, 50, 51, 52, 53, 54, 55, 56, 50, 51, 52, 53, 50, 51]
NUM_TOKENS = 8
ADAPTER_SCALE = 1.0
_ids = itertools.count()


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("hf")
    _tiny_hf(folder, head_dim=32)  # q8_0 KV blocks are 32 values
    return folder


@pytest.fixture(scope="module")
def peft_adapter(hf_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A random peft LoRA over the float checkpoint: its folder, and the peft model (the reference)."""
    out = tmp_path_factory.mktemp("adapter") / "a"
    return out, make_adapter(hf_folder, out, r=4, alpha=8, seed=1)


@pytest.fixture(scope="module")
def adapter(peft_adapter: tuple[Path, Any]) -> Path:
    return peft_adapter[0]


FORMATS = {  # name -> writer of the folder
    "mlx-4bit": lambda hf, out: _convert(hf, out, 4, 32),
    "gptq-4bit": gptq_folder,
    "ct-w4a16": lambda hf, out: _write_compressed(hf, out, *CT_SCHEMES["w4a16"]),
    "ct-fp8-block": lambda hf, out: _write_compressed(hf, out, *CT_SCHEMES["fp8-block"]),
}


@pytest.fixture(scope="module", params=list(FORMATS))
def folder(request: pytest.FixtureRequest, hf_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return FORMATS[request.param](hf_folder, tmp_path_factory.mktemp(request.param) / "m")


def _engine_config(cache_dir: Path, draft_kind: str) -> EngineConfig:
    return EngineConfig(max_num_seqs=2, ctx_size=256, decode_step="eager", cache_type_k="q8_0", cache_type_v="q8_0",
                        prefix_cache_dir=str(cache_dir), prefix_cache_disk_bytes=1 << 24,
                        speculative=SpeculativeConfig(draft_kind=draft_kind, ngram_size=2, draft_max=4))


def _serve(folder: Path, adapter: Path, config: EngineConfig) -> ServedModel:
    options = RuntimeOptions(warmup=False, quantize="auto", adapters=((adapter, 1.0),))
    return start_served_model(ResolvedModel(folder, folder.name, "test"), options, config)


def _generate(served: ServedModel, prompt: list[int], scale: float) -> tuple[list[int], Any]:
    """Greedy tokens of one request and its last event (cached and drafted token counts)."""
    async def run() -> tuple[list[int], Any]:
        tokens, last = [], None
        params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
        async for event in served.engine.generate(Request(f"qf-{next(_ids)}", prompt, params, lora_scales=(scale,))):
            tokens.extend(event.token_ids)
            last = event
        return tokens, last

    return asyncio.run(run())


@pytest.fixture(scope="module")
def served(folder: Path, adapter: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One engine with every feature on (drafting included) over `folder`, stopped gracefully (its prefix blocks
    go to disk), then a restarted one on the same cache folder without drafting; the streams of each."""
    cache_dir = tmp_path_factory.mktemp("prefix-cache")
    config = _engine_config(cache_dir, "prompt-lookup")
    first = _serve(folder, adapter, config)
    try:
        drafted = {(name, scale): _generate(first, prompt, scale)
                   for name, prompt, scale in (("prompt", PROMPT, 0.0), ("prompt", PROMPT, ADAPTER_SCALE),
                                               ("other", OTHER, ADAPTER_SCALE))}
    finally:
        assert first.close(30)
    second = _serve(folder, adapter, replace(config, speculative=SpeculativeConfig()))
    try:
        # OTHER first, cold (its blocks were on disk too: a cache-off request computes it), then PROMPT from disk.
        plain_other = _run_uncached(second, OTHER)
        restarted = _generate(second, PROMPT, ADAPTER_SCALE)
    finally:
        second.close(30)
    yield {"drafted": drafted, "plain_other": plain_other, "restarted": restarted}


def _run_uncached(served: ServedModel, prompt: list[int]) -> list[int]:
    async def run() -> list[int]:
        tokens = []
        params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
        request = Request(f"qf-{next(_ids)}", prompt, params, cache_prompt=False, lora_scales=(ADAPTER_SCALE,))
        async for event in served.engine.generate(request):
            tokens.extend(event.token_ids)
        return tokens

    return asyncio.run(run())


@pytest.fixture(scope="module")
def packed_with_adapter(folder: Path, adapter: Path) -> torch.nn.Module:
    model = _packed(folder)
    apply_adapters(model, [load_adapter(adapter)])
    return model


def test_lora_update_over_the_packed_codes_is_peft_over_the_encoded_weights(
        folder: Path, peft_adapter: tuple[Path, Any], packed_with_adapter: torch.nn.Module) -> None:
    reference = peft_adapter[1]
    encoded = dict(load_model(folder).model.named_parameters())  # the folder's weights dequantized; names = HF's
    with torch.no_grad():  # the peft model's base weights become the ones the folder encodes
        for name, param in reference.base_model.model.named_parameters():
            if "lora_" not in name:
                param.copy_(encoded[name.replace(".base_layer", "")])
    want = []
    for scale in (0.0, ADAPTER_SCALE):
        set_peft_scale(reference, scale)
        with torch.no_grad():
            want.append(reference(torch.tensor([PROMPT])).logits[0])
    base, tuned = (our_logits(packed_with_adapter, [PROMPT], [(s,)])[0] for s in (0.0, ADAPTER_SCALE))
    update = want[1] - want[0]
    assert float(update.abs().max()) > 0.1  # the adapter acts
    assert float((tuned - base - update).abs().max()) < 0.05 * float(update.abs().max())


def test_served_tokens_are_the_packed_models_own_with_the_adapter_and_a_q8_0_cache(
        served: dict[str, Any], packed_with_adapter: torch.nn.Module) -> None:
    for (name, scale), (tokens, _) in served["drafted"].items():
        prompt = PROMPT if name == "prompt" else OTHER
        logits = our_logits(packed_with_adapter, [prompt + tokens], [(scale,)])[0][len(prompt) - 1:-1]
        chosen = logits.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
        # q8_0 K and V round the cached keys and values: a near tie of the float-cache reference may go either way.
        tolerance = 0.02 * float(logits.abs().max())
        assert bool((chosen >= logits.amax(-1) - tolerance).all()), (name, scale, tokens, logits.argmax(-1).tolist())
    assert served["drafted"][("prompt", 0.0)][0] != served["drafted"][("prompt", ADAPTER_SCALE)][0]


def test_drafted_stream_equals_the_plain_one(served: dict[str, Any]) -> None:
    tokens, last = served["drafted"][("other", ADAPTER_SCALE)]
    assert served["plain_other"] == tokens
    assert sum(event.num_drafted for _, event in served["drafted"].values()) > 0  # drafts were verified


def test_restarted_engine_serves_the_prompt_from_disk_with_the_same_tokens(served: dict[str, Any]) -> None:
    tokens, last = served["restarted"]
    assert last.num_cached_tokens > 0  # the restarted engine read the blocks the first one wrote
    assert tokens == served["drafted"][("prompt", ADAPTER_SCALE)][0]
