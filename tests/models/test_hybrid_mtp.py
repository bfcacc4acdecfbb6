"""Issue 41 / F10: Qwen3.5 and Qwen3-Next draft with their own MTP head (`mtp.*`: fc over [embedding;
hidden state] with norms, one full-attention decoder layer of the target's kind, a final norm).

- the head (layers/mtp.py) computes what transformers 5.25's generic `MtpLayer` computes over the
  family's own decoder layer and norm, dense (qwen3_5_text) and MoE (qwen3_next), and rows after a
  context equal one pass;
- served (the real served-model path, `--mtp on`): a tiny qwen3_5 checkpoint with `mtp.*` tensors
  added to its safetensors drafts through the MTP policy, drafts are accepted (the head is made to
  predict what the main model mostly predicts) and some rejected (the recurrent state rolls back),
  and the temperature-0 streams equal plain decoding (`--mtp off`) and transformers' greedy tokens.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.modeling_layers import MtpLayer as ReferenceMtpLayer

from mlxcel.config import EngineConfig, SpeculativeConfig
from mlxcel.engine.spec.mtp import load_mtp_head
from mlxcel.loading import load_model, resolve_model
from mlxcel.serving.chat_model import start_served_model
from mlxcel.serving.served_model import RuntimeOptions, ServedModel
from mlxcel.types import Request, SamplingParams
from tests.loading.tiny_checkpoint import EOS, tiny_tokenizer_json

from .harness import save_tiny_hf

SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             intermediate_size=128, max_position_embeddings=512, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=16, linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"])
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
FAMILIES = {
    "qwen3_5_text": (lambda vocab: transformers.Qwen3_5TextConfig(**SMALL, vocab_size=vocab),
                     "transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5"),
    "qwen3_next": (lambda vocab: transformers.Qwen3NextConfig(**SMALL, **MOE, vocab_size=vocab),
                   "transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3Next"),
}
# transformers' generic MtpLayer names -> the Qwen3-Next / Qwen3.5 checkpoints' names under `mtp.`
NAMES = {"enorm.": "pre_fc_norm_embedding.", "hnorm.": "pre_fc_norm_hidden.", "eh_proj.": "fc.",
         "mtp_block.": "layers.0.", "post_norm.": "norm."}
FULL_ATTENTION = 1  # SMALL's layer_types: the MTP layer is built as this layer is


def _reference_head(family: str, vocab: int, seed: int = 1) -> tuple[ReferenceMtpLayer, object, object]:
    import importlib

    make, module, prefix = FAMILIES[family]
    config = make(vocab)
    config._attn_implementation = "eager"
    modeling = importlib.import_module(module)
    torch.manual_seed(seed)
    layer = ReferenceMtpLayer(config, getattr(modeling, f"{prefix}DecoderLayer"), getattr(modeling, f"{prefix}RMSNorm"),
                              FULL_ATTENTION).eval()
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0.0, 0.2)
    rotary = getattr(modeling, f"{prefix}TextRotaryEmbedding" if family == "qwen3_5_text" else f"{prefix}RotaryEmbedding")
    return layer, config, rotary(config)


def _checkpoint_names(reference: ReferenceMtpLayer) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in reference.state_dict().items():
        for old, new in NAMES.items():
            if name.startswith(old):
                name = new + name.removeprefix(old)
                break
        out["mtp." + name] = tensor.clone()
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_mtp_head_equals_transformers_mtp_layer(family: str, tmp_path: Path) -> None:
    """Loaded from the checkpoint's names (qwen3_next: per-expert tensors, stacked by the family's sanitize)."""
    save_tiny_hf(FAMILIES[family][0](128), tmp_path)
    target = load_model(tmp_path).model
    reference, config, rotary = _reference_head(family, 128)
    head = load_mtp_head(target, _checkpoint_names(reference), ("mtp.",), device="cpu", dtype=torch.float32)
    previous, embeds = torch.randn(7, 64), torch.randn(7, 64)
    positions = torch.arange(3, 10)
    mask = torch.full((7, 7), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        expected = reference(embeds[None], previous[None], position_embeddings=rotary(embeds[None], positions[None]),
                             attention_mask=mask, position_ids=positions[None], cache=None)[0]
        got, k, v = head(previous, embeds, positions, None)
        # Rows after a context of the first rows' own keys and values equal the single pass.
        _, k5, v5 = head(previous[:5], embeds[:5], positions[:5], None)
        tail, _, _ = head(previous[5:], embeds[5:], positions[5:], (k5, v5))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(tail, got[5:], rtol=1e-5, atol=1e-5)
    assert k.shape == v.shape == (7, 2, 16)


# ---- served: the MTP policy drafting with the head ----

NUM_TOKENS = 24
MIXER_SCALE = 0.01  # how much the recurrent, attention and MLP layers add to the embedding (0: all drafts right)
PROMPTS = ["The quick brown fox", "jumps over the lazy dog and the"]


def _mtp_checkpoint(folder: Path) -> tuple[torch.nn.Module, list[list[int]]]:
    """A tiny qwen3_5 (the release's layout: text model under `model.language_model`, `mtp.*` beside it).

    Its mixers' and MLP's output projections are scaled down (MIXER_SCALE), so the main model mostly predicts the next
    token from the current one alone (its hidden state is mostly the token's embedding; the norms are
    unit: Qwen3.5's (1 + w) with w = 0); the MTP head passes its token's embedding through (`fc` = [I, 0],
    its layer's outputs zero), so it predicts that same next token: its drafts are often right, and
    wrong where the recurrent and attention layers tip the main model's choice."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tiny_tokenizer_json()[0])
    vocab = tokenizer.get_vocab_size()
    reference = save_tiny_hf(FAMILIES["qwen3_5_text"][0](vocab), folder)
    weights = load_file(str(folder / "model.safetensors"))
    for name in list(weights):
        if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")):
            weights[name] = weights[name] * MIXER_SCALE
        elif name.endswith("norm.weight") and "linear_attn" not in name and "_norm" not in name.rsplit(".", 2)[-2]:
            weights[name] = torch.zeros_like(weights[name])
    # The end token (which ignore_eos bans from the stream, not from the head's drafts) is never the argmax.
    weights["lm_head.weight"][vocab - 1] = 0.0
    head = _checkpoint_names(_reference_head("qwen3_5_text", vocab)[0])
    hidden = 64
    head["mtp.fc.weight"] = torch.cat((torch.eye(hidden), torch.zeros(hidden, hidden)), dim=1)
    for name in head:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            head[name] = torch.zeros_like(head[name])
        elif "norm" in name.rsplit(".", 2)[-2] and "self_attn" not in name:  # pre_fc_norm_*, layer norms, norm
            head[name] = torch.zeros_like(head[name])
    nested = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
              for k, v in weights.items()}
    save_file({**nested, **head}, str(folder / "model.safetensors"))
    reference.load_state_dict(weights)  # the reference computes the modified main model
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({
        "model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": {**config, "mtp_num_hidden_layers": 1}, "tie_word_embeddings": False}))
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS, "bos_token": None}))
    return reference, [tokenizer.encode(p).ids for p in PROMPTS]


@pytest.fixture(scope="module")
def mtp_served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, ServedModel], list, list]]:
    folder = tmp_path_factory.mktemp("qwen3_5_mtp")
    reference, prompts = _mtp_checkpoint(folder)
    eos = reference.config.vocab_size - 1  # tiny_tokenizer_json's last token; ignore_eos bans it, as llama.cpp does
    with torch.inference_mode():
        expected = [reference.generate(torch.tensor([p]), max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS,
                                       do_sample=False, suppress_tokens=[eos])[0, len(p):].tolist() for p in prompts]
    served = {mode: start_served_model(resolve_model(str(folder)), RuntimeOptions(warmup=False, quantize="off"),
                                       EngineConfig(max_num_seqs=2, ctx_size=512, decode_step="eager", block_size=16,
                                                    speculative=SpeculativeConfig(mtp=mode)))
              for mode in ("on", "off")}
    yield served, prompts, expected
    for model in served.values():
        model.close(30)


async def _greedy(served: ServedModel, request_id: str, prompt: list[int]) -> list[int]:
    tokens: list[int] = []
    sampling = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    async for event in served.engine.generate(Request(request_id, prompt, sampling)):
        tokens.extend(event.token_ids)
    return tokens


@pytest.mark.slow
def test_f10_qwen3_5_mtp_head_drafts_and_streams_equal_plain_decoding(mtp_served) -> None:
    served, prompts, expected = mtp_served
    on, off = served["on"], served["off"]
    assert on.mtp.state == "forced" and on.mtp.is_enabled and on.mtp.num_mtp_layers == 1
    assert off.mtp.state == "forced" and not off.mtp.is_enabled
    for i, prompt in enumerate(prompts):  # one at a time: the MTP policy drafts at batch 1
        plain = asyncio.run(_greedy(off, f"off{i}", prompt))
        drafted = asyncio.run(_greedy(on, f"on{i}", prompt))
        assert plain == expected[i]
        assert drafted == plain
    drafts = on.engine.stats().drafts
    assert drafts is not None and drafts.kind == "mtp"
    # Accepted drafts (the head predicts what the main model mostly does) and rejected ones (rolled back).
    assert 0 < drafts.num_accepted < drafts.num_drafted and drafts.acceptance_rate > 0.2, drafts  # seen: 18 of 48
    assert off.engine.stats().drafts is None or off.engine.stats().drafts.num_drafted == 0
