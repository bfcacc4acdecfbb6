"""DFlash drafting (B3) on tiny random models, with a drafter checkpoint built for the test in
z-lab's layout: loading and refusals, the target features it reads (prefill, decode and verify
rows, rejected drafts dropped), and the temperature-0 identity with plain decoding."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from mlxcel.config import EngineConfig, SpeculativeConfig
from mlxcel.engine.client import EngineClient
from mlxcel.engine.loop import EngineCore, ModelShape
from mlxcel.engine.spec import DraftPolicy
from mlxcel.engine.spec.dflash import MAX_PENDING, DFlashCheckpointError, DFlashDrafter, load_dflash
from mlxcel.layers.attention import AttentionContext, SequenceSlice
from mlxcel.types import Request

from tests.engine.conftest import EOS, VOCAB, collect, greedy, random_llama, reference_greedy, run
from tests.engine.dflash_drafter import write_dflash_drafter
from tests.engine.test_speculative import repetitive_prompt

TAPS = (0, 1)  # both layers of the tiny target: the last one is read after the final norm, as in HF
MASK = VOCAB - 1


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, tiny_model):  # noqa: ANN001, ANN201
    return write_dflash_drafter(tmp_path_factory.mktemp("dflash"), tiny_model.args, target_layer_ids=TAPS,
                                mask_token_id=MASK, block_size=6)


class KeepingDrafter(DFlashDrafter):
    """Keeps, per request, the features of every position it took into its context."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.taken: dict[str, dict[int, torch.Tensor]] = {}

    def _take_in(self, state, num_accepted: int) -> None:  # noqa: ANN001
        rid = next(r for r, s in self._states.items() if s is state)
        for p in range(state.num_positions, num_accepted):
            if p in state.pending:
                self.taken.setdefault(rid, {})[p] = state.pending[p].clone()
        super()._take_in(state, num_accepted)


def dflash_engine(model, directory, *, drafter_class=DFlashDrafter, **overrides):  # noqa: ANN001, ANN003, ANN201
    spec = SpeculativeConfig(draft_kind="dflash", draft_model=str(directory), draft_max=5, max_batch=8,
                             block_size=6)
    config = EngineConfig(**{"max_num_seqs": 8, "ctx_size": 8 * 128, "max_num_batched_tokens": 64, "block_size": 4,
                             "cache_type_k": "f32", "cache_type_v": "f32", "speculative": spec, **overrides})
    drafter = drafter_class(load_dflash(directory, model, device="cpu", dtype=torch.float32), model, block_size=6)
    core = EngineCore(model, ModelShape(2, 2, 16, 512), config, eos_token_ids=frozenset({EOS}),
                      drafts=DraftPolicy(spec, drafter))
    core.start()
    return EngineClient(core), drafter


def test_b3_loading_checks_the_drafter_against_the_target(tmp_path, tiny_model, drafter_dir) -> None:  # noqa: ANN001
    model = load_dflash(drafter_dir, tiny_model, device="cpu", dtype=torch.float32)
    assert model.spec.target_layer_ids == TAPS and model.spec.mask_token_id == MASK
    wider = random_llama(1, hidden_size=32)
    with pytest.raises(DFlashCheckpointError, match=f"{drafter_dir}.*hidden size is 64, the target's 32"):
        load_dflash(drafter_dir, wider, device="cpu", dtype=torch.float32)
    deep = write_dflash_drafter(tmp_path / "deep", tiny_model.args, target_layer_ids=(0, 5), mask_token_id=MASK)
    with pytest.raises(DFlashCheckpointError, match=r"reads target layers \[0, 5\], the target has 2"):
        load_dflash(deep, tiny_model, device="cpu", dtype=torch.float32)
    masked = write_dflash_drafter(tmp_path / "mask", tiny_model.args, target_layer_ids=TAPS, mask_token_id=VOCAB)
    with pytest.raises(DFlashCheckpointError, match="mask token 97 is outside"):
        load_dflash(masked, tiny_model, device="cpu", dtype=torch.float32)
    config = json.loads((drafter_dir / "config.json").read_text())
    (tmp_path / "v2").mkdir()
    (tmp_path / "v2" / "config.json").write_text(json.dumps({**config, "architectures": ["DFlash2DraftModel"]}))
    with pytest.raises(DFlashCheckpointError, match="DFlash2DraftModel"):
        load_dflash(tmp_path / "v2", tiny_model, device="cpu", dtype=torch.float32)
    with pytest.raises(DFlashCheckpointError, match="no readable config.json"):
        load_dflash(tmp_path, tiny_model, device="cpu", dtype=torch.float32)


def test_b3_context_taken_in_parts_drafts_as_taken_in_whole(tiny_model, drafter_dir) -> None:  # noqa: ANN001
    class Seq:
        def __init__(self, rid: str, tokens: list[int], computed: int) -> None:
            self.request_id, self.token_ids, self.num_computed_tokens = rid, tokens, computed

    model = load_dflash(drafter_dir, tiny_model, device="cpu", dtype=torch.float32)
    tokens = repetitive_prompt(20, 5)
    features = torch.randn(len(tokens), len(TAPS) * 64)
    whole, parts = (DFlashDrafter(model, tiny_model, block_size=6) for _ in range(2))
    whole.record("w", 0, features)
    parts.record("p", 0, features[:7])
    assert parts.propose(Seq("p", tokens, 7), 5)  # takes in positions 0-6
    parts.record("p", 7, features[7:])
    parts.record("p", 19, torch.randn(1, len(TAPS) * 64))  # a rejected draft's position: never taken in
    draft = whole.propose(Seq("w", tokens, 19), 5)
    assert len(draft) == 5 and parts.propose(Seq("p", tokens, 19), 5) == draft
    parts.free("p")
    assert parts.num_requests == 0
    # A row that never speculates holds a bounded number of positions; its context is the same.
    long_tokens = tokens * 8
    features = torch.randn(len(long_tokens), len(TAPS) * 64)
    bounded, whole = (DFlashDrafter(model, tiny_model, block_size=6) for _ in range(2))
    whole.record("w", 0, features)
    for position in range(len(long_tokens)):
        bounded.record("b", position, features[position:position + 1])
        assert len(bounded._states["b"].pending) <= MAX_PENDING
    n = len(long_tokens) - 1
    assert bounded.propose(Seq("b", long_tokens, n), 5) == whole.propose(Seq("w", long_tokens, n), 5)


def test_b3_greedy_stream_equals_plain_decoding_and_the_context_is_the_targets(tiny_model, drafter_dir) -> None:  # noqa: ANN001
    prompts = [repetitive_prompt(n, 20 + i) for i, n in enumerate((9, 26, 40))]
    client, drafter = dflash_engine(tiny_model, drafter_dir, drafter_class=KeepingDrafter)
    try:
        async def batch():  # noqa: ANN202
            reqs = [Request(f"d{i}", p, greedy(30)) for i, p in enumerate(prompts)]
            return await asyncio.gather(*(collect(client, r) for r in reqs))
        batched = [t for t, _ in run(batch())]
        alone = [run(collect(client, Request(f"e{i}", p, greedy(30))))[0] for i, p in enumerate(prompts)]
        stats = client.core.stats().drafts
    finally:
        client.core.stop(10)
    expected = [reference_greedy(tiny_model, p, 30) for p in prompts]
    assert batched == expected and alone == expected
    assert stats.kind == "dflash" and stats.num_drafted > 30 and stats.num_rounds > 0
    assert drafter.num_requests == 0  # every request's draft context went with it
    # What the drafter took in is the target's own hidden states at the tapped layers (the last
    # one normed), position by position: prefill chunks, decode and verify rows, no rejected draft.
    # The second run of a prompt found its prefix cached: those positions brought no features.
    for i, prompt in enumerate(prompts):
        wanted = target_features(tiny_model, prompt + expected[i])
        for rid in (f"d{i}", f"e{i}"):
            taken = drafter.taken[rid]
            first = 0 if rid.startswith("d") else min(taken)
            assert sorted(taken) == list(range(first, max(taken) + 1)) and first < len(prompt) <= max(taken), rid
            for position, row in taken.items():
                torch.testing.assert_close(row, wanted[position], rtol=1e-4, atol=1e-4)


def target_features(model, tokens: list[int]) -> torch.Tensor:  # noqa: ANN001
    outputs = []
    hooks = [model.model.layers[i].register_forward_hook(lambda m, a, out: outputs.append(out)) for i in TAPS]
    try:
        with torch.inference_mode():
            model(torch.tensor(tokens), torch.arange(len(tokens)),
                  AttentionContext([SequenceSlice(0, len(tokens), len(tokens))]))
    finally:
        for hook in hooks:
            hook.remove()
    return torch.cat([outputs[0], model.model.norm(outputs[1])], dim=-1)
