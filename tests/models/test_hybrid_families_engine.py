"""Issue 41 (part B): the Mamba-2, short-conv and RG-LRU hybrids through the real engine (continuous
batching, paged KV beside the recurrent-state pool, prefix cache with state snapshots, prompt-lookup
drafts with rollback) give transformers' greedy tokens: alone, in a batch, after a prefix-cache hit,
and with drafts verified."""

from __future__ import annotations

import pytest

from mlxcel.loading import load_model

from . import test_families_engine as issue40
from .harness import save_tiny_hf
from .test_hybrid_families import FAMILIES

# One family a mixer kind: Mamba-2 (SSD, conv and recurrent state), LFM2 (a conv state only), the RG-LRU.
# granitemoehybrid and falcon_h1 run the same Mamba-2 mixer (they pass here too; left out for CI's time).
ENGINE_FAMILIES = ["nemotron_h", "lfm2", "recurrent_gemma"]


@pytest.fixture(scope="module", params=ENGINE_FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp(request.param)
    reference = save_tiny_hf(FAMILIES[request.param][1](), folder)
    model = load_model(folder).model
    client = issue40._engine(model)
    yield reference, client, model
    client.core.stop(10)


# The checks of test_families_engine.py (issue 40), here run on this module's `family` fixture: alone,
# batched, after a prefix hit (from a state snapshot), and with prompt-lookup drafts verified (a rejected
# draft rolls the recurrent state back to the last accepted row).
test_issue41_hybrid_in_the_engine_alone_batched_and_after_a_prefix_hit = \
    issue40.test_issue40_family_in_the_engine_alone_batched_and_after_a_prefix_hit
test_issue41_hybrid_with_prompt_lookup_drafts_keeps_its_greedy_tokens = \
    issue40.test_issue40_family_with_prompt_lookup_drafts_keeps_its_greedy_tokens
