"""Gemma 3: the shared decoder's Gemma recipe (Gemma3ForCausalLM's parameter names) and, for a
Gemma3ForConditionalGeneration checkpoint, its vision side (issue 43, models/_vision.py): a SigLIP
tower (`vision_tower.`), then the projector (4x4 average pooling of the 64x64 patch grid to 256 tokens, a (1 + w)
RMSNorm, one matmul into the text width). Each image becomes `<start_of_image>`, 256 soft tokens,
`<end_of_image>` between blank lines (Gemma3Processor's expansion); its soft tokens attend each
other both ways in prefill.

Differences from Llama: embeddings scaled by sqrt(hidden); (1 + w) RMSNorms, also on q and k
per head; norms before and after both attention and MLP; tanh-GELU MLP; a fixed query scale
(query_pre_attn_scalar); sliding-window layers with their own rope theta, interleaved with
global layers (which alone take the rope scaling).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from mlxcel.layers.decoder import (
    FULL, SLIDING, AttentionRecipe, DecoderArgs, DecoderLM, MLPRecipe, NormRecipe, RopeRecipe, activation,
)
from mlxcel.layers.norm import RMSNorm
from mlxcel.layers.rope import rope_settings
from mlxcel.layers.vision import VisionRecipe, VisionTransformer, pool_patches
from mlxcel.models import _mmproj
from mlxcel.models._gguf import unshift_norms
from mlxcel.models._vision import (
    ImageInput, PromptTokenizer, config_token, decode_image, expand_markers, image_digest, load_image_processor,
    LLAVA_TEXT_PREFIXES, LLAVA_VISION_PREFIXES, VisionFamily, pixel_batch, placeholder_runs, single_token,
)

if TYPE_CHECKING:
    from collections.abc import Mapping

    from mlxcel.models._gguf import GGUFTensors

SANDWICH_NORMS = {"attn_in": "input_layernorm", "attn_out": "post_attention_layernorm",
                  "mlp_in": "pre_feedforward_layernorm", "mlp_out": "post_feedforward_layernorm"}


@dataclass(frozen=True)
class ModelArgs(DecoderArgs):
    head_dim: int | None = 256
    rope_theta: float = 1_000_000.0  # global layers
    rope_local_base_freq: float = 10_000.0
    rope_local_scaling: dict[str, Any] | None = None
    query_pre_attn_scalar: float = 256.0
    sliding_window: int | None = 4096  # applies to the sliding layers only
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = True
    hidden_activation: str = "gelu_pytorch_tanh"
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None

    NORM_NAMES: ClassVar[Mapping[str, str]] = SANDWICH_NORMS

    @classmethod
    def prepare(cls, config: dict[str, Any]) -> dict[str, Any]:
        _check_supported(config)
        return {**config, **_rope_fields(config), "layer_types": _layer_types(config),
                "hidden_activation": config.get("hidden_activation") or "gelu_pytorch_tanh"}

    @property
    def embed_scale(self) -> float:
        return self.hidden_size**0.5

    @property
    def final_softcap(self) -> float | None:
        return self.final_logit_softcapping

    def layer_rope(self, layer_idx: int) -> RopeRecipe:
        if self.is_sliding(layer_idx):
            return RopeRecipe.of(self.rope_local_base_freq, self.rope_local_scaling, self.dim_per_head)
        return RopeRecipe.of(self.rope_theta, self.rope_scaling, self.dim_per_head)

    def norm_recipe(self) -> NormRecipe:
        return NormRecipe("rms", self.rms_norm_eps, offset=1.0)

    def attention_recipe(self, layer_idx: int) -> AttentionRecipe:
        return replace(super().attention_recipe(layer_idx), scale=float(self.query_pre_attn_scalar) ** -0.5,
                       qk_norm="head", softcap=self.attn_logit_softcapping)

    def mlp_recipe(self, layer_idx: int) -> MLPRecipe:
        return MLPRecipe(self.intermediate_size, self.hidden_activation)


def _check_supported(config: dict[str, Any]) -> None:
    if config.get("use_bidirectional_attention"):
        raise ValueError("gemma3: use_bidirectional_attention (an embedding model) is not supported")
    activation(config.get("hidden_activation") or "gelu_pytorch_tanh")


def _rope_fields(config: dict[str, Any]) -> dict[str, Any]:
    """Global and local rope from `rope_parameters` (keyed by layer type) or the older flat keys."""
    theta, scaling = rope_settings(config, FULL, default_theta=1_000_000.0)
    params = config.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get(SLIDING), dict):
        local_theta, local_scaling = rope_settings(config, SLIDING)
    else:
        local_theta, local_scaling = float(config.get("rope_local_base_freq") or 10_000.0), None
    return {"rope_theta": theta, "rope_scaling": scaling,
            "rope_local_base_freq": local_theta, "rope_local_scaling": local_scaling}


def _layer_types(config: dict[str, Any]) -> tuple[str, ...]:
    if config.get("layer_types"):
        return tuple(config["layer_types"])
    # Older configs give a pattern: every n-th layer is global, the rest slide.
    pattern = int(config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 6)
    return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(config["num_hidden_layers"]))


IS_VISION_LANGUAGE = True


class Projector(nn.Module):
    """Gemma3MultiModalProjector: pool the patch grid to mm_tokens_per_image, norm, project."""

    def __init__(self, vision: dict[str, Any], text_hidden: int) -> None:
        super().__init__()
        width = int(vision["vision_config"]["hidden_size"])
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(width, text_hidden))
        self.mm_soft_emb_norm = RMSNorm(width, float(vision["vision_config"].get("layer_norm_eps", 1e-6)), offset=1.0)
        self.patches_per_side = int(vision["vision_config"]["image_size"]) // int(vision["vision_config"]["patch_size"])
        tokens_per_side = int(int(vision.get("mm_tokens_per_image", 256)) ** 0.5)
        self.kernel = self.patches_per_side // tokens_per_side

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[B, patches, vision hidden] -> [B, tokens, text hidden]."""
        pooled = pool_patches(features, self.patches_per_side, self.kernel)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).to(features.dtype)


class ImagePrompter:
    """Gemma 3's processor side (models/_vision.py): transformers' Gemma3 image processor with the
    checkpoint's settings; each `<start_of_image>` marker becomes Gemma3Processor's full image sequence."""

    def __init__(self, vision: dict[str, Any], model_dir: Path | None, tokenizer: PromptTokenizer) -> None:
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        size = int(vision["vision_config"]["image_size"])
        self.processor = load_image_processor(model_dir, Gemma3ImageProcessorPil, size={"height": size, "width": size},
                                              image_mean=vision.get("image_mean", [0.5] * 3),
                                              image_std=vision.get("image_std", [0.5] * 3))
        self.boi = config_token(vision, "boi_token_index", "boi_token_id")
        self.eoi = config_token(vision, "eoi_token_index", "eoi_token_id")
        self.image_token = config_token(vision, "image_token_index", "image_token_id")
        self.num_tokens = int(vision.get("mm_tokens_per_image", 256))
        self.marker = tokenizer.decode([self.boi], skip_special_tokens=False)
        self.newlines = tokenizer.encode("\n\n", add_special_tokens=False)

    def prepare(self, token_ids: list[int], images: Sequence[bytes]) -> tuple[list[int], tuple[ImageInput, ...]]:
        sequence = [*self.newlines, self.boi, *[self.image_token] * self.num_tokens, self.eoi, *self.newlines]
        expanded = expand_markers(token_ids, self.boi, [sequence] * len(images))
        runs = placeholder_runs(expanded, self.image_token)
        if len(runs) != len(images):
            raise ValueError("the prompt holds image soft tokens outside its images")
        pixels = self.processor(images=[decode_image(data) for data in images], return_tensors="pt")["pixel_values"]
        return expanded, tuple(ImageInput(image_digest(data), (run,), {"pixel_values": pixels[i:i + 1]},
                                          is_bidirectional=True)
                               for i, (data, run) in enumerate(zip(images, runs)))




class Model(VisionFamily, DecoderLM):
    ARGS = ModelArgs
    PROMPTER = ImagePrompter
    TEXT_PREFIXES, VISION_PREFIXES = LLAVA_TEXT_PREFIXES, LLAVA_VISION_PREFIXES
    DROPPED_VISION = ("head.",)  # SigLIP's pooling head (vision_use_head): an output Gemma 3 never reads

    def __init__(self, args: DecoderArgs) -> None:
        super().__init__(args)
        self.vision = args.extra.get("vision")
        if self.vision is not None:
            self.vision_tower = VisionTransformer(VisionRecipe.from_config(self.vision["vision_config"]))
            self.multi_modal_projector = Projector(self.vision, args.hidden_size)

    def encode_images(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        """Every image through the tower and projector in one batch: [mm_tokens_per_image, hidden] each."""
        pixels = pixel_batch(images, self.multi_modal_projector.mm_input_projection_weight)
        return list(self.multi_modal_projector(self.vision_tower(pixels)).unbind(0))


# GGUF per-layer tensor names that differ from the Llama mapping.
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def gguf_config(config: dict[str, Any], gguf: GGUFTensors) -> dict[str, Any]:
    """Settings llama.cpp fixes in code for gemma3 rather than storing them in the file: every 6th
    layer global unless the file gives a pattern, local rope theta 10000 unless `rope.freq_base_swa`."""
    config = {**config, "rope_local_base_freq": gguf.arch_value("rope.freq_base_swa", 10_000.0),
              "sliding_window_pattern": 6, "query_pre_attn_scalar": gemma_query_scalar(config, 62)}
    return config


def gemma_query_scalar(config: dict[str, Any], layers_of_27b: int) -> int:
    """llama.cpp: the 27B (by its layer count) scales queries by hidden/heads, every other size by head_dim."""
    if config["num_hidden_layers"] == layers_of_27b:
        return config["hidden_size"] // config["num_attention_heads"]
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


fix_gguf_weights = unshift_norms  # the converter stores (1 + w)


# ---- llama.cpp's projector file (--mmproj, loading/mmproj.py) ----

def attach_mmproj(model: Model, mmproj: Any, tokenizer: PromptTokenizer) -> None:
    """The SigLIP tower and projector from llama.cpp's gemma3 mmproj GGUF (its `clip.vision.*` settings;
    tensor names as tools/mtmd/clip-impl.h names them), attached to a text model loaded from GGUF."""
    config = _mmproj.vision_config(mmproj)
    tokens_per_side = config["image_size"] // config["patch_size"] // int(
        _mmproj.clip_value(mmproj, "projector.scale_factor", 4))
    vision = {"vision_config": config, "mm_tokens_per_image": tokens_per_side**2,
              "image_mean": list(_mmproj.clip_value(mmproj, "image_mean", [0.5] * 3)),
              "image_std": list(_mmproj.clip_value(mmproj, "image_std", [0.5] * 3)),
              **{key: single_token(tokenizer, text, "gemma3") for key, text in (
                  ("boi_token_index", "<start_of_image>"), ("eoi_token_index", "<end_of_image>"),
                  ("image_token_index", "<image_soft_token>"))}}
    param = next(model.model.norm.parameters())
    projector = Projector(vision, model.args.hidden_size)
    projector.load_state_dict({
        "mm_input_projection_weight": _mmproj.tensor(mmproj, "mm.input_projection.weight"),
        "mm_soft_emb_norm.weight": _mmproj.tensor(mmproj, "mm.soft_emb_norm.weight") - 1.0,  # (1 + w) stored
    }, strict=True)
    model.vision_tower = _mmproj.load_tower(mmproj, config, param)
    model.multi_modal_projector = projector.to(param.device, param.dtype).eval()
    model.vision = vision


