"""Request bodies of the embedding and rerank adapters (OpenAI, llama-server, Jina/Cohere/TEI) as
pydantic wire models, like every other body in api/: the `input` forms, typed fields, and
400 messages that name the field the way these APIs' clients expect.

A field of the wrong type is an `ApiError` (400, the route's envelope) raised by the field's own
check, so the message is exactly "'truncate' must be true or false", never pydantic's wording.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import ValidationInfo, field_validator, model_validator

from mlxcel.api.errors import invalid_request
from mlxcel.api.schema import WireModel, validate_body

B = TypeVar("B", bound=WireModel)
Inputs = list[str | list[int]]


def parse_body(model: type[B], body: Any) -> B:
    """`body` validated into `model`; ApiError(400) for anything it refuses."""
    if not isinstance(body, Mapping):
        raise invalid_request("the request body must be a JSON object")
    return validate_body(model, body)


def parse_inputs(value: Any, field: str = "input", allow_mixed: bool = False) -> Inputs:
    """`input` as a string, token ids, or a list of either; one entry per embedding.

    `allow_mixed` lets strings and token lists share one list (llama-server accepts it;
    OpenAI's schema does not). Raises ApiError(400).
    """
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise invalid_request(f"'{field}' must be a string, a list of strings or a list of token ids")
    if all(_is_token(item) for item in value):
        return [list(value)]
    items = [_parse_item(item, field, index) for index, item in enumerate(value)]
    if not allow_mixed and len({type(item) for item in items}) > 1:
        raise invalid_request(f"'{field}' must not mix strings and token lists")
    return items


def _parse_item(item: Any, field: str, index: int) -> str | list[int]:
    if isinstance(item, str):
        return item
    if isinstance(item, list) and item and all(_is_token(token) for token in item):
        return list(item)
    raise invalid_request(f"'{field}[{index}]' must be a string or a non-empty list of token ids")


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class ProviderBody(WireModel):
    """Field checks shared by the embedding and rerank bodies (null is the default everywhere)."""

    truncate: bool = False  # TEI / vLLM: cut inputs past the model window instead of a 400

    @field_validator("truncate", "return_documents", "return_text", "raw_scores", mode="before", check_fields=False)
    @classmethod
    def _check_flag(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None:
            return False
        if not isinstance(value, bool):
            raise invalid_request(f"'{info.field_name}' must be true or false")
        return value

    @field_validator("dimensions", "top_n", mode="before", check_fields=False)
    @classmethod
    def _check_positive(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and (not _is_int(value) or value < 1):
            raise invalid_request(f"'{info.field_name}' must be a positive integer")
        return value

    @field_validator("embd_normalize", mode="before", check_fields=False)
    @classmethod
    def _check_int(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and not _is_int(value):
            raise invalid_request(f"'{info.field_name}' must be an integer")
        return value


class EmbeddingsBody(ProviderBody):
    """OpenAI `POST /v1/embeddings`, with the `truncate` and `embd_normalize` extensions."""

    input: Inputs
    model: str | None = None
    encoding_format: str = "float"
    dimensions: int | None = None
    embd_normalize: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _check_required(cls, body: Any) -> Any:
        if isinstance(body, Mapping) and "input" not in body:
            raise invalid_request("'input' is required")
        return body

    @field_validator("input", mode="before")
    @classmethod
    def _check_input(cls, value: Any) -> Inputs:
        return parse_inputs(value)

    @field_validator("model", mode="before")
    @classmethod
    def _check_model(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, str):
            raise invalid_request("'model' must be a string")
        return value

    @field_validator("encoding_format", mode="before")
    @classmethod
    def _check_format(cls, value: Any) -> Any:
        choices = ("float", "base64")
        if value is None:
            return "float"
        if value not in choices:
            raise invalid_request(f"'encoding_format' must be one of {', '.join(choices)}, not {value!r}")
        return value


class NativeEmbeddingBody(ProviderBody):
    """llama-server `POST /embedding`: `input` or the older `content`, mixed forms allowed."""

    input: Inputs
    embd_normalize: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _pick_input(cls, body: Any) -> Any:
        if not isinstance(body, Mapping):
            return body
        for field in ("input", "content"):
            if field in body:
                return {**body, "input": parse_inputs(body[field], field, allow_mixed=True)}
        raise invalid_request('"input" or "content" must be provided')


class RerankBody(ProviderBody):
    """Jina/Cohere (`documents`, `top_n`, `return_documents`) or TEI (`texts`, `raw_scores`,
    `return_text`); `documents` holds either list, `is_tei` says which shape came."""

    query: str
    documents: list[str]
    is_tei: bool = False
    top_n: int | None = None
    return_documents: bool = False
    return_text: bool = False
    raw_scores: bool = False

    @model_validator(mode="before")
    @classmethod
    def _pick_shape(cls, body: Any) -> Any:
        if not isinstance(body, Mapping):
            return body
        query = body.get("query")
        if not isinstance(query, str) or not query:
            raise invalid_request("'query' must be a non-empty string")
        is_tei = "texts" in body
        if is_tei and "documents" in body:
            raise invalid_request("give 'documents' (Jina/Cohere) or 'texts' (TEI), not both")
        field = "texts" if is_tei else "documents"
        return {**{k: v for k, v in body.items() if k != "texts"}, "is_tei": is_tei,
                "documents": _documents(body.get(field), field)}


def _documents(value: Any, field: str) -> list[str]:
    if not isinstance(value, list) or not value:
        raise invalid_request(f"'{field}' must be a non-empty list")
    return [_document_text(item, field, index) for index, item in enumerate(value)]


def _document_text(item: Any, field: str, index: int) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, Mapping) and isinstance(item.get("text"), str):
        return item["text"]
    raise invalid_request(f"'{field}[{index}]' must be a string or an object with a 'text' string")


__all__ = ["EmbeddingsBody", "Inputs", "NativeEmbeddingBody", "RerankBody", "parse_body", "parse_inputs"]
