"""Issue 43's GPU figure, run on the lent GPU (see bench/RESULTS.md):

    PYTHONPATH=src python3 bench/gpu_vision.py [--out DIR] [--batches 1,16]

Images a second through a vision-language model's encoder (tower + projector, `Model.encode_images`, the
call the engine makes once per step for every image that step needs): Gemma 3 4B's vision side at its real
shape (SigLIP so400m: 27 layers, hidden 1152, 896x896 images as 4,096 patches, pooled to 256 tokens of the
2,560-wide text model) with random weights in bfloat16, beside transformers' `get_image_features` on the
same weights. The text model is a 1-layer stand-in: only the encoder is timed.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

VISION = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
              image_size=896, patch_size=14, vision_use_head=False)
TEXT = dict(hidden_size=2560, intermediate_size=256, num_hidden_layers=1, num_attention_heads=8,
            num_key_value_heads=4, head_dim=256, vocab_size=262208)


def random_gemma3(folder: Path) -> Path:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(0)
    config = Gemma3Config(text_config=TEXT, vision_config=VISION, mm_tokens_per_image=256)
    with torch.device("cuda"):
        model = Gemma3ForConditionalGeneration(config).to(torch.bfloat16)
    with torch.no_grad():  # transformers starts the projector at zero: every image would encode to zeros
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.02)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def timed(fn, repeats: int = 5) -> float:  # noqa: ANN001
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("/tmp"))
    parser.add_argument("--batches", default="1,16")
    args = parser.parse_args()
    from transformers import Gemma3ForConditionalGeneration

    from mlxcel.loading import load_model
    from mlxcel.types import ImageInput

    path = random_gemma3(Path("/tmp/gemma3-vision-random"))
    ours = load_model(path, device="cuda", dtype=torch.bfloat16).model
    ref = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    report: dict = {"device": torch.cuda.get_device_name(), "vision": VISION}
    g = torch.Generator().manual_seed(1)
    for batch in (int(b) for b in args.batches.split(",")):
        pixels = torch.randn(batch, 3, 896, 896, generator=g)
        images = [ImageInput(f"d{i}", ((0, 256),), {"pixel_values": pixels[i:i + 1]}, True) for i in range(batch)]
        on_gpu = pixels.to("cuda", torch.bfloat16)
        with torch.inference_mode():
            mine = torch.stack(ours.encode_images(images))
            theirs = ref.model.get_image_features(pixel_values=on_gpu)
            theirs = getattr(theirs, "pooler_output", theirs)
            theirs = torch.stack(list(theirs)) if isinstance(theirs, (list, tuple)) else theirs
            diff = float((mine.float() - theirs.float().reshape(mine.shape)).abs().max() / theirs.float().abs().max())
            ours_s = timed(lambda: ours.encode_images(images))
            ref_s = timed(lambda: ref.model.get_image_features(pixel_values=on_gpu))
        report[f"batch_{batch}"] = {"ours_images_s": round(batch / ours_s, 1), "transformers_images_s":
                                    round(batch / ref_s, 1), "ratio": round(ref_s / ours_s, 2),
                                    "max_rel_diff_bf16": round(diff, 4)}
        print(json.dumps(report), flush=True)
    text = json.dumps(report, indent=1)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_vision.json").write_text(text)


if __name__ == "__main__":
    main()
