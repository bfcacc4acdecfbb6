"""The one object an app holds: configuration, the served model once loaded, metrics, lifecycle."""

from __future__ import annotations

import time

from mlxcel.api.context import ApiContext
from mlxcel.api.errors import unavailable
from mlxcel.runtime import ServedModel
from mlxcel.server.config import ServerConfig
from mlxcel.server.metrics import ServerMetrics
from mlxcel.types import EngineStats


class ServerState:
    """Shared by every route of one app; `served` is None until the model is attached."""

    def __init__(self, config: ServerConfig, served: ServedModel | None = None) -> None:
        self.config = config
        self.metrics = ServerMetrics(self.engine_stats)
        self.served: ServedModel | None = None
        self.api: ApiContext | None = None
        self.is_shutting_down = False
        if served is not None:
            self.attach(served)

    @property
    def model_name(self) -> str | None:
        if self.served is None:
            return None
        return self.config.alias or self.served.name

    def attach(self, served: ServedModel) -> None:
        """Start serving `served` (the model is loaded and warmed up)."""
        self.served = served
        self.api = ApiContext(
            model_name=self.config.alias or served.name, engine=served.engine, tokenizer=served.tokenizer,
            chat_template=served.chat_template, context_size=served.context_size, created=int(time.time()),
            telemetry=self.metrics, sse_keepalive_s=self.config.sse_keepalive_s)

    def engine_stats(self) -> EngineStats | None:
        return self.served.engine.stats() if self.served is not None else None

    def require_api(self) -> ApiContext:
        """The API context, or 503 while loading or shutting down."""
        if self.is_shutting_down:
            raise unavailable("the server is shutting down")
        if self.api is None:
            raise unavailable("Loading model")
        return self.api

    def require_served(self) -> ServedModel:
        self.require_api()
        assert self.served is not None
        return self.served

