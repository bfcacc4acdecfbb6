"""Decode attention over the paged KV cache: a small C++ kernel on the CPU (kernels/paged_attention.cpp),
a Triton one on CUDA (paged_attention_triton.py), as one torch custom op.

Issue 11: at long context the decode step is its attention. As tensor ops (gather the row's
keys, a masked softmax, a weighted sum) inductor's kernels took ~0.25 us a key and row on
SmolLM2's shapes (2 threads); this kernel reads each key once from its cache slot, vectorised,
split in fixed chunks over the threads, in ~0.07 us. A row's result depends on its own keys only (chunk boundaries are key indices of
the row, padding adds nothing), so tokens stay bit-identical alone and in any batch.

The kernel is compiled on first use with the system's C++ compiler (the one inductor uses), for
this CPU (`-march=native`), into the user's cache directory, keyed by its source, flags,
compiler and CPU; that takes about a second. It is called through ctypes and registered as a
torch custom op, so the compiled decode step keeps it in its graph as one opaque call. Where
no compiler works, `available()` is False and the caller keeps the tensor-op path.
"""

from __future__ import annotations

import ctypes
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

SOURCE = Path(__file__).with_name("kernels") / "paged_attention.cpp"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC")
CACHE_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


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


@torch.library.custom_op("mlxcel::paged_decode_attention", mutates_args=())
def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, key_slots: torch.Tensor,
                           key_pos: torch.Tensor, q_pos: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    """q [B, Hq, D] -> [B, Hq, D] in q's dtype; caches [slots, Hkv, D]; key_slots, key_pos [B, L]
    (pos -1: padding); q_pos [B]; window 0 = none. Sums in float32."""
    lib = _library()
    rows, q_heads, dim = q.shape
    num_slots, kv_heads = k_cache.shape[0], k_cache.shape[1]
    keys = key_slots.shape[1]
    _check(q, k_cache, v_cache, key_slots, key_pos, q_pos)
    query = q.float().contiguous()
    out = torch.empty(rows, q_heads, dim, dtype=torch.float32)
    scratch = torch.empty(lib.mlxcel_paged_attention_scratch(rows, keys, q_heads, kv_heads, dim), dtype=torch.float32)
    status = lib.mlxcel_paged_attention(
        CACHE_TYPES[k_cache.dtype], query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), key_slots.data_ptr(),
        key_pos.data_ptr(), q_pos.data_ptr(), out.data_ptr(), scratch.data_ptr(), rows, keys, q_heads, kv_heads, dim,
        num_slots, float(scale), int(window))
    if status != 0:
        raise ValueError(f"the paged attention kernel does not take {q_heads} query heads over {kv_heads} kv heads "
                         f"of dim {dim}")
    return out if q.dtype == torch.float32 else out.to(q.dtype)


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, key_slots: torch.Tensor,
           key_pos: torch.Tensor, q_pos: torch.Tensor) -> None:
    """The kernel reads raw memory: every shape, dtype and layout it relies on, checked first."""
    rows, _, dim = q.shape
    problems = [
        k_cache.shape != v_cache.shape or k_cache.dim() != 3 or k_cache.shape[2] != dim,
        k_cache.dtype != v_cache.dtype or k_cache.dtype not in CACHE_TYPES,
        not (k_cache.is_contiguous() and v_cache.is_contiguous()),
        key_slots.shape != key_pos.shape or key_slots.dim() != 2 or key_slots.shape[0] != rows,
        q_pos.shape != (rows,),
        any(t.dtype != torch.long or not t.is_contiguous() for t in (key_slots, key_pos, q_pos)),
        any(t.device.type != "cpu" for t in (q, k_cache, key_slots, key_pos, q_pos)),
    ]
    if any(problems):
        raise ValueError(f"paged attention: inconsistent inputs q {tuple(q.shape)}, caches {tuple(k_cache.shape)} "
                         f"{k_cache.dtype}, key slots {tuple(key_slots.shape)} {key_slots.dtype}, "
                         f"positions {tuple(key_pos.shape)}, query positions {tuple(q_pos.shape)}")


@paged_decode_attention.register_fake
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
    paged_decode_attention.register_kernel("cuda")(paged_decode_attention_cuda)
    return True


@functools.cache
def _library() -> ctypes.CDLL | None:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None or platform.machine() not in ("x86_64", "AMD64", "aarch64", "arm64"):
        log.warning("paged attention kernel: no C++ compiler found; decode attention stays on tensor ops")
        return None
    try:
        path = _build(compiler)
        lib = ctypes.CDLL(str(path))
    except subprocess.CalledProcessError as e:
        log.warning("paged attention kernel could not be built (%s: %s); decode attention stays on tensor ops", e,
                    (e.stderr or "").strip()[-2000:])
        return None
    except OSError as e:
        log.warning("paged attention kernel could not be built or loaded (%s); decode attention stays on tensor ops", e)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.mlxcel_paged_attention_scratch.argtypes = [i64] * 5
    lib.mlxcel_paged_attention_scratch.restype = i64
    lib.mlxcel_paged_attention.argtypes = [ctypes.c_int] + [ptr] * 8 + [i64] * 6 + [ctypes.c_float, i64]
    lib.mlxcel_paged_attention.restype = ctypes.c_int
    return lib


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS), version, _cpu_signature()]).encode())
    target = _cache_dir() / f"paged_attention-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # built aside, then moved in whole
        built = Path(tmp) / target.name
        subprocess.run([compiler, *FLAGS, "-o", str(built), str(SOURCE)], check=True, capture_output=True, text=True)
        os.replace(built, target)
    log.info("paged attention kernel built: %s", target)
    return target


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
