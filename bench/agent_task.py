"""A real coding task through the real agent clients, end to end (issue 26 point 7; not in CI):

    .venv/bin/python bench/agent_task.py [--model qwen2.5-coder-1.5b-instruct] [--clients codex,claude]

For each client, in a fresh scratch git repository: `codex exec` (over /v1/responses) or `claude -p`
(over /v1/messages) is asked to create hello.py that prints a greeting and to run it, against the real
`mlxcel-server` on the model, through the tests' recording proxy (loopback only; any other host is
refused). Printed and written to OUT/agent_task.json: the time, the client's exit status, every tool
call the model made (as our server sent it), whether hello.py exists and what it prints.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.reliability.server_process import ServerProcess  # noqa: E402
from tests.server import test_npm_agent_clients  # noqa: E402
from tests.server.test_npm_agent_clients import (  # noqa: E402
    CLAUDE_CODE, CODEX, Recorder, client_env, codex_config, npm_client,
)

TASK = "Create a file hello.py that prints a greeting, then run it with python3 to show it works."
TIMEOUT_S = 1800
test_npm_agent_clients.CLIENT_TIMEOUT_S = TIMEOUT_S  # the recording proxy waits as long for a first token


def sse_events(body: bytes) -> list[dict]:
    events = []
    for line in body.decode(errors="replace").splitlines():
        if line.startswith("data: {"):
            try:
                events.append(json.loads(line[6:]))
            except json.JSONDecodeError:
                pass
    return events


def tool_calls(recorder: Recorder) -> list[dict]:
    """The tool calls in the server's replies, in order: Responses' *_call output items, Messages' tool_use blocks."""
    calls: list[dict] = []
    for exchange in recorder.exchanges:
        pending: dict[int, dict] = {}
        for event in sse_events(exchange.response):
            kind = event.get("type")
            if kind == "response.output_item.done" and str(event["item"].get("type", "")).endswith("call"):
                item = event["item"]
                calls.append({"type": item["type"], "name": item.get("name"),
                              "input": item.get("arguments") or item.get("input") or item.get("action")})
            elif kind == "content_block_start" and event["content_block"].get("type") == "tool_use":
                pending[event["index"]] = {"type": "tool_use", "name": event["content_block"]["name"], "input": ""}
            elif kind == "content_block_delta" and event["delta"].get("type") == "input_json_delta":
                pending[event["index"]]["input"] += event["delta"]["partial_json"]
            elif kind == "content_block_stop" and event.get("index") in pending:
                calls.append(pending.pop(event["index"]))
    return calls


def codex_command(binary: Path, home: Path, recorder: Recorder, model: str) -> tuple[list[str], dict[str, str]]:
    codex_home = home / "codex-home"
    codex_home.mkdir(parents=True)
    # its ~10k-token first prompt takes minutes to prefill on a 2-core CPU: past Codex's 300 s idle default
    config = codex_config(recorder.address, model, "danger-full-access", idle_timeout_ms=TIMEOUT_S * 1000)
    (codex_home / "config.toml").write_text(config)
    env = client_env(home, recorder, CODEX_HOME=str(codex_home), MLXCEL_API_KEY="dummy")
    return [str(binary), "exec", "--json", "--skip-git-repo-check", TASK], env


def claude_command(binary: Path, home: Path, recorder: Recorder, model: str) -> tuple[list[str], dict[str, str]]:
    env = client_env(home, recorder, ANTHROPIC_BASE_URL=recorder.address, ANTHROPIC_API_KEY="dummy",
                     API_TIMEOUT_MS=str(TIMEOUT_S * 1000), CLAUDE_CODE_MAX_OUTPUT_TOKENS="1024", DISABLE_TELEMETRY="1", DISABLE_AUTOUPDATER="1",
                     DISABLE_ERROR_REPORTING="1", CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1")
    return [str(binary), "-p", TASK, "--model", model, "--output-format", "json", "--permission-mode", "acceptEdits",
            "--allowedTools", "Bash", "Write", "Edit", "Read"], env


def run_one(name: str, server: ServerProcess, model: str) -> dict:
    binary = npm_client(*(CODEX if name == "codex" else CLAUDE_CODE))
    recorder = Recorder(server.address)
    scratch = Path(tempfile.mkdtemp(prefix=f"agent-{name}-"))
    home, work = scratch / "home", scratch / "repo"
    home.mkdir()
    work.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=work, check=True)
    build = codex_command if name == "codex" else claude_command
    command, env = build(binary, home, recorder, model)
    started = time.monotonic()
    try:
        done = subprocess.run(command, env=env, cwd=work, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=TIMEOUT_S)
        status, stdout, stderr = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as error:
        status, stdout, stderr = "timeout", str(error.stdout or ""), str(error.stderr or "")
    seconds = time.monotonic() - started
    recorder.close()
    recorder.dump(scratch / "exchanges.jsonl")
    hello = work / "hello.py"
    ran = subprocess.run([sys.executable, str(hello)], capture_output=True, text=True, timeout=30) if hello.exists() else None
    return {"client": name, "seconds": round(seconds, 1), "exit_status": status,
            "requests": [(e.method, e.path, e.status) for e in recorder.exchanges], "egress": recorder.egress,
            "tool_calls": tool_calls(recorder), "hello_py": hello.read_text() if hello.exists() else None,
            "hello_py_output": None if ran is None else (ran.returncode, ran.stdout.strip(), ran.stderr.strip()[-300:]),
            "client_stdout_tail": stdout[-3000:], "client_stderr_tail": stderr[-1500:], "exchanges": str(scratch)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--clients", default="codex,claude")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")))
    args = parser.parse_args()
    results = []
    with ServerProcess("-m", args.model, "-c", "32768", "--parallel", "1", "-n", "1024") as server:
        for name in args.clients.split(","):
            result = run_one(name, server, args.model)
            print(json.dumps({k: v for k, v in result.items() if not k.startswith("client_")}, indent=1), flush=True)
            results.append(result)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "agent_task.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
