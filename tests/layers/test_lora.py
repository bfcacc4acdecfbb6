"""F8 LoRA adapters on a tiny random llama, against transformers + peft with the same adapter.

The adapters are built by peft itself (random A and B, saved in PEFT's layout), so loading
reads what a user's adapter folder holds. Checks: logits equal peft's at several scales,
scale 0 equals the base model bit for bit, rows of one batch with different scales each equal
their own reference (prefill and the decode step, eager and compiled), the prefix cache never
hands KV computed under other scales to a request, nor does a restored slot file (F12), and adapters
that do not fit are refused.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from mlxcel.config import EngineConfig
from mlxcel.engine.kv.slot_files import SlotError
from mlxcel.layers.attention import AttentionContext, SequenceSlice
from mlxcel.layers.lora import AdapterError, apply_adapters, load_adapter, token_scales
from mlxcel.loading import load_model
from mlxcel.serving.chat_model import start_served_model
from mlxcel.serving.served_model import RuntimeOptions, ServedModel
from mlxcel.types import Request, SamplingParams
from tests.layers.peft_adapters import make_adapter, peft_greedy, set_peft_scale
from tests.loading.tiny_checkpoint import tiny_llama_files, write_files

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

TOL = 2e-5  # float32, the same math in another order (tests/models/test_families.py)
PROMPTS = [[5, 17, 33, 2, 9, 40, 61, 12, 3, 77, 21, 8, 30, 44, 50, 6, 19, 70, 14, 25, 36],
           [60, 3, 3, 41, 22, 90, 11]]
NUM_TOKENS = 8
_ids = itertools.count()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_files(tmp_path_factory.mktemp("tiny-llama"), tiny_llama_files(seed=3))


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": (root / "a", make_adapter(model_dir, root / "a", r=4, alpha=8, seed=1)),
        "b": (root / "b", make_adapter(model_dir, root / "b", r=2, alpha=3, rslora=True,
                                       targets=["q_proj", "v_proj", "down_proj"], seed=2)),
    }


@torch.inference_mode()
def reference_logits(model: Any, ids: list[int], scale: float) -> torch.Tensor:
    set_peft_scale(model, scale)
    return model(torch.tensor([ids])).logits[0]


def reference_greedy(model: Any, prompt: list[int], scale: float) -> list[int]:
    return peft_greedy(model, prompt, scale, NUM_TOKENS)


@torch.inference_mode()
def our_logits(model: torch.nn.Module, prompts: list[list[int]], scales: list[tuple[float, ...]]) -> list[torch.Tensor]:
    """All prompts in one flat step, each with its own adapter scales."""
    ids, pos, slices = [], [], []
    for prompt in prompts:
        slices.append(SequenceSlice(q_start=len(ids), q_len=len(prompt), kv_len=len(prompt)))
        ids.extend(prompt)
        pos.extend(range(len(prompt)))
    model.lora_rows.set_rows(token_scales(model.lora_rows, scales, [len(p) for p in prompts], torch.device("cpu")))
    hidden = model(torch.tensor(ids), torch.tensor(pos), AttentionContext(slices))
    logits = model.compute_logits(hidden)
    return [logits[s.q_start:s.q_start + s.q_len] for s in slices]


@pytest.fixture(scope="module")
def ours(model_dir: Path, adapters: dict[str, tuple[Path, Any]]) -> torch.nn.Module:
    model = load_model(model_dir).model
    apply_adapters(model, [load_adapter(adapters["a"][0]), load_adapter(adapters["b"][0])])
    return model


@pytest.mark.parametrize("scale", [1.0, 0.5, 2.0])
def test_f8_logits_equal_peft_at_each_scale(ours: torch.nn.Module, adapters: dict[str, tuple[Path, Any]],
                                            scale: float) -> None:
    for name, scales in (("a", (scale, 0.0)), ("b", (0.0, scale))):
        got = our_logits(ours, [PROMPTS[0]], [scales])[0]
        want = reference_logits(adapters[name][1], PROMPTS[0], scale)
        assert (got - want).abs().max() < TOL, name
    base = reference_logits(adapters["a"][1], PROMPTS[0], 0.0)
    assert (our_logits(ours, [PROMPTS[0]], [(scale, 0.0)])[0] - base).abs().max() > 100 * TOL  # the adapter acts


def test_f8_scale_zero_is_the_base_model_bit_for_bit(ours: torch.nn.Module, model_dir: Path) -> None:
    base = load_model(model_dir).model
    got = our_logits(ours, [PROMPTS[0]], [(0.0, 0.0)])[0]
    ctx = AttentionContext([SequenceSlice(0, len(PROMPTS[0]), len(PROMPTS[0]))])
    with torch.inference_mode():
        want = base.compute_logits(base(torch.tensor(PROMPTS[0]), torch.arange(len(PROMPTS[0])), ctx))
    assert torch.equal(got, want)


def test_f8_rows_of_one_batch_keep_their_own_scales(ours: torch.nn.Module,
                                                    adapters: dict[str, tuple[Path, Any]]) -> None:
    first, second = our_logits(ours, PROMPTS, [(1.0, 0.0), (0.0, 0.5)])
    assert (first - reference_logits(adapters["a"][1], PROMPTS[0], 1.0)).abs().max() < TOL
    assert (second - reference_logits(adapters["b"][1], PROMPTS[1], 0.5)).abs().max() < TOL


# ---- through the engine: prefill, decode step (eager and compiled), prefix cache ----

def serve(model_dir: Path, adapter: Path, mode: str, cache_dir: Path, **engine: Any) -> ServedModel:
    from mlxcel.loading import ResolvedModel

    config = EngineConfig(max_num_seqs=4, ctx_size=1024, decode_step=mode, compile_cache_dir=str(cache_dir), **engine)
    device = "cuda" if mode == "cuda-graph" else "cpu"  # float32 there too: the reference is float32
    options = RuntimeOptions(device=device, dtype="float32", warmup=mode == "cuda-graph", quantize="off",
                             adapters=((adapter, 1.0),))
    return start_served_model(ResolvedModel(model_dir, model_dir.name, "test"), options, config)


def generate(served: ServedModel, jobs: list[tuple[list[int], tuple[float, ...]]]) -> list[list[int]]:
    """Submit every (prompt, scales) at once, greedy; the tokens of each."""
    async def one(prompt: list[int], scales: tuple[float, ...]) -> list[int]:
        tokens: list[int] = []
        params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
        request = Request(f"lora-{next(_ids)}", prompt, params, lora_scales=scales)
        async for event in served.engine.generate(request):
            tokens.extend(event.token_ids)
        return tokens

    async def all_of() -> list[list[int]]:
        return await asyncio.gather(*(one(p, s) for p, s in jobs))

    return asyncio.run(all_of())


CUDA_GRAPH = pytest.param("cuda-graph", marks=[pytest.mark.gpu, pytest.mark.slow, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])


@pytest.fixture(scope="module", params=["eager", pytest.param("compile", marks=pytest.mark.slow), CUDA_GRAPH])
def engine(request: pytest.FixtureRequest, model_dir: Path, adapters: dict[str, tuple[Path, Any]],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedModel]:
    served = serve(model_dir, adapters["a"][0], request.param, tmp_path_factory.mktemp("compile"))
    yield served
    served.close()


def test_f8_concurrent_requests_with_different_scales_each_equal_their_reference(
        engine: ServedModel, adapters: dict[str, tuple[Path, Any]]) -> None:
    reference = adapters["a"][1]
    jobs = [(PROMPTS[0], (1.0,)), (PROMPTS[0], (0.0,)), (PROMPTS[1], (0.5,)), (PROMPTS[1], (2.0,))]
    got = generate(engine, jobs)
    want = [reference_greedy(reference, prompt, scales[0]) for prompt, scales in jobs]
    assert got == want
    assert got[0] != got[1]  # the adapter changes the output, so equality above is not vacuous


def test_f8_prefix_cache_is_keyed_by_the_scales(engine: ServedModel, adapters: dict[str, tuple[Path, Any]]) -> None:
    reference = adapters["a"][1]
    prompt = PROMPTS[0] * 2  # two full blocks of 16 tokens to share
    for scale in (1.0, 0.0, 1.0, 0.5):  # one after another: each could hit the previous one's blocks
        assert generate(engine, [(prompt, (scale,))]) == [reference_greedy(reference, prompt, scale)]


def test_f12_slot_files_are_keyed_by_the_lora_scales(model_dir: Path, adapters: dict[str, tuple[Path, Any]],
                                                     tmp_path: Path) -> None:
    """A slot saved under scale 1 records it: restored into a fresh engine, a request at scale 1 hits its blocks
    and one at scale 0 does not (each gives its own reference tokens); base-model KV restores beside other
    adapters; LoRA KV is refused by a server whose adapters differ, naming both."""
    reference = adapters["a"][1]
    prompt = PROMPTS[0] * 2  # two full blocks of 16 tokens
    slots = {"slot_save_path": str(tmp_path / "slots")}

    def run(served: ServedModel, scales: tuple[float, ...], slot_id: int | None = None) -> tuple[list[int], int]:
        async def one() -> tuple[list[int], int]:
            tokens, cached = [], 0
            params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
            request = Request(f"slot-{next(_ids)}", prompt, params, lora_scales=scales, slot_id=slot_id)
            async for event in served.engine.generate(request):
                tokens.extend(event.token_ids)
                cached = max(cached, event.num_cached_tokens)
            return tokens, cached
        return asyncio.run(one())

    first = serve(model_dir, adapters["a"][0], "eager", tmp_path, **slots)
    try:
        run(first, (1.0,), slot_id=0)
        run(first, (0.0,), slot_id=1)
        saved = asyncio.run(first.engine.save_slot(0, "lora.bin"))
        base = asyncio.run(first.engine.save_slot(1, "base.bin"))
    finally:
        first.close()
    # prompt and output: 3 full blocks each; a request with the prompt alone hits its 2
    assert (saved.num_tokens, saved.lora_scales) == (48, (1.0,)) and (base.num_tokens, base.lora_scales) == (48, ())
    fresh = serve(model_dir, adapters["a"][0], "eager", tmp_path, **slots)
    try:
        assert asyncio.run(fresh.engine.restore_slot(0, "lora.bin")).lora_scales == (1.0,)
        assert run(fresh, (0.0,)) == (reference_greedy(reference, prompt, 0.0), 0)  # not under other scales
        assert run(fresh, (1.0,)) == (reference_greedy(reference, prompt, 1.0), 32)  # the restored blocks
    finally:
        fresh.close()
    other = serve(model_dir, adapters["b"][0], "eager", tmp_path, **slots)
    try:
        with pytest.raises(SlotError, match=rf"under LoRA adapters 0: {adapters['a'][0]} at scale 1, but this "
                                            rf"server's adapters are 0: {adapters['b'][0]}"):
            asyncio.run(other.engine.restore_slot(0, "lora.bin"))
        assert asyncio.run(other.engine.restore_slot(0, "base.bin")).num_tokens == 48
        assert run(other, (0.0,))[1] == 32  # base-model KV serves the base model whatever adapters are loaded
    finally:
        other.close()


# ---- refusals ----

def test_f8_adapter_for_other_shapes_is_refused(ours: torch.nn.Module, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"],
                                                              "peft_type": "LORA"}))
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 48),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(32, 2)},
              str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match=r"model.layers.0.self_attn.q_proj adapter maps 48 -> 32 features"):
        apply_adapters(load_model_like(ours), [load_adapter(tmp_path)])


def test_f8_adapter_for_missing_layers_or_other_modules_is_refused(tmp_path: Path, model_dir: Path) -> None:
    from safetensors.torch import save_file

    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}))
    save_file({"base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight": torch.zeros(2, 32),
               "base_model.model.model.layers.9.self_attn.q_proj.lora_B.weight": torch.zeros(32, 2)},
              str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="layers.9.self_attn.q_proj, which this model does not have"):
        apply_adapters(load_model(model_dir).model, [load_adapter(tmp_path)])
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4,
                                                              "target_modules": ["embed_tokens"]}))
    with pytest.raises(AdapterError, match=r"target_modules \['embed_tokens'\] are not supported"):
        load_adapter(tmp_path)


def load_model_like(model: torch.nn.Module) -> torch.nn.Module:
    from mlxcel.models.llama import Model

    fresh = Model(model.args)
    return fresh


def test_f8_adapters_wrap_the_cpu_decode_rewrite(model_dir: Path, adapters: dict[str, tuple[Path, Any]]) -> None:
    """Over the quantized / fused projections the update is the same: ours(s) - ours(0) = peft(s) - peft(0)."""
    from mlxcel.layers.quant import can_quantize, quantize

    if not can_quantize():
        pytest.skip("this torch build has no int8 weight-only CPU kernel")
    model = load_model(model_dir).model
    quantize(model)
    apply_adapters(model, [load_adapter(adapters["a"][0])])
    base, tuned = (our_logits(model, [PROMPTS[0]], [(s,)])[0] for s in (0.0, 1.5))
    reference = adapters["a"][1]
    want = reference_logits(reference, PROMPTS[0], 1.5) - reference_logits(reference, PROMPTS[0], 0.0)
    assert (tuned - base - want).abs().max() < 0.05 * want.abs().max()
