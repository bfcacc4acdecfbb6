"""Short test videos made with PyAV: frame i is a flat gray of level step * i (8 by default), so a
decoded frame names its index."""

from __future__ import annotations

import io

import av
import numpy as np
from PIL import Image


def make_video(num_frames: int = 30, rate: int = 10, width: int = 64, height: int = 48, step: int = 8) -> bytes:
    """An MPEG-4 video in an MP4 container: `num_frames` frames at `rate` frames per second."""
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for index in range(num_frames):
            pixels = np.full((height, width, 3), (step * index) % 256, dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def frame_index(image: Image.Image, step: int = 8) -> int:
    """The index a decoded frame of `make_video` was made from (lossy coding moves a level a little)."""
    return round(image.getpixel((image.width // 2, image.height // 2))[0] / step)
