"""Decoding uploads and encoding speech (spec G): every kind of bad audio is a clear AudioInputError."""

from __future__ import annotations

import io
import re
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import soundfile

from mlxcel.loading import ModelLoadError
from mlxcel.workers.audio_checkpoints import AudioKind, detect_audio_checkpoint, verify_audio_checkpoint
from mlxcel.workers.audio_io import (
    AudioInputError, AudioTooLongError, decode_audio, encode_audio, streaming_wav_header, to_int16,
)


def tone(seconds: float, rate: int = 22050) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)


def encoded(samples: np.ndarray, rate: int, fmt: str) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format=fmt)
    return buffer.getvalue()


@pytest.mark.parametrize("fmt", ["WAV", "FLAC", "OGG", "MP3"])
def test_decodes_common_containers_to_16k_mono(fmt: str) -> None:
    decoded = decode_audio(encoded(tone(1.0), 22050, fmt), max_duration_s=60)
    assert decoded.samples.dtype == np.float32
    assert abs(decoded.duration_s - 1.0) < 0.08  # MP3 and Vorbis pad a little
    assert 0.15 < float(np.abs(decoded.samples).max()) <= 1.0


def test_stereo_is_mixed_down() -> None:
    stereo = np.stack([tone(0.5), tone(0.5)], axis=1)
    assert decode_audio(encoded(stereo, 22050, "WAV"), max_duration_s=60).samples.ndim == 1


@pytest.mark.parametrize("data, message", [
    (b"", "empty (0 bytes)"),
    (b"this is plain text, not audio at all " * 20, "not a decodable audio file"),
    (b"\x89PNG\r\n\x1a\n" + bytes(200), "no audio stream"),
    (b"RIFF\x24\x00\x00\x00WAVEfmt ", "not a decodable audio file"),
])
def test_not_audio_is_refused_with_the_reason(data: bytes, message: str) -> None:
    with pytest.raises(AudioInputError, match=re.escape(message)):
        decode_audio(data, max_duration_s=60, filename="upload.wav")


def test_truncated_wav_is_refused() -> None:
    data = encoded(tone(1.0), 22050, "WAV")
    with pytest.raises(AudioInputError, match="truncated WAV"):
        decode_audio(data[: len(data) // 2], max_duration_s=60)


def test_header_only_wav_has_no_samples() -> None:
    with pytest.raises(AudioInputError, match="no audio samples"):
        decode_audio(encoded(tone(1.0), 22050, "WAV")[:44], max_duration_s=60)


def test_unsupported_sample_format_is_named() -> None:
    data = bytearray(encoded(tone(0.5), 22050, "WAV"))
    struct.pack_into("<H", data, 20, 0x99)  # an audio format code no decoder knows
    with pytest.raises(AudioInputError, match="unsupported codec or sample format"):
        decode_audio(bytes(data), max_duration_s=60)


def test_too_long_is_refused_naming_the_limit() -> None:
    with pytest.raises(AudioTooLongError, match="limit of 2 s"):
        decode_audio(encoded(tone(3.0), 22050, "WAV"), max_duration_s=2)


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3"])
def test_encoded_speech_reads_back(fmt: str) -> None:
    samples, rate = soundfile.read(io.BytesIO(encode_audio(tone(1.0, 24000), 24000, fmt)), dtype="float32")
    assert rate == 24000 and abs(len(samples) / rate - 1.0) < 0.08


def test_pcm_is_raw_int16() -> None:
    data = encode_audio(tone(0.5, 24000), 24000, "pcm")
    assert len(data) == 2 * 12000
    assert np.array_equal(np.frombuffer(data, "<i2"), to_int16(tone(0.5, 24000)))


def test_streamed_wav_header_is_readable() -> None:
    body = streaming_wav_header(22050) + to_int16(tone(0.5)).tobytes()
    samples, rate = soundfile.read(io.BytesIO(body), dtype="float32")
    assert rate == 22050 and len(samples) == int(0.5 * 22050)


# ---- checkpoint layouts ----

def write_ct2_whisper(folder: Path, spec: bytes = b"WhisperSpec") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    name = spec + b"\0"
    (folder / "model.bin").write_bytes(struct.pack("<IH", 6, len(name)) + name + bytes(64))
    (folder / "config.json").write_text("{}")
    (folder / "tokenizer.json").write_text("{}")
    return folder


def test_ct2_whisper_folder_is_detected_and_verified(tmp_path: Path) -> None:
    checkpoint = detect_audio_checkpoint(write_ct2_whisper(tmp_path / "whisper-base"))
    assert checkpoint is not None and checkpoint.kind is AudioKind.WHISPER
    verify_audio_checkpoint(checkpoint)
    (tmp_path / "whisper-base" / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="tokenizer.json: unreadable JSON"):
        verify_audio_checkpoint(checkpoint)


def test_other_ct2_specs_are_not_whisper(tmp_path: Path) -> None:
    assert detect_audio_checkpoint(write_ct2_whisper(tmp_path / "mt", b"TransformerSpec")) is None


def test_transformers_whisper_names_the_converter(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "whisper"}))
    with pytest.raises(ModelLoadError, match="ct2-transformers-converter"):
        detect_audio_checkpoint(tmp_path)


def test_piper_pair_and_kokoro_folder(tmp_path: Path) -> None:
    piper = tmp_path / "piper"
    piper.mkdir()
    (piper / "en_US-x-medium.onnx").write_bytes(b"\x08\x07rest")
    (piper / "en_US-x-medium.onnx.json").write_text(json.dumps({"audio": {"sample_rate": 22050},
                                                                 "phoneme_id_map": {}}))
    found = detect_audio_checkpoint(piper)
    assert found is not None and found.kind is AudioKind.PIPER
    verify_audio_checkpoint(found)
    assert detect_audio_checkpoint(piper / "en_US-x-medium.onnx") == found
    kokoro = tmp_path / "kokoro"
    kokoro.mkdir()
    (kokoro / "kokoro-v1.0.onnx").write_bytes(b"not onnx")
    (kokoro / "voices-v1.0.bin").write_bytes(b"x")
    found = detect_audio_checkpoint(kokoro)
    assert found is not None and found.kind is AudioKind.KOKORO
    with pytest.raises(ModelLoadError, match="not an ONNX model"):
        verify_audio_checkpoint(found)


def test_a_chat_gguf_is_not_audio(smollm2_path: Path) -> None:
    assert detect_audio_checkpoint(smollm2_path) is None
