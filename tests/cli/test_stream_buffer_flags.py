"""F6 stream buffer settings: flags, MLXCEL_STREAM_BUFFER_* mirrors (the flag wins), refusals."""

from __future__ import annotations

import pytest

from mlxcel.command_line import OPTIONS, resolve_values, serve_parser, serve_settings
from mlxcel.env import Environment
from mlxcel.server.config import ServerConfig


def server_config(argv: list[str], env: dict[str, str] | None = None) -> ServerConfig:
    environment = Environment.read(env or {})
    namespace = serve_parser("mlxcel serve", "serve").parse_args(argv)
    return serve_settings(resolve_values(namespace, OPTIONS, environment), environment).server


def test_f6_stream_buffer_defaults_flags_and_mirrors() -> None:
    default = server_config([])
    assert (default.stream_buffer_streams, default.stream_buffer_bytes, default.stream_buffer_ttl_s) == \
        (64, 4 << 20, 300.0)
    flags = server_config(["--stream-buffer-streams", "8", "--stream-buffer-bytes", "1M", "--stream-buffer-ttl", "30"])
    assert (flags.stream_buffer_streams, flags.stream_buffer_bytes, flags.stream_buffer_ttl_s) == (8, 1 << 20, 30.0)
    env = {"MLXCEL_STREAM_BUFFER_STREAMS": "3", "MLXCEL_STREAM_BUFFER_BYTES": "64K", "MLXCEL_STREAM_BUFFER_TTL": "5"}
    mirrored = server_config([], env)
    assert (mirrored.stream_buffer_streams, mirrored.stream_buffer_bytes, mirrored.stream_buffer_ttl_s) == \
        (3, 64 << 10, 5.0)
    assert server_config(["--stream-buffer-streams", "9"], env).stream_buffer_streams == 9


@pytest.mark.parametrize("argv", [["--stream-buffer-streams", "0"], ["--stream-buffer-ttl", "0"],
                                  ["--stream-buffer-bytes", "0"]])
def test_f6_stream_buffer_limits_must_be_positive(argv: list[str]) -> None:
    with pytest.raises(ValueError, match="stream_buffer"):
        server_config(argv)
