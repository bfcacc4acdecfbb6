"""Running the installed `mlxcel` console script in a subprocess that cannot leave the machine:
a sitecustomize.py on its PYTHONPATH installs the loopback-only guard before anything else runs."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .netguard import SUBPROCESS_GUARD

MLXCEL = Path(sys.executable).with_name("mlxcel")  # the console script beside this interpreter
GUARD_EXIT = 99  # the guard's exit status on a non-loopback connect or lookup


@dataclass(frozen=True)
class CliResult:
    returncode: int
    stdout: str
    stderr: str

    def stderr_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]


def cli_env(folder: Path, **extra: str) -> dict[str, str]:
    """The parent's environment minus any model/hub settings, plus the guard and `extra`."""
    guard_dir = folder / "netguard"
    guard_dir.mkdir(parents=True, exist_ok=True)
    (guard_dir / "sitecustomize.py").write_text(SUBPROCESS_GUARD)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLXCEL_", "HF_", "LLAMA_ARG_"))}
    env |= {"PYTHONPATH": str(guard_dir), "HF_HOME": str(folder / "hf-home"), "HF_HUB_DISABLE_XET": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return env | extra


def start(args: list[str], env: dict[str, str], cwd: Path | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([str(MLXCEL), *args], env=env, cwd=cwd, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def finish(process: subprocess.Popen[str], timeout: float = 240) -> CliResult:
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, stderr = process.communicate()
    return CliResult(process.returncode, stdout, stderr)


def run(args: list[str], env: dict[str, str], cwd: Path | None = None) -> CliResult:
    return finish(start(args, env, cwd))
