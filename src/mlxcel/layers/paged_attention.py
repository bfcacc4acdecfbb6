"""Decode attention over the paged KV cache: a small C++ kernel on the CPU (kernels/paged_attention.cpp),
a Triton one on CUDA (paged_attention_triton.py), as one torch custom op.

Issue 11: at long context the decode step is its attention. As tensor ops (gather the row's
keys, a masked softmax, a weighted sum) inductor's kernels took ~0.25 us a key and row on
SmolLM2's shapes (2 threads); this kernel reads each key once from its cache slot, vectorised,
split in fixed chunks over the threads, in ~0.07 us. A row's result depends on its own keys only (chunk boundaries are key indices of
the row, padding adds nothing), so tokens stay bit-identical alone and in any batch.

The op's schema and its fake (shape) function are defined here, so the compiled decode step keeps
it in its graph as one opaque call. The CPU kernel is compiled on first use with the system's C++
compiler (the one inductor uses), for this CPU (`-march=native`), against torch's headers, into
the user's cache directory, keyed by its source, flags, compiler, CPU and torch version (about
10 s, once); loading it registers the C++ function as the op's CPU kernel, so a call costs the
dispatcher's few microseconds (through a Python custom op with ctypes it was ~65 us, against the
kernel's 22: bench/RESULTS.md). Where no compiler works, `available()` is False and the caller
keeps the tensor-op path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# Built into one library: the attention kernel, the decode step's layers that call it, and the
# CPU sampler (engine/sampler.py) that draws from the step's logits.
SOURCES = tuple(Path(__file__).with_name("kernels") / name
                for name in ("paged_attention.cpp", "decode_layers.cpp", "sample_rows.cpp"))
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC",
         "-std=c++17", "-w")
CACHE_TYPES = (torch.float32, torch.bfloat16, torch.float16)
SCHEMA = ("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor key_slots, Tensor key_pos, "
          "Tensor q_pos, float scale, int window) -> Tensor")

_LIBRARY = torch.library.Library("mlxcel", "FRAGMENT")  # kept alive: the op lives as long as the module
_LIBRARY.define(SCHEMA)
# q [B, Hq, D] -> [B, Hq, D] in q's dtype; caches [slots, Hkv, D]; key_slots, key_pos [B, L] (pos -1:
# padding); q_pos [B]; window 0 = none. Sums in float32. Inconsistent inputs raise a ValueError.
paged_decode_attention = torch.ops.mlxcel.paged_decode_attention.default


def available() -> bool:
    return _library() is not None


def supports(cache_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a cache of this dtype on this device is read by a kernel (unquantized): the C++ one on
    the CPU, the Triton one (paged_attention_triton.py) on CUDA."""
    if cache_dtype not in CACHE_TYPES:
        return False
    if device.type == "cuda":
        return _triton_kernel()
    return device.type == "cpu" and available()


@torch.library.register_fake("mlxcel::paged_decode_attention", lib=_LIBRARY)
def _paged_decode_attention_fake(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 key_slots: torch.Tensor, key_pos: torch.Tensor, q_pos: torch.Tensor, scale: float,
                                 window: int) -> torch.Tensor:
    return torch.empty_like(q)


@functools.cache
def _triton_kernel() -> bool:
    """Registers the CUDA kernel of the op on first use; False where Triton is missing or fails."""
    try:
        from mlxcel.layers.paged_attention_triton import paged_decode_attention_cuda
    except Exception as e:  # noqa: BLE001 - no Triton (or a broken one): the tensor-op path stays
        log.warning("paged attention: no Triton kernel on CUDA (%s); decode attention stays on tensor ops", e)
        return False
    _LIBRARY.impl("paged_decode_attention", paged_decode_attention_cuda, "CUDA")
    return True


@functools.cache
def _library() -> Path | None:
    """Builds (once per source, flags, compiler, CPU and torch) and loads the CPU kernel; None where that fails."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None or platform.machine() not in ("x86_64", "AMD64", "aarch64", "arm64"):
        log.warning("paged attention kernel: no C++ compiler found; decode attention stays on tensor ops")
        return None
    try:
        path = _build(compiler)
        torch.ops.load_library(str(path))
        _register_fakes()
    except subprocess.CalledProcessError as e:
        log.warning("paged attention kernel could not be built (%s: %s); decode attention stays on tensor ops", e,
                    (e.stderr or "").strip()[-2000:])
        return None
    except OSError as e:
        log.warning("paged attention kernel could not be built or loaded (%s); decode attention stays on tensor ops", e)
        return None
    return path


def _register_fakes() -> None:
    """Shapes of the ops decode_layers.cpp defines, for a traced step (torch.compile) that calls them."""
    @torch.library.register_fake("mlxcel::int8_linear", lib=_LIBRARY)
    def _int8_linear_fake(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        # w: [blocks, in, 64] (layers/quant.py int8_blocks) or 6-bit [blocks, in / 16, 3, 64] (int6_blocks);
        # scale [out] (a scale a row) or, grouped (a GGUF's own codes, int8_group_scales), [blocks, groups,
        # (2,) 64]: then every block is whole.
        out = w.shape[0] * w.shape[-1] if scale.dim() >= 3 else scale.shape[0]
        return x.new_empty(x.shape[0], out)

    @torch.library.register_fake("mlxcel::int4_linear", lib=_LIBRARY)
    def _int4_linear_fake(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape[0], packed.shape[0] * 16)  # packed: [blocks of 16 outputs, ...] (int4_blocks)

    @torch.library.register_fake("mlxcel::quant_experts", lib=_LIBRARY)
    def _quant_experts_fake(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, linears: list[torch.Tensor],
                            activation: str, limit: float, alpha: float) -> torch.Tensor:
        return torch.empty_like(x)  # layers/moe.py QuantExperts: the routed experts' weighted sum


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    flags = [*FLAGS, *_torch_flags()]  # after the source: the linker takes libraries in order
    key = hashlib.sha256("\0".join([*(source.read_text() for source in SOURCES), " ".join(flags), version,
                                     _cpu_signature(), torch.__version__]).encode())
    target = _cache_dir() / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    log.info("building the CPU kernels (paged attention, decode layers) for this CPU and torch %s (about 20 s, once)",
             torch.__version__)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # built aside, then moved in whole
        built = Path(tmp) / target.name
        subprocess.run([compiler, "-o", str(built), *map(str, SOURCES), *flags], check=True, capture_output=True,
                       text=True)
        os.replace(built, target)
    log.info("CPU kernels built: %s", target)
    return target


def _torch_flags() -> list[str]:
    """Compile and link against the running torch (its headers, ABI, libc10 and libtorch_cpu)."""
    from torch.utils import cpp_extension

    lib_dir = Path(torch.__file__).parent / "lib"
    return [*(f"-I{p}" for p in cpp_extension.include_paths()),
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            f"-L{lib_dir}", f"-Wl,-rpath,{lib_dir}", "-lc10", "-ltorch_cpu"]


def _cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "mlxcel" / "kernels"


def _cpu_signature() -> str:
    """The CPU's model and feature flags: a kernel built for one CPU is never loaded on another."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags", "Features"))}))
