"""OpenAI protocol adapter: chat completions (and their live control), completions, models (F1, F5).

Each route is two steps, so the server can answer body errors before availability (D1):
`parse_*_request(body)` (400 on bad fields), then `create_*(ctx, request, headers)`.
"""

from mlxcel.api.openai.chat import count_chat_input_tokens, create_chat_completion, parse_chat_request
from mlxcel.api.openai.completions import create_completion, parse_completion_request
from mlxcel.api.openai.control import control_chat_completion, parse_control_request
from mlxcel.api.openai.models import list_models, retrieve_model

__all__ = [
    "control_chat_completion", "count_chat_input_tokens", "create_chat_completion", "create_completion",
    "list_models", "parse_chat_request", "parse_completion_request", "parse_control_request", "retrieve_model",
]
