"""Tokens in, tokens out: the engine loop (the single owner of batch, KV cache and model), its
scheduler, the KV subsystem (`kv/`), runner, decode step and sampler; `client.EngineClient` is the
asyncio face the API layer uses. No HTTP, JSON, templates or chat features: those reach it only as
`types.TokenProcessor` objects on a Request."""
