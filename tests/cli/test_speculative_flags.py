"""Issue 12 flags (B1-B4): spellings, env mirrors and the startup refusals (exit 2, one clear line)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.test_cli import settings


def test_draft_flags_and_their_mirrors() -> None:
    s = settings(["--draft-kind", "prompt-lookup", "--draft-max", "8", "--draft-min", "2",
                  "--prompt-lookup-max-batch", "3", "--prompt-lookup-ngram", "4"]).engine.speculative
    assert (s.draft_kind, s.draft_max, s.draft_min, s.max_batch, s.ngram_size) == ("prompt-lookup", 8, 2, 3, 4)
    env = {"MLXCEL_DRAFT_KIND": "prompt-lookup", "LLAMA_ARG_DRAFT_MAX": "5", "LLAMA_ARG_DRAFT_MIN": "1",
           "MLXCEL_PROMPT_LOOKUP_MAX_BATCH": "1"}
    s = settings([], env).engine.speculative
    assert (s.draft_kind, s.draft_max, s.draft_min, s.max_batch) == ("prompt-lookup", 5, 1, 1)
    assert settings(["--draft-n", "7"], env).engine.speculative.draft_max == 7  # the flag wins
    defaults = settings([]).engine.speculative
    assert (defaults.draft_kind, defaults.draft_max, defaults.draft_min, defaults.max_batch) == ("none", 16, 0, 2)


def test_f10_mtp_flag_and_its_mirror() -> None:
    assert settings([]).engine.speculative.mtp == "auto"
    assert settings(["--mtp", "on"]).engine.speculative.mtp == "on"
    assert settings([], {"MLXCEL_MTP": "off"}).engine.speculative.mtp == "off"
    with pytest.raises(Exception, match="'sometimes' is not valid"):
        settings(["--mtp", "sometimes"])


def test_a_draft_model_means_full_model_drafting() -> None:
    s = settings(["-md", "small.gguf"]).engine.speculative
    assert (s.draft_kind, s.draft_model) == ("full-model", "small.gguf")
    with pytest.raises(ValueError, match="--draft-model is for --draft-kind full-model or dflash, not prompt-lookup"):
        settings(["-md", "small.gguf", "--draft-kind", "prompt-lookup"])
    with pytest.raises(ValueError, match="--draft-min must lie between 0 and --draft-max"):
        settings(["--draft-kind", "prompt-lookup", "--draft-max", "2", "--draft-min", "3"])


def serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlxcel.cli", "serve", "--port", "0", *args], capture_output=True,
                          text=True, timeout=300)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "ERROR" in line or "error:" in line]


def serve_one_chat(model: Path, log_file: Path, content: str, *flags: str) -> tuple[dict, dict]:
    """`mlxcel serve -m model *flags` on port 0: one greedy chat request; /props and /health after
    it; SIGTERM must end the server with exit 0. Returns (props, health)."""
    import httpx

    from tests.server.test_process import read_address

    command = [sys.executable, "-m", "mlxcel.cli", "serve", "-m", str(model), "--port", "0", "-c", "2048", "-np", "1",
               "--no-warmup", "--props", "--log-file", str(log_file), *flags]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    try:
        address = read_address(process, lines, timeout=240)
        props = httpx.get(address + "/props").json()
        body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 24, "temperature": 0}
        assert httpx.post(address + "/v1/chat/completions", json=body, timeout=120).status_code == 200
        health = httpx.get(address + "/health").json()
        process.terminate()
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
    return props, health


def test_unknown_draft_kind_and_dflash_are_refused_with_exit_2() -> None:
    unknown = serve("--draft-kind", "medusa")
    assert unknown.returncode == 2 and "'medusa' is not valid" in unknown.stderr and "--draft-kind" in unknown.stderr
    dflash = serve("--draft-kind", "dflash", "--draft-block-size", "8")
    assert dflash.returncode == 2
    [line] = error_lines(dflash.stderr)
    assert "--draft-kind dflash needs --draft-model DIR: a DFlash block-diffusion drafter checkpoint" in line
    no_model = serve("--draft-kind", "full-model")
    assert no_model.returncode == 2 and "--draft-kind full-model needs --draft-model" in no_model.stderr


@pytest.mark.slow
def test_a_draft_model_with_another_vocabulary_is_refused_naming_both_files(smollm2_path: Path,
                                                                            gemma3_path: Path) -> None:
    result = serve("-m", str(smollm2_path), "--draft-model", str(gemma3_path), "--no-warmup")
    assert result.returncode == 2, result.stderr[-2000:]
    [line] = error_lines(result.stderr)
    assert str(smollm2_path) in line and str(gemma3_path) in line and "different vocabulary" in line


@pytest.mark.slow
def test_serve_with_a_draft_model_drafts_and_logs_acceptance(smollm2_path: Path, tmp_path: Path) -> None:
    """`mlxcel serve -m X -md X`: the startup path loads the drafter; /props and /health report it;
    the finish log line carries the request's accepted/drafted count."""
    import re

    log_file = tmp_path / "server.log"
    props, health = serve_one_chat(smollm2_path, log_file, "Copy exactly: one two three four five six",
                                   "-md", str(smollm2_path), "--no-compile", "--draft-max", "4")
    assert props["speculative"]["draft_kind"] == "full-model"
    assert health["speculative"]["draft_model"] == str(smollm2_path) and health["speculative"]["drafted_tokens"] > 0
    finished = [line for line in log_file.read_text().splitlines() if " finished (" in line]
    assert finished and re.search(r"draft tokens accepted \d+/\d+ \(\d+ %\)", finished[-1])


@pytest.mark.slow
def test_b3_serve_with_a_dflash_drafter_drafts_and_one_for_another_model_is_refused(smollm2_path: Path,
                                                                                    tmp_path: Path) -> None:
    """`--draft-kind dflash -md DIR` with a drafter in z-lab's layout built for SmolLM2 (random weights:
    none trained can be had here): it loads, drafts, is counted and reported; one built for a model
    of another width is refused with exit 2, naming both."""
    from types import SimpleNamespace

    from tests.engine.dflash_drafter import write_dflash_drafter

    smollm2 = SimpleNamespace(hidden_size=576, num_attention_heads=9, num_key_value_heads=3)
    narrow = write_dflash_drafter(tmp_path / "narrow", SimpleNamespace(hidden_size=64, num_attention_heads=4,
                                                                       num_key_value_heads=2),
                                  target_layer_ids=(1, 2), mask_token_id=7)
    refused = serve("-m", str(smollm2_path), "--draft-kind", "dflash", "-md", str(narrow), "--no-warmup")
    assert refused.returncode == 2, refused.stderr[-2000:]
    [line] = error_lines(refused.stderr)
    assert str(narrow) in line and str(smollm2_path) in line and "hidden size is 64, the target's 576" in line

    drafter = write_dflash_drafter(tmp_path / "dflash", smollm2, target_layer_ids=(1, 15, 29), mask_token_id=7,
                                   std=0.05)
    log_file = tmp_path / "server.log"
    props, health = serve_one_chat(smollm2_path, log_file, "Count from one to twenty.", "--draft-kind", "dflash",
                                   "-md", str(drafter), "--draft-block-size", "5")
    assert props["speculative"]["draft_kind"] == "dflash"
    assert health["speculative"]["draft_kind"] == "dflash" and health["speculative"]["drafted_tokens"] > 0
    log = log_file.read_text()
    assert "DFlash drafter loaded" in log and "reads target layers [1, 15, 29]" in log
    finished = [line for line in log.splitlines() if " finished (" in line]
    assert finished and "draft tokens accepted" in finished[-1]


@pytest.mark.slow
def test_f10_serve_a_mimo_checkpoint_with_mtp_forced_on(tmp_path: Path) -> None:
    """`mlxcel serve -m <tiny MiMo> --mtp on`: the startup path loads the MTP layer, which drafts."""
    from tests.server.mimo_model import write_mimo_model

    model = write_mimo_model(tmp_path / "mimo", exact=True)
    log_file = tmp_path / "server.log"
    props, health = serve_one_chat(model, log_file, "ABC", "--mtp", "on")
    assert props["speculative"]["draft_kind"] == "mtp" and health["speculative"]["drafted_tokens"] > 0
    assert "MTP drafter loaded: model.mtp_layers.0.* (1 MTP layer(s) declared; --mtp on)" in log_file.read_text()
