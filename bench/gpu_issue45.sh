#!/usr/bin/env bash
# Issue 45's two device calls, run from the folder that holds src/, bench/ and tests/ (see bench/RESULTS.md):
#   bench/gpu_issue45.sh build   llama-server (CUDA) in the background; the CUDA tests and the random 1.5B GGUF
#                                meanwhile; the binary back through $OUT; then, time allowing, the 1.5B side by side
#   bench/gpu_issue45.sh bench   both servers on both GGUFs (SKIP_QWEN15=1: the SmolLM2 one alone), then the 1.5B
#                                shape's decode-step profile, time allowing (BUDGET, either phase: its seconds, default 580)
# Files it expects beside it: llama-src.tar.xz (bench/gpu_llama_src.sh), pydeps.tar.xz (the server's packages the
# device lacks, for Python 3.12), smol-tok/ (bench/gpu_serving.py --export-tokenizer), and the SmolLM2 Q4_1 GGUF in
# two parts (smol.part-a with `build`, smol.part-b with `bench`: 98 MB is over one call's 64 MiB) with smol.sha256.
# State between the two calls stays in $W on the (still warm) machine. A CPU dry run of this script here:
# SMOKE_ARGS="--device cpu --smoke-shape --gen 8" with a stand-in nvidia-smi on PATH.
set -uo pipefail
phase=${1:?usage: gpu_issue45.sh build|bench}
W=/tmp/i45
OUT=${OUT:-/tmp/i45-out}
mkdir -p "$W" "$OUT"
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
[[ -d $W/pydeps ]] || { mkdir -p "$W/pydeps" && tar -xJf pydeps.tar.xz -C "$W" ; }
export PYTHONPATH=$PWD/src:$W/pydeps PYTHONUNBUFFERED=1 MLXCEL_TEST_SMOLLM2_GGUF=$W/smol.gguf
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/card.txt"
BIN=$W/ls/build/bin/llama-server
side_by_side() {  # $1: seconds it may take; the rest: gpu_side_by_side.py's arguments
  local limit=$1; shift
  timeout "$limit" python3 bench/gpu_side_by_side.py --llama-server "$BIN" --llama-src "$W/ls/src" \
    --tokenizer smol-tok --work "$W" --out "$OUT" "$@" ${SMOKE_ARGS:-} 2>&1 | tee -a "$OUT/side_by_side.log" | grep -v "^ "
}

budget=${BUDGET:-580}  # seconds the phase may take in all (the call's limit, less a margin)
if [[ $phase == build ]]; then
  cp smol.part-a "$W/"
  mkdir -p "$W/ls/src" && tar -xJf llama-src.tar.xz -C "$W/ls/src"
  bench/gpu_llama_server_build.sh llama-src.tar.xz "$W/ls" cuda 14 >"$W/build.out" 2>&1 &
  build=$!
  python3 -m pytest -q -p no:cacheprovider tests/engine/test_sampler.py tests/layers/test_paged_attention_cuda.py \
    tests/engine/test_cuda_engine.py 2>&1 | tail -25 | tee "$OUT/tests.log"
  echo "tests done at $(elapsed) s"
  python3 bench/gpu_side_by_side.py --random-qwen15 --prepare-only --llama-src "$W/ls/src" --tokenizer smol-tok \
    --work "$W" --out "$OUT" ${SMOKE_ARGS:-} 2>&1 | tail -5
  echo "random GGUF done at $(elapsed) s"; ls -la "$W"/*.gguf
  while kill -0 $build 2>/dev/null && (( $(elapsed) < budget - 60 )); do sleep 5; done
  tail -5 "$W/build.out"; tail -3 "$W/ls/build.log" | cut -c1-300
  echo "build waited until $(elapsed) s"
  if [[ -x $BIN ]]; then
    ls -la "$BIN"
    xz -T16 -3 -c "$BIN" >"$W/llama-server.xz" && ls -la "$W/llama-server.xz"
    split -b 15M -d "$W/llama-server.xz" "$OUT/llama-server.xz.part"
    left=$(( budget - 10 - $(elapsed) ))
    # llama.cpp first: it starts in seconds, so a cut-short run still has one server's figures in full
    if (( left > 120 )); then side_by_side "$left" --random-qwen15 --widths 1,16,64,256 --servers llama.cpp,mlxcel; fi
  fi
elif [[ $phase == bench ]]; then
  if [[ -f $W/smol.part-a && -f smol.part-b ]]; then
    cat "$W/smol.part-a" smol.part-b >"$W/smol.gguf"
    (cd "$W" && sha256sum -c "$OLDPWD/smol.sha256" 2>&1 | sed "s|$W/||") || rm -f "$W/smol.gguf"
  fi
  if [[ ! -x $BIN ]]; then  # a cold machine: the first call's build is gone; build again
    bench/gpu_llama_server_build.sh llama-src.tar.xz "$W/ls" cuda 16 2>&1 | tail -3
  fi
  models=()
  [[ ${SKIP_QWEN15:-0} == 1 ]] || models=(--random-qwen15)
  [[ -f $W/smol.gguf ]] && models=(--gguf "smol-q4_1=$W/smol.gguf" "${models[@]}")
  side_by_side $(( budget - 20 - $(elapsed) )) "${models[@]}" --widths 1,16,64,256
  echo "side by side done at $(elapsed) s"
  left=$(( budget - $(elapsed) ))
  if (( left > 60 )); then
    timeout "$left" python3 bench/gpu_profile.py --qwen15 --configs 64x65536 --kernels 2>&1 | tee "$OUT/profile.log" | tail -60
  fi
fi
echo "phase $phase ended at $(elapsed) s"
