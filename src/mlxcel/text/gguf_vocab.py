"""Building a Hugging Face `tokenizers.Tokenizer` from a GGUF file's tokenizer metadata.

A GGUF carries no tokenizer.json, only llama.cpp's vocabulary keys. Two kinds are rebuilt here:
byte-level BPE (`tokenizer.ggml.model == "gpt2"`, split by the regex `tokenizer.ggml.pre` names)
and SentencePiece BPE (`"llama"`: scores, byte fallback, `▁` for spaces). Token ids equal those
of transformers' conversion of the same file, which the tests check on real models.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from mlxcel.loading.errors import ModelLoadError

logger = logging.getLogger(__name__)

# llama.cpp token types (gguf.TokenType).
CONTROL = 3
USER_DEFINED = 4

# Pre-tokenizer split regexes by `tokenizer.ggml.pre`; names not listed use GPT-2's own regex.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS: Mapping[str, str] = {
    **dict.fromkeys(
        ("llama-bpe", "llama3", "llama-v3", "dbrx", "smaug-bpe", "falcon3", "pixtral"), _LLAMA3_SPLIT
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), _GPT4O_SPLIT),
    "tekken": _TEKKEN_SPLIT,
}
# NOTE: "smollm" (like "starcoder") is split with GPT-2's regex, as transformers does. llama.cpp
# splits digits first; the two differ only on runs of spaces before a digit ("  1").
GPT2_REGEX_PRES = frozenset({"gpt2", "smollm", "starcoder", "refact", "codeshell", "default"})

# Architectures whose SentencePiece vocab spells spaces as " " and has no prefix space.
GEMMA_ARCHITECTURES = frozenset({"gemma", "gemma2", "gemma3", "gemma3n"})


def build_backend(metadata: Mapping[str, Any]) -> BackendTokenizer:
    """The tokenizer the GGUF metadata describes, with its special tokens and BOS/EOS rule."""
    kind = metadata.get("tokenizer.ggml.model")
    builder = _BUILDERS.get(str(kind))
    if builder is None:
        raise ModelLoadError(
            f"GGUF tokenizer model {kind!r} is not supported (supported: {', '.join(sorted(_BUILDERS))})"
        )
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError("GGUF metadata has no tokenizer.ggml.tokens; cannot build a tokenizer")
    backend = builder(metadata)
    _add_special_tokens(backend, metadata)
    backend.post_processor = _post_processor(metadata, default_bos=kind == "llama")
    return backend


# --- byte-level BPE ("gpt2") --------------------------------------------------------------


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (printable Latin-1 maps to itself)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    mapping = {b: chr(b) for b in kept}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


def _byte_level(metadata: Mapping[str, Any]) -> BackendTokenizer:
    tokens: Sequence[str] = metadata["tokenizer.ggml.tokens"]
    types: Sequence[int] = metadata.get("tokenizer.ggml.token_type") or ()
    vocab = {_byte_spelling(tok, _type_at(types, i)): i for i, tok in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges") or ()]
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(str(metadata.get("tokenizer.ggml.pre", "")))
    backend.decoder = decoders.ByteLevel()
    return backend


def _byte_spelling(token: str, token_type: int) -> str:
    # Normal tokens are stored in the byte alphabet; one outside it is re-spelled byte by byte.
    # Control and user-defined tokens stay literal: they are matched whole as added tokens.
    alphabet = _alphabet_chars()
    if token_type in (CONTROL, USER_DEFINED) or set(token) <= alphabet:
        return token
    spelling = byte_alphabet()
    return "".join(spelling[b] for b in token.encode("utf-8"))


@lru_cache(maxsize=1)
def _alphabet_chars() -> frozenset[str]:
    return frozenset(byte_alphabet().values())


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    split = PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        if pre not in GPT2_REGEX_PRES:
            logger.warning("unknown GGUF pre-tokenizer %r; splitting with GPT-2's regex", pre)
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


# --- SentencePiece BPE ("llama") ----------------------------------------------------------


def _sentencepiece(metadata: Mapping[str, Any]) -> BackendTokenizer:
    is_gemma = metadata.get("general.architecture") in GEMMA_ARCHITECTURES
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    if is_gemma:
        # Gemma files store runs of spaces as real spaces; the model looks them up as "▁▁".
        tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = _sentencepiece_merges(metadata, tokens, vocab, by_position=is_gemma)
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    bpe = models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    backend = BackendTokenizer(bpe)
    if is_gemma:
        _set_gemma_pipeline(backend)
    else:
        _set_metaspace_pipeline(backend, bool(metadata.get("tokenizer.ggml.add_space_prefix", True)))
    return backend


def _set_gemma_pipeline(backend: BackendTokenizer) -> None:
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )


def _set_metaspace_pipeline(backend: BackendTokenizer, add_space_prefix: bool) -> None:
    scheme = "first" if add_space_prefix else "never"
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)


def _sentencepiece_merges(
    metadata: Mapping[str, Any], tokens: Sequence[str], vocab: Mapping[str, int], *, by_position: bool
) -> list[tuple[str, str]]:
    stored = metadata.get("tokenizer.ggml.merges")
    if stored:
        return [tuple(m.split(" ", 1)) for m in stored]
    if by_position:
        # Gemma's scores do not follow its merge order; the order of the vocabulary does.
        ranks = {tok: -float(i) for i, tok in enumerate(tokens)}
    else:
        ranks = dict(zip(tokens, (float(s) for s in metadata.get("tokenizer.ggml.scores") or ())))
    return merges_from_vocab(vocab, ranks)


def merges_from_vocab(vocab: Mapping[str, int], ranks: Mapping[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocab: every split of a token into two tokens.

    Merges are ordered best first by the merged token's rank, then longer left piece, then
    longer right piece, then the order of `ranks` (the vocabulary order).
    """
    found: list[tuple[float, int, int, int, str, str]] = []
    for order, (merged, rank) in enumerate(ranks.items()):
        for cut in range(1, len(merged)):
            left, right = merged[:cut], merged[cut:]
            if left in vocab and right in vocab:
                found.append((-rank, -len(left), -len(right), order, left, right))
    found.sort(key=lambda m: m[:4])
    return [(m[4], m[5]) for m in found]


# --- shared ---------------------------------------------------------------------------------


def _type_at(types: Sequence[int], index: int) -> int:
    return int(types[index]) if index < len(types) else 1


def _add_special_tokens(backend: BackendTokenizer, metadata: Mapping[str, Any]) -> None:
    # Control tokens (<|im_end|>, <start_of_turn>) are special; user-defined ones (<think>,
    # "\n\n") are plain added tokens. Both are matched whole in the text, as llama.cpp does.
    tokens: Sequence[str] = metadata["tokenizer.ggml.tokens"]
    types: Sequence[int] = metadata.get("tokenizer.ggml.token_type") or ()
    vocab = backend.get_vocab(with_added_tokens=False)
    control = [t for i, t in enumerate(tokens) if _type_at(types, i) == CONTROL and t in vocab]
    user = [t for i, t in enumerate(tokens) if _type_at(types, i) == USER_DEFINED and t in vocab]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])


def _post_processor(metadata: Mapping[str, Any], *, default_bos: bool) -> processors.PostProcessor:
    tokens: Sequence[str] = metadata["tokenizer.ggml.tokens"]
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", default_bos))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    bos_id = metadata.get("tokenizer.ggml.bos_token_id")
    eos_id = metadata.get("tokenizer.ggml.eos_token_id")
    bos = (tokens[bos_id], int(bos_id)) if add_bos and bos_id is not None else None
    eos = (tokens[eos_id], int(eos_id)) if add_eos and eos_id is not None else None
    return template_processor(bos, eos)


def template_processor(
    bos: tuple[str, int] | None, eos: tuple[str, int] | None
) -> processors.TemplateProcessing:
    """A post-processor adding `bos` before and `eos` after the text (either may be None)."""
    head = [f"{bos[0]}:0"] if bos else []
    tail = [f"{eos[0]}:0"] if eos else []
    pair_head = [f"{bos[0]}:1"] if bos else []
    pair_tail = [f"{eos[0]}:1"] if eos else []
    return processors.TemplateProcessing(
        single=[*head, "$A:0", *tail],
        pair=[*head, "$A:0", *tail, *pair_head, "$B:1", *pair_tail],
        special_tokens=[t for t in {bos, eos} if t is not None],
    )


_BUILDERS: dict[str, Callable[[Mapping[str, Any]], BackendTokenizer]] = {
    "gpt2": _byte_level,
    "llama": _sentencepiece,
}
