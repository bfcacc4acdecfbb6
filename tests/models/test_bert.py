"""BERT family (spec I): the encoder equals transformers' BertModel on padded batches, the
1-label classification head equals BertForSequenceClassification, names equal the checkpoint's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mlxcel.loading.errors import ModelLoadError
from mlxcel.loading import encoder
from tests.workers.tiny_checkpoints import minilm_dir, write_tiny_bert  # noqa: F401 - a fixture

IDS = torch.tensor([[101, 7592, 2088, 999, 102, 0, 0], [101, 2023, 2003, 1037, 2936, 6251, 102]])
MASK = (IDS != 0).long()
TYPES = torch.tensor([[0, 0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 1, 1, 1]])


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_bert(tmp_path_factory.mktemp("bert"))


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_bert(tmp_path_factory.mktemp("cross"), classifier=True)


def test_I_encoder_matches_transformers_on_a_padded_batch(encoder_dir: Path) -> None:
    from transformers import BertModel

    ours = encoder.load_model(encoder_dir)
    reference = BertModel.from_pretrained(str(encoder_dir)).eval()
    with torch.no_grad():
        got = ours(IDS, MASK, TYPES)
        want = reference(input_ids=IDS, attention_mask=MASK, token_type_ids=TYPES).last_hidden_state
    real = MASK.bool()  # padded positions carry no meaning in either
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-4)


def test_I_padding_does_not_change_a_sequence(encoder_dir: Path) -> None:
    model = encoder.load_model(encoder_dir)
    with torch.no_grad():
        alone = model(IDS[:1, :5], MASK[:1, :5], TYPES[:1, :5])
        padded = model(IDS, MASK, TYPES)[:1, :5]
    torch.testing.assert_close(alone, padded, atol=1e-5, rtol=1e-4)


def test_I_classifier_matches_transformers(classifier_dir: Path) -> None:
    from transformers import BertForSequenceClassification

    ours = encoder.load_classifier(classifier_dir)
    reference = BertForSequenceClassification.from_pretrained(str(classifier_dir)).eval()
    with torch.no_grad():
        got = ours(IDS, MASK, TYPES)
        want = reference(input_ids=IDS, attention_mask=MASK, token_type_ids=TYPES).logits
    assert got.shape == (2, 1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_I_parameter_names_equal_the_checkpoint(classifier_dir: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(classifier_dir / "model.safetensors"), "pt") as f:
        stored = {name for name in f.keys() if not name.endswith("position_ids")}
    assert set(encoder.load_classifier(classifier_dir).state_dict()) == stored
    encoder_names = set(encoder.load_model(classifier_dir).state_dict())  # the `bert.` prefix dropped
    assert encoder_names == {name[5:] for name in stored if name.startswith("bert.")}


def test_I_generic_builder_loads_bert_through_sanitize(encoder_dir: Path) -> None:
    from mlxcel.loading.checkpoint import build_model, hf_config, hf_state_dict

    model = build_model(hf_config(encoder_dir), hf_state_dict(encoder_dir), device="cpu", dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS, MASK, TYPES), encoder.load_model(encoder_dir)(IDS, MASK, TYPES))


def test_I_relative_positions_are_refused(tmp_path: Path) -> None:
    folder = write_tiny_bert(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "position_embedding_type": "relative_key"}))
    with pytest.raises(ModelLoadError, match="relative_key"):
        encoder.load_model(folder)


def test_I_missing_weights_name_the_tensor(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = write_tiny_bert(tmp_path)
    state = load_file(str(folder / "model.safetensors"))
    del state["encoder.layer.1.output.dense.weight"]
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"encoder\.layer\.1\.output\.dense\.weight"):
        encoder.load_model(folder)


@pytest.mark.slow
def test_I_minilm_hidden_states_match_transformers(minilm_dir: Path) -> None:
    from transformers import BertModel

    reference = BertModel.from_pretrained(str(minilm_dir)).eval()
    with torch.no_grad():
        got = encoder.load_model(minilm_dir)(IDS, MASK, TYPES)
        want = reference(input_ids=IDS, attention_mask=MASK, token_type_ids=TYPES).last_hidden_state
    torch.testing.assert_close(got[MASK.bool()], want[MASK.bool()], atol=1e-5, rtol=1e-4)
