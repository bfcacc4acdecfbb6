"""POST /v1/chat/completions in a Florence-2 process (spec T): one task, one image, one greedy answer.

The request is one user message holding a task prompt (`<OD>`, `<CAPTION>`,
`<OPEN_VOCABULARY_DETECTION>a red car`, ...) as text and one `image_url` part. The task and its
text are checked here, before the image is fetched; the image goes through the media layer's
limits as every other family's does (payload, dimensions, decompression bombs). The reply's
`message.content` is the answer as text and the mlxcel field `message.florence2_result` the
processor's parsed result. Decoding is greedy, so sampling fields and `response_format` are
accepted and ignored; `stream: true` sends the whole answer as one delta, since the parse exists
only after the whole decode. `usage.prompt_tokens` is the fused encoder length.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from mlxcel.api.context import Telemetry
from mlxcel.api.errors import ApiError, truncate_message
from mlxcel.api.media import media_error
from mlxcel.api.openai import common
from mlxcel.api.openai.media import media_refs
from mlxcel.api.openai.schemas import ChatCompletionRequest
from mlxcel.api.providers import run_on_provider
from mlxcel.api.replies import JsonReply, Reply, StreamReply
from mlxcel.api.sse import DONE_FRAME, sse_frame
from mlxcel.media import MediaError, MediaKind, MediaPolicy, MediaRef, resolve_media_parts
from mlxcel.types import Usage
from mlxcel.workers.florence2 import Florence2Answer, Florence2Job, Florence2Provider, TaskError, TaskPrompt, \
    parse_task_prompt

RESULT_FIELD = "florence2_result"  # the mlxcel message field with the parsed answer
_ONE_MESSAGE = ("a Florence-2 request is one user message holding a task prompt (e.g. <OD>) as text and one "
                "image_url part")


async def create_florence2_completion(provider: Florence2Provider, req: ChatCompletionRequest,
                                      policy: MediaPolicy, model_name: str, telemetry: Telemetry) -> Reply:
    """Run one Florence-2 task; raises ApiError (400 input, 503 queue full, 504 timeout) before any stream."""
    task, ref = florence2_input(req)
    max_new_tokens = _max_new_tokens(provider, req)
    try:
        resolved = await resolve_media_parts([ref], policy)
    except MediaError as exc:
        raise media_error(exc) from None
    image = resolved[0].image
    assert image is not None  # an image part resolves to a decoded image
    answer = await run_on_provider(provider.run(Florence2Job(task, image.image, max_new_tokens)))
    usage = Usage(answer.prompt_tokens, answer.completion_tokens)
    telemetry.record_completed_request(usage)  # K2: counted as any chat completion
    reply = _Reply(common.new_id("chatcmpl"), common.now(), model_name, answer, usage)
    if req.stream:
        return StreamReply(reply.frames(req.n, common.include_usage(req)), on_close=_nothing)
    return JsonReply(reply.body(req.n))


def florence2_input(req: ChatCompletionRequest) -> tuple[TaskPrompt, MediaRef]:
    """The task and the one image of the request; a 400 naming the field otherwise."""
    if len(req.messages) != 1 or req.messages[0].role != "user":
        raise _bad("messages", f"{_ONE_MESSAGE}; got {len(req.messages)} message(s)"
                   f"{'' if len(req.messages) != 1 else ' with role ' + req.messages[0].role}")
    content = req.messages[0].content
    parts = content if isinstance(content, list) else []
    text = content if isinstance(content, str) else "".join(p.text or "" for p in parts if p.type == "text")
    refs = media_refs(req)  # a malformed media part is a 400 naming its place
    _check_parts(parts, refs)
    try:
        return parse_task_prompt(text), refs[0]
    except TaskError as exc:
        raise _bad("messages.0.content", str(exc)) from None


def _check_parts(parts: list[Any], refs: list[MediaRef]) -> None:
    for j, part in enumerate(parts):
        if part.type not in ("text", "image_url"):
            raise _bad(f"messages.0.content.{j}", f"Florence-2 takes text and one image_url part, not {part.type!r}")
    num_images = sum(ref.kind is MediaKind.IMAGE for ref in refs)
    if num_images != 1:
        raise _bad("messages.0.content", f"{_ONE_MESSAGE}; got {num_images} image_url parts")


def _max_new_tokens(provider: Florence2Provider, req: ChatCompletionRequest) -> int:
    asked = req.max_completion_tokens or req.max_tokens
    if asked is None:
        return provider.default_max_tokens
    if asked > provider.max_new_tokens:
        field = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        raise _bad(field, f"{asked} is over this Florence-2 model's decoder window of "
                   f"{provider.max_new_tokens} tokens")
    return asked


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, truncate_message(f"{param}: {message}"), code=400, extra={"param": param})


async def _nothing() -> None:
    return None  # the answer is whole before the stream starts: nothing to free


class _Reply:
    """One answer as a chat.completion body or as its chunks."""

    def __init__(self, completion_id: str, created: int, model: str, answer: Florence2Answer, usage: Usage) -> None:
        self.base = {"id": completion_id, "created": created, "model": model,
                     "system_fingerprint": common.system_fingerprint()}
        self.answer = answer
        self.usage = usage

    def message(self) -> dict[str, Any]:
        return {"role": "assistant", "content": self.answer.content, RESULT_FIELD: self.answer.result}

    def body(self, n: int) -> dict[str, Any]:
        # Greedy decoding: every one of n choices is the same answer, computed once.
        choices = [{"index": i, "message": self.message(), "logprobs": None,
                    "finish_reason": self.answer.finish_reason} for i in range(n)]
        return {**self.base, "object": "chat.completion", "choices": choices, "usage": common.usage_json(self.usage)}

    async def frames(self, n: int, with_usage: bool) -> AsyncIterator[str]:
        chunk = {**self.base, "object": "chat.completion.chunk", **({"usage": None} if with_usage else {})}
        for i in range(n):  # the whole answer in one delta, then the finish
            yield sse_frame({**chunk, "choices": [{"index": i, "delta": self.message(), "logprobs": None,
                                                   "finish_reason": None}]})
            yield sse_frame({**chunk, "choices": [{"index": i, "delta": {}, "logprobs": None,
                                                   "finish_reason": self.answer.finish_reason}]})
        if with_usage:
            yield sse_frame({**chunk, "choices": [], "usage": common.usage_json(self.usage)})
        yield DONE_FRAME
