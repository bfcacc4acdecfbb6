"""llama-server native protocol adapter (F4): /completion, /tokenize, /detokenize, /apply-template,
/infill, /lora-adapters (and /embedding in embeddings.py).

Each route is two steps, so the server answers body errors before availability (D1):
`parse_*_request(body)` (400 on bad fields), then the call with the API context.
"""

from mlxcel.api.llama_server.completion import create_completion, parse_completion_request
from mlxcel.api.llama_server.infill import create_infill, parse_infill_request
from mlxcel.api.llama_server.lora import list_adapters, parse_lora_request, set_adapters
from mlxcel.api.llama_server.template import apply_template, parse_apply_template_request
from mlxcel.api.llama_server.tokenize import (
    detokenize_tokens, parse_detokenize_request, parse_tokenize_request, tokenize, tokenize_content, tokenizer_info,
)

__all__ = [
    "apply_template", "create_completion", "create_infill", "detokenize_tokens", "parse_apply_template_request",
    "parse_completion_request", "parse_detokenize_request", "parse_infill_request", "parse_tokenize_request",
    "tokenize", "tokenize_content", "tokenizer_info", "list_adapters", "parse_lora_request", "set_adapters",
]
