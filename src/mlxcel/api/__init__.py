"""Protocol adapters (OpenAI chat/completions/embeddings/audio, Responses, Anthropic Messages,
llama-server native, rerank, realtime): JSON bodies validated by pydantic wire models, turned into
`types.Request`s (chat features and sampling as one `chat.options.ChatOptions` per request,
api/chat_options.py) and back
from `TokenEvent`s into JSON or SSE. One error type, `errors.ApiError`, rendered in each
protocol's envelope. Never imports the web framework or server/; sees the engine only through
`engine.client.EngineClient`."""
