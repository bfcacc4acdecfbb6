"""Issue 43: `--mmproj`: a Gemma 3 text GGUF and llama.cpp's projector GGUF beside it (tensor names from the
gguf package's own MMPROJ name map, metadata under its `clip.vision.*` keys, the soft-embedding norm stored
as 1 + w and the input projection in F16, as llama.cpp's converter writes them) load into one model whose
logits with an image equal transformers' Gemma3ForConditionalGeneration on the same weights."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from mlxcel.loading import ModelLoadError, load_model
from mlxcel.loading.mmproj import attach_mmproj
from mlxcel.text.tokenizer import Tokenizer

from .harness import write_tiny_gguf
from .test_vision_families import FAMILIES, _our_logits, _prompt, _reference_logits
from .vision_checkpoints import png, write_gemma3_vlm, write_idefics3_vlm, write_llava_vlm

TOL = 2e-5


def clip_writer(path: Path, config: transformers.PretrainedConfig, projector: str, *, num_layers: int | None = None,
                use_gelu: bool = True) -> gguf.GGUFWriter:
    """A projector GGUF's writer with the `clip.vision.*` keys llama.cpp's MmprojModel writes for every tower."""
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_clip_has_vision_encoder(True)
    writer.add_clip_projector_type(projector)
    writer.add_vision_image_size(config.image_size)
    writer.add_vision_patch_size(config.patch_size)
    writer.add_vision_embedding_length(config.hidden_size)
    writer.add_vision_feed_forward_length(config.intermediate_size)
    writer.add_vision_block_count(config.num_hidden_layers if num_layers is None else num_layers)
    writer.add_vision_head_count(config.num_attention_heads)
    writer.add_vision_attention_layernorm_eps(config.layer_norm_eps)
    writer.add_vision_image_mean([0.5] * 3)
    writer.add_vision_image_std([0.5] * 3)
    writer.add_vision_use_gelu(use_gelu)
    return writer


def finish(writer: gguf.GGUFWriter, path: Path) -> Path:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_mmproj(reference: torch.nn.Module, path: Path) -> Path:
    config = reference.config.vision_config
    writer = clip_writer(path, config, gguf.VisionProjectorType.GEMMA3)
    writer.add_vision_projector_scale_factor((config.image_size // config.patch_size) // 2)  # 4 tokens: 2 a side
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, config.num_hidden_layers)
    for name, tensor in reference.model.state_dict().items():
        if not name.startswith(("vision_tower.", "multi_modal_projector.")) or ".head." in name:
            continue
        hf = "vision_tower.vision_model." + name.removeprefix("vision_tower.") if name.startswith("vision_tower.") \
            else name.replace("_weight", ".weight")
        stem, kind = hf.rsplit(".", 1)
        array = tensor.float().numpy()
        if "soft_emb_norm" in stem:
            array = array + 1.0
        if "input_projection" in stem:
            array = array.astype(np.float16)
        writer.add_tensor(f"{names.get_name(stem)}.{kind}", array)
    return finish(writer, path)


def write_idefics3_mmproj(reference: torch.nn.Module, path: Path) -> Path:
    """SmolVLM's projector file as llama.cpp's SmolVLMModel converter writes it (conversion/smolvlm.py)."""
    config = reference.config.vision_config
    writer = clip_writer(path, config, gguf.VisionProjectorType.IDEFICS3)
    writer.add_vision_projector_scale_factor(reference.config.scale_factor)
    writer.add_vision_preproc_image_size(64)  # the checkpoint's processor: size.longest_edge
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, config.num_hidden_layers)
    for name, tensor in reference.state_dict().items():
        if name.startswith(("model.vision_model.", "model.connector.")):
            stem, kind = name.rsplit(".", 1)
            writer.add_tensor(f"{names.get_name(stem)}.{kind}", tensor.float().numpy())
    return finish(writer, path)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("gemma3_mmproj")
    reference, ids = write_gemma3_vlm(folder / "hf", pattern=6)  # llama.cpp fixes gemma3's pattern at 6
    text = transformers.Gemma3ForCausalLM(reference.config.text_config)
    text.model.load_state_dict(reference.model.language_model.state_dict())
    text.lm_head.weight = text.model.embed_tokens.weight
    write_tiny_gguf(text.eval(), "gemma3", folder / "text.gguf")
    return reference, ids, folder


def test_issue43_gemma3_text_gguf_with_mmproj_matches_transformers(pair) -> None:
    reference, ids, folder = pair
    model = load_model(folder / "text.gguf").model
    tokenizer = Tokenizer.from_pretrained_dir(folder / "hf")
    attach_mmproj(model, write_mmproj(reference, folder / "mmproj.gguf"), tokenizer)
    with torch.no_grad():  # the reference with the projection the file holds (F16, as the converter writes it)
        weight = reference.model.multi_modal_projector.mm_input_projection_weight
        weight.copy_(weight.half().float())
    prompter = model.image_prompter(None, tokenizer)  # no preprocessor_config.json: the file's settings
    family = FAMILIES["gemma3"]
    for num_images in (1, 2):
        token_ids, images = prompter.prepare(_prompt(family, ids, num_images), [png(i) for i in range(num_images)])
        ours = _our_logits(model, token_ids, images)
        expected = _reference_logits(family, reference, token_ids, images, ids[family.image_token])
        assert (ours - expected).abs().max() <= TOL


def test_issue43_smolvlm_llama_text_gguf_with_idefics3_mmproj_matches_transformers(tmp_path: Path) -> None:
    """SmolVLM as llama.cpp ships it: a llama text GGUF and an idefics3 mmproj; the pair's logits with one and
    two images (tiles and the global image) equal transformers' Idefics3ForConditionalGeneration."""
    reference, ids = write_idefics3_vlm(tmp_path / "hf")
    text = transformers.LlamaForCausalLM(reference.config.text_config)
    text.model.load_state_dict(reference.model.text_model.state_dict())
    text.lm_head.weight.data.copy_(reference.lm_head.weight)
    model = load_model(write_tiny_gguf(text.eval(), "llama", tmp_path / "text.gguf")).model
    tokenizer = Tokenizer.from_pretrained_dir(tmp_path / "hf")
    attach_mmproj(model, write_idefics3_mmproj(reference, tmp_path / "mmproj.gguf"), tokenizer)
    prompter = model.image_prompter(None, tokenizer)  # the file's processor settings
    family = FAMILIES["idefics3"]
    for num_images in (1, 2):
        token_ids, images = prompter.prepare(_prompt(family, ids, num_images), [png(i) for i in range(num_images)])
        assert [image.num_tokens for image in images] == [family.tokens_per_image] * num_images
        ours = _our_logits(model, token_ids, images)
        expected = _reference_logits(family, reference, token_ids, images, ids[family.image_token])
        assert (ours - expected).abs().max() <= TOL


def legacy_clip_name(name: str) -> str:
    """llama.cpp's tools/mtmd/legacy-models/convert_image_encoder_to_gguf.py `get_tensor_name`, as it is."""
    if name.startswith("multi_modal_projector"):
        return name.replace("multi_modal_projector", "mm").replace("linear_1", "0").replace("linear_2", "2")
    return name.replace("text_model", "t").replace("vision_model", "v").replace("encoder.layers", "blk").replace(
        "embeddings.", "").replace("_proj", "").replace("self_attn.", "attn_").replace("layer_norm", "ln").replace(
        "layernorm", "ln").replace("mlp.fc1", "ffn_down").replace("mlp.fc2", "ffn_up").replace(
        "embedding", "embd").replace("final", "post").replace("layrnorm", "ln")


def write_llava_mmproj(reference: torch.nn.Module, path: Path) -> Path:
    """LLaVA 1.5's projector file as the legacy CLIP converter writes it: the layers up to the feature layer
    (-2: all but the last), no final norm, ffn names swapped, the projector's matrices in F16."""
    config = reference.config.vision_config
    num_kept = config.num_hidden_layers - 1  # NOTE: the file's block count is the kept layers
    writer = clip_writer(path, config, "mlp", num_layers=num_kept, use_gelu=config.hidden_act == "gelu")
    writer.add_array("clip.vision.feature_layer", [num_kept])
    for name, tensor in reference.model.vision_tower.state_dict().items():
        name = name if name.startswith("vision_model.") else "vision_model." + name  # a hub CLIPVisionModel's
        if "post_layernorm" in name or "position_ids" in name or f"layers.{num_kept}." in name:
            continue
        writer.add_tensor(legacy_clip_name(name), tensor.float().squeeze().numpy())
    for name, tensor in reference.model.multi_modal_projector.state_dict().items():
        array = tensor.float().numpy()
        writer.add_tensor(legacy_clip_name("multi_modal_projector." + name),
                          array.astype(np.float16) if array.ndim == 2 else array)
    return finish(writer, path)


def test_issue43_llama_text_gguf_with_llava_mlp_mmproj_matches_transformers(tmp_path: Path) -> None:
    """LLaVA 1.5 as llama.cpp ships it: a llama text GGUF and the legacy converter's "mlp" projector file; the
    pair's logits with one and two images equal transformers' LlavaForConditionalGeneration."""
    reference, ids = write_llava_vlm(tmp_path / "hf")
    with torch.no_grad():  # the reference with the projector matrices the file holds (F16)
        for linear in (reference.model.multi_modal_projector.linear_1, reference.model.multi_modal_projector.linear_2):
            linear.weight.copy_(linear.weight.half().float())
    text = transformers.LlamaForCausalLM(reference.config.text_config)
    text.model.load_state_dict(reference.model.language_model.state_dict())
    text.lm_head.weight.data.copy_(reference.lm_head.weight)
    model = load_model(write_tiny_gguf(text.eval(), "llama", tmp_path / "text.gguf")).model
    tokenizer = Tokenizer.from_pretrained_dir(tmp_path / "hf")
    attach_mmproj(model, write_llava_mmproj(reference, tmp_path / "mmproj.gguf"), tokenizer)
    prompter = model.image_prompter(None, tokenizer)  # the tower's size, the file's normalisation
    assert list(prompter.processor.image_mean) == list(prompter.processor.image_std) == [0.5] * 3  # the file's
    family = FAMILIES["llava"]
    for num_images in (1, 2):
        token_ids, images = prompter.prepare(_prompt(family, ids, num_images), [png(i) for i in range(num_images)])
        ours = _our_logits(model, token_ids, images)
        expected = _reference_logits(family, reference, token_ids, images, ids[family.image_token])
        assert (ours - expected).abs().max() <= TOL


def test_issue43_an_mmproj_of_another_projector_type_is_refused(pair, tmp_path: Path) -> None:
    _, _, folder = pair
    model = load_model(folder / "text.gguf").model
    writer = gguf.GGUFWriter(str(tmp_path / "other.gguf"), "clip")
    writer.add_clip_projector_type("pixtral")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="projector type 'pixtral' is not supported"):
        attach_mmproj(model, tmp_path / "other.gguf", Tokenizer.from_pretrained_dir(folder / "hf"))
