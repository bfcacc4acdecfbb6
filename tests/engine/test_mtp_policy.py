"""F10: the batch-1 MTP decision read from a checkpoint's config (HF spellings and GGUF metadata)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxcel.engine.spec.mtp import decide_mtp, declared_mtp_layers
from mlxcel.types import MtpDecision


@pytest.mark.parametrize(("config", "expected"), [
    ({"model_type": "deepseek_v3", "num_nextn_predict_layers": 1}, (1, "num_nextn_predict_layers")),
    ({"model_type": "mellum", "num_mtp_layers": 1}, (1, "num_mtp_layers")),
    ({"model_type": "qwen3_next", "mtp_num_hidden_layers": 2}, (2, "mtp_num_hidden_layers")),
    ({"model_type": "exaone4_5", "text_config": {"num_nextn_predict_layers": 3}}, (3, "num_nextn_predict_layers")),
    ({"model_type": "qwen3", "num_nextn_predict_layers": 0}, (0, None)),
    ({"model_type": "qwen3", "num_nextn_predict_layers": True}, (0, None)),  # not a count
    ({"model_type": "llama"}, (0, None)),
])
def test_declared_mtp_layers_reads_every_spelling(config: dict, expected: tuple[int, str | None]) -> None:
    assert declared_mtp_layers(config) == expected


def test_no_heads_is_unavailable_with_the_reason() -> None:
    decision = decide_mtp({"model_type": "llama"})
    assert decision.state == "unavailable" and not decision.is_enabled and decision.num_mtp_layers == 0
    assert "no MTP heads" in decision.reason and "num_nextn_predict_layers" in decision.reason


def test_declared_heads_of_a_family_without_mtp_layers_are_unavailable() -> None:
    decision = decide_mtp({"model_type": "qwen2", "num_nextn_predict_layers": 1})
    assert decision.state == "unavailable" and decision.num_mtp_layers == 1 and not decision.is_enabled
    assert "declares 1 MTP layer(s) (num_nextn_predict_layers)" in decision.reason and "qwen2" in decision.reason


def test_a_state_outside_the_spec_is_refused() -> None:
    with pytest.raises(ValueError, match="exactness_declined"):
        MtpDecision("maybe", "no")


def test_gguf_nextn_predict_layers_reaches_the_config(tmp_path: Path) -> None:
    import gguf

    from mlxcel.loading.checkpoint import gguf_config
    from mlxcel.loading.gguf import GGUFFile

    path = tmp_path / "nextn.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_uint32("llama.nextn_predict_layers", 1)
    writer.add_tensor("token_embd.weight", gguf.np.zeros((4, 8), dtype=gguf.np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = gguf_config(GGUFFile(path))
    assert config["num_nextn_predict_layers"] == 1
    assert decide_mtp(config).num_mtp_layers == 1
