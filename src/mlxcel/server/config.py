"""How the HTTP layer listens and what it exposes; built by the CLI, read by the app and lifecycle."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEFAULT_MAX_BODY_BYTES = 32 << 20  # D1: --max-body-size default, 32 MiB
RESPONSES_DB_FILENAME = "responses.sqlite3"


def default_responses_db(models_dir: Path | None) -> Path:
    """--responses-db default (F2): `<models dir>/responses.sqlite3`, else under ~/.cache/mlxcel."""
    root = models_dir if models_dir is not None else Path.home() / ".cache" / "mlxcel"
    return Path(root).expanduser() / RESPONSES_DB_FILENAME


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Listener, auth and endpoint switches (llama-server flag names in comments)."""

    host: str = "127.0.0.1"  # --host; a value ending in .sock is a Unix socket path (A4)
    port: int = 8080  # --port; 0 = a kernel-chosen ephemeral port
    api_keys: tuple[str, ...] = ()  # --api-key / --api-key-file / LLAMA_API_KEY (C1); empty = no auth
    alias: str | None = None  # --alias: the model's names, comma-separated (llama-server); the first is its id
    tags: tuple[str, ...] = ()  # --tags: informational labels /v1/models reports
    timeout_s: float = 3600.0  # --timeout: HTTP read/write timeout (A8)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # --max-body-size (D1)
    endpoint_slots: bool = True  # --slots / --no-slots (F12)
    endpoint_props: bool = False  # --props
    endpoint_metrics: bool = False  # --metrics
    sse_keepalive_s: float = 15.0  # --sse-keepalive (A9)
    shutdown_timeout_s: float = 120.0  # A7 worker exit deadline
    anthropic_pin_billing_stamp: bool = True  # MLXCEL_ANTHROPIC_PIN_BILLING_STAMP (E2), read at startup
    responses_db: Path | None = None  # --responses-db (F2); None = an in-memory store (tests, embedding)
    stream_buffer_streams: int = 64  # --stream-buffer-streams (F6): finished resumable streams kept
    stream_buffer_bytes: int = 4 << 20  # --stream-buffer-bytes (F6): events kept per stream
    stream_buffer_ttl_s: float = 300.0  # --stream-buffer-ttl (F6): seconds kept after the last event
    webui: bool = False  # --webui: /webui/ and /ui-api/v1/* (A5)
    ui_session_key: str | None = None  # A5: the one-time key of a loopback --webui without --api-key
    api_prefix: str = ""  # --api-prefix (A11): every route under it, e.g. "/llm"

    @property
    def aliases(self) -> tuple[str, ...]:
        """--alias as llama-server reads it: comma-separated, stripped, in sorted order (its std::set)."""
        return tuple(sorted({name.strip() for name in (self.alias or "").split(",") if name.strip()}))
    cors_origins: tuple[str, ...] | None = None  # --cors-origins / --allowed-origins (C6); None = no policy
    ssl_keyfile: Path | None = None  # --ssl-key-file
    ssl_certfile: Path | None = None  # --ssl-cert-file

    def __post_init__(self) -> None:
        if not self.is_unix_socket and not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be between 0 and 65535, not {self.port}")
        for name in ("timeout_s", "sse_keepalive_s", "shutdown_timeout_s", "stream_buffer_streams",
                     "stream_buffer_bytes", "stream_buffer_ttl_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, not {getattr(self, name)}")
        if self.max_body_bytes < 1:
            raise ValueError(f"--max-body-size must be at least 1 byte, not {self.max_body_bytes}")
        if self.api_prefix and (not self.api_prefix.startswith("/") or self.api_prefix.endswith("/")):
            raise ValueError(f"--api-prefix must start with / and not end with one (e.g. /llm), not {self.api_prefix!r}")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("--ssl-key-file and --ssl-cert-file go together")

    @property
    def is_unix_socket(self) -> bool:
        return self.host.endswith(".sock")

    @property
    def is_auth_enabled(self) -> bool:
        return bool(self.api_keys)

    @property
    def is_tls(self) -> bool:
        return self.ssl_certfile is not None

    @property
    def ui_keys(self) -> tuple[str, ...]:
        """The keys /ui-api/v1 takes (A5: always authenticated): the API keys, else the session key."""
        return self.api_keys or ((self.ui_session_key,) if self.ui_session_key else ())
