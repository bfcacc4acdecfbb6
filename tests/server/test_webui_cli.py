"""A5 startup rules from the command line: unsafe --webui listeners refused, the one-time session
key printed by a real `mlxcel-server --webui` process that starts model-less."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from mlxcel.cli import server_main
from mlxcel.command_line import OPTIONS, resolve_values, serve_parser, serve_settings
from mlxcel.env import Environment
from tests.server.test_process import read_address


def settings_for(args: list[str]):  # noqa: ANN201 - ServeSettings
    environment = Environment.read({})
    return serve_settings(resolve_values(serve_parser("t", "server").parse_args(args), OPTIONS, environment),
                          environment)


@pytest.mark.parametrize(("args", "fragment"), [
    (["--webui", "--host", "/tmp/mlxcel-test.sock"], "cannot serve on the Unix socket"),
    (["--webui", "--host", "0.0.0.0"], "needs --api-key and --ssl-key-file and --ssl-cert-file"),
    (["--webui", "--host", "0.0.0.0", "--api-key", "k"], "needs --ssl-key-file and --ssl-cert-file"),
    (["--webui", "--host", "10.1.2.3", "--ssl-key-file", "k.pem", "--ssl-cert-file", "c.pem"], "needs --api-key:"),
    (["--api-prefix", "llm"], "--api-prefix must start with /"),
    (["--cors-origins", "evil.example"], "is not an origin"),
    (["--ssl-key-file", "k.pem"], "--ssl-key-file and --ssl-cert-file go together"),
])
def test_a5_unsafe_webui_listeners_refuse_to_start(args: list[str], fragment: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert server_main(args) == 2  # one line on stderr, exit status 2
    assert fragment in capsys.readouterr().err


def test_a5_loopback_webui_without_a_key_gets_a_session_key_and_with_one_none() -> None:
    server = settings_for(["--webui"]).server
    assert server.webui and server.ui_session_key and server.ui_keys == (server.ui_session_key,)
    assert settings_for(["--webui"]).server.ui_session_key != server.ui_session_key  # one-time: new per start
    keyed = settings_for(["--webui", "--api-key", "k1"]).server
    assert keyed.ui_session_key is None and keyed.ui_keys == ("k1",)
    tls = settings_for(["--webui", "--host", "0.0.0.0", "--api-key", "k", "--ssl-key-file", "k.pem",
                        "--ssl-cert-file", "c.pem"]).server
    assert tls.is_tls and tls.ui_session_key is None
    assert settings_for(["--webui"]).server.cors_origins is None
    assert settings_for(["--allowed-origins", "https://a.example/, https://b.example"]).server.cors_origins == (
        "https://a.example", "https://b.example")


@pytest.mark.slow
def test_a5_real_process_starts_model_less_and_prints_the_session_key(tmp_path: Path) -> None:
    command = [sys.executable, "-c", "import sys; from mlxcel.cli import server_main; sys.exit(server_main())",
               "--webui", "--port", "0", "--models-dir", str(tmp_path), "--log-file", str(tmp_path / "server.log")]
    process = subprocess.Popen(command, env=dict(os.environ), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                               text=True)
    log: list[str] = []
    try:
        address = read_address(process, log)
        match = re.search(r"session key .*: (mlxcel-ui-\S+)", "".join(log))
        assert match, "".join(log)
        key = match.group(1)
        assert key not in (tmp_path / "server.log").read_text()  # the terminal only, never the log file
        assert httpx.get(address + "/health").json()["status"] == "no model loaded"
        assert httpx.post(address + "/v1/chat/completions", json={"messages": []}).status_code in (400, 503)
        assert httpx.get(address + "/ui-api/v1/bootstrap").status_code == 401
        boot = httpx.get(address + "/ui-api/v1/bootstrap", headers={"Authorization": f"Bearer {key}"})
        assert boot.status_code == 200 and boot.json()["models"]["chat"] is None
        assert "mlxcel" in httpx.get(address + "/webui/").text
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()


def test_a11_prefix_mount_covers_websocket_upgrades_too() -> None:
    """PrefixMount (A11) sits outside every route, the realtime WebSocket included."""
    from starlette.applications import Starlette
    from starlette.routing import WebSocketRoute
    from starlette.testclient import TestClient
    from starlette.websockets import WebSocket, WebSocketDisconnect

    from mlxcel.server.cors import PrefixMount

    async def echo(websocket: WebSocket) -> None:
        await websocket.accept()
        await websocket.send_text(websocket.scope["path"])
        await websocket.close()

    app = PrefixMount(Starlette(routes=[WebSocketRoute("/v1/realtime", echo)]), prefix="/llm")
    with TestClient(app) as client:
        with client.websocket_connect("/llm/v1/realtime") as websocket:
            assert websocket.receive_text() == "/v1/realtime"
        with pytest.raises(WebSocketDisconnect):
            with client.websocket_connect("/v1/realtime") as websocket:
                websocket.receive_text()
