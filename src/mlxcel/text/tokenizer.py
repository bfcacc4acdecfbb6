"""The model's tokenizer: text to token ids and back, plus the special tokens the API layer needs.

`Tokenizer` wraps a Hugging Face `tokenizers.Tokenizer` (Rust) built either from a GGUF file's
metadata (`from_gguf`) or from a Hugging Face folder's tokenizer.json (`from_pretrained_dir`).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from mlxcel.loading.errors import ModelLoadError
from mlxcel.text.gguf_vocab import build_backend, byte_alphabet, template_processor

logger = logging.getLogger(__name__)

# Special tokens that end a turn in common chat formats; each counts as an end-of-sequence token
# when the vocabulary has it as a special token (llama.cpp's end-of-generation set does the same).
END_OF_TURN_TOKENS = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>",
    "<|end_of_text|>", "<|return|>", "<|call|>", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
    "<EOT>",
)  # fmt: skip

# Fill-in-the-middle token spellings by role, in the order they are tried.
FIM_TOKEN_SPELLINGS: Mapping[str, tuple[str, ...]] = {
    "prefix": ("<fim_prefix>", "<|fim_prefix|>", "<|fim▁begin|>", "<PRE>", "▁<PRE>"),
    "suffix": ("<fim_suffix>", "<|fim_suffix|>", "<|fim▁hole|>", "<SUF>", "▁<SUF>"),
    "middle": ("<fim_middle>", "<|fim_middle|>", "<|fim▁end|>", "<MID>", "▁<MID>"),
    "pad": ("<fim_pad>", "<|fim_pad|>"),
    "repo": ("<repo_name>", "<|repo_name|>", "<reponame>"),
    "sep": ("<file_sep>", "<|file_sep|>"),
}
_GGUF_FIM_KEYS = {
    "prefix": "pre", "suffix": "suf", "middle": "mid", "pad": "pad", "repo": "rep", "sep": "sep",
}  # fmt: skip

THINK_MARKER_PAIRS = (("<think>", "</think>"),)

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass(frozen=True, slots=True)
class FimTokenIds:
    """Fill-in-the-middle token ids; None where the vocabulary lacks that role."""

    prefix: int | None = None
    suffix: int | None = None
    middle: int | None = None
    pad: int | None = None
    repo: int | None = None
    sep: int | None = None

    @property
    def is_available(self) -> bool:
        return None not in (self.prefix, self.suffix, self.middle)


@dataclass(frozen=True, slots=True)
class ThinkMarkers:
    """The strings that open and close a reasoning block, each a single token."""

    start: str
    end: str


class Tokenizer:
    """Encodes text to token ids and decodes ids to text, with the model's special tokens."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        end_token_ids: Iterable[int] = (),
        fim_token_ids: Mapping[str, int] | None = None,
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        self._end_token_ids = frozenset(int(i) for i in end_token_ids)
        self._declared_fim = dict(fim_token_ids or {})
        self.num_ids = self.vocab_size  # the id space: past vocab_size where the model's rows are padded

    def cover_model_rows(self, num_rows: int) -> None:
        """Widen the id space to a model's embedding rows (Qwen2.5: 151,936 rows for 151,665 tokens).

        The ids past the tokenizer are llama.cpp's `[PAD{id}]` tokens of type UNUSED: an id a model may
        rank or emit, whose text and bytes are empty (llama.cpp's token_to_piece and vLLM's decode agree)."""
        self.num_ids = max(self.vocab_size, int(num_rows))

    def is_padding_id(self, token_id: int) -> bool:
        """An id past the tokenizer's vocabulary (a padded embedding row): no text, no bytes."""
        return token_id >= self.vocab_size or token_id < 0

    # --- constructors ---------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """The tokenizer described by a GGUF file's metadata (`GGUFFile(path).metadata`)."""
        backend = build_backend(metadata)
        ends = [metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
        fim = {
            role: metadata[f"tokenizer.ggml.fim_{key}_token_id"]
            for role, key in _GGUF_FIM_KEYS.items()
            if metadata.get(f"tokenizer.ggml.fim_{key}_token_id") is not None
        }
        return cls(
            backend,
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=metadata.get("tokenizer.ggml.eos_token_id"),
            end_token_ids=[int(i) for i in ends if i is not None],
            fim_token_ids=fim,
            pad_token_id=metadata.get("tokenizer.ggml.padding_token_id"),
            unk_token_id=metadata.get("tokenizer.ggml.unknown_token_id"),
        )

    @classmethod
    def from_pretrained_dir(cls, path: str | Path) -> Tokenizer:
        """The tokenizer of a Hugging Face model folder (tokenizer.json and its config files)."""
        folder = Path(path)
        file = folder / "tokenizer.json"
        if not file.is_file():
            raise ModelLoadError(f"{folder}: no tokenizer.json (a Hugging Face tokenizer is required)")
        try:
            backend = BackendTokenizer.from_file(str(file))
        except Exception as exc:  # noqa: BLE001 - the Rust loader raises plain Exceptions
            raise ModelLoadError(f"{file}: not a readable tokenizer.json ({exc})") from exc
        # NOTE: some tokenizer.json files pad or truncate to a fixed length; a prompt must do neither.
        backend.no_padding()
        backend.no_truncation()
        # tokenizer_config.json wins over the older special_tokens_map.json.
        config = {
            **_read_json(folder / "special_tokens_map.json"),
            **_read_json(folder / "tokenizer_config.json"),
        }
        generation_eos = _as_id_list(_read_json(folder / "generation_config.json").get("eos_token_id"))
        bos_id = _token_id(backend, config.get("bos_token"))
        eos_id = _token_id(backend, config.get("eos_token"))
        if eos_id is None and generation_eos:
            eos_id = generation_eos[0]
        _apply_bos_eos_flags(backend, config, bos_id, eos_id)
        return cls(backend, bos_token_id=bos_id, eos_token_id=eos_id, end_token_ids=generation_eos,
                   pad_token_id=_token_id(backend, config.get("pad_token")),
                   unk_token_id=_token_id(backend, config.get("unk_token")))

    # --- text <-> ids ---------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. With `add_special_tokens`, BOS (and EOS) are added only where the
        model's configuration says so. Special-token text such as `<|im_start|>` is matched whole.
        Pass add_special_tokens=False for prompts rendered from a chat template (they carry BOS)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """The text of `token_ids`; an incomplete UTF-8 character decodes to U+FFFD."""
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary spelling of a token (e.g. "Ġhello" or "▁hello"), not its text."""
        return self.backend.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a single token stands for (what logprobs report as `bytes`); none for a padded id."""
        token = self.backend.id_to_token(token_id) if not self.is_padding_id(token_id) else None
        if token is None:
            return b""
        if token_id in self._added_token_ids:
            return token.encode("utf-8")
        if self._is_byte_level:
            inverse = _inverse_byte_alphabet()
            if all(ch in inverse for ch in token):
                return bytes(inverse[ch] for ch in token)
            return token.encode("utf-8")
        match = _BYTE_TOKEN.fullmatch(token)
        if match:
            return bytes([int(match.group(1), 16)])
        return token.replace("▁", " ").encode("utf-8")

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    # --- special tokens -------------------------------------------------------------------

    @property
    def bos_token(self) -> str | None:
        return self._token_text(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self._token_text(self.eos_token_id)

    @property
    def pad_token(self) -> str | None:
        return self._token_text(self.pad_token_id)

    @property
    def unk_token(self) -> str | None:
        return self._token_text(self.unk_token_id)

    @cached_property
    def adds_bos_token(self) -> bool:
        """Whether encoding with special tokens puts BOS first (the post-processor's template)."""
        ids = self.backend.encode("a", add_special_tokens=True).ids
        return self.bos_token_id is not None and bool(ids) and ids[0] == self.bos_token_id

    @cached_property
    def eos_token_ids(self) -> frozenset[int]:
        """Every token that ends generation: EOS, end-of-turn/message tokens and config extras."""
        ids = set(self._end_token_ids)
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        for text in END_OF_TURN_TOKENS:
            token_id = self.backend.token_to_id(text)
            if token_id is not None and token_id in self.special_token_ids:
                ids.add(token_id)
        # Harmony (gpt-oss) ends a message with <|end|> and generation with <|return|>.
        if self.backend.token_to_id("<|return|>") is not None:
            ids.discard(self.backend.token_to_id("<|end|>"))
        return frozenset(ids)

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of the added tokens marked special (what skip_special_tokens drops)."""
        added = self.backend.get_added_tokens_decoder()
        return frozenset(i for i, token in added.items() if token.special)

    @cached_property
    def fim_token_ids(self) -> FimTokenIds:
        """Fill-in-the-middle ids from the GGUF keys, else from well-known token spellings."""
        found = dict(self._declared_fim)
        for role, spellings in FIM_TOKEN_SPELLINGS.items():
            if role not in found:
                found[role] = next(
                    (i for i in map(self.backend.token_to_id, spellings) if i is not None), None
                )
        return FimTokenIds(**found)

    @cached_property
    def think_markers(self) -> ThinkMarkers | None:
        """The reasoning open/close strings when each is a single token, else None."""
        for start, end in THINK_MARKER_PAIRS:
            if self.backend.token_to_id(start) is not None and self.backend.token_to_id(end) is not None:
                return ThinkMarkers(start=start, end=end)
        return None

    # --- internals ------------------------------------------------------------------------

    def _token_text(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)

    @cached_property
    def _added_token_ids(self) -> frozenset[int]:
        return frozenset(self.backend.get_added_tokens_decoder())

    @cached_property
    def _is_byte_level(self) -> bool:
        decoder = self.backend.decoder
        return decoder is not None and b'"ByteLevel"' in decoder.__getstate__()


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: not valid JSON ({exc})") from exc
    return value if isinstance(value, dict) else {}


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json writes a token as a string or as a serialized AddedToken dict.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _token_id(backend: BackendTokenizer, value: Any) -> int | None:
    text = _token_content(value)
    return None if text is None else backend.token_to_id(text)


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [int(v) for v in value if isinstance(v, int)]
    return []


def _apply_bos_eos_flags(
    backend: BackendTokenizer, config: Mapping[str, Any], bos_id: int | None, eos_id: int | None
) -> None:
    """Make tokenizer.json's post-processor agree with explicit add_bos/eos_token flags."""
    if "add_bos_token" not in config and "add_eos_token" not in config:
        return
    probe = backend.encode("a", add_special_tokens=True).ids
    adds_bos = bos_id is not None and probe[:1] == [bos_id]
    adds_eos = eos_id is not None and probe[-1:] == [eos_id]
    want_bos = bool(config.get("add_bos_token", adds_bos)) and bos_id is not None
    want_eos = bool(config.get("add_eos_token", adds_eos)) and eos_id is not None
    if (want_bos, want_eos) == (adds_bos, adds_eos):
        return
    bos = (backend.id_to_token(bos_id), bos_id) if want_bos and bos_id is not None else None
    eos = (backend.id_to_token(eos_id), eos_id) if want_eos and eos_id is not None else None
    backend.post_processor = template_processor(bos, eos)


@lru_cache(maxsize=1)
def _inverse_byte_alphabet() -> dict[str, int]:
    return {ch: b for b, ch in byte_alphabet().items()}
