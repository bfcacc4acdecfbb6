"""The tokenizer routes: llama-server's `POST /tokenize` and `POST /detokenize` (F4), which take
vLLM's shapes too, and vLLM's `GET /tokenizer_info`, so evaluation clients (lm-evaluation-harness'
`local-completions` with `tokenizer_backend=auto`) tokenize through the server instead of
downloading the tokenizer.

`/tokenize` with llama-server's `content` answers `{"tokens": [ids]}`, or with `with_pieces`
`{"tokens": [{"id", "piece"}]}` where a piece is its text, or its byte values when they are not
valid UTF-8 on their own (one byte of a multi-byte character). With vLLM's `prompt` (text) or
`messages` (rendered as /apply-template renders them) it answers vLLM's `{"count",
"max_model_len", "tokens"}` (`token_strs` with `return_token_strs`). `add_special` /
`add_special_tokens` adds BOS where the model's configuration does; `parse_special: false` reads
special-token text such as `<|im_start|>` as plain text. `/detokenize` answers the text as
llama-server's `content` and vLLM's `prompt`.
"""

from __future__ import annotations

import weakref
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from mlxcel.api.context import ApiContext
from mlxcel.api.errors import invalid_request
from mlxcel.api.llama_server.schemas import ApplyTemplateRequest, DetokenizeRequest, TokenizeRequest
from mlxcel.api.llama_server.template import render_template
from mlxcel.api.replies import JsonReply
from mlxcel.api.schema import validate_body
from mlxcel.text.tokenizer import Tokenizer

# NOTE: `encode_special_tokens` is a setting of the whole backend, so plain-text encoding uses a
# private copy per served tokenizer rather than flipping the shared one between requests.
_PLAIN_TEXT_COPIES: weakref.WeakKeyDictionary[Tokenizer, BackendTokenizer] = weakref.WeakKeyDictionary()


def parse_tokenize_request(body: Any) -> TokenizeRequest:
    return validate_body(TokenizeRequest, body)


def parse_detokenize_request(body: Any) -> DetokenizeRequest:
    return validate_body(DetokenizeRequest, body)


def tokenize(ctx: ApiContext, req: TokenizeRequest) -> JsonReply:
    """llama-server's reply for `content`; vLLM's for `prompt` or `messages`."""
    if req.content is not None:
        return tokenize_content(ctx.tokenizer, req)
    text = req.prompt if req.messages is None else render_template(ctx, _template_request(req))
    assert text is not None  # the schema requires one of the three
    ids = _encode(ctx.tokenizer, text, req)
    body: dict[str, Any] = {"count": len(ids), "max_model_len": ctx.context_size, "tokens": ids}
    if req.return_token_strs:
        body["token_strs"] = [ctx.tokenizer.id_to_token(i) for i in ids]
    return JsonReply(body)


def tokenize_content(tokenizer: Tokenizer, req: TokenizeRequest) -> JsonReply:
    """The token ids of `content`, with their pieces when asked."""
    assert req.content is not None
    ids = _encode(tokenizer, req.content, req)
    if not req.with_pieces:
        return JsonReply({"tokens": ids})
    return JsonReply({"tokens": [{"id": i, "piece": piece(tokenizer, i)} for i in ids]})


def tokenizer_info(ctx: ApiContext) -> JsonReply:
    """vLLM's `GET /tokenizer_info`: the tokenizer_config.json a client would otherwise download.
    `model_max_length` is the context one request may use here (a slot's)."""
    tokenizer = ctx.tokenizer
    added = tokenizer.backend.get_added_tokens_decoder()
    return JsonReply({
        "tokenizer_class": "PreTrainedTokenizerFast",  # a tokenizer.json (HF `tokenizers`) tokenizer
        "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token, "pad_token": tokenizer.pad_token,
        "unk_token": tokenizer.unk_token, "add_bos_token": tokenizer.adds_bos_token,
        "model_max_length": ctx.context_size, "vocab_size": tokenizer.vocab_size,
        "chat_template": ctx.chat_template.source if ctx.chat_template is not None else None,
        "added_tokens_decoder": {str(i): _added_token_json(token) for i, token in sorted(added.items())},
    })


def detokenize_tokens(tokenizer: Tokenizer, req: DetokenizeRequest) -> JsonReply:
    """The text of `tokens`, special tokens included (as llama-server renders them)."""
    for k, token_id in enumerate(req.tokens):
        if not 0 <= token_id < tokenizer.num_ids:
            raise invalid_request(f"tokens.{k}: token id {token_id} is outside the vocabulary "
                                  f"(0..{tokenizer.num_ids - 1})")
    text = tokenizer.decode(req.tokens)
    return JsonReply({"content": text, "prompt": text})  # llama-server's key and vLLM's


def piece(tokenizer: Tokenizer, token_id: int) -> str | list[int]:
    """The token's text, or its bytes when they are not valid UTF-8 by themselves."""
    raw = tokenizer.token_bytes(token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def _encode(tokenizer: Tokenizer, text: str, req: TokenizeRequest) -> list[int]:
    backend = tokenizer.backend if req.parse_special else _plain_text_backend(tokenizer)
    return backend.encode(text, add_special_tokens=req.adds_special_tokens).ids


def _template_request(req: TokenizeRequest) -> ApplyTemplateRequest:
    """vLLM's chat form of /tokenize as the /apply-template body it is."""
    assert req.messages is not None
    return ApplyTemplateRequest(messages=req.messages, tools=req.tools, add_generation_prompt=req.add_generation_prompt,
                                continue_final_message=req.continue_final_message,
                                chat_template_kwargs=req.chat_template_kwargs)


def _added_token_json(token: Any) -> dict[str, Any]:
    """One entry of tokenizer_config.json's `added_tokens_decoder`."""
    return {"content": token.content, "lstrip": token.lstrip, "normalized": token.normalized,
            "rstrip": token.rstrip, "single_word": token.single_word, "special": token.special}


def _plain_text_backend(tokenizer: Tokenizer) -> BackendTokenizer:
    copy = _PLAIN_TEXT_COPIES.get(tokenizer)
    if copy is None:
        copy = BackendTokenizer.from_str(tokenizer.backend.to_str())
        copy.encode_special_tokens = True
        _PLAIN_TEXT_COPIES[tokenizer] = copy
    return copy
