"""llama-server native `POST /infill` (F4): fill-in-the-middle with the vocabulary's FIM tokens.

The prompt is built as llama-server builds it. With repo and file-separator tokens (the
repo-level pattern of Qwen2.5-Coder and StarCoder):

    <repo>myproject\n<sep>{extra filename}\n{extra text}...<sep>filename\n<pre>{prefix}<suf>{suffix}<mid>{prompt}

without them each `input_extra` chunk follows a "--- snippet ---" line. Every /completion option
applies. A model whose vocabulary lacks the prefix/suffix/middle tokens gets a 400 naming them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mlxcel.api.context import ApiContext
from mlxcel.api.errors import invalid_request
from mlxcel.api.generation import Prompt
from mlxcel.api.llama_server.completion import run_completion
from mlxcel.api.llama_server.schemas import InfillRequest
from mlxcel.api.replies import Reply
from mlxcel.api.schema import validate_body
from mlxcel.text.tokenizer import FIM_TOKEN_SPELLINGS, FimTokenIds, Tokenizer

REPO_NAME = "myproject\n"  # llama-server's placeholder repository name
CURRENT_FILE = "filename\n"  # and current-file name
SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"


def parse_infill_request(body: Any) -> InfillRequest:
    return validate_body(InfillRequest, body)


async def create_infill(ctx: ApiContext, req: InfillRequest, headers: Mapping[str, str]) -> Reply:
    """Complete the middle between `input_prefix` and `input_suffix`; answers like /completion."""
    ids = infill_token_ids(ctx.tokenizer, req)
    return await run_completion(ctx, [Prompt(tuple(ids))], req, headers)


def infill_token_ids(tokenizer: Tokenizer, req: InfillRequest) -> list[int]:
    """The FIM prompt; raises ApiError(400) when the vocabulary has no FIM tokens."""
    fim = require_fim_tokens(tokenizer)
    assert fim.prefix is not None and fim.suffix is not None and fim.middle is not None

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    ids = _extra_context(tokenizer, fim, req)
    ids += [fim.prefix, *encode(req.input_prefix), fim.suffix, *encode(req.input_suffix)]
    if _adds_bos(tokenizer):
        ids.insert(0, tokenizer.bos_token_id)  # type: ignore[arg-type]
    return ids + [fim.middle, *encode(req.prompt)]


def require_fim_tokens(tokenizer: Tokenizer) -> FimTokenIds:
    fim = tokenizer.fim_token_ids
    missing = [role for role in ("prefix", "suffix", "middle") if getattr(fim, role) is None]
    if missing:
        names = ", ".join(f"{role} ({' / '.join(FIM_TOKEN_SPELLINGS[role][:2])})" for role in missing)
        raise invalid_request(f"/infill needs fill-in-the-middle tokens, and the served model's vocabulary "
                              f"has no {names} token; serve a FIM-trained model (e.g. Qwen2.5-Coder)")
    return fim


def _extra_context(tokenizer: Tokenizer, fim: FimTokenIds, req: InfillRequest) -> list[int]:
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    ids: list[int] = [fim.repo, *encode(REPO_NAME)] if fim.repo is not None else []
    for chunk in req.input_extra:
        head = [fim.sep, *encode(chunk.filename + "\n")] if fim.sep is not None else encode(SNIPPET_SEPARATOR)
        ids += head + encode(chunk.text)
    if fim.sep is not None:
        ids += [fim.sep, *encode(CURRENT_FILE)]
    return ids


def _adds_bos(tokenizer: Tokenizer) -> bool:
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer.encode("a", add_special_tokens=True)[:1] == [bos]
