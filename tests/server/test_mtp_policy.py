"""F10 through the real server: GET /v1/internal/mtp-policy, the versioned batch-1 MTP decision, and
drafting with a tiny MiMo checkpoint's own MTP layer (mimo_model.py): temperature-0 streams equal plain
decoding's, acceptance counts in /metrics, profiling settles, the flag forces, a KV window declines."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from mlxcel.config import EngineConfig, SpeculativeConfig
from mlxcel.serving.chat_model import start_served_model
from mlxcel.serving.served_model import RuntimeOptions, ServedModel
from mlxcel.server.config import ServerConfig
from mlxcel.server.lifecycle import ServerThread
from tests.server.mimo_model import write_mimo_model

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
    # The same weights, with a config that declares one MTP layer: a llama family, which loads none.
    config = {**served.loaded.config, "num_nextn_predict_layers": 1}
    declared = replace(served, loaded=replace(served.loaded, config=config), mtp_decision=None)
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


# ---- a checkpoint with MTP layers (MiMo) ----

PROMPTS = ["\nAB", "\nxyz", "\n012"]
Serve = Callable[..., str]


@pytest.fixture(scope="module")
def mimo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mimo")
    return {"random": write_mimo_model(root / "random", exact=False),
            "exact": write_mimo_model(root / "exact", exact=True)}


@pytest.fixture(scope="module")
def serve(start_server: Callable[..., ServerThread]) -> Iterator[Serve]:
    """serve(folder, mtp=..., max_kv_size=..., draft_kind=...) -> the address of a real server over it."""
    from mlxcel.loading import resolve_model

    models: list[ServedModel] = []

    def start(folder: Path, *, max_kv_size: int = 0, warmup: bool = False, **speculative: Any) -> str:
        engine = EngineConfig(max_num_seqs=2, ctx_size=4096, max_kv_size=max_kv_size,
                              speculative=SpeculativeConfig(**speculative))
        models.append(start_served_model(resolve_model(str(folder)), RuntimeOptions(warmup=warmup, quantize="off"),
                                         engine))
        return start_server(models[-1], ServerConfig(port=0, endpoint_metrics=True)).address

    yield start
    for model in models:
        model.close(30)


def policy(address: str) -> dict[str, Any]:
    reply = httpx.get(address + "/v1/internal/mtp-policy", timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()


def metric(address: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(address + "/metrics", timeout=30).text, re.MULTILINE)
    assert match, name
    return float(match.group(1))


def greedy_texts(address: str, *, max_tokens: int = 48) -> list[str]:
    """Each prompt's greedy completion, and a streamed chat reply, as text."""
    texts = []
    for prompt in PROMPTS:
        body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        texts.append(httpx.post(address + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"])
    with openai.OpenAI(base_url=address + "/v1", api_key="x", max_retries=0, timeout=120) as sdk:
        stream = sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "ABC"}], temperature=0,
                                             max_tokens=max_tokens, stream=True, extra_body={"ignore_eos": True})
        texts.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
    return texts


def test_f10_forced_mtp_drafts_and_the_streams_equal_plain_decoding(mimo: dict[str, Path], serve: Serve) -> None:
    plain, drafting = serve(mimo["random"], mtp="off"), serve(mimo["random"], mtp="on")
    assert policy(plain)["state"] == "forced" and policy(plain)["enabled"] is False
    on = policy(drafting)
    assert on["state"] == "forced" and on["enabled"] is True and on["mtp_layers"] == 1 and on["profile"] is None
    assert greedy_texts(drafting) == greedy_texts(plain)
    assert metric(drafting, "mlxcel_draft_tokens_total") > 0 and metric(plain, "mlxcel_draft_tokens_total") == 0
    assert metric(drafting, "mlxcel_draft_tokens_accepted_total") <= metric(drafting, "mlxcel_draft_tokens_total")
    assert httpx.get(drafting + "/health", timeout=30).json()["speculative"]["draft_kind"] == "mtp"


def test_f10_heads_that_predict_the_token_after_next_are_always_accepted(mimo: dict[str, Path], serve: Serve) -> None:
    address = serve(mimo["exact"], mtp="on", warmup=True)  # the startup warmup runs with the drafter too
    # The warmup ignores the end token, which the MTP layer still proposes: count this request's drafts only.
    before = [metric(address, name) for name in ("mlxcel_draft_tokens_total", "mlxcel_draft_tokens_accepted_total")]
    body = {"model": "m", "prompt": "\nAB", "max_tokens": 80, "temperature": 0}
    text = httpx.post(address + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    assert text == "CDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
    drafted = metric(address, "mlxcel_draft_tokens_total") - before[0]
    assert drafted > 0 and metric(address, "mlxcel_draft_tokens_accepted_total") - before[1] == drafted
    assert metric(address, "llamacpp:spec_decode_num_accepted_tokens_total") - before[1] == drafted


def test_f10_auto_profiles_at_batch_1_then_settles_by_measured_speed(mimo: dict[str, Path], serve: Serve) -> None:
    address = serve(mimo["random"])  # --mtp auto, the default
    before = policy(address)
    assert before["state"] == "profiling" and before["enabled"] is False and before["profile"] is None
    texts = greedy_texts(address, max_tokens=64)
    settled = policy(address)
    assert settled["state"] == "settled", settled
    profile = settled["profile"]
    assert profile["steps_with_mtp"] >= 16 and profile["steps_without_mtp"] >= 16
    # Not a timing assertion: whichever way it went, the decision follows its own measurements.
    faster = profile["tokens_per_second_with_mtp"] > profile["tokens_per_second_without_mtp"]
    assert settled["enabled"] is faster and ("is on" if faster else "is off") in settled["reason"]
    assert texts == greedy_texts(serve(mimo["random"], mtp="off"), max_tokens=64)


def test_f10_a_kv_window_declines_mtp_for_exactness(mimo: dict[str, Path], serve: Serve) -> None:
    address = serve(mimo["random"], max_kv_size=256)
    body = policy(address)
    assert body["state"] == "exactness_declined" and body["enabled"] is False and body["mtp_layers"] == 1
    assert "--max-kv-size 256" in body["reason"]
    assert greedy_texts(address, max_tokens=8) and metric(address, "mlxcel_draft_tokens_total") == 0


def test_f10_another_draft_kind_leaves_the_mtp_layers_unavailable(mimo: dict[str, Path], serve: Serve) -> None:
    body = policy(serve(mimo["random"], draft_kind="prompt-lookup"))
    assert body["state"] == "unavailable" and "--draft-kind prompt-lookup drafts instead" in body["reason"]


def test_f10_a_checkpoint_that_dropped_its_mtp_weights_is_served_without_them(
        mimo: dict[str, Path], serve: Serve, tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "stripped"
    shutil.copytree(mimo["random"], folder)
    weights = load_file(str(folder / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if ".mtp_layers." not in k}, str(folder / "model.safetensors"))
    address = serve(folder)
    body = policy(address)
    assert body["state"] == "unavailable" and body["mtp_layers"] == 1
    assert "declares 1 MTP layer(s) (num_nextn_predict_layers), but the checkpoint holds no model.mtp_layers.0.*" \
        in body["reason"]
    assert greedy_texts(address, max_tokens=8)
