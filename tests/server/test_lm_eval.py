"""lm-evaluation-harness's `local-completions` against the real server (issue 27 point 2): a local
multiple-choice task (tests/server/lm_eval_task, no download) scores every choice with the
server's prompt logprobs; each score equals the continuation's log-probability taken from the
engine in-process, so none is the 0.0 that echoed text without prompt logprobs used to give."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlxcel.serving.served_model import ServedModel

from .test_prompt_logprobs import engine_logprobs

pytestmark = pytest.mark.slow

TASK_DIR = Path(__file__).parent / "lm_eval_task"


def save_tokenizer(served: ServedModel, folder: Path) -> Path:
    """The served tokenizer as a transformers folder, so lm-eval tokenizes without the hub."""
    folder.mkdir()
    served.tokenizer.backend.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": served.tokenizer.eos_token,
              "bos_token": served.tokenizer.bos_token, "model_max_length": 8192}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def continuation_logprob(served: ServedModel, context: list[int], continuation: list[int]) -> float:
    ref = engine_logprobs(served, context + continuation)
    return sum(float(ref[len(context) + i - 1, token]) for i, token in enumerate(continuation))


def test_lm_eval_local_completions_multiple_choice_scores_are_the_engines(server, served, tmp_path,
                                                                         monkeypatch) -> None:
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.chdir(TASK_DIR)  # the YAML names its JSONL relative to this folder
    lm = LocalCompletionsAPI(base_url=server.address + "/v1/completions", model="m",
                             tokenizer_backend="huggingface", tokenizer=str(save_tokenizer(served, tmp_path / "tok")),
                             tokenized_requests=True, num_concurrent=1, max_retries=1, batch_size=2)
    results = lm_eval.simple_evaluate(model=lm, tasks=["mlxcel_capitals_mc"], log_samples=True,
                                      task_manager=TaskManager(include_path=str(TASK_DIR)))
    samples = results["samples"]["mlxcel_capitals_mc"]
    assert len(samples) == 6
    scores = [float(resp[0][0]) for sample in samples for resp in sample["resps"]]
    assert len(scores) == 22 and all(s < -0.01 for s in scores)  # real log-probabilities, not 0.0
    for sample in samples:
        assert len(sample["arguments"]) == len(sample["doc"]["choices"])
        for arguments, resp in zip(sample["arguments"], sample["resps"]):
            context, continuation = arguments[0], arguments[1]  # "Question: ...\nAnswer:", " Paris"
            context_ids, continuation_ids = lm._encode_pair(context, continuation)
            expected = continuation_logprob(served, context_ids, continuation_ids)
            assert float(resp[0][0]) == pytest.approx(expected, abs=1e-4)
    assert results["results"]["mlxcel_capitals_mc"]["acc,none"] >= 0.5  # the model knows most of these
