"""Audio in and out: decode any upload FFmpeg reads into 16 kHz mono float32, encode speech.

Decoding goes through PyAV (FFmpeg: WAV, MP3, FLAC, OGG/Opus/Vorbis, WebM, M4A ...), the
library faster-whisper itself uses; every failure becomes an `AudioInputError` whose message
says what was wrong with the upload (HTTP 400), never an FFmpeg traceback. Encoding uses
libsndfile (soundfile) for WAV, FLAC and MP3; `pcm` is raw 16-bit little-endian samples.
A streamed WAV carries the "unknown length" sizes (0xFFFFFFFF) that players and OpenAI's
streamed WAV use, so its header can go out before the length is known.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass

import numpy as np

WHISPER_SAMPLE_RATE = 16_000
SPEECH_FORMATS = ("wav", "mp3", "flac", "pcm")  # what /v1/audio/speech can return
STREAMED_FORMATS = ("wav", "pcm")  # formats written chunk by chunk as the voice speaks
MEDIA_TYPES = {"wav": "audio/wav", "mp3": "audio/mpeg", "flac": "audio/flac", "pcm": "audio/pcm"}
_SNDFILE_FORMATS = {"wav": ("WAV", "PCM_16"), "flac": ("FLAC", "PCM_16"), "mp3": ("MP3", "MPEG_LAYER_III")}


class AudioInputError(ValueError):
    """The upload is not audio we can decode (HTTP 400); the message says why."""


class AudioTooLongError(AudioInputError):
    """The audio is longer than the server's limit (HTTP 400, naming the limit)."""


@dataclass(frozen=True, slots=True)
class DecodedAudio:
    samples: np.ndarray  # [num_samples] float32 in [-1, 1], mono, 16 kHz
    source_format: str  # the container FFmpeg recognised, e.g. "wav", "mp3"

    @property
    def duration_s(self) -> float:
        return len(self.samples) / WHISPER_SAMPLE_RATE


def decode_audio(data: bytes, *, max_duration_s: float, filename: str = "file") -> DecodedAudio:
    """Decode an uploaded file; raises AudioInputError (empty, not audio, broken, too long)."""
    import av

    if not data:
        raise AudioInputError(f"{filename}: the uploaded file is empty (0 bytes)")
    try:
        with av.open(io.BytesIO(data), mode="r", metadata_errors="ignore") as container:
            stream = _audio_stream(container, filename)
            samples = _decode_stream(container, stream, max_duration_s, filename)
            source_format = container.format.name.split(",")[0]
    except av.error.FFmpegError as exc:
        raise AudioInputError(f"{filename}: not a decodable audio file ({_ffmpeg_reason(exc)}); send WAV, MP3, "
                              "FLAC, OGG, WebM or M4A audio") from None
    if samples.size == 0:
        raise AudioInputError(f"{filename}: the file holds no audio samples")
    if source_format == "wav":
        _check_wav_complete(data, filename)
    return DecodedAudio(samples, source_format)


def _check_wav_complete(data: bytes, filename: str) -> None:
    # FFmpeg decodes a cut-off WAV without complaint; its data chunk size says what is missing.
    offset = 12
    while offset + 8 <= len(data):
        chunk_id, size = data[offset:offset + 4], struct.unpack_from("<I", data, offset + 4)[0]
        if chunk_id == b"data":
            available = len(data) - offset - 8
            if size not in (0, 0xFFFFFFFF) and available < size:
                raise AudioInputError(f"{filename}: truncated WAV file (its header declares {size} bytes of "
                                      f"audio, the upload holds {available})")
            return
        offset += 8 + size + (size & 1)


def _audio_stream(container: object, filename: str) -> object:
    streams = getattr(container, "streams").audio
    if not streams:
        raise AudioInputError(f"{filename}: the file has no audio stream")
    return streams[0]


def _decode_stream(container: object, stream: object, max_duration_s: float, filename: str) -> np.ndarray:
    import av

    resampler = av.AudioResampler(format="flt", layout="mono", rate=WHISPER_SAMPLE_RATE)
    max_samples = int(max_duration_s * WHISPER_SAMPLE_RATE)
    pieces: list[np.ndarray] = []
    num_samples = 0
    for frame in getattr(container, "decode")(stream):
        for out in resampler.resample(frame):
            pieces.append(out.to_ndarray().reshape(-1))
            num_samples += pieces[-1].size
        if num_samples > max_samples:
            raise AudioTooLongError(f"{filename}: the audio is longer than this server's limit of "
                                    f"{max_duration_s:g} s (--audio-max-duration-secs)")
    for out in resampler.resample(None):  # flush what the resampler holds
        pieces.append(out.to_ndarray().reshape(-1))
    return np.concatenate(pieces).astype(np.float32, copy=False) if pieces else np.zeros(0, np.float32)


def _ffmpeg_reason(exc: Exception) -> str:
    import av

    if isinstance(exc, av.error.DecoderNotFoundError):
        return "unsupported codec or sample format"
    text = getattr(exc, "strerror", None) or str(exc)
    return str(text).strip().rstrip(".") or type(exc).__name__


# ---- encoding speech ----

def to_int16(samples: np.ndarray) -> np.ndarray:
    return (np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2")


def encode_audio(samples: np.ndarray, sample_rate: int, response_format: str) -> bytes:
    """Encode a whole utterance (float32 mono) in one of SPEECH_FORMATS."""
    if response_format == "pcm":
        return to_int16(samples).tobytes()
    import soundfile

    container, subtype = _SNDFILE_FORMATS[response_format]
    buffer = io.BytesIO()
    soundfile.write(buffer, np.clip(samples, -1.0, 1.0), sample_rate, format=container, subtype=subtype)
    return buffer.getvalue()


def streaming_wav_header(sample_rate: int) -> bytes:
    """A 16-bit mono WAV header with unknown sizes, for a WAV written while it is produced."""
    unknown = 0xFFFFFFFF
    return (b"RIFF" + struct.pack("<I", unknown) + b"WAVE" + b"fmt " +
            struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16) +
            b"data" + struct.pack("<I", unknown))
