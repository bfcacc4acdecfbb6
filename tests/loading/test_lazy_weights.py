"""A6 lazy weights (MLXCEL_WEIGHT_MATERIALIZATION=lazy): the checkpoint is mapped, each tensor read
on first use, and the logits are the same bits as with eager loading (safetensors and GGUF)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mlxcel.env import Environment, EnvError
from mlxcel.layers.attention import AttentionContext, SequenceSlice
from mlxcel.loading import load_model
from tests.loading.tiny_checkpoint import tiny_llama_files, write_files

PROMPT = [5, 17, 33, 2, 9, 40, 61, 12, 3, 77, 21, 8]


@torch.inference_mode()
def logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    ctx = AttentionContext([SequenceSlice(0, len(ids), len(ids))])
    return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), ctx))


def test_a6_lazy_safetensors_reads_on_first_use_and_equals_eager(tmp_path: Path) -> None:
    folder = write_files(tmp_path / "tiny", tiny_llama_files(seed=5))
    lazy = load_model(folder, lazy=True).model
    pending = lazy.lazy_weights.num_pending
    assert pending > 0 and all(p.is_meta for p in lazy.parameters())  # nothing read yet
    assert torch.equal(logits(lazy, PROMPT), logits(load_model(folder).model, PROMPT))
    assert lazy.lazy_weights.num_pending == 0 and not any(p.is_meta for p in lazy.parameters())


@pytest.mark.slow
def test_a6_lazy_gguf_equals_eager_on_smollm2(smollm2_path: Path) -> None:
    lazy = load_model(smollm2_path, lazy=True).model
    assert lazy.lazy_weights.num_pending > 0
    got = logits(lazy, PROMPT)
    assert torch.equal(got, logits(load_model(smollm2_path).model, PROMPT))


@pytest.mark.parametrize("decode_step", ["eager", pytest.param("compile", marks=pytest.mark.slow)])
def test_a6_engine_serves_lazy_weights_like_eager(tmp_path: Path, decode_step: str) -> None:
    from mlxcel.config import EngineConfig
    from mlxcel.loading import ResolvedModel
    from mlxcel.serving.chat_model import start_served_model
    from mlxcel.serving.served_model import RuntimeOptions
    from mlxcel.types import Request, SamplingParams

    folder = write_files(tmp_path / "tiny", tiny_llama_files(seed=5))
    outputs = []
    for mode in ("lazy", "eager"):
        options = RuntimeOptions(warmup=False, quantize="off", weight_materialization=mode)
        served = start_served_model(ResolvedModel(folder, "tiny", "test"), options,
                                    EngineConfig(max_num_seqs=2, ctx_size=256, decode_step=decode_step,
                                                 compile_cache_dir=str(tmp_path / "compile")))
        try:
            from mlxcel.serving.served_model import _run_blocking

            params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
            outputs.append(_run_blocking(served, Request(f"lazy-{mode}-{decode_step}", PROMPT, params)))
        finally:
            served.close()
    assert outputs[0] == outputs[1] and len(outputs[0]) == 6


def test_a6_bad_materialization_value_names_the_variable_and_choices() -> None:
    with pytest.raises(EnvError, match=r"weight_materialization \(MLXCEL_WEIGHT_MATERIALIZATION\): 'sometimes' is "
                                       r"not valid; expected one of eager, lazy"):
        Environment.read({"MLXCEL_WEIGHT_MATERIALIZATION": "sometimes"})
    assert Environment.read({"MLXCEL_WEIGHT_MATERIALIZATION": "lazy"})["MLXCEL_WEIGHT_MATERIALIZATION"] == "lazy"


@pytest.mark.parametrize(("quantize", "mode", "load_says", "then_says"), [
    ("off", "eager", "read llama weights", "weights: read in full at load"),
    ("off", "lazy", "mapped (no tensor read yet) llama weights", "weights: mapped, each tensor read when its module"),
    ("auto", "eager", "mapped (no tensor read yet) llama weights", "weights: mapped, each linear read from the file"),
    ("auto", "lazy", "mapped (no tensor read yet) llama weights", "lazy does not apply, --quantize off keeps them"),
])
def test_issue47_the_load_log_tells_one_story(tmp_path: Path, caplog: pytest.LogCaptureFixture, quantize: str,
                                              mode: str, load_says: str, then_says: str) -> None:
    """The weights' line at load and the "Model loaded" line agree: never "mapped (lazy)" then "eager"."""
    import logging

    from mlxcel.config import EngineConfig
    from mlxcel.loading import ResolvedModel
    from mlxcel.layers.quant import can_quantize
    from mlxcel.serving.chat_model import start_served_model
    from mlxcel.serving.served_model import RuntimeOptions

    if quantize == "auto" and not can_quantize():
        pytest.skip("no CPU decode rewrite on this machine")
    folder = write_files(tmp_path / "tiny", tiny_llama_files(seed=5))
    options = RuntimeOptions(warmup=False, quantize=quantize, weight_materialization=mode)
    with caplog.at_level(logging.INFO):
        served = start_served_model(ResolvedModel(folder, "tiny", "test"), options,
                                    EngineConfig(max_num_seqs=1, ctx_size=128))
        served.close()
    lines = [record.getMessage() for record in caplog.records]
    load = [line for line in lines if " llama weights " in line]
    loaded = [line for line in lines if line.startswith("Model loaded")]
    assert len(load) == 1 and load[0].startswith(load_says), lines
    assert len(loaded) == 1 and then_says in loaded[0], lines
    if load_says.startswith("mapped"):
        assert "eager" not in loaded[0] and "read in full at load" not in loaded[0]


@pytest.mark.parametrize("family", ["phi3", "glm4"])
def test_issue40_lazy_fused_projections_read_only_their_rows_on_first_use(tmp_path: Path, family: str,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Phi-3's qkv_proj / gate_up_proj and GLM-4's gate_up_proj are split at load without reading them:
    each part reads its own rows of the mapped tensor when its module first runs, never the whole
    fused tensor, and the logits are eager loading's bits."""
    from mlxcel.loading.lazy import SafetensorsReader
    from tests.models.harness import save_tiny_hf
    from tests.models.test_families import FAMILIES

    save_tiny_hf(FAMILIES[family][1](), tmp_path)
    whole, rows = [], []
    read_whole, read_rows = SafetensorsReader.__call__, SafetensorsReader.rows
    monkeypatch.setattr(SafetensorsReader, "__call__", lambda self, n: whole.append(self.key) or read_whole(self, n))
    monkeypatch.setattr(SafetensorsReader, "rows",
                        lambda self, a, b: rows.append((self.key, a, b)) or read_rows(self, a, b))
    lazy = load_model(tmp_path, lazy=True).model
    assert all(p.is_meta for p in lazy.parameters()) and not whole and not rows  # nothing read at load
    got = logits(lazy, PROMPT)
    fused = {k for k in whole + [key for key, _, _ in rows] if k.endswith(("qkv_proj.weight", "gate_up_proj.weight"))}
    assert fused and not any(k in fused for k in whole)  # fused tensors only ever read by rows
    layer0 = sorted((a, b) for key, a, b in rows if key == "model.layers.0.mlp.gate_up_proj.weight")
    width = lazy.args.intermediate_size
    assert layer0 == [(0, width), (width, 2 * width)]
    monkeypatch.undo()
    assert torch.equal(got, logits(load_model(tmp_path).model, PROMPT))
