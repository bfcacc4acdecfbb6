"""Video parts as ordered still frames (spec C5), decoded with PyAV (FFmpeg).

A frame is taken every 1/fps seconds of the video (the block's `fps`, else `--video-fps`); when
that gives more than `--video-max-frames`, the kept ones are spread evenly over the whole video.
With a known duration the sample times are computed first; without one the candidates are
thinned as they come (every other one dropped, the step doubled, whenever there are twice the
limit). Either way at most 2 x max frames are ever held in memory.
Each frame passes the image decoder caps, and the frames count toward `--max-images`.
PyAV is imported where a video is decoded, so a text-only server never loads it (issue 26).
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

from PIL import Image

from mlxcel.media.errors import MediaError, Reason
from mlxcel.media.images import check_image_dimensions
from mlxcel.media.limits import MediaPolicy

if TYPE_CHECKING:
    import av

_TIME_EPSILON_S = 1e-6


def decode_video_frames(data: bytes, fps: float, max_frames: int, policy: MediaPolicy) -> list[Image.Image]:
    """The sampled frames of `data` as RGB images, in order; raises MediaError for a bad video."""
    import av  # PyAV (FFmpeg, tens of MB): only when a video is decoded

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise MediaError("media is not a video: it has no video stream", Reason.INVALID_VIDEO)
            stream = container.streams.video[0]
            check_image_dimensions(stream.codec_context.width, stream.codec_context.height, policy)
            duration_s = _duration_s(container, stream)
            frames = container.decode(stream)
            if duration_s is None:
                candidates = _sample(frames, 1.0 / fps, max_frames, policy)
            else:
                candidates = _take_at(frames, sample_times(duration_s, fps, max_frames), policy)
    except (av.FFmpegError, ValueError, EOFError) as exc:  # FFmpeg's and PyAV's refusals of bad data
        raise MediaError(f"media is not a decodable video: {exc}", Reason.INVALID_VIDEO) from None
    if not candidates:
        raise MediaError("the video has no frames", Reason.INVALID_VIDEO)
    return [candidates[i][1] for i in spread_indices(len(candidates), max_frames)]


def sample_times(duration_s: float, fps: float, max_frames: int) -> list[float]:
    """One time every 1/fps seconds over `duration_s`, at most `max_frames` of them spread evenly."""
    num_samples = max(1, math.ceil(duration_s * fps - _TIME_EPSILON_S))
    return [index / fps for index in spread_indices(num_samples, max_frames)]


def _duration_s(container: av.container.InputContainer, stream: av.VideoStream) -> float | None:
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration:
        from av import time_base

        return container.duration / time_base
    return None


def _take_at(frames: Iterable[av.VideoFrame], times: list[float], policy: MediaPolicy) -> list[tuple[float, Image.Image]]:
    """The first frame at or after each time (one frame covers every time it reaches)."""
    kept: list[tuple[float, Image.Image]] = []
    index = 0
    for frame in frames:
        if index == len(times):
            break
        time_s = frame.time if frame.time is not None else times[index]
        if time_s + _TIME_EPSILON_S < times[index]:
            continue
        check_image_dimensions(frame.width, frame.height, policy)
        kept.append((time_s, frame.to_image()))
        while index < len(times) and times[index] <= time_s + _TIME_EPSILON_S:
            index += 1
    return kept


def _sample(frames: Iterable[av.VideoFrame], step_s: float, max_frames: int, policy: MediaPolicy) -> list[tuple[float, Image.Image]]:
    kept: list[tuple[float, Image.Image]] = []
    next_s = 0.0
    for frame in frames:
        time_s = frame.time if frame.time is not None else next_s
        if time_s + _TIME_EPSILON_S < next_s:
            continue
        check_image_dimensions(frame.width, frame.height, policy)
        kept.append((time_s, frame.to_image()))
        if len(kept) > 2 * max_frames:  # thin out: every other frame, twice the step
            kept, step_s = kept[::2], step_s * 2
            next_s = kept[-1][0]
        while next_s <= time_s + _TIME_EPSILON_S:
            next_s += step_s
    return kept


def spread_indices(num_candidates: int, max_frames: int) -> list[int]:
    """`max_frames` indices spread evenly over `num_candidates` (first and last included), or all."""
    if num_candidates <= max_frames:
        return list(range(num_candidates))
    if max_frames == 1:
        return [0]
    return [round(i * (num_candidates - 1) / (max_frames - 1)) for i in range(max_frames)]
