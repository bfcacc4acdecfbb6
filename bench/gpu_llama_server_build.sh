#!/usr/bin/env bash
# Build llama.cpp's llama-server from the trimmed tarball of bench/gpu_llama_src.sh (issue 45).
# Usage: bench/gpu_llama_server_build.sh SRC.tar.xz OUT_DIR [cuda|cpu] [JOBS]
# cuda (the lent H100 / H200): -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90, static, only the llama-server target;
# cpu: the same source built for this machine's CPU (a smoke test of the tarball). Prints the binary's path last.
set -euo pipefail
src_tar=${1:?usage: gpu_llama_server_build.sh SRC.tar.xz OUT_DIR [cuda|cpu] [JOBS]}
out=${2:?usage: gpu_llama_server_build.sh SRC.tar.xz OUT_DIR [cuda|cpu] [JOBS]}
backend=${3:-cuda}
jobs=${4:-$(nproc)}
mkdir -p "$out/src"
[[ -f $out/src/CMakeLists.txt ]] || tar -xJf "$src_tar" -C "$out/src"  # a second call resumes the same build
flags=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF
       -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DGGML_NATIVE=ON)
if [[ $backend == cuda ]]; then
  flags+=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90)
fi
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
started=$(date +%s)
if [[ ! -f $out/build/CMakeCache.txt ]]; then
  cmake -S "$out/src" -B "$out/build" "${generator[@]}" "${flags[@]}" >"$out/configure.log" 2>&1 \
    || { tail -30 "$out/configure.log"; exit 1; }
fi
cmake --build "$out/build" --target llama-server -j"$jobs" >"$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
echo "built in $(( $(date +%s) - started )) s" >&2
echo "$out/build/bin/llama-server"
