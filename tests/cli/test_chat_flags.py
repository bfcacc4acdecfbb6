"""The chat flags (S, R, Q, P): --reasoning-format, --reasoning-budget, --chat-template-kwargs,
--skip-chat-parsing and their environment mirrors reach the chat features; bad values refuse
startup before any model loads."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mlxcel.command_line import OPTIONS, resolve_values, serve_parser, serve_settings
from mlxcel.env import Environment
from mlxcel.chat.plan import FeatureSettings


def chat(argv: list[str], env: dict[str, str] | None = None) -> FeatureSettings:
    environment = Environment.read(env or {})
    namespace = serve_parser("mlxcel serve", "serve").parse_args(argv)
    return serve_settings(resolve_values(namespace, OPTIONS, environment), environment).runtime.chat


def test_defaults() -> None:
    assert chat([]) == FeatureSettings(reasoning_budget=-1)


def test_flags_and_mirrors() -> None:
    settings = chat(["--reasoning-format", "deepseek-legacy", "--reasoning-budget", "64", "--skip-chat-parsing",
                     "--chat-template-kwargs", '{"preserve_thinking": true}'],
                    {"LLAMA_ARG_CHAT_TEMPLATE_KWARGS": '{"enable_thinking": false}', "MLXCEL_LOOP_DETECTION": "on",
                     "MLXCEL_REASONING_ECHO_MAX_BYTES": "0"})
    assert settings == FeatureSettings(
        reasoning_format="deepseek-legacy", reasoning_budget=64, chat_template_kwargs='{"preserve_thinking": true}',
        chat_template_kwargs_env='{"enable_thinking": false}', loop_detection="on", echo_max_bytes=0,
        skip_chat_parsing=True)
    assert chat([], {"LLAMA_ARG_REASONING_BUDGET": "8"}).reasoning_budget == 8
    assert chat(["--reasoning-budget", "4"], {"LLAMA_ARG_REASONING_BUDGET": "8"}).reasoning_budget == 4


@pytest.mark.parametrize(("argv", "env", "message"), [
    (["--chat-template-kwargs", "{bad"], {}, r"chat_template_kwargs \(--chat-template-kwargs\): '\{bad' is not valid"),
    ([], {"LLAMA_ARG_CHAT_TEMPLATE_KWARGS": "[1]"}, "LLAMA_ARG_CHAT_TEMPLATE_KWARGS.*expected a JSON object"),
    (["--reasoning-budget", "-2"], {}, "reasoning_budget .*expected a whole number >= -1"),
    ([], {"MLXCEL_LOOP_DETECTION": "sometimes"}, "MLXCEL_LOOP_DETECTION"),
])  # fmt: skip
def test_bad_values_refuse_startup(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        chat(argv, env)


def test_invalid_kwargs_json_exits_2_with_one_line() -> None:
    run = subprocess.run([sys.executable, "-m", "mlxcel.cli", "serve", "--chat-template-kwargs", "{bad"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "error: chat_template_kwargs (--chat-template-kwargs): '{bad' is not valid" in run.stderr.splitlines()[-1]
