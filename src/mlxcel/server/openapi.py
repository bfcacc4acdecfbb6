"""The OpenAPI 3.1 description of the routes that GET /openapi.json serves, request bodies included.

The routes read their bodies themselves (body.py, then each adapter's pydantic model), so
FastAPI's own generator sees no body at all; this one walks the routes table and takes each
body's JSON Schema from the model that validates it, so the schema is what the server checks.
Bodies without a pydantic model (embeddings, rerank, multipart audio) get a small hand schema.
`build_openapi` is handed the table (routes.py serves it), so this module never imports routes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import lru_cache
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from mlxcel.api.anthropic.schemas import CountTokensRequest, MessagesRequest
from mlxcel.api.llama_server import schemas as native
from mlxcel.api.openai import schemas as openai
from mlxcel.api.responses.schemas import CompactRequest, InputTokensRequest, ResponseCreateRequest

REF_TEMPLATE = "#/components/schemas/{model}"
_TEXT_OR_TEXTS = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}},
                            {"type": "array", "items": {"type": "integer"}},
                            {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}}]}


def _image_body(image: dict[str, Any] | None) -> dict[str, Any]:
    """An image request's fields; with `image`, the multipart edit's source upload too."""
    properties: dict[str, Any] = {
        "prompt": {"type": "string"}, "model": {"type": "string"}, "n": {"type": "integer", "minimum": 1},
        "size": {"type": "string"}, "response_format": {"enum": ["b64_json"]},
        "output_format": {"type": "string"}, "output_compression": {"type": "integer"},
        "steps": {"type": "integer", "minimum": 1}, "seed": {"type": "integer", "minimum": 0},
        "guidance_scale": {"type": "number"}, "negative_prompt": {"type": "string"},
        "strength": {"type": "number"}, "stream": {"type": "boolean"},
        "partial_images": {"type": "integer", "minimum": 0}}
    if image is not None:
        properties["image"] = image
    return {"type": "object", "required": ["prompt"] + (["image"] if image is not None else []),
            "properties": properties}


HAND_SCHEMAS: Mapping[str, dict[str, Any]] = {
    "EmbeddingRequest": {"type": "object", "required": ["input"],
                         "properties": {"input": _TEXT_OR_TEXTS, "model": {"type": "string"},
                                        "encoding_format": {"enum": ["float", "base64"]},
                                        "dimensions": {"type": "integer", "minimum": 1}}},
    "NativeEmbeddingRequest": {"type": "object",
                               "properties": {"content": _TEXT_OR_TEXTS, "input": _TEXT_OR_TEXTS,
                                              "embd_normalize": {"type": "integer"}}},
    "RerankRequest": {"type": "object", "required": ["query", "documents"],
                      "properties": {"query": {"type": "string"}, "model": {"type": "string"},
                                     "documents": {"type": "array", "items": {"type": "string"}},
                                     "top_n": {"type": "integer", "minimum": 0}}},
    "SpeechRequest": {"type": "object", "required": ["input"],
                      "properties": {"input": {"type": "string"}, "model": {"type": "string"},
                                     "voice": {"type": "string"}, "response_format": {"type": "string"},
                                     "speed": {"type": "number"}}},
    "SettingsPatch": {"type": "object", "additionalProperties": False,  # F9; the names: GET /v1/settings
                      "properties": {"settings": {"type": "object"}, "replace": {"type": "boolean"}}},
    "LoraAdaptersRequest": {"type": "array",
                            "items": {"type": "object", "required": ["id", "scale"],
                                      "properties": {"id": {"type": "integer"}, "scale": {"type": "number"}}}},
    "ImageGenerationRequest": _image_body(None),  # spec J; api/images.py checks the values
    "ImageEditRequest": _image_body({"type": "string", "format": "binary"}),
    "ErrorEnvelope": {"type": "object", "required": ["error"],
                      "properties": {"error": {"type": "object"}, "type": {"type": "string"}}},
}
_MODEL_BODIES: Mapping[str, type[BaseModel]] = {
    "/v1/chat/completions": openai.ChatCompletionRequest,
    "/v1/chat/completions/input_tokens": openai.ChatCompletionRequest,
    "/v1/chat/completions/control": openai.ControlRequest,
    "/v1/completions": openai.CompletionRequest,
    "/v1/responses": ResponseCreateRequest,
    "/v1/responses/input_tokens": InputTokensRequest,
    "/v1/responses/compact": CompactRequest,
    "/completion": native.CompletionRequest,
    "/infill": native.InfillRequest,
    "/tokenize": native.TokenizeRequest,
    "/detokenize": native.DetokenizeRequest,
    "/apply-template": native.ApplyTemplateRequest,
    "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": CountTokensRequest,
}
_HAND_BODIES: Mapping[str, str] = {
    "/v1/embeddings": "EmbeddingRequest", "/embedding": "NativeEmbeddingRequest",
    "/v1/rerank": "RerankRequest", "/v1/audio/speech": "SpeechRequest", "/v1/settings": "SettingsPatch",
    "/lora-adapters": "LoraAdaptersRequest", "/v1/images/generations": "ImageGenerationRequest",
}
_MULTIPART = frozenset({"/v1/audio/transcriptions", "/v1/audio/translations"})
_PATH_PARAM = re.compile(r"\{(\w+)(?::\w+)?\}")


def build_openapi(routes: tuple[Any, ...]) -> dict[str, Any]:
    """The schema of `routes` (the routes table): each route's first path, its methods and body."""
    names, definitions = _body_definitions()
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        primary = route.paths[0]
        for path in route.paths:
            for method in route.methods:
                operation = _operation(route, primary, path, method, names)
                paths.setdefault(_PATH_PARAM.sub(r"{\1}", path), {})[method.lower()] = operation
    return {
        "openapi": "3.1.0",
        "info": {"title": "mlxcel", "version": _version(),
                 "description": "OpenAI, Anthropic and llama-server compatible inference server"},
        "paths": paths,
        "components": {"schemas": {**definitions, **HAND_SCHEMAS},
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }


def _operation(route: Any, primary: str, path: str, method: str, names: Mapping[str, str]) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "operationId": f"{method.lower()}_{_slug(path)}",
        "responses": {"200": {"description": "success"},
                      "default": {"description": "an error in the route's protocol envelope",
                                  "content": {"application/json": {"schema": {"$ref": REF_TEMPLATE.format(
                                      model="ErrorEnvelope")}}}}},
    }
    parameters = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                  for name in _PATH_PARAM.findall(primary)]
    if parameters:
        operation["parameters"] = parameters
    if not route.is_public:
        operation["security"] = [{"bearer": []}, {}]
    body = _request_body(primary, names) if method in ("POST", "PATCH") else None
    if body is not None:
        operation["requestBody"] = body
    return operation


def _request_body(path: str, names: Mapping[str, str]) -> dict[str, Any] | None:
    if path in _MODEL_BODIES:
        ref = REF_TEMPLATE.format(model=names[path])
    elif path in _HAND_BODIES:
        ref = REF_TEMPLATE.format(model=_HAND_BODIES[path])
    elif path == "/v1/images/edits":
        return {"required": True, "content": {"multipart/form-data": {"schema": {
            "$ref": REF_TEMPLATE.format(model="ImageEditRequest")}}}}
    elif path in _MULTIPART:
        return {"required": True, "content": {"multipart/form-data": {"schema": {
            "type": "object", "required": ["file"],
            "properties": {"file": {"type": "string", "format": "binary"}, "model": {"type": "string"}}}}}}
    else:
        return None
    return {"required": True, "content": {"application/json": {"schema": {"$ref": ref}}}}


@lru_cache(maxsize=1)
def _body_definitions() -> tuple[dict[str, str], dict[str, Any]]:
    """(path -> component name, components) from the pydantic body models, generated once."""
    models = list(dict.fromkeys(_MODEL_BODIES.values()))
    keys, schema = models_json_schema([(m, "validation") for m in models], ref_template=REF_TEMPLATE)
    by_model = {m: keys[(m, "validation")]["$ref"].rsplit("/", 1)[-1] for m in models}
    return {path: by_model[m] for path, m in _MODEL_BODIES.items()}, schema.get("$defs", {})


def _slug(path: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", path.lower()).strip("_") or "root"


def _version() -> str:
    try:
        return version("mlxcel")
    except PackageNotFoundError:
        return "0"
