"""The option table (A1, A10): aliases, primary spellings per entry point, env mirrors, config building."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mlxcel.command_line import (
    GENERATE_OPTIONS, OPTIONS, generate_parser, resolve_values, serve_parser, serve_settings,
)
from mlxcel.env import Environment, EnvError
from mlxcel.settings import parse_size


def values(argv: list[str], env: dict[str, str] | None = None, style: str = "serve") -> dict[str, object]:
    namespace = serve_parser("mlxcel serve", style).parse_args(argv)
    return resolve_values(namespace, OPTIONS, Environment.read(env or {}))


def settings(argv: list[str], env: dict[str, str] | None = None):  # noqa: ANN201 - ServeSettings
    environment = Environment.read(env or {})
    namespace = serve_parser("mlxcel serve", "serve").parse_args(argv)
    return serve_settings(resolve_values(namespace, OPTIONS, environment), environment)


@pytest.mark.parametrize("flag", ["--parallel", "--n-parallel", "-np"])
def test_a1_parallel_spellings(flag: str) -> None:
    assert values([flag, "3"])["parallel"] == 3
    assert values([flag, "3"], style="server")["parallel"] == 3


@pytest.mark.parametrize("flag", ["--model-draft", "--draft-model", "-md"])
def test_a1_draft_spellings(flag: str) -> None:
    assert values([flag, "small.gguf"])["draft_model"] == "small.gguf"


def test_a1_primary_spelling_per_entry_point() -> None:
    serve_help = serve_parser("mlxcel serve", "serve").format_help()
    server_help = serve_parser("mlxcel-server", "server").format_help()
    assert "--n-parallel, -np, --parallel N" in serve_help and "--draft-model, -md, --model-draft" in serve_help
    assert "--parallel, -np, --n-parallel N" in server_help and "--model-draft, -md, --draft-model" in server_help
    assert "-m, --model MODEL" in serve_help and "env: LLAMA_ARG_N_PARALLEL" in serve_help


def test_defaults() -> None:
    s = settings([])
    assert (s.server.host, s.server.port) == ("127.0.0.1", 8080)
    assert s.engine.max_num_seqs == 4 and s.engine.enable_prefix_caching and s.server.endpoint_slots
    assert not s.server.endpoint_props and not s.server.endpoint_metrics and not s.server.api_keys
    assert s.server.timeout_s == 3600 and s.engine.decode_timeout_s == 600
    assert s.server.max_body_bytes == 32 << 20 and s.model is None


def test_a10_env_mirrors_and_cli_wins() -> None:
    env = {"LLAMA_ARG_N_PARALLEL": "2", "LLAMA_ARG_PORT": "9000", "LLAMA_ARG_ENDPOINT_METRICS": "true",
           "LLAMA_ARG_MAX_KV_SIZE": "128", "LLAMA_API_KEY": "k1,k2", "LLAMA_ARG_APC_ENABLED": "false"}
    s = settings(["--port", "0"], env)
    assert s.engine.max_num_seqs == 2 and s.server.port == 0 and s.server.endpoint_metrics
    assert s.engine.max_kv_size == 128 and s.server.api_keys == ("k1", "k2")
    assert s.engine.enable_prefix_caching is False
    assert settings(["-np", "5", "--api-key", "cli"], env).engine.max_num_seqs == 5
    assert settings(["--api-key", "cli"], env).server.api_keys == ("cli",)
    assert settings(["--apc-enabled"], env).engine.enable_prefix_caching is True


def test_llama_server_alias_list_and_tags() -> None:
    s = settings(["--alias", "b, a,,b", "--tags", "x,y"])
    assert s.server.aliases == ("a", "b") and s.server.tags == ("x", "y")
    assert settings([], {"LLAMA_ARG_TAGS": "t"}).server.tags == ("t",)


def test_llama_server_n_predict_and_seed_defaults() -> None:
    s = settings(["-n", "64", "-s", "42"])
    assert (s.engine.n_predict, s.engine.seed) == (64, 42)
    assert settings(["--n-predict", "8"], {"LLAMA_ARG_N_PREDICT": "99"}).engine.n_predict == 8
    assert settings([], {"LLAMA_ARG_N_PREDICT": "99"}).engine.n_predict == 99
    assert (settings([]).engine.n_predict, settings([]).engine.seed) == (-1, -1)
    with pytest.raises(ValueError, match="--n-predict"):
        settings(["-n", "0"])


def test_a10_bad_env_value_names_the_variable() -> None:
    with pytest.raises(EnvError, match="LLAMA_ARG_N_PARALLEL"):
        values([], {"LLAMA_ARG_N_PARALLEL": "many"})
    with pytest.raises(EnvError, match="LLAMA_ARG_ENDPOINT_SLOTS"):
        values([], {"LLAMA_ARG_ENDPOINT_SLOTS": "maybe"})


def test_a3_prompt_cache_switches() -> None:
    for argv in (["--no-prompt-cache"], ["--no-cache-prompt"], ["--apc-enabled=false"], ["--apc-enabled", "0"]):
        assert settings(argv).engine.enable_prefix_caching is False, argv
    assert settings(["--apc-enabled=true"]).engine.enable_prefix_caching is True


def test_endpoint_switches_and_sizes() -> None:
    s = settings(["--no-slots", "--props", "--metrics", "--max-body-size", "1M", "-to", "5"])
    assert not s.server.endpoint_slots and s.server.endpoint_props and s.server.endpoint_metrics
    assert s.server.max_body_bytes == 1 << 20 and s.server.timeout_s == 5
    assert parse_size("32MiB") == 32 << 20 and parse_size("100") == 100
    with pytest.raises(ValueError):
        parse_size("lots")


def test_engine_flags() -> None:
    s = settings(["-c", "4096", "-b", "256", "-ub", "512", "--max-queue-depth", "3", "--decode-timeout", "9",
                  "--slot-save-path", "/tmp/s"])
    assert s.engine.ctx_size == 4096 and s.engine.max_num_batched_tokens == 256
    assert s.engine.max_num_prefill_tokens == 256  # the prompt budget is at most the step's
    defaults = settings([]).engine  # llama-server's on the CPU: 2,048 tokens a step, of them 512 prompt tokens
    assert (defaults.max_num_batched_tokens, defaults.max_num_prefill_tokens) == (2048, 512)
    assert s.engine.max_queue_depth == 3 and s.engine.decode_timeout_s == 9 and s.engine.slot_save_path == "/tmp/s"
    with pytest.raises(ValueError, match="max-kv-size"):
        settings(["--max-kv-size", "10"])


def test_issue25_auto_choices_follow_the_device() -> None:
    """--ubatch-size 0 and --engine-process auto: 512 prompt tokens a step and one process on the CPU;
    2,048 and the engine core in its own process with a GPU (measured on an H200: bench/RESULTS.md)."""
    from mlxcel.command_line import _step_budget
    from mlxcel.serving.served_model import RuntimeOptions

    assert _step_budget(2048, 0, "cpu")["max_num_prefill_tokens"] == 512
    assert _step_budget(2048, 0, "cuda:0")["max_num_prefill_tokens"] == 2048
    assert _step_budget(1024, 0, "cuda")["max_num_prefill_tokens"] == 1024  # never more than the step
    assert _step_budget(2048, 300, "cuda")["max_num_prefill_tokens"] == 300
    assert not RuntimeOptions(device="cpu", engine_process="auto").runs_engine_process()
    assert RuntimeOptions(device="cuda", engine_process="auto").runs_engine_process()
    assert not RuntimeOptions(device="cuda", engine_process="off").runs_engine_process()
    assert RuntimeOptions(device="cpu", engine_process="on").runs_engine_process()


def test_c1_api_key_file(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("alpha\n\n  beta  \n")
    assert settings(["--api-key-file", str(keys)]).server.api_keys == ("alpha", "beta")
    assert settings(["--api-key", "x", "--api-key-file", str(keys)]).server.api_keys == ("x", "alpha", "beta")
    with pytest.raises(ValueError, match="api-key-file"):
        settings(["--api-key-file", str(tmp_path / "missing")])


def test_a4_unix_socket_host() -> None:
    s = settings(["--host", "/tmp/m.sock", "--port", "99999"])
    assert s.server.is_unix_socket  # the port is ignored, even an out-of-range one


def test_generate_parser_has_generation_flags() -> None:
    namespace = generate_parser("mlxcel generate").parse_args(["-m", "x", "-p", "hi", "--chat", "--max-tokens", "4",
                                                               "--temp", "0.5", "--seed", "1"])
    got = resolve_values(namespace, GENERATE_OPTIONS + OPTIONS, Environment.read({}))
    assert (got["prompt"], got["chat"], got["max_tokens"], got["temperature"], got["seed"]) == ("hi", True, 4, 0.5, 1)


def test_cli_errors_exit_2() -> None:
    bad = subprocess.run([sys.executable, "-m", "mlxcel.cli", "serve", "--parallel", "0"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "parallel (--parallel, LLAMA_ARG_N_PARALLEL): '0' is not valid" in bad.stderr
    unknown = subprocess.run([sys.executable, "-m", "mlxcel.cli", "bogus"], capture_output=True, text=True,
                             timeout=120)
    assert unknown.returncode == 2 and "serve" in unknown.stderr


def test_kv_cache_types_and_decode_step_flags() -> None:
    """Issue 11: --cache-type-k/-v as llama-server spells them (bf16 by default), --decode-step and
    --no-compile with their env mirrors, and the compile cache beside the models."""
    s = settings([])
    assert (s.engine.cache_type_k, s.engine.cache_type_v, s.engine.decode_step) == ("bf16", "bf16", "auto")
    s = settings(["-ctk", "f16", "--cache-type-v", "f32", "--no-compile", "--models-dir", "/srv/models"])
    assert (s.engine.cache_type_k, s.engine.cache_type_v, s.engine.decode_step) == ("f16", "f32", "eager")
    assert s.engine.compile_cache_dir == "/srv/models/compile-cache"
    env = {"LLAMA_ARG_CACHE_TYPE_K": "f32", "MLXCEL_DECODE_STEP": "compile"}
    assert (settings([], env).engine.cache_type_k, settings([], env).engine.decode_step) == ("f32", "compile")
    assert settings([], {"MLXCEL_NO_COMPILE": "1"}).engine.decode_step == "eager"
    with pytest.raises(ValueError, match="--no-compile contradicts --decode-step compile"):
        settings(["--no-compile", "--decode-step", "compile"])
    with pytest.raises(EnvError, match="LLAMA_ARG_CACHE_TYPE_K.*expected one of f32, bf16, f16"):
        settings([], {"LLAMA_ARG_CACHE_TYPE_K": "q4"})
    with pytest.raises(ValueError, match="cache_type_v.*'q4' is not valid; expected one of f32, bf16, f16"):
        settings(["--cache-type-v", "q4"])


def test_f8_lora_flags_keep_their_order_and_scales(tmp_path) -> None:  # noqa: ANN001
    runtime = settings(["--lora", "a", "--lora-scaled", "b", "0.25", "--adapter", "c"]).runtime
    assert [(p.name, s) for p, s in runtime.adapters] == [("a", 1.0), ("b", 0.25), ("c", 1.0)]
    env = settings([], {"LLAMA_ARG_LORA_SCALED": "x:0.5,y:2"}).runtime.adapters
    assert [(p.name, s) for p, s in env] == [("x", 0.5), ("y", 2.0)]
    assert settings(["--lora", "a", "--lora-init-without-apply"]).runtime.adapters[0][1] == 0.0
    with pytest.raises(ValueError, match=r"lora \(--lora, LLAMA_ARG_LORA\): .*'big'.* is not valid; expected adapter folders"):
        settings(["--lora-scaled", "b", "big"])


def test_f8_adapter_that_does_not_fit_exits_2(tmp_path) -> None:  # noqa: ANN001
    import json

    from safetensors.torch import save_file

    from mlxcel.cli import run_serve
    from tests.loading.tiny_checkpoint import tiny_llama_files, write_files

    model = write_files(tmp_path / "tiny", tiny_llama_files())
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}))
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 99),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(32, 2)},
              str(adapter / "adapter_model.safetensors"))
    assert run_serve(settings(["-m", str(model), "--lora", str(adapter), "--no-warmup", "--port", "0"])) == 2
