"""Issue 26 point 6: the real npm agent clients complete a turn against the real `mlxcel-server` process on the
default model (SmolLM2-135M: no useful work, but no protocol error either).

- Codex CLI (`@openai/codex`), `codex exec` over `wire_api = "responses"`, its default tools (namespace,
  web_search ...) left on; only what phones home (plugins, apps) is switched off.
- Claude Code (`@anthropic-ai/claude-code`), `claude -p` over `/v1/messages` with a local model name.
- Issue 46, on the same server: a Claude Code turn whose tool_result holds `tool_reference` blocks (its tool
  search), instructor's forced named tool through the OpenAI SDK (one complete call each time), and no request
  refused (4xx) in the server's log across the whole module.

Each client is installed once with npm into ~/.cache/mlxcel-test-npm/<name>-<version> (MLXCEL_TEST_NPM_CACHE
moves it) and the tests skip, saying why, where node/npm is missing or the install fails. The clients reach the
server through a recording proxy in the test (every exchange's route and status, bodies kept for diagnosis) that
is also their HTTP(S)_PROXY: a connection meant for anywhere but the loopback server is refused and fails the test.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import openai
import pytest

from tests.reliability.server_process import ServerProcess

pytestmark = pytest.mark.slow

CODEX = ("@openai/codex", "0.171.0", "codex")
CLAUDE_CODE = ("@anthropic-ai/claude-code", "2.1.332", "claude")
NPM_CACHE = Path(os.environ.get("MLXCEL_TEST_NPM_CACHE", Path.home() / ".cache" / "mlxcel-test-npm"))
# Codex's prompt is ~9.7k tokens, Claude Code's ~13k: a 2-core CPU prefills them in 1-3 minutes.
CLIENT_TIMEOUT_S = 480
PROMPT = "Reply with one word: hello."


def npm_client(package: str, version: str, binary: str) -> Path:
    """The client's executable, installed into the npm cache folder on first use (atomically: a partial
    install never looks complete)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node/npm not on PATH: the npm agent client tests need Node.js")
    prefix = NPM_CACHE / f"{package.rsplit('/', 1)[-1]}-{version}"
    executable = prefix / "node_modules" / ".bin" / binary
    if not executable.exists():
        NPM_CACHE.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=prefix.name + ".", dir=NPM_CACHE))
        try:
            done = subprocess.run(["npm", "install", "--prefix", str(staging), "--no-audit", "--no-fund",
                                   f"{package}@{version}"], capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired:
            done = None
        if done is None or done.returncode != 0 or not (staging / "node_modules" / ".bin" / binary).exists():
            shutil.rmtree(staging, ignore_errors=True)
            errors = [] if done is None else [line for line in done.stderr.splitlines() if "error" in line]
            reason = "timed out" if done is None else "; ".join(errors[:2]) or done.stderr.strip()[-300:]
            pytest.skip(f"npm install {package}@{version} failed (no network?): {reason}")
        staging.rename(prefix)
    probe = subprocess.run([str(executable), "--version"], capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0 and version in probe.stdout, (probe.stdout, probe.stderr)
    return executable


@pytest.fixture(scope="session")
def codex_bin() -> Path:
    return npm_client(*CODEX)


@pytest.fixture(scope="session")
def claude_bin() -> Path:
    return npm_client(*CLAUDE_CODE)


@dataclass
class Exchange:
    method: str
    path: str
    status: int
    request: bytes
    response: bytes


@dataclass
class Recorder:
    """A loopback HTTP proxy: plain requests go on to `upstream` and are recorded; CONNECT and absolute-URI
    requests (a client using it as HTTP(S)_PROXY for some other host) are refused and listed in `egress`."""

    upstream: str
    exchanges: list[Exchange] = field(default_factory=list)
    egress: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.http = httpx.Client(base_url=self.upstream, timeout=httpx.Timeout(CLIENT_TIMEOUT_S))
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.address = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.http.close()

    def failed(self) -> list[Exchange]:
        return [e for e in self.exchanges if not 200 <= e.status < 300]

    def dump(self, path: Path) -> None:
        """Every exchange as JSON lines, for reading a protocol failure after the fact."""
        with path.open("w") as out:
            for e in self.exchanges:
                out.write(json.dumps({"method": e.method, "path": e.path, "status": e.status,
                                      "request": e.request.decode(errors="replace"),
                                      "response": e.response.decode(errors="replace")}) + "\n")

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
                pass

            def do_CONNECT(self) -> None:
                self._refuse()

            def _refuse(self) -> None:
                recorder.egress.append(f"{self.command} {self.path}")
                self.send_response(403)
                self.send_header("Content-Length", "0")
                self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = True

            def _body(self) -> bytes:
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    chunks = []
                    while size := int(self.rfile.readline().split(b";")[0], 16):
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                    self.rfile.readline()
                    return b"".join(chunks)
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _forward(self) -> None:
                if not self.path.startswith("/"):  # absolute URI: a proxied plain-HTTP request elsewhere
                    self._refuse()
                    return
                body = self._body()
                skip = {"host", "content-length", "transfer-encoding", "connection", "proxy-connection"}
                headers = {k: v for k, v in self.headers.items() if k.lower() not in skip}
                response = bytearray()
                with recorder.http.stream(self.command, self.path, headers=headers, content=body) as upstream:
                    self.send_response(upstream.status_code)
                    for key, value in upstream.headers.multi_items():
                        if key.lower() not in {"content-length", "transfer-encoding", "connection"}:
                            self.send_header(key, value)
                    self.send_header("Transfer-Encoding", "chunked")
                    self.send_header("Connection", "close")
                    self.end_headers()
                    for chunk in upstream.iter_raw():  # SSE events pass on as they come
                        response += chunk
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                self.close_connection = True
                recorder.exchanges.append(Exchange(self.command, self.path, upstream.status_code, body,
                                                   bytes(response)))

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_OPTIONS = _forward

        return Handler


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """One slot with room for Claude Code's ~13k-token prompt; -n bounds replies (Codex sends no output limit;
    on its prompt SmolLM2 ended within 256 tokens in every run)."""
    with ServerProcess("-c", "32768", "--parallel", "1", "-n", "256") as process:
        yield process


@pytest.fixture
def recorder(server: ServerProcess, tmp_path: Path) -> Iterator[Recorder]:
    recorder = Recorder(server.address)
    yield recorder
    recorder.close()
    recorder.dump(tmp_path / "exchanges.jsonl")


def client_env(home: Path, recorder: Recorder, **extra: str) -> dict[str, str]:
    """A clean environment (no keys or settings of the machine's user), every proxy variable at the recorder."""
    proxies = {name: recorder.address for name in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy",
                                                   "http_proxy", "all_proxy")}
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8",
            "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost", **proxies, **extra}


def run_client(command: list[str], env: dict[str, str], cwd: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    try:
        done = subprocess.run(command, env=env, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=CLIENT_TIMEOUT_S)
    except subprocess.TimeoutExpired as error:
        raise AssertionError(f"{command[0]} ran past {CLIENT_TIMEOUT_S} s:\n{error.stderr}") from error
    return done, time.monotonic() - started


def check_exchanges(recorder: Recorder, route: str, done_event: bytes) -> None:
    """Every request the client made succeeded, one at least on `route`, and its stream ended properly."""
    assert not recorder.egress, f"the client tried to leave loopback: {recorder.egress}"
    assert not recorder.failed(), [(e.method, e.path, e.status, e.response[:2000]) for e in recorder.failed()]
    turns = [e for e in recorder.exchanges if e.method == "POST" and e.path.split("?")[0] == route]
    assert turns, [(e.method, e.path) for e in recorder.exchanges]
    assert all(done_event in e.response for e in turns), [e.response[-2000:] for e in turns]


def codex_config(address: str, model: str, sandbox_mode: str = "read-only", idle_timeout_ms: int | None = None) -> str:
    """Codex CLI's config.toml for our server behind `address`: Responses wire API, no retries, nothing that
    phones home (analytics, feedback, plugins, apps)."""
    idle = f"stream_idle_timeout_ms = {idle_timeout_ms}\n" if idle_timeout_ms else ""
    return f"""\
model = "{model}"
model_provider = "mlxcel"
approval_policy = "never"
sandbox_mode = "{sandbox_mode}"
check_for_update_on_startup = false

[model_providers.mlxcel]
name = "mlxcel"
base_url = "{address}/v1"
wire_api = "responses"
env_key = "MLXCEL_API_KEY"
request_max_retries = 0
stream_max_retries = 0
{idle}
[analytics]
enabled = false

[feedback]
enabled = false

[features]
plugins = false
remote_plugin = false
apps = false
tool_suggest = false
"""


def test_codex_exec_completes_a_turn_over_responses(codex_bin: Path, recorder: Recorder, tmp_path: Path) -> None:
    """Codex's default tools (a namespace, hosted web_search, ...) and fields (include, store: false,
    prompt_cache_key ...) are accepted; only plugins/apps (GitHub and chatgpt.com fetches) are off."""
    codex_home, work = tmp_path / "codex-home", tmp_path / "work"
    codex_home.mkdir()
    work.mkdir()
    (codex_home / "config.toml").write_text(codex_config(recorder.address, "smollm2"))
    env = client_env(tmp_path / "home", recorder, CODEX_HOME=str(codex_home), MLXCEL_API_KEY="dummy")
    done, seconds = run_client([str(codex_bin), "exec", "--json", "--skip-git-repo-check", PROMPT], env, work)
    print(f"codex exec: {seconds:.1f} s")
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    kinds = [event.get("type") for event in events]
    if done.returncode != 0:
        # Codex sends no temperature (llama-server's 0.8 here, issue 46) and no output limit: SmolLM2 sometimes runs past -n 256 on this
        # prompt, our reply is a well-formed `response.incomplete` (max_output_tokens) and Codex fails the turn
        # itself. That is the model's limit, not the protocol's: anything else fails.
        failed = [e for e in events if e.get("type") == "turn.failed"]
        assert failed and "max_output_tokens" in failed[0]["error"]["message"], done.stdout[-4000:] + done.stderr[-4000:]
        check_exchanges(recorder, "/v1/responses", b"response.incomplete")
        return
    assert "turn.completed" in kinds and "turn.failed" not in kinds and "error" not in kinds, events
    check_exchanges(recorder, "/v1/responses", b"response.completed")


def test_claude_code_print_mode_completes_a_turn_over_messages(claude_bin: Path, recorder: Recorder,
                                                               tmp_path: Path) -> None:
    """Claude Code's own system prompt and tools (~13k tokens, a `system` message inside `messages`), a local
    model name, replies kept short."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    env = client_env(home, recorder, ANTHROPIC_BASE_URL=recorder.address, ANTHROPIC_API_KEY="dummy",
                     CLAUDE_CODE_MAX_OUTPUT_TOKENS="16", DISABLE_TELEMETRY="1", DISABLE_AUTOUPDATER="1",
                     DISABLE_ERROR_REPORTING="1", CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1")
    command = [str(claude_bin), "-p", PROMPT, "--model", "smollm2", "--output-format", "json"]
    done, seconds = run_client(command, env, work)
    print(f"claude -p: {seconds:.1f} s")
    result = json.loads(done.stdout)
    check_exchanges(recorder, "/v1/messages", b"message_stop")
    assert result["type"] == "result" and result["api_error_status"] is None, result  # no HTTP error reached it
    if done.returncode != 0:
        # SmolLM2 often never ends a reply on this prompt (greedy or sampled, 16 or 256 tokens): Claude Code then
        # asks it to resume three times over our replies and gives up with its own max_output_tokens error.
        # That is the model's limit, not the protocol's: anything else fails.
        assert result["api_error"] == "max_output_tokens" and result["num_turns"] >= 2, result
        assert len(recorder.exchanges) >= 2 and b'"stop_reason":"max_tokens"' in recorder.exchanges[-1].response
    else:
        assert result["is_error"] is False, result


# ---- issue 46: what a coding agent on a small model sends, beside the clients' own turns ----

CLAUDE_CODE_TOOLS = [
    {"name": "ToolSearch", "description": "Find deferred tools by name or keyword.",
     "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}},
    {"name": "Bash", "description": "Run a shell command.",
     "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}},
]
WRITE_FILE = {"type": "function", "function": {
    "name": "write_file", "description": "Write a file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                   "required": ["path", "content"]}}}
REFUSED = re.compile(r" -> 4\d\d: ")  # the server logs each refused request as "METHOD PATH -> STATUS: message"


def test_claude_code_tool_search_result_with_tool_reference_blocks_is_a_turn(server: ServerProcess) -> None:
    """Claude Code's ToolSearch answers with `tool_reference` blocks inside the tool_result; the next turn must be
    served (it was a 400 that made Claude Code re-send every tool and lose the prefix cache), streamed as Claude
    Code streams it."""
    messages = [
        {"role": "user", "content": "Create hello.py that prints 2 + 3, then run it."},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_01", "name": "ToolSearch", "input": {"query": "select:Bash"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01", "content": [
                {"type": "tool_reference", "tool_name": "Bash"}]},
            {"type": "text", "text": "Go on."}]},
    ]
    body = {"model": "smollm2", "max_tokens": 24, "stream": True, "tools": CLAUDE_CODE_TOOLS, "messages": messages,
            "system": [{"type": "text", "text": "You are a coding agent."}]}
    with server.client(timeout=CLIENT_TIMEOUT_S) as http, http.stream(
            "POST", "/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"}) as reply:
        text = "".join(reply.iter_text())
    assert reply.status_code == 200, text
    assert "event: message_stop" in text and "event: error" not in text
    counted = server.client().post("/v1/messages/count_tokens", json={k: body[k] for k in ("model", "messages", "tools")})
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0


def test_forced_named_tool_through_the_openai_sdk_is_exactly_one_complete_call(server: ServerProcess) -> None:
    """instructor's TOOLS mode as the OpenAI SDK sends it (instructor itself cannot be installed beside openai 3.x):
    tool_choice names one function, no parallel_tool_calls, no sampling fields. Each reply is one complete call."""
    with openai.OpenAI(base_url=server.address + "/v1", api_key="dummy", max_retries=0, timeout=CLIENT_TIMEOUT_S) as sdk:
        for seed in range(3):
            choice = sdk.chat.completions.create(
                model="smollm2", seed=seed, tools=[WRITE_FILE],
                tool_choice={"type": "function", "function": {"name": "write_file"}},
                messages=[{"role": "user", "content": "Write hello.py printing 2 + 3."}]).choices[0]
            assert choice.finish_reason == "tool_calls", choice
            (call,) = choice.message.tool_calls
            assert call.function.name == "write_file"
            arguments = json.loads(call.function.arguments)
            assert isinstance(arguments["path"], str) and isinstance(arguments["content"], str)


def test_no_request_was_refused_across_the_run(server: ServerProcess) -> None:
    """Last in the module: every request of the clients and of the tests above was served (no 4xx logged)."""
    time.sleep(0.5)  # the log is read by a thread: let the last lines arrive
    refused = [line for line in server.log if REFUSED.search(line)]
    assert not refused, refused
