"""`mlxcel generate` (A10): generated text on stdout only, speeds on stderr."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_a10_generate_streams_text_to_stdout_and_speed_to_stderr() -> None:
    done = subprocess.run([sys.executable, "-m", "mlxcel.cli", "generate", "-p", "Hi", "--chat", "--max-tokens", "4",
                           "--temp", "0", "-c", "512"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Hello") and not done.stdout.endswith("\n")
    assert "tokens/s" not in done.stdout
    assert "prompt:" in done.stderr and "generation: 4 tokens" in done.stderr and "tokens/s" in done.stderr


def test_f8_generate_takes_serves_lora_flags() -> None:
    """The same --lora / --adapter / --lora-scaled declarations as serve (the settings table), in order."""
    from mlxcel.command_line import GENERATE_OPTIONS, OPTIONS, generate_parser, generate_settings, resolve_values
    from mlxcel.env import Environment

    argv = ["-p", "x", "--lora", "a", "--lora-scaled", "b", "0.5", "--adapter", "c"]
    values = resolve_values(generate_parser("mlxcel generate").parse_args(argv), GENERATE_OPTIONS + OPTIONS,
                            Environment.read({}))
    runtime, _ = generate_settings(values)
    assert runtime.adapters == ((Path("a"), 1.0), (Path("b"), 0.5), (Path("c"), 1.0))
    env = Environment.read({"LLAMA_ARG_LORA": "d", "MLXCEL_NO_COMPILE": "1"})
    runtime, engine = generate_settings(resolve_values(generate_parser("g").parse_args(["-p", "x"]),
                                                       GENERATE_OPTIONS + OPTIONS, env))
    assert runtime.adapters == ((Path("d"), 1.0),) and engine.decode_step == "eager"
    values = resolve_values(generate_parser("g").parse_args(argv + ["--lora-init-without-apply"]),
                            GENERATE_OPTIONS + OPTIONS, Environment.read({}))
    assert [scale for _, scale in generate_settings(values)[0].adapters] == [0.0, 0.0, 0.0]


@pytest.mark.slow
def test_f8_generate_output_equals_the_servers_with_the_same_adapter_and_scale(tmp_path: Path) -> None:
    """`mlxcel generate --adapter / --lora-scaled` on a tiny random llama (adapter built by peft) gives the text
    the real server's /completion gives with that adapter at that scale; without one, the base model's."""
    pytest.importorskip("peft")
    pytest.importorskip("transformers")
    import httpx

    from mlxcel.config import EngineConfig
    from mlxcel.loading import ResolvedModel
    from mlxcel.serving.chat_model import start_served_model
    from mlxcel.serving.served_model import RuntimeOptions
    from mlxcel.server.config import ServerConfig
    from mlxcel.server.lifecycle import ServerThread
    from mlxcel.server.state import ServerState
    from tests.layers.peft_adapters import make_adapter
    from tests.loading.tiny_checkpoint import tiny_llama_files, write_files

    model_dir = write_files(tmp_path / "tiny-llama", tiny_llama_files(seed=3))
    adapter = tmp_path / "adapter"
    make_adapter(model_dir, adapter, r=4, alpha=8, seed=1)
    prompt = "the quick brown fox"
    refused = subprocess.run([sys.executable, "-m", "mlxcel.cli", "generate", "-m", str(model_dir), "-p", prompt,
                              "--lora", str(tmp_path / "missing")], capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "cannot start: LoRA adapter" in refused.stderr  # as serve refuses it
    options = RuntimeOptions(warmup=False, quantize="off", adapters=((adapter, 1.0),))
    served = start_served_model(ResolvedModel(model_dir, "tiny-llama", "test"), options,
                                EngineConfig(max_num_seqs=1, decode_step="eager"))
    server = ServerThread(ServerState(ServerConfig(port=0), served)).start()
    texts = {}
    try:
        for scale, flags in ((0.0, []), (1.0, ["--adapter", str(adapter)]),
                             (0.5, ["--lora-scaled", str(adapter), "0.5"])):
            done = subprocess.run([sys.executable, "-m", "mlxcel.cli", "generate", "-m", str(model_dir), "-p", prompt,
                                   "-n", "8", "--temp", "0", "--quantize", "off", *flags],
                                  capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stderr
            body = {"prompt": prompt, "n_predict": 8, "temperature": 0, "lora": [{"id": 0, "scale": scale}]}
            assert done.stdout == httpx.post(server.address + "/completion", json=body, timeout=120).json()["content"]
            texts[scale] = done.stdout
    finally:
        server.stop()
        served.close()
    assert len(set(texts.values())) == 3  # each scale changes the text: the equalities above are not vacuous
