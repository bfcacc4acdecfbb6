"""F10: the batch-1 MTP decision: read from a checkpoint's config (HF spellings and GGUF metadata) where
it needs no measuring, and MtpDraftPolicy's profile -> settled / forced states over a clock the test drives."""

from __future__ import annotations

from pathlib import Path

import pytest

from dataclasses import dataclass, field

from mlxcel.config import SpeculativeConfig
from mlxcel.engine.spec.mtp import MtpDraftPolicy, decide_mtp, declared_mtp_layers
from mlxcel.types import MtpDecision


@pytest.mark.parametrize(("config", "expected"), [
    ({"model_type": "deepseek_v3", "num_nextn_predict_layers": 1}, (1, "num_nextn_predict_layers")),
    ({"model_type": "mellum", "num_mtp_layers": 1}, (1, "num_mtp_layers")),
    ({"model_type": "qwen3_next", "mtp_num_hidden_layers": 2}, (2, "mtp_num_hidden_layers")),
    ({"model_type": "exaone4_5", "text_config": {"num_nextn_predict_layers": 3}}, (3, "num_nextn_predict_layers")),
    ({"model_type": "qwen3", "num_nextn_predict_layers": 0}, (0, None)),
    ({"model_type": "qwen3", "num_nextn_predict_layers": True}, (0, None)),  # not a count
    ({"model_type": "llama"}, (0, None)),
])
def test_declared_mtp_layers_reads_every_spelling(config: dict, expected: tuple[int, str | None]) -> None:
    assert declared_mtp_layers(config) == expected


def test_no_heads_is_unavailable_with_the_reason() -> None:
    decision = decide_mtp({"model_type": "llama"})
    assert decision.state == "unavailable" and not decision.is_enabled and decision.num_mtp_layers == 0
    assert "no MTP heads" in decision.reason and "num_nextn_predict_layers" in decision.reason


def test_declared_heads_of_a_family_without_mtp_layers_are_unavailable() -> None:
    decision = decide_mtp({"model_type": "qwen2", "num_nextn_predict_layers": 1})
    assert decision.state == "unavailable" and decision.num_mtp_layers == 1 and not decision.is_enabled
    assert "declares 1 MTP layer(s) (num_nextn_predict_layers)" in decision.reason and "qwen2" in decision.reason


def test_a_state_outside_the_spec_is_refused() -> None:
    with pytest.raises(ValueError, match="exactness_declined"):
        MtpDecision("maybe", "no")


def test_gguf_nextn_predict_layers_reaches_the_config(tmp_path: Path) -> None:
    import gguf

    from mlxcel.loading.checkpoint import gguf_config
    from mlxcel.loading.gguf import GGUFFile

    path = tmp_path / "nextn.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_uint32("llama.nextn_predict_layers", 1)
    writer.add_tensor("token_embd.weight", gguf.np.zeros((4, 8), dtype=gguf.np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = gguf_config(GGUFFile(path))
    assert config["num_nextn_predict_layers"] == 1
    assert decide_mtp(config).num_mtp_layers == 1


MIMO = {"model_type": "mimo", "num_nextn_predict_layers": 1}


@pytest.mark.parametrize(("speculative", "max_kv_size", "state", "words"), [
    (SpeculativeConfig(draft_kind="prompt-lookup"), 0, "unavailable", "--draft-kind prompt-lookup drafts instead"),
    (SpeculativeConfig(mtp="off"), 0, "forced", "--mtp off"),
    (SpeculativeConfig(), 256, "exactness_declined", "--max-kv-size 256"),
])
def test_what_needs_no_measuring(speculative: SpeculativeConfig, max_kv_size: int, state: str, words: str) -> None:
    decision = decide_mtp(MIMO, family_runs_mtp=True, speculative=speculative, max_kv_size=max_kv_size)
    assert decision is not None and decision.state == state and not decision.is_enabled
    assert words in decision.reason and decision.num_mtp_layers == 1


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_a_family_with_mtp_layers_drafts(mode: str) -> None:
    assert decide_mtp(MIMO, family_runs_mtp=True, speculative=SpeculativeConfig(mtp=mode)) is None


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="--mtp must be one of auto, on, off; not 'sometimes'"):
        SpeculativeConfig(mtp="sometimes")


@dataclass
class Seq:
    request_id: str = "r"
    token_ids: list[int] = field(default_factory=lambda: [1, 2, 3])
    num_computed_tokens: int = 2


class OneTokenDrafter:
    kind = "mtp"

    def propose(self, seq: Seq, max_len: int) -> tuple[int, ...]:
        return (7,)

    def free(self, request_id: str) -> None:
        return None


class Run:
    """Decode steps of one lone request: a drafted step costs `cost_on` seconds and emits `accepted` + 1 tokens."""

    def __init__(self, mode: str = "auto", *, cost_on: float, cost_off: float = 1.0, accepted: int = 1) -> None:
        self.now = 0.0
        self.cost_on, self.cost_off, self.accepted = cost_on, cost_off, accepted
        self.policy = MtpDraftPolicy(SpeculativeConfig(mtp=mode), OneTokenDrafter(), num_mtp_layers=1,
                                     clock=lambda: self.now, profile_steps=4, profile_block=2)
        self.drafted: list[bool] = []

    def steps(self, count: int, num_running: int = 1) -> None:
        for _ in range(count):
            draft = self.policy.draft(Seq(), num_running, room=8)
            self.drafted.append(bool(draft))
            if draft:
                self.policy.record("r", len(draft), self.accepted)
            self.now += self.cost_on if draft else self.cost_off


def test_profiling_alternates_then_settles_on_when_drafts_are_faster() -> None:
    run = Run(cost_on=1.5)  # 2 tokens in 1.5 s against 1 token in 1 s
    assert run.policy.decision.state == "profiling" and not run.policy.decision.is_enabled
    run.steps(9)
    assert run.drafted[:8] == [True, True, False, False, True, True, False, False]
    decision = run.policy.decision
    assert decision.state == "settled" and decision.is_enabled, decision
    assert decision.profile is not None and decision.profile.num_steps_on >= 4 and decision.profile.num_steps_off >= 4
    assert decision.profile.tokens_per_second_on == pytest.approx(2 / 1.5, abs=0.01)
    assert decision.profile.tokens_per_second_off == pytest.approx(1.0)
    run.steps(4)
    assert all(run.drafted[-4:])


def test_profiling_settles_off_when_drafts_are_rejected() -> None:
    run = Run(cost_on=1.3, accepted=0)
    run.steps(12)
    assert run.policy.decision.state == "settled" and not run.policy.decision.is_enabled
    assert "MTP drafting is off" in run.policy.decision.reason
    assert not any(run.drafted[-3:])


def test_only_a_lone_request_drafts_or_is_measured() -> None:
    run = Run(cost_on=1.5)
    run.steps(20, num_running=2)
    assert not any(run.drafted) and run.policy.decision.profile is None


def test_forced_on_drafts_every_batch_1_step_without_profiling() -> None:
    run = Run("on", cost_on=5.0, accepted=0)
    run.steps(10)
    assert all(run.drafted) and run.policy.decision.state == "forced" and run.policy.decision.is_enabled
