"""`mlxcel perplexity` (issue 27 point 1): llama.cpp's logits file round-trips, an exact path scores
KLD 0 against its own base, the perplexity equals a direct computation from the model's logits, and
the real default model's run is in tests/server/test_perplexity_command.py."""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from mlxcel.layers.attention import AttentionContext, SequenceSlice
from mlxcel.perplexity import (
    BaseHeader, PerplexityError, PerplexityRun, decode_rows, engine_chunk_logits, encode_rows, final_estimate,
    read_header, read_rows, row_width, run_perplexity, write_header,
)

from tests.engine.conftest import make_engine, random_llama

N_CTX, N_CHUNK, VOCAB = 24, 3, 97


@pytest.fixture(scope="module")
def tiny():
    model = random_llama(3)
    client = make_engine(model, max_num_batched_tokens=10)  # each chunk is computed in several prefill steps
    yield model, client.core
    client.core.stop(10)


def text_tokens(seed: int = 5) -> np.ndarray:
    return np.random.default_rng(seed).integers(4, VOCAB, N_CTX * N_CHUNK).astype(np.int32)


def direct_logits(model, tokens: list[int]) -> torch.Tensor:  # noqa: ANN001
    with torch.inference_mode():
        n = len(tokens)
        h = model(torch.tensor(tokens), torch.arange(n), AttentionContext([SequenceSlice(0, n, n)]))
        return model.compute_logits(h).float()


def test_the_logits_file_round_trips_in_llama_cpps_layout(tmp_path: Path) -> None:
    header = BaseHeader(N_CTX, VOCAB, N_CHUNK, text_tokens())
    logits = np.random.default_rng(0).normal(0, 6, (header.num_scored, VOCAB)).astype(np.float32)
    path = tmp_path / "base.bin"
    with open(path, "wb") as out:
        write_header(out, header)
        out.write(encode_rows(logits).tobytes())
    raw = path.read_bytes()
    assert raw[:8] == b"_logits_" and len(raw) == 20 + 4 * N_CTX * N_CHUNK + 2 * header.num_scored * row_width(VOCAB)
    assert np.frombuffer(raw[8:20], dtype="<i4").tolist() == [N_CTX, VOCAB, N_CHUNK]
    with open(path, "rb") as source:
        back = read_header(source, "base.bin")
        rows = read_rows(source, back, 0, "base.bin")
    assert (back.n_ctx, back.n_vocab, back.n_chunk) == (N_CTX, VOCAB, N_CHUNK)
    assert np.array_equal(back.tokens, header.tokens)
    logp = torch.log_softmax(torch.from_numpy(logits), dim=-1).numpy()
    kept = logp > logp.max(axis=1, keepdims=True) - 16
    step = (16 / 65535) * 0.51 + 1e-5  # half a level, plus float rounding
    assert np.all(np.abs(decode_rows(rows, VOCAB) - logp)[kept] < step)
    with open(path, "rb") as source, pytest.raises(PerplexityError, match="chunk 2 are cut short"):
        back = read_header(source, "x")
        read_rows(source, back, 0, "x")
        read_rows(source, back, 1, "x")  # only one chunk's rows were written
    with pytest.raises(PerplexityError, match="does not look like"):
        read_header(io.BytesIO(b"not a base file at all"), "x")


def test_an_exact_path_gives_kld_zero_against_its_own_base_and_the_direct_perplexity(tiny, tmp_path: Path) -> None:
    model, core = tiny
    header = BaseHeader(N_CTX, VOCAB, N_CHUNK, text_tokens())
    chunk_logits = engine_chunk_logits(core)
    out, err = io.StringIO(), io.StringIO()
    path = tmp_path / "base.bin"
    with open(path, "wb") as sink:
        write_header(sink, header)
        written = run_perplexity(PerplexityRun(N_CTX, base_file=path), header, None, chunk_logits, out, err, base=sink)
    first = N_CTX // 2
    nll = []
    for c in range(N_CHUNK):
        chunk = header.tokens[c * N_CTX:(c + 1) * N_CTX].tolist()
        logp = torch.log_softmax(direct_logits(model, chunk), dim=-1)
        nll += [-float(logp[p, chunk[p + 1]]) for p in range(first, N_CTX - 1)]
    assert written.count == len(nll) == N_CHUNK * (N_CTX - 1 - first)
    assert math.exp(written.sum_nll / written.count) == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-5)
    assert final_estimate(written).startswith(f"Final estimate: PPL = {math.exp(sum(nll) / len(nll)):.4f} +/- ")
    assert "[3]" in err.getvalue()  # progress per chunk on stderr
    with open(path, "rb") as source:
        read = read_header(source, "base")
        again = run_perplexity(PerplexityRun(N_CTX, base_file=path, is_kl_divergence=True), read, None, chunk_logits,
                               out, err, base=source)
    assert again.sum_kld / again.count < 1e-6  # only the 16-bit rounding of the base
    assert again.num_same_top == again.count
    assert abs(again.sum_nll - again.sum_nll_base) / again.count < 1e-3
    assert "KL Divergence" in out.getvalue()
