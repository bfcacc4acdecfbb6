"""MiMo (F10): the main model is Qwen2's and leaves the MTP layers to the drafter; the MTP layer
computes what transformers' own MTP layer does (transformers 5.25's `MtpLayer` over a Qwen2 decoder
layer, hidden state first, post norm: MiMo's layout); the drafter's context built step by step gives
the rows a single pass gives."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers.modeling_layers import MtpLayer as ReferenceMtpLayer
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RMSNorm, Qwen2RotaryEmbedding

from mlxcel.engine.spec.mtp import MtpDrafter, MtpLayer, MtpSpec, load_mtp_layer
from mlxcel.loading import load_weights, open_checkpoint
from tests.models.harness import uncached_hidden, uncached_logits
from tests.server.mimo_model import write_mimo_model

CONFIG = {"model_type": "mimo", "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
          "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": 50}
NAMES = {"enorm.": "token_layernorm.", "hnorm.": "hidden_layernorm.", "eh_proj.": "input_proj.",
         "post_norm.": "final_layernorm.", "mtp_block.": ""}


def reference_layer() -> tuple[ReferenceMtpLayer, transformers.Qwen2Config]:
    config = transformers.Qwen2Config(**{k: v for k, v in CONFIG.items() if k != "model_type"})
    config.mtp_hidden_states_first = True  # MiMo fuses [hidden state, embedding]
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer = ReferenceMtpLayer(config, Qwen2DecoderLayer, Qwen2RMSNorm, 0, use_post_norm=True).eval()
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0.0, 0.3) if param.ndim > 1 else param.uniform_(0.5, 1.5)
    return layer, config


def ours_from(reference: ReferenceMtpLayer) -> MtpLayer:
    weights = {}
    for name, tensor in reference.state_dict().items():
        for old, new in NAMES.items():
            if name.startswith(old):
                name = new + name.removeprefix(old)
                break
        weights["model.mtp_layers.0." + name] = tensor
    return load_mtp_layer(CONFIG, weights, "model.mtp_layers.0.", device="cpu", dtype=torch.float32)


def test_mtp_layer_equals_transformers_mtp_layer() -> None:
    reference, config = reference_layer()
    ours = ours_from(reference)
    previous, embeds = torch.randn(7, 64), torch.randn(7, 64)
    positions = torch.arange(3, 10)
    rotary = Qwen2RotaryEmbedding(config)
    with torch.no_grad():
        expected = reference(embeds[None], previous[None], position_embeddings=rotary(embeds[None], positions[None]),
                             attention_mask=None, position_ids=positions[None], cache=None)[0]
        got, _, _ = ours(previous, embeds, positions, None)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_mtp_rows_after_a_context_equal_one_pass() -> None:
    ours = ours_from(reference_layer()[0])
    previous, embeds, positions = torch.randn(9, 64), torch.randn(9, 64), torch.arange(1, 10)
    with torch.no_grad():
        whole, _, _ = ours(previous, embeds, positions, None)
        _, k, v = ours(previous[:5], embeds[:5], positions[:5], None)
        tail, _, _ = ours(previous[5:], embeds[5:], positions[5:], (k, v))
    torch.testing.assert_close(tail, whole[5:], rtol=1e-5, atol=1e-5)


def test_mimo_is_qwen2_with_its_mtp_layers_left_out(tmp_path: Path) -> None:
    folder = write_mimo_model(tmp_path / "mimo", exact=False)
    loaded = load_weights(open_checkpoint(folder))
    assert loaded.model_type == "mimo"
    assert not [name for name, _ in loaded.model.named_parameters() if "mtp" in name]
    reference = transformers.Qwen2ForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    ids = [5, 17, 3, 99, 42, 8]
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(uncached_logits(loaded.model, ids), expected, rtol=1e-4, atol=1e-4)


def test_the_drafter_drafts_the_tokens_after_the_next_one(tmp_path: Path) -> None:
    """The exact checkpoint's MTP layer predicts the chain's token after next, and chains on its own output."""
    from safetensors.torch import load_file

    from mlxcel.text.tokenizer import Tokenizer

    folder = write_mimo_model(tmp_path / "exact", exact=True)
    loaded = load_weights(open_checkpoint(folder))
    layer = load_mtp_layer(loaded.config, load_file(str(folder / "model.safetensors")), "model.mtp_layers.0.",
                           device="cpu", dtype=torch.float32)
    drafter = MtpDrafter(layer, loaded.model, max_draft=3)
    tokenizer = Tokenizer.from_pretrained_dir(folder)
    ids = tokenizer.encode("\nABC", add_special_tokens=False)
    # The target computed every position but the last (whose token comes next). Its final hidden
    # states stand in for the tapped last-layer outputs: with unit norm weights the norm is idempotent.
    drafter.record("r", 0, uncached_hidden(loaded.model, ids)[:-1])
    seq = SimpleNamespace(request_id="r", token_ids=ids, num_computed_tokens=len(ids) - 1)
    assert tokenizer.decode(list(drafter.propose(seq, 3))) == "DEF"
    assert tokenizer.decode(list(drafter.propose(seq, 2))) == "DE"  # asked again at the same position
    drafter.free("r")
    assert drafter.num_requests == 0


@pytest.mark.parametrize("key", ["hidden_size", "num_attention_heads"])
def test_mtp_spec_reads_the_target_config(key: str) -> None:
    assert getattr(MtpSpec.from_config(CONFIG), {"num_attention_heads": "num_heads"}.get(key, key)) == CONFIG[key]
