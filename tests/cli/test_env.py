"""The environment table: typed, read once, bad values named."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxcel.env import ENV_VARS, Environment, EnvError


def test_defaults_and_parsing() -> None:
    env = Environment.read({"MLXCEL_MODELS_DIR": "~/models", "MLXCEL_ALLOW_PRIVATE_MEDIA_URLS": "yes",
                            "MLXCEL_VIDEO_FPS": "4", "LLAMA_ARG_PORT": "1", "OTHER": "x"})
    assert env["MLXCEL_DEFAULT_ORG"] == "mlx-community"
    assert env["MLXCEL_MODELS_DIR"] == Path("~/models").expanduser()
    assert env["MLXCEL_ALLOW_PRIVATE_MEDIA_URLS"] is True and env["MLXCEL_VIDEO_FPS"] == 4.0
    assert env.llama_args == {"LLAMA_ARG_PORT": "1"}
    assert len({v.name for v in ENV_VARS}) == len(ENV_VARS)


def test_snapshot_is_not_live(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLXCEL_DEFAULT_ORG", "first")
    env = Environment.read()
    monkeypatch.setenv("MLXCEL_DEFAULT_ORG", "second")
    assert env["MLXCEL_DEFAULT_ORG"] == "first"


def test_bad_values_refuse_startup() -> None:
    with pytest.raises(EnvError, match="MLXCEL_VIDEO_MAX_FRAMES"):
        Environment.read({"MLXCEL_VIDEO_MAX_FRAMES": "many"})
    with pytest.raises(KeyError):
        Environment.read({})["NOT_A_VARIABLE"]
