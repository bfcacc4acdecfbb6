"""layers/moe.py against transformers' own sparse-MoE blocks (issue 40, MoE part).

For each router family a one-layer transformers model of a tiny config (hidden 64, 8 experts, top-2,
expert width 32) gets weights ~ N(0, 0.2) (tie-free routing) and is saved with save_pretrained, so the
checkpoint has the family's real on-disk names (transformers 5 reverts its stacked names on save).
Layer 0's entries go through `sanitize_moe` into our `MoE`; outputs must equal the transformers
block's (float32, <= 1e-5) and the selected experts the transformers router's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file

from mlxcel.layers.moe import (
    EXPERT_PATHS, MoE, MoESpec, RouterSpec, moe_spec_from_config, route, sanitize_moe,
)

TOL = 1e-5
NUM_TOKENS = 40
COMMON = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=32,
              num_experts_per_tok=2)
MLA = dict(q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
GROUPED = dict(moe_intermediate_size=32, n_routed_experts=8, n_group=4, topk_group=2, routed_scaling_factor=2.5,
               norm_topk_prob=True, n_shared_experts=1, first_k_dense_replace=0)


@dataclass(frozen=True)
class Family:
    config: Callable[[], transformers.PretrainedConfig]
    spec: Callable[[dict[str, Any]], MoESpec]  # what the family module declares
    layout: str  # sanitize_moe's checkpoint layout
    block: str = "mlp"  # the block's attribute in transformers' decoder layer
    stored_block: str = "mlp"  # ... and its name in the saved checkpoint
    router: str = "gate"  # the router's attribute in transformers' block
    stored_layer: str = "model.layers.0."  # the first layer's prefix in the saved checkpoint


FAMILIES: dict[str, Family] = {
    "mixtral": Family(
        lambda: transformers.MixtralConfig(**COMMON, intermediate_size=32, num_local_experts=8),
        lambda c: moe_spec_from_config(c, "softmax", normalize=True), "mixtral", stored_block="block_sparse_moe"),
    "qwen2_moe": Family(
        lambda: transformers.Qwen2MoeConfig(**COMMON, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                            num_experts=8, norm_topk_prob=False),
        lambda c: moe_spec_from_config(c, "softmax", shared_name="shared_expert", is_shared_gated=True), "per_expert"),
    "qwen3_moe": Family(
        lambda: transformers.Qwen3MoeConfig(**COMMON, moe_intermediate_size=32, num_experts=8, norm_topk_prob=True),
        lambda c: moe_spec_from_config(c, "softmax"), "per_expert"),
    "qwen3_moe-unnormalised": Family(
        lambda: transformers.Qwen3MoeConfig(**COMMON, moe_intermediate_size=32, num_experts=8, norm_topk_prob=False),
        lambda c: moe_spec_from_config(c, "softmax"), "per_expert"),
    "olmoe": Family(
        lambda: transformers.OlmoeConfig(**COMMON, intermediate_size=32, num_experts=8, norm_topk_prob=False),
        lambda c: moe_spec_from_config(c, "softmax"), "per_expert"),
    "granitemoe": Family(
        lambda: transformers.GraniteMoeConfig(**COMMON, intermediate_size=32, num_local_experts=8),
        lambda c: moe_spec_from_config(c, "topk_softmax"), "granite",
        block="block_sparse_moe", stored_block="block_sparse_moe", router="router"),
    "phimoe": Family(
        lambda: transformers.PhimoeConfig(**COMMON, intermediate_size=32, num_local_experts=8, router_jitter_noise=0.3),
        lambda c: moe_spec_from_config(c, "sparsemixer"), "mixtral", stored_block="block_sparse_moe", router="router"),
    "gpt_oss": Family(
        # A limit of 1 clamps many of the gate and up values.
        lambda: transformers.GptOssConfig(**COMMON, intermediate_size=32, num_local_experts=8, head_dim=16,
                                          swiglu_limit=1.0),
        lambda c: moe_spec_from_config(c, "topk_softmax", has_bias=True, has_expert_bias=True,
                                       activation="swiglu_clamped"), "gpt_oss", router="router"),
    "deepseek_v3": Family(
        lambda: transformers.DeepseekV3Config(**COMMON, **GROUPED, **MLA),
        lambda c: moe_spec_from_config(c, "sigmoid_grouped"), "per_expert"),
    # DeepSeek-V2's softmax router, limited to the best 2 of 4 groups; the family module's own spec.
    "deepseek_v2": Family(
        lambda: transformers.DeepseekV2Config(**COMMON, **{**GROUPED, "n_shared_experts": 2},
                                              topk_method="group_limited_greedy", **MLA),
        lambda c: _deepseek_v2_spec(c), "per_expert"),
    # Issue 41: Nemotron-H's ungated relu^2 experts and shared expert, its sigmoid router limited to 1 of 2 groups.
    "nemotron_h": Family(
        lambda: transformers.NemotronHConfig(**COMMON, layers_block_type=["moe"], n_routed_experts=8,
                                             moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
                                             n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True),
        lambda c: _nemotron_h_spec(c), "per_expert", block="mixer", stored_block="mixer",
        stored_layer="backbone.layers.0."),
    "glm4_moe": Family(
        lambda: transformers.Glm4MoeConfig(**COMMON, **GROUPED, head_dim=16),
        lambda c: moe_spec_from_config(c, "sigmoid_grouped"), "per_expert"),
}


def _nemotron_h_spec(config: dict[str, Any]) -> MoESpec:
    from mlxcel.models import nemotron_h

    return nemotron_h.ModelArgs.from_dict(config).moe_spec()


def _deepseek_v2_spec(config: dict[str, Any]) -> MoESpec:
    from mlxcel.models import deepseek_v2

    return deepseek_v2.ModelArgs.from_dict(config).moe_spec()


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Any:
    # Tiny matmuls: a second OpenMP thread only adds wake-ups (10-100x slower on a busy 2-core box).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@dataclass
class Pair:
    reference: torch.nn.Module  # transformers' MoE block of layer 0
    router: torch.nn.Module  # its router
    ours: MoE
    stored: dict[str, torch.Tensor]  # the checkpoint's entries of that block, names relative to it
    layout: str


def _build(name: str, tmp_path: Path) -> Pair:
    family = FAMILIES[name]
    torch.manual_seed(0)
    config = family.config()
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="eager").eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
        for buffer_name, buffer in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):  # a bias big enough to change choices
                buffer.normal_(0.0, 0.2)
    model.save_pretrained(tmp_path)
    prefix = f"{family.stored_layer}{family.stored_block}."
    stored = {k[len(prefix):]: v for k, v in load_file(tmp_path / "model.safetensors").items() if k.startswith(prefix)}
    ours = MoE(family.spec(config.to_dict()))
    missing, unexpected = ours.load_state_dict(sanitize_moe(stored, family.layout), strict=True)
    assert not missing and not unexpected
    block = getattr(model.model.layers[0], family.block)
    return Pair(block, getattr(block, family.router), ours.eval(), stored, family.layout)


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    return _build(request.param, tmp_path_factory.mktemp(request.param))


def _inputs() -> torch.Tensor:
    return torch.randn(NUM_TOKENS, 64, generator=torch.Generator().manual_seed(1))


@torch.inference_mode()
def test_moe_output_equals_transformers_block(pair: Pair) -> None:
    x = _inputs()
    expected = pair.reference(x[None])
    expected = expected[0] if isinstance(expected, tuple) else expected  # gpt-oss also returns its scores
    got = pair.ours(x)
    assert got.shape == x.shape
    torch.testing.assert_close(got, expected[0], rtol=0, atol=TOL)


@torch.inference_mode()
def test_selected_experts_equal_transformers_router(pair: Pair) -> None:
    x = _inputs()
    _, ref_weights, ref_ids = pair.router(x)
    weights, ids = pair.ours.gate(x)
    assert torch.equal(ids.sort(dim=-1).values, ref_ids.sort(dim=-1).values)
    # The weights in the reference's own expert order.
    reordered = weights.gather(-1, ids.argsort(-1)).gather(-1, ref_ids.argsort(-1).argsort(-1))
    torch.testing.assert_close(reordered, ref_weights.float(), rtol=0, atol=TOL)
    assert len(torch.unique(ids)) > pair.ours.spec.router.top_k  # the test does spread over experts


@torch.inference_mode()
@pytest.mark.parametrize("path", [p for p in EXPERT_PATHS if p != "grouped"])
def test_every_expert_path_equals_grouped_matmul(pair: Pair, path: str) -> None:
    x = _inputs()
    weights, ids = pair.ours.gate(x)
    grouped = pair.ours.experts(x, ids, weights, path="grouped")
    torch.testing.assert_close(pair.ours.experts(x, ids, weights, path=path), grouped, rtol=0, atol=TOL)


@torch.inference_mode()
def test_one_token_and_lazy_readers(pair: Pair) -> None:
    """A decode step's single row matches the batch's row; lazy readers stack as eager loading does."""
    x = _inputs()
    torch.testing.assert_close(pair.ours(x[5:6]), pair.ours(x)[5:6], rtol=0, atol=TOL)
    readers = {k: (lambda _n, v=v: v) for k, v in pair.stored.items()}
    eager = sanitize_moe(pair.stored, pair.layout)
    lazy = sanitize_moe(readers, pair.layout)
    assert set(lazy) == set(eager)
    for key, value in eager.items():
        torch.testing.assert_close(lazy[key](key), value, rtol=0, atol=0)


@pytest.mark.slow  # ~30 s of inductor on 2 cores
@torch.inference_mode()
def test_full_graph_compile_equals_eager() -> None:
    """The compiled decode step traces a whole layer (fullgraph, dynamic rows): the experts op is opaque."""
    spec = MoESpec(RouterSpec("softmax", 8, 2, normalize=True), 64, 32, shared_intermediate_size=48,
                   shared_name="shared_expert", is_shared_gated=True)
    torch.manual_seed(0)
    moe = MoE(spec)
    for param in moe.parameters():
        torch.nn.init.normal_(param, 0.0, 0.2)
    compiled = torch.compile(moe, fullgraph=True, dynamic=True)
    for num_rows in (3, 7):
        x = torch.randn(num_rows, 64)
        torch.testing.assert_close(compiled(x), moe(x), rtol=0, atol=TOL)


def test_grouped_routing_keeps_the_best_groups_only() -> None:
    # Expert 0 scores best, but its group's second expert is poor: group 1 (experts 2, 3) wins.
    spec = RouterSpec("sigmoid_grouped", num_experts=4, top_k=2, num_groups=2, topk_groups=1)
    logits = torch.tensor([[3.0, -3.0, 2.0, 1.9]])
    weights, ids = route(logits, spec)
    assert ids.sort(-1).values.tolist() == [[2, 3]]
    torch.testing.assert_close(weights.sort(-1).values, torch.sigmoid(torch.tensor([[1.9, 2.0]])))
    ungrouped = RouterSpec("sigmoid_grouped", num_experts=4, top_k=2)
    assert route(logits, ungrouped)[1].sort(-1).values.tolist() == [[0, 2]]


def test_softmax_grouped_routing_scores_a_group_by_its_best_expert() -> None:
    """DeepSeek-V2: group 0 (experts 0, 1) holds the best expert and wins, though group 1's two
    together outscore it (V3's sum of the best two would keep group 1); not renormalised, scaled."""
    spec = RouterSpec("softmax_grouped", num_experts=4, top_k=2, num_groups=2, topk_groups=1, scaling=2.0)
    logits = torch.tensor([[3.0, -3.0, 2.0, 1.9]])
    weights, ids = route(logits, spec)
    assert ids.sort(-1).values.tolist() == [[0, 1]]
    probs = torch.softmax(logits, -1)[0]
    torch.testing.assert_close(weights.sort(-1, descending=True).values[0], 2.0 * probs[[0, 1]])
    assert route(logits, RouterSpec("softmax_grouped", num_experts=4, top_k=2))[1].sort(-1).values.tolist() == [[0, 2]]


def test_correction_bias_selects_but_does_not_weigh() -> None:
    spec = RouterSpec("sigmoid_grouped", num_experts=4, top_k=2, normalize=True, scaling=2.0)
    logits = torch.tensor([[1.0, 0.5, 0.0, -1.0]])
    weights, ids = route(logits, spec, torch.tensor([0.0, 0.0, 0.0, 5.0]))
    assert ids.sort(-1).values.tolist() == [[0, 3]]
    chosen = torch.sigmoid(torch.tensor([1.0, -1.0]))
    torch.testing.assert_close(weights.sort(-1, descending=True).values[0], 2.0 * chosen / chosen.sum())


def test_sparsemixer_equals_transformers_function() -> None:
    from transformers.models.phimoe.modeling_phimoe import sparsemixer

    logits = torch.randn(200, 8, generator=torch.Generator().manual_seed(2))
    for eps in (0.01, 0.3, 2.0):
        ref_weights, ref_ids = sparsemixer(logits, jitter_eps=eps, training=False)
        weights, ids = route(logits, RouterSpec("sparsemixer", 8, 2, jitter_eps=eps))
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(weights, ref_weights, rtol=0, atol=1e-6)


@pytest.mark.parametrize("bad", [
    dict(kind="top1", num_experts=4, top_k=1),
    dict(kind="softmax", num_experts=4, top_k=5),
    dict(kind="sparsemixer", num_experts=4, top_k=1),
    dict(kind="sigmoid_grouped", num_experts=6, top_k=2, num_groups=4),
])
def test_router_spec_refuses_impossible_settings(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        RouterSpec(**bad)


def test_stacking_refuses_a_missing_expert() -> None:
    stored = {f"mlp.experts.{e}.{p}.weight": torch.zeros(2, 2) for e in (0, 2) for p in ("gate_proj", "up_proj", "down_proj")}
    with pytest.raises(ValueError, match="experts 0..N-1"):
        sanitize_moe(stored, "per_expert")
