"""Issue 46: a checkpoint's own sampling defaults (generation_config.json as vLLM reads it, GGUF general.sampling.*
as llama-server does) and the layers a request's missing field falls through: server flag, checkpoint,
llama-server's built-in defaults."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from mlxcel.api.context import SamplingDefaults
from mlxcel.loading.sampling import checkpoint_sampling

QWEN25 = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
          "repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
          "transformers_version": "4.37.0"}  # Qwen2.5-*-Instruct's generation_config.json


def test_generation_config_gives_vllms_fields(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN25))
    assert checkpoint_sampling(None, tmp_path) == {"temperature": 0.7, "top_k": 20, "top_p": 0.8,
                                                   "repeat_penalty": 1.05}
    assert checkpoint_sampling(None, tmp_path / "missing") == {}
    assert checkpoint_sampling(None, None) == {}


def test_gguf_sampling_keys_are_read_as_written(caplog: pytest.LogCaptureFixture) -> None:
    metadata = {"general.sampling.temp": float(np.float32(0.6)), "general.sampling.top_k": 20,
                "general.sampling.top_p": float(np.float32(0.95)), "general.sampling.min_p": 0.0,
                "general.sampling.penalty_last_n": 128, "general.sampling.penalty_repeat": float(np.float32(1.05)),
                "general.sampling.mirostat": 0, "general.name": "x"}
    assert checkpoint_sampling(metadata, None) == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.0,
                                                   "repeat_last_n": 128, "repeat_penalty": 1.05}
    assert checkpoint_sampling({"general.name": "x"}, None) == {}  # a GGUF with no keys: nothing


@pytest.mark.parametrize("bad", [{"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": "20"},
                                 {"top_k": 2.5}, {"repetition_penalty": 0}, {"min_p": True}])
def test_a_bad_value_is_left_out_and_logged(tmp_path: Path, bad: dict[str, object],
                                            caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_p": 0.8, **bad}))
    with caplog.at_level(logging.WARNING):
        found = checkpoint_sampling(None, tmp_path)
    (key,) = bad
    assert {"repetition_penalty": "repeat_penalty"}.get(key, key) not in found
    assert found and any("left out" in record.getMessage() for record in caplog.records)


def test_unreadable_generation_config_is_no_defaults(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text("{not json")
    assert checkpoint_sampling(None, tmp_path) == {}


def test_each_field_falls_through_server_then_checkpoint_then_llama_server() -> None:
    defaults = SamplingDefaults(temperature=0.2, checkpoint={"temperature": 0.7, "top_k": 20})
    assert defaults.pick("temperature", 1.3) == 1.3  # the request's own value
    assert defaults.pick("temperature", None) == 0.2 and defaults.source("temperature") == "server"
    assert defaults.pick("top_k", None) == 20 and defaults.source("top_k") == "checkpoint"
    assert defaults.pick("min_p", None) == 0.05 and defaults.source("min_p") == "llama-server"
    assert defaults.values() == {"temperature": 0.2, "top_k": 20, "top_p": 0.95, "min_p": 0.05, "repeat_last_n": 64,
                                 "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
    assert defaults.sources()["top_p"] == {"value": 0.95, "source": "llama-server"}
    assert defaults.params("repeat_penalty", "min_p") == {"repetition_penalty": 1.0, "min_p": 0.05}
