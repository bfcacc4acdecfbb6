#!/usr/bin/env bash
# A trimmed llama.cpp source tarball for bench/gpu_llama_server_build.sh (issue 45): what llama-server's
# CUDA (or CPU) build and convert_hf_to_gguf.py need, no other backends, UI sources, tests or models.
# Usage: bench/gpu_llama_src.sh GIT_DIR OUT.tar.xz   (GIT_DIR: a git directory of github:ngxson/llama.cpp)
set -euo pipefail
git_dir=${1:?usage: gpu_llama_src.sh GIT_DIR OUT.tar.xz}
out=${2:?usage: gpu_llama_src.sh GIT_DIR OUT.tar.xz}
keep=(CMakeLists.txt LICENSE cmake common ggml include src tools vendor licenses convert_hf_to_gguf.py conversion gguf-py
      scripts/ui-assets.cmake)  # ui-assets.cmake: llama-ui's build step runs it even with LLAMA_BUILD_UI=OFF
drop=()
for backend in cann et hexagon hip metal musa opencl openvino sycl virtgpu vulkan webgpu zdnn zendnn blas; do
  drop+=(":(exclude)ggml/src/ggml-$backend")
done
# the UI's sources and test fixtures (LLAMA_BUILD_UI=OFF needs only its CMake files), mtmd's media samples
drop+=(":(exclude)tools/ui/src" ":(exclude)tools/ui/tests" ":(exclude)tools/ui/static" ":(exclude)tools/ui/package-lock.json"
       ":(exclude)tools/mtmd/*.mp4" ":(exclude)tools/mtmd/*.jpg" ":(exclude)tools/mtmd/*.png" ":(exclude)tools/mtmd/*.mp3")
git --git-dir="$git_dir" archive --format=tar HEAD -- "${keep[@]}" "${drop[@]}" | xz -T2 -6 >"$out"
echo "$(git --git-dir="$git_dir" rev-parse HEAD) $(stat -c %s "$out") bytes -> $out"
