"""Issue 40: a model_type with no module of ours loads through the transformers fallback
(models/_transformers.py): transformers' own modeling code with our paged attention plugged in.

Each family below has no module under mlxcel.models (the first test checks it still takes the fallback)
and reaches a different part of the fallback: StableLM (partial rotary, LayerNorm, GQA), GPT-NeoX (a
base model named `gpt_neox`, a parallel residual, and a checkpoint key transformers renames on load:
embed_out -> lm_head), OLMo 3 (q/k norms over whole projections, sliding-window layers from
`layer_types` beside a full-attention one).

Tolerances (float32, CPU) as tests/models/test_families.py: vs transformers <= 2e-5, same math <= 1e-5.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import transformers
from torch import nn

from mlxcel.loading import ModelLoadError, load_model

from .harness import cached_logits, greedy, lockstep_cached_logits, save_tiny_hf, uncached_logits

VOCAB = 128
TOL_VS_TRANSFORMERS = 2e-5
TOL_SAME_MATH = 1e-5
COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
              vocab_size=VOCAB, max_position_embeddings=256)

FAMILIES: dict[str, Callable[..., Any]] = {
    "stablelm": lambda **kw: transformers.StableLmConfig(**{**COMMON, "num_key_value_heads": 2, **kw}),
    "gpt_neox": lambda **kw: transformers.GPTNeoXConfig(**{**COMMON, **kw}),
    # 4 layers: three slide over a window of 4 (shorter than the prompts), the fourth attends to all.
    "olmo3": lambda **kw: transformers.Olmo3Config(**{**COMMON, "num_hidden_layers": 4, "num_key_value_heads": 2,
                                                      "sliding_window": 4, **kw}),
}

_rng = random.Random(2)
PROMPTS = [[_rng.randrange(VOCAB) for _ in range(n)] for n in (3, 8, 13, 21)]


@dataclass
class Tiny:
    family: str
    reference: nn.Module  # the transformers model the checkpoint was saved from (eager attention)
    ours: nn.Module
    implementation: str


@pytest.fixture(scope="module", params=list(FAMILIES))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    folder = tmp_path_factory.mktemp(request.param)
    reference = save_tiny_hf(FAMILIES[request.param](), folder)
    loaded = load_model(folder)
    assert loaded.model_type == request.param
    return Tiny(request.param, reference, loaded.model, loaded.implementation)


@torch.inference_mode()
def reference_logits(model: nn.Module, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0]


def test_family_without_a_module_takes_the_fallback(tiny: Tiny) -> None:
    import importlib.util

    assert importlib.util.find_spec(f"mlxcel.models.{tiny.family}") is None  # else pick another family here
    assert tiny.implementation == "transformers"
    assert type(tiny.ours).__module__ == "mlxcel.models._transformers"


def test_logits_equal_transformers(tiny: Tiny) -> None:
    for prompt in PROMPTS:
        torch.testing.assert_close(uncached_logits(tiny.ours, prompt), reference_logits(tiny.reference, prompt),
                                   atol=TOL_VS_TRANSFORMERS, rtol=0)


def test_paged_cache_with_chunked_prefill_equals_transformers(tiny: Tiny) -> None:
    """Chunked prefill (6 + 5 tokens) then one token a step over a paged, shuffled block table."""
    prompt = PROMPTS[-1]
    got = cached_logits(tiny.ours, prompt, (6, 5))
    torch.testing.assert_close(got, uncached_logits(tiny.ours, prompt), atol=TOL_SAME_MATH, rtol=0)
    torch.testing.assert_close(got, reference_logits(tiny.reference, prompt), atol=TOL_VS_TRANSFORMERS, rtol=0)


def test_mixed_batch_gives_each_prompt_its_own_logits(tiny: Tiny) -> None:
    """One mixed prefill step of four prompts, then all four decode together (the grouped decode path)."""
    for got, prompt in zip(lockstep_cached_logits(tiny.ours, PROMPTS, prefill_len=3), PROMPTS):
        torch.testing.assert_close(got, reference_logits(tiny.reference, prompt), atol=TOL_VS_TRANSFORMERS, rtol=0)


def test_greedy_16_tokens_equal_transformers(tiny: Tiny) -> None:
    prompt = PROMPTS[2]
    with torch.inference_mode():
        expected = _reference_generate(tiny.reference, prompt, 16, min_new_tokens=16)
    assert greedy(tiny.ours, prompt, 16) == expected


@torch.inference_mode()
def _reference_generate(reference: nn.Module, ids: list[int], num_tokens: int, **options: Any) -> list[int]:
    """Transformers' greedy continuation. NOTE: the attention mask is given: inferred, it would mask every
    prompt token equal to the pad id."""
    out = reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=num_tokens, do_sample=False, pad_token_id=0, **options)
    return out[0, len(ids):].tolist()


# ---- refusals: what our paged attention cannot compute is refused at load, in one line ----

def _fallback_model(config: Any) -> nn.Module:
    from mlxcel.models import _transformers

    args = _transformers.ModelArgs.from_dict(config.to_dict())
    with torch.device("meta"):
        return _transformers.Model(args)


def test_soft_capped_attention_is_refused() -> None:
    config = transformers.Gemma2Config(**COMMON, num_key_value_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="soft-capped"):
        _fallback_model(config)


@pytest.mark.parametrize(("shape", "match"), [
    (dict(global_head_dim=32), r"differ in head size / KV heads \[\(16, 2\), \(32, 2\)\]"),
    (dict(global_head_dim=16, num_kv_shared_layers=2), "reuse earlier layers' keys and values"),
])
def test_issue40_gemma4_text_layers_the_cache_cannot_hold_are_refused(shape: dict[str, Any], match: str) -> None:
    """Gemma 4 through the fallback (models/gemma4_text.py serves it natively; the fallback stays for what has no
    module): global layers of another head size, or KV-shared layers, are one clear refusal, not transformers'
    AmbiguousGlobalPerLayerAttributeError from deep inside the load."""
    config = transformers.Gemma4TextConfig(**{**COMMON, "num_hidden_layers": 4}, num_key_value_heads=2, head_dim=16,
                                           layer_types=["sliding_attention", "full_attention"] * 2, **shape)
    with pytest.raises(ValueError, match=match):
        _fallback_model(config)


def test_layers_without_attention_are_refused() -> None:
    config = transformers.Lfm2Config(**{**COMMON, "num_hidden_layers": 3}, num_key_value_heads=2,
                                     layer_types=["conv", "full_attention", "conv"])
    with pytest.raises(ValueError, match="layers without attention"):
        _fallback_model(config)


def test_probe_notes_attention_arguments_attend_cannot_honour() -> None:
    """Soft-capping and sinks reach the attention function as arguments (Gemma 2's `softcap`, gpt-oss's
    `s_aux`): the load-time probe notes them, so the model is refused."""
    from mlxcel.models import _transformers

    probe = _transformers._ProbeStep(_transformers.ModelArgs.from_dict(FAMILIES["stablelm"]().to_dict()))
    module = nn.Module()
    module.layer_idx = 1
    q, kv = torch.zeros(1, 4, 2, 16, device="meta"), torch.zeros(1, 2, 2, 16, device="meta")
    with _transformers.attending(probe):
        _transformers.paged_attention(module, q, kv, kv, None, scaling=0.25, softcap=30.0, s_aux=torch.zeros(4))
    assert probe.layers == [1]
    assert probe.problems == ["layer 1 has soft-capped attention scores", "layer 1 has attention sinks"]


def test_refusal_through_the_loader_is_one_line(tmp_path: Path) -> None:
    """A hybrid (recurrent) checkpoint that transformers knows and we do not (Bamba: Mamba-2 and attention; LFM2,
    the example before, is a family of ours since issue 41): one ModelLoadError line naming why."""
    config = transformers.BambaConfig(**{**COMMON, "num_hidden_layers": 2}, num_key_value_heads=2,
                                      attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1,
                                      mamba_d_state=16, mamba_chunk_size=16, time_step_limit=[0.0, 100.0])
    save_tiny_hf(config, tmp_path)
    with pytest.raises(ModelLoadError) as refused:
        load_model(tmp_path)
    message = str(refused.value)
    assert "\n" not in message and "bamba" in message and "layers without attention" in message


def test_unknown_model_type_names_both_paths(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_family"}))
    with pytest.raises(ModelLoadError, match="not supported.*any decoder model_type transformers knows"):
        load_model(tmp_path)


def test_native_family_says_native(tmp_path: Path) -> None:
    from tests.loading.tiny_checkpoint import tiny_llama_files, write_files

    assert load_model(write_files(tmp_path, tiny_llama_files())).implementation == "native"


# ---- end to end: the real engine on the CPU (CLI and HTTP server) ----

def _tiny_served_checkpoint(folder: Path) -> tuple[Path, Any]:
    """A tiny StableLM with the tiny ASCII tokenizer (one token a character) in HF layout; and the reference."""
    from tests.loading.tiny_checkpoint import EOS, tiny_tokenizer_json

    tokenizer_json, vocab_size = tiny_tokenizer_json()
    reference = save_tiny_hf(FAMILIES["stablelm"](vocab_size=vocab_size, eos_token_id=vocab_size - 1,
                                                  bos_token_id=None), folder, seed=3)
    (folder / "tokenizer.json").write_text(tokenizer_json)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS, "bos_token": None}))
    return folder, reference


def _reference_text(folder: Path, reference: nn.Module, prompt: str, num_tokens: int) -> str:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = tokenizer.encode(prompt).ids
    return tokenizer.decode(_reference_generate(reference, ids, num_tokens))


@pytest.mark.slow
def test_generate_cli_runs_the_fallback_through_the_engine(tmp_path: Path) -> None:
    """`mlxcel generate -m DIR`: the real engine (its decode step asked for the native CPU step, which a
    fallback model declines for the eager one) gives transformers' greedy text."""
    folder, reference = _tiny_served_checkpoint(tmp_path / "tiny-stablelm")
    prompt = "the quick brown fox"
    env = {k: v for k, v in os.environ.items() if k != "MLXCEL_NO_COMPILE"}  # the CPU default: the native step
    done = subprocess.run([sys.executable, "-m", "mlxcel.cli", "generate", "-m", str(folder), "-p", prompt,
                           "-n", "16", "--temp", "0", "--quantize", "off", "-v"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout == _reference_text(folder, reference, prompt, 16)
    assert "model code: transformers" in done.stderr and "decode step: eager" in done.stderr, done.stderr
    quantized = subprocess.run([sys.executable, "-m", "mlxcel.cli", "generate", "-m", str(folder), "-p", prompt,
                                "-n", "16", "--temp", "0", "--quantize", "auto", "-v"],
                               capture_output=True, text=True, timeout=300, env=env)
    assert quantized.returncode == 0, quantized.stderr  # the CPU decode rewrite's linears inside transformers' code
    assert "generation: " in quantized.stderr and "int8 weight-only matmuls" in quantized.stderr


@pytest.mark.slow
def test_server_serves_the_fallback_with_batching_and_prefix_cache(tmp_path: Path) -> None:
    """The real server on port 0: /props names the fallback; three concurrent /completion requests (continuous
    batching) and a repeat of one (a prefix-cache hit) each give transformers' greedy text."""
    import httpx

    from mlxcel.config import EngineConfig
    from mlxcel.loading import ResolvedModel
    from mlxcel.server.config import ServerConfig
    from mlxcel.server.lifecycle import ServerThread
    from mlxcel.server.state import ServerState
    from mlxcel.serving.chat_model import start_served_model
    from mlxcel.serving.served_model import RuntimeOptions

    folder, reference = _tiny_served_checkpoint(tmp_path / "tiny-stablelm")
    prompts = ["the quick brown fox jumps over the lazy dog, twice", "Hello there", "0123456789 abc"]
    expected = [_reference_text(folder, reference, p, 12) for p in prompts]
    served = start_served_model(ResolvedModel(folder, "tiny-stablelm", "test"),
                                RuntimeOptions(warmup=False, quantize="off"),
                                EngineConfig(max_num_seqs=3, decode_step="native"))
    server = ServerThread(ServerState(ServerConfig(port=0, endpoint_props=True), served)).start()
    try:
        props = httpx.get(server.address + "/props", timeout=30).json()
        assert props["model_implementation"] == "transformers"
        results: dict[int, dict[str, Any]] = {}

        def complete(i: int) -> None:
            body = {"prompt": prompts[i], "n_predict": 12, "temperature": 0}
            results[i] = httpx.post(server.address + "/completion", json=body, timeout=120).json()

        threads = [threading.Thread(target=complete, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [results[i]["content"] for i in range(len(prompts))] == expected
        complete(0)  # the same prompt again: its whole blocks come from the prefix cache
        assert results[0]["content"] == expected[0] and results[0]["tokens_cached"] > 0
    finally:
        server.stop()
        served.close()
