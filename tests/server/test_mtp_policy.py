"""F10 through the real server: GET /v1/internal/mtp-policy, the versioned batch-1 MTP decision."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import httpx
import pytest

from mlxcel.runtime import ServedModel
from mlxcel.server.config import ServerConfig
from mlxcel.server.lifecycle import ServerThread

pytestmark = pytest.mark.slow
STATES = ["settled", "profiling", "forced", "unavailable", "exactness_declined"]


def test_f10_a_checkpoint_without_mtp_heads_is_unavailable_with_the_reason(client: httpx.Client) -> None:
    reply = client.get("/v1/internal/mtp-policy")
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "mtp_policy" and body["version"] == 1 and body["batch_size"] == 1
    assert body["state"] == "unavailable" and body["enabled"] is False and body["mtp_layers"] == 0
    assert "no MTP heads" in body["reason"] and body["states"] == STATES
    assert body["model"] == client.get("/v1/models").json()["data"][0]["id"]


def test_f10_declared_heads_the_family_does_not_load_are_named(
        served: ServedModel, start_server: Callable[..., ServerThread]) -> None:
    # The same weights, with a config that declares one MTP layer, as a qwen2-style MiMo export would.
    config = {**served.loaded.config, "num_nextn_predict_layers": 1}
    declared = replace(served, loaded=replace(served.loaded, config=config))
    server = start_server(declared, ServerConfig(port=0))
    body = httpx.get(server.address + "/v1/internal/mtp-policy", timeout=30).json()
    assert body["state"] == "unavailable" and body["mtp_layers"] == 1 and body["enabled"] is False
    assert "declares 1 MTP layer(s) (num_nextn_predict_layers)" in body["reason"]
    assert served.loaded.model_type in body["reason"]


def test_f10_needs_the_key_when_one_is_set(served: ServedModel, start_server: Callable[..., ServerThread]) -> None:
    server = start_server(served, ServerConfig(port=0, api_keys=("sekrit",)))
    url = server.address + "/v1/internal/mtp-policy"
    refused = httpx.get(url, timeout=30)
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "invalid_api_key"
    allowed = httpx.get(url, headers={"Authorization": "Bearer sekrit"}, timeout=30)
    assert allowed.status_code == 200 and allowed.json()["state"] == "unavailable"
