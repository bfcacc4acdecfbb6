"""Image generation speed (spec J): seconds per image through mlxcel's image worker.

Builds a tiny random-weight Stable Diffusion pipeline (tests/workers/tiny_image_pipeline.py) shaped like
the real family where it matters for cost per pixel (a VAE that downsamples by 8, so 512x512 is a
64x64 latent; a two-level UNet with cross-attention at 32x32), or takes a real diffusers folder with
--model, loads it through `ImageGenerator.load` (the server's path) and times whole requests
through the worker (queue, thread, denoising, VAE decode, PNG encoding). Prints one JSON line.
Needs diffusers (`pip install 'mlxcel[image]'`).

    .venv/bin/python bench/image_gen.py --device cuda                   # tiny pipeline, 512x512, 20 steps
    .venv/bin/python bench/image_gen.py --device cuda --dtype float16 --model ./models/sd-turbo --steps 4
    .venv/bin/python bench/image_gen.py --size 64 --steps 2 --images 1  # a quick CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from mlxcel.workers.base import WorkerConfig  # noqa: E402
from mlxcel.workers.image import ImageConfig, ImageGenerator, ImageJob, ImageSpec  # noqa: E402
from tests.workers.tiny_image_pipeline import write_tiny_pipeline  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a diffusers pipeline folder (default: build the tiny one)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--size", type=int, default=512, help="width and height in pixels")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance", type=float, default=None, help="guidance scale (default: the pipeline's)")
    parser.add_argument("--images", type=int, default=5, help="timed images, after one warmup image")
    return parser.parse_args()


def tiny_pipeline(folder: Path) -> Path:
    return write_tiny_pipeline(folder / "tiny-sd-512", channels=(32, 64), vae_channels=(32, 64, 64, 64),
                               sample_size=64)


def time_images(generator: ImageGenerator, args: argparse.Namespace) -> list[float]:
    seconds = []
    for index in range(args.images + 1):
        spec = ImageSpec("a lighthouse on a cliff at dusk", width=args.size, height=args.size, steps=args.steps,
                         guidance_scale=args.guidance, seed=index)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        images = generator.run_sync(ImageJob(spec))
        assert images and (images[0].width, images[0].height) == (args.size, args.size)
        seconds.append(time.perf_counter() - start)
    return seconds[1:]  # the first pays for kernel selection and allocator growth


def main() -> int:
    args = parse_args()
    config = ImageConfig(args.device, args.dtype, WorkerConfig(queue_depth=2, batch_size=1, request_timeout_s=3600.0))
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.model or tiny_pipeline(Path(scratch))
        start = time.perf_counter()
        generator = ImageGenerator.load(folder, config)
        load_s = time.perf_counter() - start
        try:
            seconds = time_images(generator, args)
        finally:
            generator.stop(60.0)
    result = {"bench": "image_gen", "model": str(args.model) if args.model else "tiny-sd-512 (random weights)",
              "family": generator.family, "device": args.device,
              "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None, "dtype": args.dtype,
              "size": f"{args.size}x{args.size}", "steps": args.steps, "images": len(seconds),
              "load_s": round(load_s, 2), "seconds_per_image": round(statistics.median(seconds), 4),
              "seconds_per_step": round(statistics.median(seconds) / args.steps, 5),
              "min_s": round(min(seconds), 4), "max_s": round(max(seconds), 4),
              "torch": torch.__version__, "diffusers": _version("diffusers")}
    print(json.dumps(result))
    return 0


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    sys.exit(main())
