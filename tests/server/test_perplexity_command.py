"""`mlxcel perplexity` on the real default model (issue 27 point 1): the command's perplexity equals the
server's prompt logprobs on the same tokens, and it scores KLD 0 against its own base."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from mlxcel.perplexity import read_header


@pytest.mark.slow
def test_the_command_on_the_default_model_matches_the_servers_prompt_logprobs(server, tmp_path: Path) -> None:
    """Issue 27: `mlxcel perplexity` and `/v1/completions` echo + logprobs give the same numbers on the same
    tokens; the command against its own base gives KLD 0 and the same top token everywhere."""
    text = (Path(__file__).parents[2] / "README.md").read_text()[:3000]
    (tmp_path / "text.txt").write_text(text)
    base = tmp_path / "base.bin"
    args = [sys.executable, "-m", "mlxcel.cli", "perplexity", "-f", str(tmp_path / "text.txt"), "-c", "64",
            "--chunks", "2", "-t", "1"]
    env = {"PYTHONPATH": str(Path(__file__).parents[2] / "src"), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([*args, "--kl-divergence-base", str(base)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    estimate = float(done.stdout.split("PPL = ")[1].split()[0])
    with open(base, "rb") as source:
        header = read_header(source, "base")
    nll = []
    for c in range(2):
        chunk = header.tokens[c * 64:(c + 1) * 64].tolist()
        body = {"prompt": chunk, "echo": True, "logprobs": 0, "max_tokens": 0, "temperature": 0}
        values = httpx.post(server.address + "/v1/completions", json=body, timeout=120).json()
        nll += [-v for v in values["choices"][0]["logprobs"]["token_logprobs"][33:]]
    assert estimate == pytest.approx(math.exp(sum(nll) / len(nll)), rel=2e-5)  # printed to 4 decimals; float sums
    again = subprocess.run([*args, "--kl-divergence-base", str(base), "--kl-divergence"], capture_output=True,
                           text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stderr
    report = again.stdout
    assert float(report.split("Mean    KLD:")[1].split()[0]) < 1e-5
    assert float(report.split("Same top p:")[1].split()[0]) == 100.0
