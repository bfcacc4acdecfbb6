"""`mlxcel perplexity`: the field's precision instrument, comparable number for number with llama.cpp's
`llama-perplexity` (issue 27 point 1).

The text is tokenized whole (BOS first when the vocabulary adds one), cut into chunks of `n_ctx`
tokens, each chunk's first token replaced by BOS when the vocabulary adds one; every chunk runs
through the engine the server decodes with (same weights rewrite, KV types, threads) as one prompt,
whose positions' logits come back through `Request.prompt_logits`; the second half of each chunk
is scored (positions n_ctx/2 .. n_ctx-2 predicting the next token), as llama.cpp does.

`--kl-divergence-base FILE` writes llama.cpp's logits file; with `--kl-divergence` that file is read
instead (its tokens and n_ctx are used) and the run is compared to it. The file, as llama.cpp writes
it (little-endian): b"_logits_", n_ctx (uint32), n_vocab (int32), n_chunk (int32), the n_chunk x n_ctx
tokens (int32), then per chunk n_ctx - 1 - n_ctx/2 rows of `row_width(n_vocab)` uint16: a float32
scale and a float32 minimum log-probability (4 uint16), then each token's log-probability in 16 bits
over the 16 nats below the top one (`encode_rows`), padded to an even count.
"""

from __future__ import annotations

import math
import queue
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, TextIO

import numpy as np
import torch

from mlxcel.text.tokenizer import Tokenizer
from mlxcel.types import Request, SamplingParams

MAGIC = b"_logits_"
LOG_PROB_RANGE = 16.0  # nats below the top log-probability that the 16-bit rows keep (llama.cpp's)


class PerplexityError(ValueError):
    """A run that cannot be made (text too short, a base from another vocabulary, a bad file)."""


# ---- llama.cpp's logits file ----

def row_width(n_vocab: int) -> int:
    """uint16 per row: 4 for the two floats, the vocabulary rounded up to even."""
    return 2 * ((n_vocab + 1) // 2) + 4


@dataclass(frozen=True, slots=True)
class BaseHeader:
    n_ctx: int
    n_vocab: int
    n_chunk: int
    tokens: np.ndarray  # [n_chunk * n_ctx] int32

    @property
    def num_scored(self) -> int:
        """Rows per chunk: positions n_ctx/2 .. n_ctx-2."""
        return self.n_ctx - 1 - self.n_ctx // 2


def write_header(out: BinaryIO, header: BaseHeader) -> None:
    out.write(MAGIC)
    out.write(np.array([header.n_ctx], dtype="<u4").tobytes())
    out.write(np.array([header.n_vocab, header.n_chunk], dtype="<i4").tobytes())
    out.write(np.ascontiguousarray(header.tokens, dtype="<i4").tobytes())


def read_header(source: BinaryIO, name: str) -> BaseHeader:
    if source.read(8) != MAGIC:
        raise PerplexityError(f"{name} does not look like a file of log-probabilities (no {MAGIC.decode()} header)")
    fields = source.read(12)
    if len(fields) != 12:
        raise PerplexityError(f"{name}: the header is cut short")
    n_ctx = int(np.frombuffer(fields[:4], dtype="<u4")[0])
    n_vocab, n_chunk = (int(v) for v in np.frombuffer(fields[4:], dtype="<i4"))
    if n_ctx < 4 or n_vocab < 1 or n_chunk < 1:
        raise PerplexityError(f"{name}: impossible sizes n_ctx={n_ctx}, n_vocab={n_vocab}, n_chunk={n_chunk}")
    raw = source.read(4 * n_ctx * n_chunk)
    if len(raw) != 4 * n_ctx * n_chunk:
        raise PerplexityError(f"{name}: the evaluation tokens are cut short")
    return BaseHeader(n_ctx, n_vocab, n_chunk, np.frombuffer(raw, dtype="<i4").copy())


def read_rows(source: BinaryIO, header: BaseHeader, chunk: int, name: str) -> np.ndarray:
    """One chunk's rows [num_scored, row_width] uint16."""
    width = row_width(header.n_vocab)
    raw = source.read(2 * header.num_scored * width)
    if len(raw) != 2 * header.num_scored * width:
        raise PerplexityError(f"{name}: the log-probabilities of chunk {chunk + 1} are cut short")
    return np.frombuffer(raw, dtype="<u2").reshape(header.num_scored, width)


def encode_rows(logits: np.ndarray) -> np.ndarray:
    """logits [n, vocab] float32 -> rows [n, row_width] uint16, llama.cpp's 16-bit log-probabilities:
    level q of token i means log p = scale * q + min_log_prob; logits under max - 16 are level 0."""
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    n, n_vocab = logits.shape
    max_logit = logits.max(axis=1)
    min_logit = np.maximum(logits.min(axis=1), max_logit - np.float32(LOG_PROB_RANGE))
    log_sum_exp = np.log(np.exp(logits - max_logit[:, None]).sum(axis=1, dtype=np.float64)).astype(np.float32)
    min_log_prob = (min_logit - max_logit - log_sum_exp).astype(np.float32)
    scale = ((max_logit - min_logit) / np.float32(65535.0)).astype(np.float32)
    rows = np.zeros((n, row_width(n_vocab)), dtype="<u2")
    head = np.stack([scale, min_log_prob], axis=1).astype("<f4")
    rows[:, :4] = head.view("<u2").reshape(n, 4)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv_scale = np.where(scale > 0, np.float32(1.0) / scale, np.float32(0.0)).astype(np.float32)
        levels = np.rint((logits - min_logit[:, None]) * inv_scale[:, None])  # round half to even, as nearest_int
    levels = np.where(logits > min_logit[:, None], levels, 0)
    rows[:, 4:4 + n_vocab] = np.clip(levels, 0, 65535).astype(np.uint16)
    return rows


def decode_rows(rows: np.ndarray, n_vocab: int) -> np.ndarray:
    """rows [n, row_width] uint16 -> log-probabilities [n, vocab] float32."""
    head = np.ascontiguousarray(rows[:, :4]).view("<f4").reshape(-1, 2)
    levels = rows[:, 4:4 + n_vocab].astype(np.float32)
    return (head[:, :1] * levels + head[:, 1:2]).astype(np.float32)


# ---- scoring ----

@dataclass(slots=True)
class Scores:
    """Running sums over scored tokens, as llama-perplexity keeps them (base terms only with a base)."""

    sum_nll: float = 0.0
    sum_nll2: float = 0.0
    sum_nll_base: float = 0.0
    sum_nll_base2: float = 0.0
    sum_nll_nll_base: float = 0.0
    sum_kld: float = 0.0
    sum_kld2: float = 0.0
    sum_p_diff: float = 0.0
    sum_p_diff2: float = 0.0
    sum_p_diff4: float = 0.0
    num_same_top: int = 0
    count: int = 0
    kld_values: list[np.ndarray] = field(default_factory=list)
    p_diff_values: list[np.ndarray] = field(default_factory=list)

    def add_nll(self, nll: np.ndarray) -> None:
        self.sum_nll += float(nll.sum(dtype=np.float64))
        self.sum_nll2 += float((nll.astype(np.float64) ** 2).sum())
        self.count += len(nll)

    def add_base(self, logits: np.ndarray, base: np.ndarray, targets: np.ndarray) -> None:
        """logits [n, vocab] float32, base log-probabilities [n, vocab], targets [n]."""
        nll = _nll(logits, targets)
        self.add_nll(nll)
        nll_base = -base[np.arange(len(targets)), targets].astype(np.float64)
        self.sum_nll_base += float(nll_base.sum())
        self.sum_nll_base2 += float((nll_base ** 2).sum())
        self.sum_nll_nll_base += float((nll.astype(np.float64) * nll_base).sum())
        kld = _kld(logits, base)
        self.sum_kld += float(kld.sum())
        self.sum_kld2 += float((kld ** 2).sum())
        p_diff = (np.exp(-nll.astype(np.float64)) - np.exp(-nll_base)).astype(np.float32)
        self.sum_p_diff += float(p_diff.sum(dtype=np.float64))
        self.sum_p_diff2 += float((p_diff.astype(np.float64) ** 2).sum())
        self.sum_p_diff4 += float((p_diff.astype(np.float64) ** 4).sum())
        self.num_same_top += int((logits.argmax(axis=1) == base.argmax(axis=1)).sum())
        self.kld_values.append(kld.astype(np.float32))
        self.p_diff_values.append(p_diff)


def _log_sum_exp(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    max_logit = logits.max(axis=1)
    total = np.exp(logits - max_logit[:, None]).sum(axis=1, dtype=np.float64)
    return max_logit, np.log(total).astype(np.float32)


def _nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log p(target) per row, float32 as llama.cpp computes it: max + log(sum exp) - logit."""
    max_logit, log_sum_exp = _log_sum_exp(logits)
    return max_logit + log_sum_exp - logits[np.arange(len(targets)), targets]


def _kld(logits: np.ndarray, base: np.ndarray) -> np.ndarray:
    """KL(base || this) per row over the tokens the base keeps (log p_base > -16), float64 sums."""
    max_logit, log_sum_exp = _log_sum_exp(logits)
    log_p = logits - (max_logit + log_sum_exp)[:, None]
    kept = base > -LOG_PROB_RANGE
    terms = np.where(kept, np.exp(base.astype(np.float64)) * (base - log_p).astype(np.float64), 0.0)
    return terms.sum(axis=1)


def mean_and_uncertainty(total: float, total2: float, count: int) -> tuple[float, float]:
    if count < 1:
        return 0.0, 0.0
    mean = total / count
    var = total2 / count - mean * mean
    return mean, math.sqrt(var / (count - 1)) if var > 0 and count > 10 else 0.0


def _covariance(sum_a: float, sum_b: float, sum_ab: float, count: int) -> float:
    if count < 10:
        return 0.0
    return (sum_ab / count - (sum_a / count) * (sum_b / count)) / (count - 1)


def _percentile(values: np.ndarray, fraction: float) -> float:
    if fraction <= 0:
        return float(values[0])
    if fraction >= 1:
        return float(values[-1])
    p = fraction * (len(values) - 1)
    i = int(p)
    return float((1 - (p - i)) * values[i] + (p - i) * values[min(i + 1, len(values) - 1)])


def _median(values: np.ndarray) -> float:
    n = len(values)
    return float(0.5 * (values[n // 2] + values[n // 2 - 1]) if n % 2 == 0 else values[n // 2])


# ---- the run ----

ChunkLogits = Callable[[list[int], int], np.ndarray]  # (chunk tokens, first scored position) -> logits [rows, vocab]


def engine_chunk_logits(core: object, timeout_s: float = 3600.0) -> ChunkLogits:
    """Logits of a chunk's positions first..n-2 through an engine (`EngineCore`), the server's prompt path:
    one request per chunk, no prefix-cache read, no token generated."""
    def run(tokens: list[int], first: int) -> np.ndarray:
        rows: list[np.ndarray] = []

        def keep(position: int, logits: torch.Tensor) -> None:
            if position + logits.shape[0] > first:
                rows.append(logits[max(first - position, 0):].float().cpu().numpy())
        events: queue.SimpleQueue = queue.SimpleQueue()
        request = Request(f"ppl-{uuid.uuid4().hex[:8]}", list(tokens), SamplingParams(temperature=0.0, max_tokens=0),
                          cache_prompt=False, prompt_logits=keep)
        core.submit(request, events.put)  # type: ignore[attr-defined]
        while (event := events.get(timeout=timeout_s)).finish_reason is None:
            pass
        if event.error:
            raise PerplexityError(f"the engine failed on a chunk: {event.error}")
        return np.concatenate(rows)
    return run


def adds_bos(tokenizer: Tokenizer) -> bool:
    """Whether the vocabulary puts BOS first (llama_vocab_get_add_bos): then each chunk starts with it."""
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer.encode("a", add_special_tokens=True)[:1] == [bos]


def chunk_tokens(tokens: np.ndarray, index: int, n_ctx: int, bos: int | None) -> list[int]:
    """Chunk `index` of the text's tokens, its first replaced by BOS when the vocabulary adds one."""
    chunk = [int(t) for t in tokens[index * n_ctx:(index + 1) * n_ctx]]
    if bos is not None:
        chunk[0] = bos
    return chunk


@dataclass(frozen=True, slots=True)
class PerplexityRun:
    n_ctx: int = 512
    num_chunks: int = -1  # -1: every whole chunk of the text
    base_file: Path | None = None  # --kl-divergence-base: written, or read with is_kl_divergence
    is_kl_divergence: bool = False


def tokenize_text(tokenizer: Tokenizer, text: str, n_ctx: int, num_chunks: int) -> BaseHeader:
    """The text's tokens as llama-perplexity takes them: whole, BOS first when the vocabulary adds one;
    at least two chunks of text are needed, as there."""
    tokens = np.array(tokenizer.encode(text, add_special_tokens=True), dtype=np.int32)
    if len(tokens) < 2 * n_ctx:
        raise PerplexityError(f"you need at least {2 * n_ctx} tokens to evaluate perplexity with a context of "
                              f"{n_ctx}; the text tokenizes to only {len(tokens)} tokens")
    n_chunk = len(tokens) // n_ctx if num_chunks < 0 else min(num_chunks, len(tokens) // n_ctx)
    return BaseHeader(n_ctx, tokenizer.vocab_size, n_chunk, tokens[:n_chunk * n_ctx])


def run_perplexity(run: PerplexityRun, header: BaseHeader, bos: int | None, chunk_logits: ChunkLogits,
                   out: TextIO, err: TextIO, base: BinaryIO | None = None) -> Scores:
    """Score every chunk: write its rows to `base` (writing a base), compare with them (`run.is_kl_divergence`,
    `base` open for reading past the header), or only count the NLL; progress on `err`, results on `out`."""
    scores = Scores()
    first = header.n_ctx // 2
    err.write(f"perplexity: calculating perplexity over {header.n_chunk} chunks, n_ctx={header.n_ctx}\n")
    for chunk in range(header.n_chunk):
        started = time.monotonic()
        tokens = chunk_tokens(header.tokens, chunk, header.n_ctx, bos)
        logits = chunk_logits(tokens, first)
        targets = header.tokens[chunk * header.n_ctx + first + 1:(chunk + 1) * header.n_ctx].astype(np.int64)
        _check_width(logits, header)
        if run.is_kl_divergence:
            assert base is not None
            rows = read_rows(base, header, chunk, str(run.base_file))
            scores.add_base(logits, decode_rows(rows, header.n_vocab), targets)
        else:
            if base is not None:
                base.write(encode_rows(logits).tobytes())
            scores.add_nll(_nll(logits, targets))
        if chunk == 0:
            _eta(err, time.monotonic() - started, header.n_chunk, run.is_kl_divergence, out)
        _chunk_progress(run, scores, chunk, out, err)
    err.write("\n")
    return scores


def _check_width(logits: np.ndarray, header: BaseHeader) -> None:
    if logits.shape[1] != header.n_vocab:
        raise PerplexityError(f"inconsistent vocabulary: the model gives {logits.shape[1]} logits, "
                              f"the base has {header.n_vocab}")


def _eta(err: TextIO, seconds: float, n_chunk: int, is_kl_divergence: bool, out: TextIO) -> None:
    err.write(f"perplexity: {seconds:.2f} seconds per pass - ETA {seconds * n_chunk / 60:.2f} minutes\n")
    if is_kl_divergence:
        out.write("\nchunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence"
                  "              Δp RMS            Same top p\n")


def _chunk_progress(run: PerplexityRun, s: Scores, chunk: int, out: TextIO, err: TextIO) -> None:
    if not run.is_kl_divergence:
        err.write(f"[{chunk + 1}]{math.exp(s.sum_nll / s.count):.4f},")
        err.flush()
        return
    log_ppl = mean_and_uncertainty(s.sum_nll, s.sum_nll2, s.count)
    log_base = mean_and_uncertainty(s.sum_nll_base, s.sum_nll_base2, s.count)
    ratio, ratio_unc = _log_ratio(s, log_ppl, log_base)
    kld = mean_and_uncertainty(s.sum_kld, s.sum_kld2, s.count)
    rms, rms_unc = _p_diff_rms(s)
    top, top_unc = _same_top(s)
    ppl = math.exp(log_ppl[0])
    out.write(f"{chunk + 1:4d}    {ppl:9.4f} ± {ppl * log_ppl[1]:9.4f}    {ratio:10.5f} ± {ratio_unc:10.5f}"
              f"    {kld[0]:10.5f} ± {kld[1]:10.5f}    {100 * rms:6.3f} ± {100 * rms_unc:6.3f} %"
              f"    {100 * top:6.3f} ± {100 * top_unc:6.3f} %\n")
    out.flush()


def _log_ratio(s: Scores, log_ppl: tuple[float, float], log_base: tuple[float, float]) -> tuple[float, float]:
    cov = _covariance(s.sum_nll, s.sum_nll_base, s.sum_nll_nll_base, s.count)
    var = log_ppl[1] ** 2 + log_base[1] ** 2 - 2.0 * cov
    return log_ppl[0] - log_base[0], math.sqrt(max(var, 0.0))


def _p_diff_rms(s: Scores) -> tuple[float, float]:
    mse = mean_and_uncertainty(s.sum_p_diff2, s.sum_p_diff4, s.count)
    rms = math.sqrt(mse[0])
    return rms, (0.5 / rms * mse[1] if rms > 0 else 0.0)


def _same_top(s: Scores) -> tuple[float, float]:
    top = s.num_same_top / s.count
    return top, math.sqrt(top * (1 - top) / (s.count - 1)) if s.count > 1 else 0.0


def final_estimate(s: Scores) -> str:
    """llama-perplexity's last line: PPL and its uncertainty (the standard error of the mean NLL, times PPL)."""
    nll = s.sum_nll / s.count
    var = s.sum_nll2 / s.count - nll * nll
    ppl = math.exp(nll)
    if var <= 0 or s.count < 2:
        return f"Final estimate: PPL = {ppl:.4f} +/- nan"
    return f"Final estimate: PPL = {ppl:.4f} +/- {math.sqrt(var / (s.count - 1)) * ppl:.5f}"


def kld_report(s: Scores) -> Iterator[str]:
    """The statistics llama-perplexity prints after a --kl-divergence run, in its words and formats."""
    kld_values = np.sort(np.concatenate(s.kld_values))
    p_diff = np.sort(np.concatenate(s.p_diff_values))
    log_ppl = mean_and_uncertainty(s.sum_nll, s.sum_nll2, s.count)
    log_base = mean_and_uncertainty(s.sum_nll_base, s.sum_nll_base2, s.count)
    ppl, base = math.exp(log_ppl[0]), math.exp(log_base[0])
    cov = _covariance(s.sum_nll, s.sum_nll_base, s.sum_nll_nll_base, s.count)
    ratio, ratio_unc = _log_ratio(s, log_ppl, log_base)
    cor = cov / (log_ppl[1] * log_base[1]) if log_ppl[1] * log_base[1] > 0 else float("nan")
    diff_unc = math.sqrt(max((ppl * log_ppl[1]) ** 2 + (base * log_base[1]) ** 2 - 2.0 * ppl * base * cov, 0.0))
    yield "====== Perplexity statistics ======"
    yield f"Mean PPL(Q)                   : {ppl:10.6f} ± {ppl * log_ppl[1]:10.6f}"
    yield f"Mean PPL(base)                : {base:10.6f} ± {base * log_base[1]:10.6f}"
    yield f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * cor:6.2f}%"
    yield f"Mean ln(PPL(Q)/PPL(base))     : {ratio:10.6f} ± {ratio_unc:10.6f}"
    yield f"Mean PPL(Q)/PPL(base)         : {math.exp(ratio):10.6f} ± {math.exp(ratio) * ratio_unc:10.6f}"
    yield f"Mean PPL(Q)-PPL(base)         : {ppl - base:10.6f} ± {diff_unc:10.6f}"
    yield ""
    yield "====== KL divergence statistics ======"
    kld = mean_and_uncertainty(s.sum_kld, s.sum_kld2, s.count)
    yield f"Mean    KLD: {kld[0]:10.6f} ± {kld[1]:10.6f}"
    yield f"Maximum KLD: {kld_values[-1]:10.6f}"
    for label, fraction in (("99.9%", 0.999), ("99.0%", 0.99), ("95.0%", 0.95), ("90.0%", 0.9)):
        yield f"{label}   KLD: {_percentile(kld_values, fraction):10.6f}"
    yield f"Median  KLD: {_median(kld_values):10.6f}"
    for label, fraction in (("10.0%", 0.1), (" 5.0%", 0.05), (" 1.0%", 0.01), (" 0.1%", 0.001)):
        yield f"{label}   KLD: {_percentile(kld_values, fraction):10.6f}"
    yield f"Minimum KLD: {kld_values[0]:10.6f}"
    yield ""
    yield "====== Token probability statistics ======"
    mean_p = mean_and_uncertainty(s.sum_p_diff, s.sum_p_diff2, s.count)
    yield f"Mean    Δp: {100 * mean_p[0]:6.3f} ± {100 * mean_p[1]:5.3f} %"
    yield f"Maximum Δp: {100 * p_diff[-1]:6.3f}%"
    for label, fraction in (("99.9%", 0.999), ("99.0%", 0.99), ("95.0%", 0.95), ("90.0%", 0.9), ("75.0%", 0.75)):
        yield f"{label}   Δp: {100 * _percentile(p_diff, fraction):6.3f}%"
    yield f"Median  Δp: {100 * _median(p_diff):6.3f}%"
    for label, fraction in (("25.0%", 0.25), ("10.0%", 0.1), (" 5.0%", 0.05), (" 1.0%", 0.01), (" 0.1%", 0.001)):
        yield f"{label}   Δp: {100 * _percentile(p_diff, fraction):6.3f}%"
    yield f"Minimum Δp: {100 * p_diff[0]:6.3f}%"
    rms, rms_unc = _p_diff_rms(s)
    yield f"RMS Δp    : {100 * rms:6.3f} ± {100 * rms_unc:5.3f} %"
    top, top_unc = _same_top(s)
    yield f"Same top p: {100 * top:6.3f} ± {100 * top_unc:5.3f} %"


def run_context(run: PerplexityRun) -> int:
    """Tokens per chunk: -c, or the base's own when comparing with one (the engine is sized for it)."""
    if not run.is_kl_divergence:
        return run.n_ctx
    if run.base_file is None:
        raise PerplexityError("--kl-divergence needs --kl-divergence-base FILE (the base's logits to compare with)")
    with open(run.base_file, "rb") as source:
        return read_header(source, str(run.base_file)).n_ctx


def perplexity_main(run: PerplexityRun, tokenizer: Tokenizer, text: str | None, chunk_logits: ChunkLogits,
                    out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> Scores:
    """The whole command once the model is up: tokens (from the text, or a base's own), chunks, report."""
    bos = tokenizer.bos_token_id if adds_bos(tokenizer) else None
    if run.is_kl_divergence:
        assert run.base_file is not None  # run_context checked it
        with open(run.base_file, "rb") as source:
            header = read_header(source, str(run.base_file))
            scores = run_perplexity(run, header, bos, chunk_logits, out, err, base=source)
        out.write("\n" + "\n".join(kld_report(scores)) + "\n")
        return scores
    if text is None:
        raise PerplexityError("-f/--file is required (the text to score)")
    header = tokenize_text(tokenizer, text, run.n_ctx, run.num_chunks)
    if run.base_file is None:
        scores = run_perplexity(run, header, bos, chunk_logits, out, err)
    else:
        with open(run.base_file, "wb") as sink:
            write_header(sink, header)
            scores = run_perplexity(run, header, bos, chunk_logits, out, err, base=sink)
        err.write(f"perplexity: saved the logits of {header.n_chunk} chunks to {run.base_file}\n")
    out.write(final_estimate(scores) + "\n")
    return scores
