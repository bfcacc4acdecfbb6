"""Model arguments that name a hub repo (A2), against a fake Hugging Face Hub on 127.0.0.1:
`owner/name` downloads into the models dir and loads; a bare name reads as
`${MLXCEL_DEFAULT_ORG:-mlx-community}/<name>`; the second resolve never asks the hub; a repo the
hub does not know, or a hub that is down, is one ModelLoadError line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_safetensors

from mlxcel.loading import ModelLoadError, load_model, resolve_model
from mlxcel.text.tokenizer import Tokenizer

from .fake_hub import FakeHub

INFO = "/api/models/{repo}/revision/main"


def test_a2_repo_id_downloads_into_the_models_dir_and_loads(fake_hub: FakeHub, tiny_llama: dict[str, bytes],
                                                            tmp_path: Path) -> None:
    store = tmp_path / "store"
    resolved = resolve_model("acme/tiny-llama", models_dir=store)
    assert resolved.name == "acme/tiny-llama"
    assert resolved.path.is_relative_to(store / "models--acme--tiny-llama" / "snapshots")
    assert {p.name: p.read_bytes() for p in resolved.path.iterdir()} == tiny_llama
    assert fake_hub.paths()[0] == INFO.format(repo="acme/tiny-llama")
    assert {p.rsplit("/", 1)[-1] for p in fake_hub.paths() if "/resolve/" in p} == set(tiny_llama)
    loaded = load_model(resolved.path)
    served = load_safetensors(tiny_llama["model.safetensors"])
    assert loaded.model_type == "llama"
    torch.testing.assert_close(loaded.model.state_dict()["model.embed_tokens.weight"],
                               served["model.embed_tokens.weight"], atol=0, rtol=0)
    assert Tokenizer.from_pretrained_dir(resolved.path).encode("hi", add_special_tokens=False) == [72, 73]


@pytest.mark.parametrize("org", ["mlx-community", "acme"])
def test_a2_bare_name_resolves_under_the_default_org(fake_hub: FakeHub, tmp_path: Path, org: str) -> None:
    resolved = resolve_model("tiny-llama", models_dir=tmp_path, default_org=org)
    assert resolved.name == f"{org}/tiny-llama"
    assert fake_hub.paths()[0] == INFO.format(repo=f"{org}/tiny-llama")
    assert resolved.path.is_relative_to(tmp_path / f"models--{org}--tiny-llama")


def test_a2_second_resolve_uses_the_local_store_without_the_hub(fake_hub: FakeHub, tmp_path: Path) -> None:
    first = resolve_model("acme/tiny-llama", models_dir=tmp_path)
    seen = fake_hub.paths()
    assert resolve_model("acme/tiny-llama", models_dir=tmp_path).path == first.path
    assert fake_hub.paths() == seen  # not even a revision check
    fake_hub.stop()
    again = resolve_model("acme/tiny-llama", models_dir=tmp_path, allow_download=False)
    assert again.path == first.path and load_model(again.path).model_type == "llama"


def assert_one_line(exc: pytest.ExceptionInfo[ModelLoadError], *fragments: str) -> None:
    message = str(exc.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message


def test_a2_repo_unknown_to_the_hub_is_one_clear_line(fake_hub: FakeHub, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as exc:
        resolve_model("acme/no-such-model", models_dir=tmp_path)
    assert_one_line(exc, "'acme/no-such-model'", "acme/no-such-model was not found on", fake_hub.url)
    assert fake_hub.paths() == [INFO.format(repo="acme/no-such-model")]
    assert not (tmp_path / "models--acme--no-such-model" / "snapshots").exists()


def test_a2_hub_down_and_model_not_stored_is_one_clear_line(fake_hub: FakeHub, tmp_path: Path) -> None:
    url = fake_hub.url
    fake_hub.stop()
    with pytest.raises(ModelLoadError) as exc:
        resolve_model("tiny-llama", models_dir=tmp_path)
    assert_one_line(exc, "'tiny-llama'", f"downloading mlx-community/tiny-llama from {url} failed", "refused")


def test_a2_downloads_off_and_model_not_stored_names_the_repo(fake_hub: FakeHub, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as exc:
        resolve_model("acme/tiny-llama", models_dir=tmp_path, allow_download=False)
    assert_one_line(exc, "acme/tiny-llama is not in the local store and downloads are off")
    assert fake_hub.paths() == []


@pytest.mark.parametrize("arg", ["missing.gguf", "./missing", "sub/dir/missing.gguf", "/no/such/model"])
def test_a2_missing_path_is_reported_as_a_path_not_asked_of_the_hub(fake_hub: FakeHub, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch, arg: str) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError) as exc:
        resolve_model(arg, models_dir=tmp_path)
    assert_one_line(exc, repr(arg), "no such file or folder")
    assert fake_hub.paths() == []
