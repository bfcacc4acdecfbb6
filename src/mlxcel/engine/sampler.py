"""Next-token selection for a batch of rows, each with its own SamplingParams (issue 25).

The whole batch is sampled where its logits are, in a few tensor ops: logit bias, penalties,
per-request processors (grammar, reasoning budget, loop guard), end-token suppression, then
temperature and the truncations (top-k, top-p, min-p) in that order, and one draw per row. A row
with llama-server's typical-p, XTC, top-n-sigma or dynamic temperature takes those steps too, in
llama.cpp's order (`_draw_chain`); mirostat and DRY keep state per request and come as processors
(engine/mirostat.py, engine/dry.py).
Only the chosen ids (and the logprobs a request asked for) cross to the host.

Truncation never sorts the vocabulary when it need not: a row's best CANDIDATES logits are taken
first (a partial selection, as llama.cpp does), on the CPU a top-p row without top-k looks only at
the tokens near its best probability (the flat nucleus), and a row falls back to a full sort only
when its surviving set may reach past them. Each row is computed from its own values alone, and
a seeded row draws its one uniform per step from its own generator (inverse-CDF sampling), so
its tokens are the same alone and in any batch.
"""

from __future__ import annotations

import math
from array import array
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mlxcel.layers import paged_attention
from mlxcel.types import MaskingProcessor, SamplingParams, TokenLogprob, TokenProcessor, apply_masks

# Widths of the sorted candidate sets, tried in turn: top_p 0.95 of a language model's
# distribution mostly sits inside the first; a row whose survivors reach past the last is sorted
# in full (on 2 CPU cores: topk 256 of 49,152 logits 0.1 ms, 4,096 0.5 ms, a full sort 3.4 ms).
CANDIDATES = (256, 4096)
# Top-p without top-k looks only at tokens whose probability is at least this share of the row's
# best: the rest weigh at most vocab x NUCLEUS_FLOOR in all (0.05 for 49,152 tokens), so top_p
# up to 0.95 always ends among them; a row whose nucleus does not goes the candidate-set way.
NUCLEUS_FLOOR = 1e-6
NUCLEUS_MAX = 4096  # a row with more candidates than this (a flat distribution) takes the candidate sets


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about one request at this step."""

    params: SamplingParams
    history: Sequence[int]  # prompt + generated tokens (penalty window source)
    num_generated: int
    eos_token_ids: frozenset[int]
    generator: torch.Generator | None = None
    processors: tuple[TokenProcessor, ...] = ()
    owner: str | None = None  # the request's id: its penalty counts are kept between steps (PenaltyCounts)


@dataclass(slots=True)
class _Drawn:
    """One group of drawn rows: the distribution each token was drawn from, over `ids` (None: the
    vocabulary in order), and the chosen position in it."""

    rows: list[int]  # indices into the batch
    final: torch.Tensor  # [len(rows), width] logits after the chain; removed tokens are -inf
    ids: torch.Tensor | None  # [len(rows), width] token ids of `final`'s columns
    positions: torch.Tensor  # [len(rows)]
    # on a GPU, whether each row's survivors all lay within its candidates (None: known to): read
    # with the tokens, so the check costs no sync of its own; a row that did not is drawn again
    fits: torch.Tensor | None = None

    @property
    def tokens(self) -> torch.Tensor:
        if self.ids is None:
            return self.positions
        return self.ids.gather(1, self.positions[:, None]).squeeze(1)

    def without(self, rows: set[int]) -> _Drawn:
        kept = [j for j, i in enumerate(self.rows) if i not in rows]
        ids = None if self.ids is None else _take(self.ids, kept)
        return _Drawn([self.rows[j] for j in kept], _take(self.final, kept), ids, _take(self.positions, kept))


@dataclass(slots=True)
class _Draws:
    """Every drawn row's group, and what drawing a row again needs (the GPU's deferred spills)."""

    groups: list[_Drawn]
    drawn: list[int]  # batch index of each drawn row
    params: list[SamplingParams]
    scaled: torch.Tensor | None = None  # [drawn, vocab] tempered logits
    uniforms: torch.Tensor | None = None  # [drawn]

    def settle(self, rows: list[int]) -> _Drawn:
        """Draw `rows` (batch indices) again from their fully sorted logits, with the same uniforms."""
        assert self.scaled is not None and self.uniforms is not None
        picked = [self.drawn.index(i) for i in rows]
        group, _ = _draw_ranked(self.scaled, self.uniforms, self.params, picked, self.scaled.shape[-1])
        group.rows = [self.drawn[j] for j in group.rows]
        self.groups = [g.without(set(rows)) for g in self.groups] + [group]
        return group


_SPILLED = -2  # a GPU row whose survivors reached past its candidates: drawn again after the read


def sample(logits: torch.Tensor, rows: list[SamplingRow],
           counts: PenaltyCounts | None = None) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits: [num_rows, vocab] on any device -> one token id per row (+ logprobs where asked).
    `counts`: the engine's penalty counts, kept between its steps (None: counted afresh).

    Raises ValueError when a drawn row has no token left (every logit -inf or NaN): the caller
    samples the rows apart to fail that request alone."""
    if all(_is_plain_greedy(r) for r in rows):
        return logits.argmax(dim=-1).tolist(), [None] * len(rows)
    raw = logits.float()
    if _all_native(raw, rows):  # the CPU's usual batch: the C++ chain reads the logits as they are
        token_list = _draw_native(raw, rows, list(range(len(rows))), with_end_tokens=True).tolist()
        _check_drawn(token_list)
        return token_list, _logprobs(raw, rows, token_list, [])
    work = raw.clone() if any(_changes_logits(r) for r in rows) else raw  # raw stays the model's own
    _apply_logit_biases(work, rows)
    _apply_penalties(work, rows, counts if counts is not None else PenaltyCounts())
    _apply_processors(work, rows)
    _suppress_end_tokens(work, rows)
    if _gpu_strategy(work.device) and not any(r.params.is_post_sampling_probs or r.params.has_llama_cpp_steps for r in rows):
        tokens, draws = _draw_fused(work, rows)
    else:
        tokens, draws = _draw_grouped(work, rows, _native_rows(work, rows))
    token_list = tokens.tolist()  # the step's one wait for the device
    spilled = [i for i, t in enumerate(token_list) if t == _SPILLED]
    if spilled:
        group = draws.settle(spilled)
        for i, t in zip(group.rows, torch.where(_has_mass(group.final), group.tokens, -1).tolist()):
            token_list[i] = t
    _check_drawn(token_list)
    return token_list, _logprobs(raw, rows, token_list, draws.groups)


def _check_drawn(tokens: list[int]) -> None:
    if -1 in tokens:
        bad = [i for i, t in enumerate(tokens) if t == -1]
        raise ValueError(f"rows {bad}: every token was removed or the logits are not finite")


def _draw_grouped(work: torch.Tensor, rows: list[SamplingRow], native: list[int]) -> tuple[torch.Tensor, _Draws]:
    """Each row drawn with its own group's ops (what post-sampling logprobs read), on the device;
    the `native` rows (batch indices) by the C++ sampler instead."""
    any_greedy = any(r.params.is_greedy for r in rows)
    tokens = work.argmax(dim=-1) if any_greedy else torch.zeros(len(rows), dtype=torch.long, device=work.device)
    if native:
        tokens = tokens.index_copy(0, on_device(native, torch.long, tokens.device), _draw_native(work, rows, native))
    draws = _draw(work, rows, skip=set(native))
    for group in draws.groups:
        chosen = torch.where(_has_mass(group.final), group.tokens, -1)
        if group.fits is not None:
            chosen = torch.where(group.fits, chosen, _SPILLED)
        tokens = tokens.index_copy(0, on_device(group.rows, torch.long, tokens.device), chosen)
    return tokens, draws


def _native_rows(work: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    """The CPU rows the C++ sampler draws (layers/kernels/sample_rows.cpp): sampled rows that do not
    ask post-sampling logprobs (those read the drawn distribution, which only the tensor ops keep)."""
    if work.device.type != "cpu" or _gpu_strategy(work.device) or not paged_attention.available():
        return []
    return [i for i, r in enumerate(rows) if not r.params.is_greedy and not r.params.is_post_sampling_probs
            and not r.params.has_llama_cpp_steps]


def _all_native(raw: torch.Tensor, rows: list[SamplingRow]) -> bool:
    """Every row drawn by the C++ chain, and nothing but end tokens to remove before it (no copy of the logits)."""
    return (len(_native_rows(raw, rows)) == len(rows)
            and not any(r.processors or r.params.logit_bias or _has_penalty(r.params) for r in rows))


def _draw_native(work: torch.Tensor, rows: list[SamplingRow], picked: list[int], *,
                 with_end_tokens: bool = False) -> torch.Tensor:
    """[len(picked)] tokens (-1: no token left) drawn by the C++ chain, each row from its own
    logits and uniform: the same distribution and draw order as `_draw` (issue 25: on 2 cores a
    row of 49,152 logits costs ~0.04 ms there against ~0.6 ms of tensor ops, and wakes no
    intra-op thread). `with_end_tokens`: the chain removes the rows' end tokens itself (not yet
    done on `work`)."""
    params = [rows[i].params for i in picked]
    ends = [sorted(_end_tokens(rows[i])) if with_end_tokens else [] for i in picked]
    width = max(map(len, ends))
    return torch.ops.mlxcel.sample_rows(
        _take(work, picked), torch.tensor([p.temperature for p in params], dtype=torch.float32),
        torch.tensor([p.top_k for p in params], dtype=torch.long), torch.tensor([p.top_p for p in params], dtype=torch.float32),
        torch.tensor([p.min_p for p in params], dtype=torch.float32), _uniforms([rows[i].generator for i in picked], work.device),
        torch.tensor([e + [-1] * (width - len(e)) for e in ends], dtype=torch.long).reshape(len(picked), width))


def _is_plain_greedy(row: SamplingRow) -> bool:
    p = row.params
    return (p.is_greedy and p.logprobs is None and not row.processors and not p.logit_bias and p.min_tokens <= row.num_generated
            and not _has_penalty(p) and (p.ignore_eos is False or not row.eos_token_ids))


def _changes_logits(row: SamplingRow) -> bool:
    p = row.params
    return bool(row.processors or p.logit_bias or _has_penalty(p) or p.ignore_eos or row.num_generated < p.min_tokens)


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _has_mass(final: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(final.max(dim=-1).values)  # NaN and all -inf rows are False


# ---- the processors, each over the whole batch ----

def _apply_logit_biases(work: torch.Tensor, rows: list[SamplingRow]) -> None:
    vocab = work.shape[-1]
    entries = [(i, t, v) for i, r in enumerate(rows) for t, v in r.params.logit_bias if 0 <= t < vocab]
    if entries:
        row_ids, token_ids, values = zip(*entries)
        index = (on_device(row_ids, torch.long, work.device), on_device(token_ids, torch.long, work.device))
        work.index_put_(index, on_device(values, work.dtype, work.device), accumulate=True)


def _apply_penalties(work: torch.Tensor, rows: list[SamplingRow], table: PenaltyCounts) -> None:
    """Repetition (CTRL-style), frequency and presence penalties over each row's repeat window, at the
    tokens in the windows alone (as llama.cpp does): a handful of entries a row, where eight ops over
    the whole [rows, vocab] batch cost ~0.75 ms a row on 2 CPU cores (issue 25, bench/penalties.py)."""
    picked = [i for i, r in enumerate(rows) if _has_penalty(r.params) and r.params.repeat_last_n != 0]
    if not picked:
        return
    owners, token_ids, counts = table.entries([rows[i] for i in picked], work.shape[-1])
    if not len(owners):
        return
    device = work.device
    which = owners.to(device, non_blocking=True)  # each entry's row among `picked`
    factors = on_device([(p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
                         for p in (rows[i].params for i in picked)], torch.float32, device)[which]
    index = (on_device(picked, torch.long, device)[which], token_ids.to(device, non_blocking=True))
    x = work[index]
    shrunk = torch.where(x > 0, x / factors[:, 0], x * factors[:, 0])
    work.index_put_(index, shrunk - counts.to(device, torch.float32, non_blocking=True) * factors[:, 1] - factors[:, 2])


def _penalty_window(history: Sequence[int], repeat_last_n: int) -> Sequence[int]:
    if repeat_last_n == 0:
        return ()
    return history if repeat_last_n < 0 else history[-repeat_last_n:]


@dataclass(slots=True)
class _Window:
    """One row's repeat window, counted over `history` up to `length`."""

    history: Sequence[int]  # the very list counted: a sequence's tokens only grow
    repeat_last_n: int
    length: int
    counts: Counter[int]  # token -> times in the window (no zeros)


class PenaltyCounts:
    """The penalties' token counts, kept per request between the engine's steps (issue 25): each step
    adds the tokens a row gained (+1) and takes off those its window's start passed (-1), a token or
    two, where counting afresh reads the whole window of every row each step (64 tokens by default;
    the whole context with repeat_last_n -1: at 2,000 tokens a step of 16 rows 5.3 -> 3.8 ms on 2 cores,
    bench/penalties.py).

    A row without an owner, a new owner, or one whose history is another list, shorter than counted,
    or under another window is counted afresh: the counts are always those of the row's window now.
    Owners unseen longest are forgotten first once twice the rows a step asks are kept."""

    MIN_KEPT = 16

    def __init__(self) -> None:
        self._windows: OrderedDict[str, _Window] = OrderedDict()  # least recently used first

    def entries(self, rows: list[SamplingRow], vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every (row's index in `rows`, token, count) of the rows' repeat windows, as three host tensors
        (int64; through `array`, 3.5x faster than torch.tensor of a list); ids past the vocabulary left out."""
        lengths, token_ids, counts = [], array("q"), array("q")
        for row in rows:
            window = self._counted(row).counts
            lengths.append(len(window))
            token_ids.extend(list(window))
            counts.extend(list(window.values()))
        keep = max(self.MIN_KEPT, 2 * len(rows))
        while len(self._windows) > keep:  # this step's owners are the most recent: the oldest go first
            self._windows.popitem(last=False)
        if not token_ids:
            return (torch.empty(0, dtype=torch.long),) * 3
        owners = torch.arange(len(rows)).repeat_interleave(torch.tensor(lengths, dtype=torch.long))
        tokens, counts_ = torch.frombuffer(token_ids, dtype=torch.long), torch.frombuffer(counts, dtype=torch.long)
        inside = (tokens >= 0) & (tokens < vocab)
        if not inside.all():
            return owners[inside], tokens[inside], counts_[inside]
        return owners, tokens, counts_

    def _counted(self, row: SamplingRow) -> _Window:
        history, n = row.history, row.params.repeat_last_n
        w = self._windows.pop(row.owner, None) if row.owner is not None else None
        if w is None or w.history is not history or w.repeat_last_n != n or w.length > len(history):
            w = _Window(history, n, len(history), Counter(_penalty_window(history, n)))
        else:
            w.counts.update(history[w.length:])
            if n > 0:  # the tokens the window's start passed
                leaving = history[max(w.length - n, 0):max(len(history) - n, 0)]
                w.counts.subtract(leaving)
                for t in leaving:
                    if w.counts.get(t, 1) <= 0:
                        del w.counts[t]
            w.length = len(history)
        if row.owner is not None:
            self._windows[row.owner] = w
        return w


def _apply_processors(work: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Per-request plug-ins: a processor that masks (a grammar: `MaskingProcessor`) fills its row of one packed
    bitmask on the host (the other rows allow everything), applied to the whole batch at once (one copy to the
    logits' device and one add: issue 25); any other changes its own row in place (a view of the batch).

    The order between them does not matter: a mask only takes tokens away, and the processors that set
    a row (the reasoning budget) act only while the reply reasons, when a grammar masks nothing."""
    words: torch.Tensor | None = None
    is_masking = False
    for i, row in enumerate(rows):
        if not row.processors:
            continue
        output_ids = row.history[len(row.history) - row.num_generated:]
        for processor in row.processors:
            if not isinstance(processor, MaskingProcessor):
                processor.process(work[i], output_ids)
                continue
            if words is None:
                words = torch.full((len(rows), -(-work.shape[-1] // 32)), -1, dtype=torch.int32)
            own = torch.empty_like(words[i])
            if processor.fill_mask(own):
                words[i] &= own
                is_masking = True
    if is_masking:
        assert words is not None
        apply_masks(work, words)


def _suppress_end_tokens(work: torch.Tensor, rows: list[SamplingRow]) -> None:
    """ignore_eos, and min_tokens not reached yet: no end-of-sequence or stop token."""
    vocab = work.shape[-1]
    entries = [(i, t) for i, r in enumerate(rows) for t in _end_tokens(r) if 0 <= t < vocab]
    if entries:
        row_ids, token_ids = zip(*entries)
        work.index_put_((on_device(row_ids, torch.long, work.device), on_device(token_ids, torch.long, work.device)),
                        work.new_full((), float("-inf")))


def _end_tokens(row: SamplingRow) -> set[int]:
    """The tokens this row may not draw now: its end tokens under ignore_eos, or before min_tokens."""
    p = row.params
    if p.ignore_eos or row.num_generated < p.min_tokens:
        return set(row.eos_token_ids) | set(p.stop_token_ids)
    return set()


# ---- temperature, truncation and the draw ----

def _draw(work: torch.Tensor, rows: list[SamplingRow], skip: set[int] = frozenset()) -> _Draws:
    """Every non-greedy row drawn: rows with no top-k or top-p in vocabulary order; on the CPU top-p
    rows without top-k from the flat nucleus; the rest (and the nucleus's spills) from their best
    logits, sorted, in widening candidate sets up to a full sort. On a GPU the candidate set's
    check is read with the tokens (`_Drawn.fits`), and only the rows that spill are sorted."""
    drawn = [i for i, r in enumerate(rows) if not r.params.is_greedy and i not in skip]  # skip: drawn natively
    params = [rows[i].params for i in drawn]
    if not drawn:
        return _Draws([], drawn, params)
    # [drawn, vocab]; a dynamic temperature comes after the truncations (_draw_chain)
    scaled = _take(work, drawn) / _column([1.0 if p.has_dynatemp else p.temperature for p in params], work.device)
    uniforms = _uniforms([rows[i].generator for i in drawn], work.device)
    vocab = work.shape[-1]
    chained = [j for j, p in enumerate(params) if p.has_llama_cpp_steps]
    ranked = [j for j, p in enumerate(params) if (p.top_k > 0 or p.top_p < 1.0) and j not in chained]
    groups = [_draw_in_order(scaled, uniforms, params, [j for j in range(len(drawn)) if j not in ranked + chained]),
              _draw_chain(scaled, uniforms, params, chained, [rows[drawn[j]].generator for j in chained])]
    # NOTE: on a GPU topk and sort are cheap and every extra kernel or sync is not: there the
    # candidate rows take one topk width and then a sort (issue 25, measured on an H200).
    on_cpu = not _gpu_strategy(work.device)
    by_probability = [j for j in ranked if on_cpu and params[j].top_k == 0 and not params[j].is_post_sampling_probs]
    group, spilled = _draw_nucleus(scaled, uniforms, params, by_probability)
    groups.append(group)
    ranked = sorted(spilled + [j for j in ranked if j not in by_probability])
    widths = CANDIDATES if on_cpu else CANDIDATES[:1]
    for width in [w for w in widths if w < vocab] + [vocab]:  # each row tries the narrowest width that holds its top-k
        tried = [j for j in ranked if params[j].top_k <= width or width == vocab]
        group, spilled = _draw_ranked(scaled, uniforms, params, tried, width, defer=not on_cpu and width < vocab)
        groups.append(group)
        ranked = sorted(spilled + [j for j in ranked if j not in tried])
    for g in groups:
        g.rows = [drawn[j] for j in g.rows]
    return _Draws([g for g in groups if g.rows], drawn, params, scaled, uniforms)


def _draw_in_order(scaled: torch.Tensor, uniforms: torch.Tensor, params: list[SamplingParams],
                   picked: list[int]) -> _Drawn:
    """Rows with at most min-p: it keeps a logit within log(min_p) of the row's best, no sort needed."""
    if not picked:
        return _Drawn([], scaled[:0], None, uniforms[:0].long())
    final = _take(scaled, picked)
    floor = _column([_log_min_p(params[j].min_p) for j in picked], final.device)
    final = final.masked_fill(final < final.max(dim=-1, keepdim=True).values + floor, float("-inf"))
    return _Drawn(picked, final, None, _inverse_cdf(final, _take(uniforms, picked)))


def _draw_nucleus(scaled: torch.Tensor, uniforms: torch.Tensor, params: list[SamplingParams],
                  picked: list[int]) -> tuple[_Drawn, list[int]]:
    """Top-p then min-p without a sort of the vocabulary: the candidates are the tokens within
    NUCLEUS_FLOOR of each row's best probability (what is left out weighs at most vocab x the floor),
    sorted together in one flat array. Returns the rows whose nucleus lies within them, drawn, and the others."""
    if not picked:
        return _Drawn([], scaled[:0], None, uniforms[:0].long()), []
    n, device = len(picked), scaled.device
    chosen = [params[j] for j in picked]
    probs = torch.softmax(_take(scaled, picked), dim=-1)  # [n, vocab]
    floor = _column([max(p.min_p, NUCLEUS_FLOOR) for p in chosen], device)
    candidates = probs >= probs.max(dim=-1, keepdim=True).values * floor
    is_narrow = candidates.sum(dim=-1) <= NUCLEUS_MAX  # a flat row is sorted more cheaply by the candidate sets
    row, col = (candidates & is_narrow[:, None]).nonzero(as_tuple=True)
    if not row.numel():  # every row is flat (or not finite): the candidate sets decide
        return _Drawn([], scaled[:0], None, uniforms[:0].long()), picked
    prob = probs[row, col]
    order = torch.argsort(prob, descending=True, stable=True)  # best first, then grouped by row (stable)
    order = order[torch.argsort(row[order], stable=True)]
    row, col, prob = row[order], col[order], prob[order]
    mass = prob.cumsum(dim=0)  # [candidates]; a row's own cumulative mass is `mass - before[row]`
    counts = torch.bincount(row, minlength=n)
    starts = counts.cumsum(0) - counts
    before = torch.where(starts > 0, mass[(starts - 1).clamp(min=0)], 0.0)
    row_mass = mass - before[row]
    top_p = _column([p.top_p for p in chosen], device).squeeze(1)
    keep = (row_mass - prob < top_p[row]) | (top_p[row] >= 1.0)  # the smallest prefix reaching top_p
    kept_mass = torch.zeros(n, device=device).index_add_(0, row, prob * keep)
    last_kept = starts + torch.bincount(row, weights=keep.float(), minlength=n).long() - 1
    total = torch.zeros(n, device=device).index_add_(0, row, prob)
    cut_by_min_p = on_device([p.min_p >= NUCLEUS_FLOOR for p in chosen], torch.bool, device)
    fits = ((total >= top_p) | cut_by_min_p) & (counts > 0)  # top-p's or min-p's cut falls among the candidates
    fits &= is_narrow
    target = before + _take(uniforms, picked) * kept_mass
    index = torch.minimum(torch.searchsorted(mass, target[:, None], right=True).squeeze(1), last_kept.clamp(min=0))
    tokens = col[index.clamp(max=col.numel() - 1)]
    fits_list = fits.tolist()
    inside = [j for j, ok in enumerate(fits_list) if ok]
    # the drawn token as a one-column distribution: what `sample` reads of a group (no post-sampling logprobs here)
    group = _Drawn([picked[j] for j in inside], torch.zeros(len(inside), 1, device=device),
                   _take(tokens, inside)[:, None], torch.zeros(len(inside), dtype=torch.long, device=device))
    return group, [picked[j] for j, ok in enumerate(fits_list) if not ok]


def _draw_ranked(scaled: torch.Tensor, uniforms: torch.Tensor, params: list[SamplingParams], picked: list[int],
                 width: int, defer: bool = False) -> tuple[_Drawn, list[int]]:
    """Top-k, then top-p over what top-k kept, then min-p, on each row's `width` best logits, sorted.

    Returns the rows whose survivors all lie within those candidates, drawn, and the others; with
    `defer`, every row drawn and the check left on the device in `fits` (no sync here)."""
    if not picked:
        return _Drawn([], scaled[:0], None, uniforms[:0].long()), []
    rows_scaled = _take(scaled, picked)  # [n, vocab]
    vocab, device = rows_scaled.shape[-1], rows_scaled.device
    chosen = [params[j] for j in picked]
    values, ids = torch.topk(rows_scaled, width, dim=-1) if width < vocab else torch.sort(rows_scaled, -1, descending=True)
    final, fits = _truncate_ranked(rows_scaled, values, ids, _Truncation.of(chosen, width, device))
    fits_list = [True] * len(picked) if width == vocab or defer else fits.tolist()
    inside = [j for j, ok in enumerate(fits_list) if ok]
    final = _take(final, inside)
    positions = _inverse_cdf(final, _take(uniforms, [picked[j] for j in inside]))
    group = _Drawn([picked[j] for j in inside], final, _take(ids, inside), positions, fits if defer else None)
    return group, [picked[j] for j, ok in enumerate(fits_list) if not ok]


def _draw_chain(scaled: torch.Tensor, uniforms: torch.Tensor, params: list[SamplingParams], picked: list[int],
                generators: list[torch.Generator | None]) -> _Drawn:
    """Rows with llama-server's typical-p, XTC, top-n-sigma or dynamic temperature, sorted: top-n-sigma, top-k,
    typical-p, top-p, min-p, XTC, then a dynamic temperature (llama.cpp's order; each step's probabilities over
    what the steps before it kept; `scaled` holds a dynamic-temperature row at 1). Only the rows' top-k best are
    sorted when every row has one (llama-server's default 40), else the whole vocabulary.
    XTC draws its own uniform a step (from the row's generator when seeded), after the one that picks the token."""
    if not picked:
        return _Drawn([], scaled[:0], None, uniforms[:0].long())
    chosen = [params[j] for j in picked]
    device, vocab = scaled.device, scaled.shape[-1]
    rows = _take(scaled, picked)
    width = max(p.top_k if 0 < p.top_k < vocab else vocab for p in chosen)
    values, ids = torch.topk(rows, width, dim=-1) if width < vocab else torch.sort(rows, -1, descending=True)
    columns = torch.arange(width, device=device)
    keep = _top_n_sigma(rows, values, _column([p.top_n_sigma for p in chosen], device))
    top_k = on_device([min(p.top_k, width) if p.top_k > 0 else width for p in chosen], torch.long, device)
    keep &= values >= values.gather(1, (top_k - 1)[:, None])  # ties with the k-th stay
    if any(p.typical_p < 1.0 for p in chosen):
        keep &= _typical(values, keep, _column([p.typical_p for p in chosen], device))
    probs = _probabilities(values, keep)
    top_p = _column([p.top_p for p in chosen], device)
    keep &= (probs.cumsum(dim=-1) - probs < top_p) | (top_p >= 1.0)  # the smallest prefix reaching top_p
    best = values.masked_fill(~keep, float("-inf")).max(dim=-1, keepdim=True).values
    keep &= values >= best + _column([_log_min_p(p.min_p) for p in chosen], device)
    xtc_rows = [j for j, p in enumerate(chosen) if p.xtc_probability > 0.0 and p.xtc_threshold <= 0.5]
    if xtc_rows:  # drop every token at least `threshold` likely but the least likely of them, when two or more are
        chance = torch.ones(len(chosen), device=device).index_copy(
            0, on_device(xtc_rows, torch.long, device), _uniforms([generators[j] for j in xtc_rows], device))
        probs = _probabilities(values, keep)
        above = keep & (probs >= _column([p.xtc_threshold for p in chosen], device))
        last_above = torch.where(above, columns, -1).max(dim=-1, keepdim=True).values
        is_cut = (chance[:, None] < _column([p.xtc_probability for p in chosen], device)) & (above.sum(-1, keepdim=True) >= 2)
        keep &= ~(is_cut & (columns < last_above))
    if any(p.has_dynatemp for p in chosen):
        values = values / _dynamic_temperature(values, keep, chosen)
    final = values.masked_fill(~keep, float("-inf"))
    return _Drawn(picked, final, ids, _inverse_cdf(final, _take(uniforms, picked)))


def _top_n_sigma(rows: torch.Tensor, values: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Which of `values` (each row's best, sorted) lie within n standard deviations of the best, the deviation over
    the whole row's finite logits; rows with n <= 0: all."""
    if not bool((n > 0.0).any()):
        return torch.ones_like(values, dtype=torch.bool)
    finite = torch.isfinite(rows)
    count = finite.sum(dim=-1, keepdim=True).clamp(min=1)
    mean = torch.where(finite, rows, 0.0).sum(dim=-1, keepdim=True) / count
    std = (torch.where(finite, rows - mean, 0.0).square().sum(dim=-1, keepdim=True) / count).sqrt()
    return (values >= values[:, :1] - n * std) | (n <= 0.0)


def _dynamic_temperature(values: torch.Tensor, keep: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[n, 1] each row's temperature: llama.cpp's entropy-scaled one between temperature -+ dynatemp_range for rows
    that set it (their survivors' entropy over its most, log(survivors), to dynatemp_exponent), else 1."""
    probs = _probabilities(values, keep)
    entropy = -torch.where(keep & (probs > 0), probs * probs.clamp(min=1e-30).log(), 0.0).sum(dim=-1, keepdim=True)
    survivors = keep.sum(dim=-1, keepdim=True)
    share = torch.where(survivors > 1, entropy / survivors.clamp(min=2).float().log(), 0.0).clamp(0.0, 1.0)
    device = values.device
    low = _column([max(p.temperature - p.dynatemp_range, 0.0) for p in params], device)
    high = _column([p.temperature + p.dynatemp_range for p in params], device)
    temperature = low + (high - low) * share.pow(_column([p.dynatemp_exponent for p in params], device))
    is_dynamic = _column([float(p.has_dynatemp) for p in params], device) > 0
    return torch.where(is_dynamic, temperature.clamp(min=1e-6), 1.0)  # a temperature of 0: the best survivor


def _probabilities(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return torch.softmax(values.masked_fill(~keep, float("-inf")), dim=-1)


def _typical(values: torch.Tensor, keep: torch.Tensor, typical_p: torch.Tensor) -> torch.Tensor:
    """Locally typical sampling's keep mask over sorted logits: the tokens whose surprisal is nearest the
    distribution's entropy, fewest first, until their probability passes typical_p (rows at 1: all kept)."""
    log_probs = torch.log_softmax(values.masked_fill(~keep, float("-inf")), dim=-1)
    probs = log_probs.exp()
    entropy = -torch.where(keep, probs * log_probs, 0.0).sum(dim=-1, keepdim=True)
    distance = torch.where(keep, (-log_probs - entropy).abs(), float("inf"))
    order = torch.argsort(distance, dim=-1, stable=True)
    in_order = probs.gather(1, order)
    kept_in_order = (in_order.cumsum(dim=-1) - in_order <= typical_p) | (typical_p >= 1.0)
    return torch.zeros_like(keep).scatter(1, order, kept_in_order)


@dataclass(slots=True)
class _Truncation:
    """The ranked chain's per-row parameters, as columns on the logits' device."""

    top_k: torch.Tensor  # [n] long: how many candidates top-k keeps (the width when it keeps more, or none is set)
    has_top_k: torch.Tensor  # [n] bool: a top-k within the width (top-p's probabilities are then over it)
    top_p: torch.Tensor  # [n, 1]
    log_min_p: torch.Tensor  # [n, 1]
    any_whole: bool  # some row's top-p is over the whole vocabulary (needs the row's logsumexp)

    @classmethod
    def of(cls, params: list[SamplingParams], width: int, device: torch.device) -> _Truncation:
        has_top_k = [0 < p.top_k <= width for p in params]
        return cls(on_device([p.top_k if k else width for p, k in zip(params, has_top_k)], torch.long, device),
                   on_device(has_top_k, torch.bool, device), _column([p.top_p for p in params], device),
                   _column([_log_min_p(p.min_p) for p in params], device), not all(has_top_k))


def _truncate_ranked(rows_scaled: torch.Tensor, values: torch.Tensor, ids: torch.Tensor,
                     t: _Truncation) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, vocab] tempered logits and their best `width` in order (ids: their columns) -> the candidates' logits after
    top-k, top-p and min-p (removed: -inf), and whether each row's survivors all lie among them."""
    keep = values >= values.gather(1, (t.top_k - 1)[:, None])  # ties with the k-th logit stay
    # top-p's probabilities are over what top-k kept, or over the whole row without a top-k
    probs = torch.softmax(values.masked_fill(~keep, float("-inf")), dim=-1)
    if t.any_whole:
        whole = torch.softmax(rows_scaled, dim=-1).gather(1, ids)
        probs = torch.where(t.has_top_k[:, None], probs, whole)
    mass = probs.cumsum(dim=-1)
    keep &= (mass - probs < t.top_p) | (t.top_p >= 1.0)  # the smallest prefix reaching top_p; the first always stays
    floor = values[:, :1] + t.log_min_p
    keep &= values >= floor
    # every survivor is a candidate: top-k fits, or top-p's or min-p's cut falls inside them
    fits = t.has_top_k | (mass[:, -1] >= t.top_p.squeeze(1)) | (values[:, -1] < floor.squeeze(1))
    return values.masked_fill(~keep, float("-inf")), fits


def _draw_fused(work: torch.Tensor, rows: list[SamplingRow]) -> tuple[torch.Tensor, _Draws]:
    """The GPU's draw of a whole batch in one pass of batch-wide ops, no sync (issue 25): greedy
    rows' argmax, min-p-only rows over the vocabulary, the rest over their best CANDIDATES[0]
    logits, each row's token picked by `torch.where`. A row whose survivors reach past its
    candidates comes back as _SPILLED, for `_Draws.settle`. Draws the tokens `_draw` would."""
    params = [r.params for r in rows]
    device, vocab = work.device, work.shape[-1]
    width = min(CANDIDATES[0], vocab)
    greedy = [p.is_greedy for p in params]
    in_order = [not g and p.top_k <= 0 and p.top_p >= 1.0 for g, p in zip(greedy, params)]
    ranked = [not g and not o for g, o in zip(greedy, in_order)]
    scaled = work / _column([1.0 if g else p.temperature for g, p in zip(greedy, params)], device)
    uniforms = _uniforms([None if g else r.generator for r, g in zip(rows, greedy)], device)
    tokens = work.argmax(dim=-1)
    if any(in_order):
        final = scaled.masked_fill(scaled < scaled.max(dim=-1, keepdim=True).values
                                   + _column([_log_min_p(p.min_p) for p in params], device), float("-inf"))
        drawn = torch.where(_has_mass(final), _inverse_cdf(final, uniforms), -1)
        tokens = torch.where(on_device(in_order, torch.bool, device), drawn, tokens)
    if any(ranked):
        values, ids = torch.topk(scaled, width, dim=-1)
        final, fits = _truncate_ranked(scaled, values, ids, _Truncation.of(params, width, device))
        drawn = torch.where(_has_mass(final), ids.gather(1, _inverse_cdf(final, uniforms)[:, None]).squeeze(1), -1)
        is_wide = on_device([p.top_k > width for p in params], torch.bool, device)  # a top-k past the candidates
        drawn = torch.where(fits & ~is_wide, drawn, _SPILLED)
        tokens = torch.where(on_device(ranked, torch.bool, device), drawn, tokens)
    return tokens, _Draws([], list(range(len(rows))), params, scaled, uniforms)


def _gpu_strategy(device: torch.device) -> bool:
    """One candidate width with its check deferred, no flat nucleus: fewer kernels and syncs."""
    return device.type != "cpu"


def _take(tensor: torch.Tensor, index: list[int]) -> torch.Tensor:
    """tensor[index] along the first dimension, without a copy when the index takes every row in order."""
    if index == list(range(tensor.shape[0])):
        return tensor
    return tensor.index_select(0, on_device(index, torch.long, tensor.device))


def on_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on `device`, copied without waiting for the device's queue
    (a plain `torch.tensor(..., device=cuda)` waits for every kernel launched before it)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _log_min_p(min_p: float) -> float:
    return math.log(min_p) if min_p > 0.0 else float("-inf")


def _inverse_cdf(final: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """[n, width] logits, [n] uniforms in [0, 1) -> [n] positions: the first whose cumulative
    probability passes u (never a removed token: its step in the CDF is empty)."""
    if not final.shape[0]:
        return torch.empty(0, dtype=torch.long, device=final.device)
    cdf = torch.softmax(final, dim=-1).cumsum(dim=-1)
    target = (uniforms * cdf[:, -1])[:, None]
    positions = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=final.shape[-1] - 1)
    is_removed = torch.isneginf(final.gather(1, positions[:, None]).squeeze(1))
    return torch.where(is_removed, final.argmax(dim=-1), positions)  # u rounding onto the last step


def _uniforms(generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """One uniform per row: a seeded row's from its own generator, the rest from the device's."""
    uniforms = torch.rand(len(generators), device=device)
    if any(g is not None for g in generators):
        seeded = on_device([torch.rand(1, generator=g).item() if g is not None else math.nan for g in generators],
                     torch.float32, device)
        uniforms = torch.where(seeded.isnan(), uniforms, seeded)
    return uniforms


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return on_device(values, torch.float32, device)[:, None]


# ---- logprobs ----

def _logprobs(raw: torch.Tensor, rows: list[SamplingRow], tokens: list[int],
              groups: list[_Drawn]) -> list[TokenLogprob | None]:
    """Raw model logprobs for the rows that asked; llama-server's post-sampling ones from the
    distribution each token was drawn from (greedy: the chosen token, probability 1)."""
    out: list[TokenLogprob | None] = [None] * len(rows)
    asked = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    post = {i for i in asked if rows[i].params.is_post_sampling_probs}
    plain = [i for i in asked if i not in post]
    if plain:
        for i, lp in zip(plain, _top_logprobs(torch.log_softmax(_take(raw, plain), dim=-1), None, rows, plain, tokens)):
            out[i] = lp
    for group in groups:
        inside = [j for j, i in enumerate(group.rows) if i in post]
        if inside:
            final = torch.log_softmax(_take(group.final, inside), dim=-1)
            ids = _take(group.ids, inside) if group.ids is not None else None
            picked = [group.rows[j] for j in inside]
            for i, lp in zip(picked, _top_logprobs(final, ids, rows, picked, tokens, positions=_take(group.positions, inside))):
                out[i] = lp
    for i in post:
        if out[i] is None:  # greedy
            out[i] = TokenLogprob(tokens[i], 0.0, ((tokens[i], 0.0),) if rows[i].params.logprobs else ())
    return out


def _top_logprobs(logprobs: torch.Tensor, ids: torch.Tensor | None, rows: list[SamplingRow], picked: list[int],
                  tokens: list[int], positions: torch.Tensor | None = None) -> list[TokenLogprob]:
    """[n, width] log-probabilities (columns are token ids unless `ids` maps them) -> each row's
    chosen token and its best alternatives; removed tokens (-inf) are never alternatives."""
    device = logprobs.device
    if positions is None:
        positions = on_device([tokens[i] for i in picked], torch.long, device)
    chosen = logprobs.gather(1, positions[:, None]).squeeze(1).tolist()
    num_top = max(rows[i].params.logprobs or 0 for i in picked)
    top_values, top_cols = torch.topk(logprobs, min(num_top, logprobs.shape[-1]), dim=-1)
    top_ids = ids.gather(1, top_cols) if ids is not None else top_cols
    results = []
    for j, (i, values, token_ids) in enumerate(zip(picked, top_values.tolist(), top_ids.tolist())):
        n = rows[i].params.logprobs or 0
        top = tuple((t, v) for t, v in zip(token_ids[:n], values[:n]) if v != float("-inf"))
        results.append(TokenLogprob(token_id=tokens[i], logprob=chosen[j], top=top))
    return results


def make_generator(seed: int | None) -> torch.Generator | None:
    if seed is None:
        return None
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator
