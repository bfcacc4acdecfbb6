"""A tiny random Florence-2 checkpoint of the real architecture (DaViT vision tower + BART), written offline.

The files are the ones a hub checkpoint has, written by transformers' own save_pretrained:
config.json + model.safetensors, and the processor's (processor_config.json with the CLIP image
processor and the post-processor rules, tokenizer.json + tokenizer_config.json). The tokenizer
is a byte-level BPE trained here on a few sentences, with BART's special tokens at ids 0-3, the
1,000 location tokens and <image>, as Florence-2's tokenizer has them.
"""

from __future__ import annotations

from pathlib import Path

import torch

IMAGE_SIDE = 32  # the processor resizes every image to this square
NUM_IMAGE_TOKENS = 17  # two DaViT stages (strides 4, 2): 4x4 patches + one pooled token
DECODER_WINDOW = 256  # BART's max_position_embeddings
_CORPUS = ["What does the image describe? A red car parks beside a green tree on the street.",
           "Locate the objects with category name in the image.", "What is the text in the image, with regions?",
           "Describe in detail what is shown in the image.", "Locate the phrases in the caption: a red car"]
_EXTRA_TOKENS = ["<od>", "</od>", "<ocr>", "</ocr>", *[f"<loc_{i}>" for i in range(1000)], "<cap>", "</cap>",
                 "<poly>", "</poly>", "<sep>"]
_POST_PROCESSOR = {
    "ocr": {"pattern": r"(.+?)<loc_(\d+)><loc_(\d+)><loc_(\d+)><loc_(\d+)><loc_(\d+)><loc_(\d+)><loc_(\d+)><loc_(\d+)>",
            "area_threshold": 0.0},
    "phrase_grounding": {"banned_grounding_tokens": ["the image"]},
    "pure_text": {}, "description_with_bboxes": {}, "description_with_polygons": {}, "polygons": {}, "bboxes": {},
    "description_with_bboxes_or_polygons": {},
}


def write_tiny_florence2(folder: Path, seed: int = 0) -> Path:
    """Model, processor and tokenizer files in `folder` (about 1 MB)."""
    from transformers import Florence2Config, Florence2ForConditionalGeneration, Florence2Processor

    tokenizer = _tokenizer(folder)
    processor = Florence2Processor(image_processor=_image_processor(), tokenizer=tokenizer,
                                   post_processor_config=_POST_PROCESSOR)
    processor.save_pretrained(folder)
    config = Florence2Config(text_config=_bart_config(len(tokenizer)), vision_config=_davit_config(),
                             image_token_id=tokenizer.image_token_id)
    torch.manual_seed(seed)
    Florence2ForConditionalGeneration(config).eval().save_pretrained(folder)
    return folder


def _tokenizer(folder: Path):  # noqa: ANN202 - a transformers tokenizer
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import BartTokenizer

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(_CORPUS, trainer)
    bpe.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    bpe.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    path = folder / "bpe.json"
    bpe.save(str(path))
    tokenizer = BartTokenizer(tokenizer_file=str(path), extra_special_tokens=_EXTRA_TOKENS, image_token="<image>",
                              model_max_length=1024)
    path.unlink()
    return tokenizer


def _image_processor():  # noqa: ANN202
    from transformers import CLIPImageProcessorPil

    side = {"height": IMAGE_SIDE, "width": IMAGE_SIDE}
    return CLIPImageProcessorPil(size=side, crop_size=side, do_center_crop=False, resample=3,
                                 image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225],
                                 image_seq_length=NUM_IMAGE_TOKENS)


def _bart_config(vocab_size: int) -> dict[str, object]:
    return {"model_type": "bart", "vocab_size": vocab_size, "max_position_embeddings": DECODER_WINDOW,
            "encoder_layers": 1, "decoder_layers": 1, "encoder_ffn_dim": 32, "decoder_ffn_dim": 32,
            "encoder_attention_heads": 2, "decoder_attention_heads": 2, "d_model": 16, "bos_token_id": 0,
            "pad_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 2, "forced_bos_token_id": 0}


def _davit_config() -> dict[str, object]:
    return {"depths": [1, 1], "patch_size": [7, 3], "patch_stride": [4, 2], "patch_padding": [3, 1],
            "patch_prenorm": [False, True], "embed_dim": [8, 16], "num_heads": [1, 2], "num_groups": [1, 2],
            "window_size": 4, "projection_dim": 16, "drop_path_rate": 0.0}
