"""Multi-token prediction (F10): batch-1 drafts from the checkpoint's own MTP layers, and the decision.

A checkpoint with multi-token-prediction layers declares them in its config (DeepSeek-V3 and
GLM-4.5's `num_nextn_predict_layers`, transformers' `num_mtp_layers`, Qwen3-Next's
`mtp_num_hidden_layers`, GGUF's `<arch>.nextn_predict_layers`). Of those architectures only
Xiaomi's MiMo (`model_type` "mimo": a Qwen2 model plus `model.mtp_layers.N.*`) is a family the
engine runs (models/mimo.py); the others are mixture-of-experts, MLA or linear-attention models.

MiMo's MTP layer predicts the token after next: at position p it fuses the target's final hidden
state of position p - 1 (normed by `hidden_layernorm`) with the embedding of the token at p
(`token_layernorm`), as `input_proj([h, e])`, runs one Qwen2 decoder layer over its own keys of
the earlier positions, and `final_layernorm` feeds the target's output head. The engine hands the
drafter the target's last-layer output of every position it computes (the decode step's `taps`,
as for DFlash); a position's MTP row is computed once both inputs are accepted, so the row of the
next token's position drafts the token after it, and further drafts chain the layer on its own
output. Drafts are verified like any other (engine/spec/__init__.py): the stream stays the target's.

`MtpDraftPolicy` is the batch-1 decision (GET /v1/internal/mtp-policy): it drafts only while one
request runs; under `--mtp auto` it first profiles, alternating blocks of decode steps with and
without drafts and measuring tokens per second of each, then settles on the faster; `--mtp on`
and `--mtp off` force it. Where it cannot run, `decide_mtp` says why (`unavailable`), and a
sliding KV window (`--max-kv-size`) declines it for exactness: a verify row would attend over
another window than plain decoding does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from mlxcel.config import SpeculativeConfig
from mlxcel.engine.spec import DraftPolicy, weights_misfit
from mlxcel.layers.mtp import MtpHead, build_mtp_head, mtp_layer_index
from mlxcel.layers.norm import RMSNorm
from mlxcel.layers.rope import RotaryEmbedding, apply_rope, rope_settings
from mlxcel.types import MtpDecision, MtpProfile

if TYPE_CHECKING:
    from mlxcel.engine.spec import Sequence

log = logging.getLogger(__name__)

# Config keys that count a checkpoint's MTP layers, in the spellings the checkpoints use.
MTP_LAYER_KEYS = ("num_nextn_predict_layers", "num_mtp_layers", "mtp_num_hidden_layers")
MAX_DRAFT = 4  # one MTP layer chained on its own output: later positions are seldom right
MAX_PENDING = 64  # target hidden states a request may hold before the oldest are dropped
PROFILE_BLOCK = 4  # decode steps in a row with (or without) drafts while profiling
PROFILE_STEPS = 16  # measured steps of each kind before the decision settles


def declared_mtp_layers(config: Mapping[str, Any]) -> tuple[int, str | None]:
    """How many MTP layers `config` declares, and under which key (a VLM's `text_config` counts)."""
    text = config.get("text_config")
    for section in (config, text if isinstance(text, Mapping) else {}):
        for key in MTP_LAYER_KEYS:
            value = section.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value, key
    return 0, None


def decide_mtp(config: Mapping[str, Any], *, family_runs_mtp: bool = False,
               speculative: SpeculativeConfig | None = None, max_kv_size: int = 0) -> MtpDecision | None:
    """The decision that needs no measuring, or None when MTP drafting starts (--mtp auto or on)."""
    num_layers, key = declared_mtp_layers(config)
    spec = speculative or SpeculativeConfig()
    if not num_layers:
        return MtpDecision("unavailable", f"the checkpoint has no MTP heads: its config declares none "
                                          f"({', '.join(MTP_LAYER_KEYS)} absent or 0)")
    if not family_runs_mtp:
        family = str(config.get("model_type", "unknown"))
        return MtpDecision("unavailable", f"the checkpoint declares {num_layers} MTP layer(s) ({key}), but the "
                                          f"engine's {family} family does not load MTP layers, so they cannot draft",
                           num_mtp_layers=num_layers)
    if spec.draft_kind != "none":
        return MtpDecision("unavailable", f"--draft-kind {spec.draft_kind} drafts instead of the MTP layers",
                           num_mtp_layers=num_layers)
    if spec.mtp == "off":
        return MtpDecision("forced", "--mtp off: batch-1 decoding never drafts with the MTP layers",
                           num_mtp_layers=num_layers)
    if max_kv_size:
        return MtpDecision("exactness_declined", f"--max-kv-size {max_kv_size}: a verify row would attend over "
                                                 "another KV window than plain decoding, so drafts could change "
                                                 "the output", num_mtp_layers=num_layers)
    return None


# ---- the MTP layer (MiMo's layout) ----

@dataclass(frozen=True, slots=True)
class MtpSpec:
    """The shapes of an MTP layer: the target's (a Qwen2 decoder layer's) config."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> MtpSpec:
        heads = int(config["num_attention_heads"])
        theta, scaling = rope_settings(config)
        return cls(hidden_size=int(config["hidden_size"]), num_heads=heads,
                   num_kv_heads=int(config.get("num_key_value_heads") or heads),
                   head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
                   intermediate_size=int(config["intermediate_size"]),
                   rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling)


class MtpLayer(nn.Module):
    """One MTP layer; parameter names equal the checkpoint's under `model.mtp_layers.N.`."""

    def __init__(self, spec: MtpSpec) -> None:
        super().__init__()
        hidden, eps = spec.hidden_size, spec.rms_norm_eps
        self.spec = spec
        self.token_layernorm = RMSNorm(hidden, eps)
        self.hidden_layernorm = RMSNorm(hidden, eps)
        self.input_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(hidden, spec.num_heads * spec.head_dim, bias=True)
        self.self_attn.k_proj = nn.Linear(hidden, spec.num_kv_heads * spec.head_dim, bias=True)
        self.self_attn.v_proj = nn.Linear(hidden, spec.num_kv_heads * spec.head_dim, bias=True)
        self.self_attn.o_proj = nn.Linear(spec.num_heads * spec.head_dim, hidden, bias=False)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(hidden, spec.intermediate_size, bias=False)
        self.mlp.up_proj = nn.Linear(hidden, spec.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(spec.intermediate_size, hidden, bias=False)
        self.final_layernorm = RMSNorm(hidden, eps)
        self.rotary = RotaryEmbedding(spec.head_dim, spec.rope_theta, spec.rope_scaling)

    def forward(self, previous: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
                context: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows [n, hidden] (the previous position's hidden state, this position's token embedding) at
        `positions`, causal among themselves after the `context` keys and values [c, kv_heads, head_dim]:
        their hidden states after `final_layernorm`, and their own keys and values."""
        spec, n = self.spec, len(previous)
        x = self.input_proj(torch.cat((self.hidden_layernorm(previous), self.token_layernorm(embeds)), dim=-1))
        h = self.input_layernorm(x)
        attn = self.self_attn
        cos, sin = self.rotary.cos_sin(positions, h.dtype)
        q = apply_rope(attn.q_proj(h).view(n, spec.num_heads, spec.head_dim), cos, sin)
        k = apply_rope(attn.k_proj(h).view(n, spec.num_kv_heads, spec.head_dim), cos, sin)
        v = attn.v_proj(h).view(n, spec.num_kv_heads, spec.head_dim)
        keys, values = (k, v) if context is None else (torch.cat((context[0], k)), torch.cat((context[1], v)))
        num_context = len(keys) - n
        mask = torch.ones(n, len(keys), dtype=torch.bool, device=h.device)
        mask[:, num_context:] = torch.ones(n, n, dtype=torch.bool, device=h.device).tril()
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                             attn_mask=mask, enable_gqa=spec.num_heads != spec.num_kv_heads)
        x = x + attn.o_proj(out.transpose(0, 1).reshape(n, -1))
        h = self.post_attention_layernorm(x)
        x = x + self.mlp.down_proj(F.silu(self.mlp.gate_proj(h)) * self.mlp.up_proj(h))
        return self.final_layernorm(x), k, v


def load_mtp_layer(config: Mapping[str, Any], weights: Mapping[str, torch.Tensor], prefix: str, *,
                   device: torch.device | str, dtype: torch.dtype) -> MtpLayer:
    """The first MTP layer from `weights` (checkpoint names under `prefix`, e.g. "model.mtp_layers.0.")."""
    layer = MtpLayer(MtpSpec.from_config(config))
    own = {name.removeprefix(prefix): tensor for name, tensor in weights.items() if name.startswith(prefix)}
    if not own:
        raise ValueError(f"the checkpoint holds no {prefix}* weights")
    misfit = weights_misfit(layer, own)
    if misfit:
        raise ValueError(f"the MTP layer {prefix}* does not fit the config: {misfit}")
    return layer.to(device=device, dtype=dtype).eval()


# ---- an MTP head of the target's own blocks (Qwen3-Next / Qwen3.5: layers/mtp.py) ----

def load_mtp_head(target: nn.Module, weights: Mapping[str, torch.Tensor], prefixes: tuple[str, ...], *,
                  device: torch.device | str, dtype: torch.dtype) -> MtpHead:
    """The MTP head of `target` from the checkpoint's `weights` under `prefixes` (e.g. "mtp."): its decoder
    layer's weights go through the family's own sanitize (fused experts stacked), as the target's did."""
    own = {name[len(p):]: tensor for name, tensor in weights.items() for p in prefixes if name.startswith(p)}
    if not own:
        raise ValueError(f"the checkpoint holds no {' or '.join(p + '*' for p in prefixes)} weights")
    index = mtp_layer_index(target.args)
    block, stem = "layers.0.", f"model.layers.{index}."
    renamed = {(stem + name[len(block):] if name.startswith(block) else name): t for name, t in own.items()}
    sanitized = type(target).sanitize(renamed, target.args)
    head = build_mtp_head(target)
    misfit = weights_misfit(head, {(block + n[len(stem):] if n.startswith(stem) else n): t
                                   for n, t in sanitized.items()})
    if misfit:
        raise ValueError(f"the MTP head {prefixes[0]}* does not fit the config: {misfit}")
    return head.to(device=device, dtype=dtype).eval()


# ---- the drafter ----

@dataclass(slots=True)
class _Context:
    """One request's MTP context: the layer's keys and values of the rows taken in, hidden states waiting."""

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    next_row: int = 1  # rows below this were taken in or skipped (row 0 has no previous hidden state)
    pending: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> target final hidden state
    last: tuple[int, torch.Tensor] | None = None  # (row, its output) of the newest row taken in


class MtpDrafter:
    """Drafts with the target's MTP layer over its final hidden states; owns each request's context."""

    kind = "mtp"

    def __init__(self, layer: MtpLayer | MtpHead, target: nn.Module, *, max_draft: int = MAX_DRAFT) -> None:
        self.layer = layer
        self.target = target
        self.max_draft = max_draft
        self.feature_layers = (target.args.num_hidden_layers - 1,)  # the decode step and prefill tap it
        self._states: dict[str, _Context] = {}
        self._dtype = next(layer.parameters()).dtype

    @property
    def num_requests(self) -> int:
        return len(self._states)

    def record(self, request_id: str, first_position: int, features: torch.Tensor) -> None:
        """The target's last-layer outputs [n, hidden] at positions first_position.. (runner.py calls it)."""
        state = self._states.setdefault(request_id, _Context())
        if len(state.pending) >= MAX_PENDING:  # not drafting for a while (a full batch, a settled "off")
            state.pending = {p: h for p, h in state.pending.items() if p >= first_position - 1}
        hidden = self.target.model.norm(features).to(self._dtype)  # the final hidden state is normed
        for i, row in enumerate(hidden):
            state.pending[first_position + i] = row

    @torch.inference_mode()
    def propose(self, seq: Sequence, max_len: int) -> tuple[int, ...]:
        state = self._states.get(seq.request_id)
        if state is None or max_len < 1:
            return ()
        known = seq.num_computed_tokens  # the next token sits here: its row drafts the one after it
        self._take_in(state, seq.token_ids, known)
        if state.last is None or state.last[0] != known:
            return ()
        return self._chain(state, known, state.last[1], min(max_len, self.max_draft))

    def free(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def _take_in(self, state: _Context, tokens: list[int], known: int) -> None:
        """Compute the rows up to `known` whose inputs are accepted (row p: hidden state p - 1, token p)
        into the context; rows without a hidden state (a cached prompt prefix) are skipped."""
        rows = [p for p in range(state.next_row, known + 1) if p - 1 in state.pending]
        state.next_row = max(state.next_row, known + 1)
        if rows:
            previous = torch.stack([state.pending[p - 1] for p in rows])
            out, k, v = self._rows(previous, [tokens[p] for p in rows], rows, state.keys, state.values)
            state.keys = k if state.keys is None else torch.cat((state.keys, k))
            state.values = v if state.values is None else torch.cat((state.values, v))
            state.last = (rows[-1], out[-1:])
        state.pending = {p: h for p, h in state.pending.items() if p >= known}

    def _chain(self, state: _Context, known: int, out: torch.Tensor, num: int) -> tuple[int, ...]:
        """Drafts for positions known + 1 ..: each the argmax of a row's logits, the next row fed with it."""
        draft = [int(self.target.compute_logits(out).float().argmax(-1))]
        keys, values = state.keys, state.values
        while len(draft) < num:
            out, k, v = self._rows(out, [draft[-1]], [known + len(draft)], keys, values)
            keys, values = torch.cat((keys, k)), torch.cat((values, v))
            draft.append(int(self.target.compute_logits(out).float().argmax(-1)))
        return tuple(draft)

    def _rows(self, previous: torch.Tensor, tokens: list[int], positions: list[int], keys: torch.Tensor | None,
              values: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The MTP layer over rows (previous hidden states [n, hidden], tokens, positions) after a context."""
        device = previous.device
        embeds = self.target.model.embed(torch.tensor(tokens, device=device)).to(self._dtype)
        context = (keys, values) if keys is not None and values is not None else None
        return self.layer(previous, embeds, torch.tensor(positions, device=device), context)


# ---- the batch-1 decision ----

@dataclass(slots=True)
class _Arm:
    """Measured decode steps of one kind (with or without drafts) at batch 1."""

    num_steps: int = 0
    num_tokens: int = 0
    seconds: float = 0.0

    def add(self, num_tokens: int, seconds: float) -> None:
        self.num_steps += 1
        self.num_tokens += num_tokens
        self.seconds += seconds

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(slots=True)
class _LastStep:
    request_id: str
    started: float
    is_drafted: bool


class MtpDraftPolicy(DraftPolicy):
    """Drafts with the MTP layers only while one request runs, as the batch-1 decision says.

    Each decode step of a lone request calls `draft` once, so the time between two calls for the
    same request is one step, and its tokens are 1 (no draft) or the accepted drafts + 1 (`record`).
    """

    def __init__(self, config: SpeculativeConfig, drafter: MtpDrafter, *, num_mtp_layers: int,
                 clock: Callable[[], float] = time.perf_counter, profile_steps: int = PROFILE_STEPS,
                 profile_block: int = PROFILE_BLOCK) -> None:
        super().__init__(config, drafter)
        self.num_mtp_layers = num_mtp_layers
        self._clock = clock
        self._profile_steps, self._profile_block = profile_steps, profile_block
        self._arms = {True: _Arm(), False: _Arm()}  # with drafts, without
        self._num_profiled = 0  # batch-1 steps scheduled while profiling (they alternate in blocks)
        self._last: _LastStep | None = None
        self._round_tokens: dict[str, int] = {}  # tokens the last verify round of a request emitted
        if config.mtp == "on":
            self.decision = MtpDecision("forced", "--mtp on: batch-1 decoding always drafts with the MTP layers",
                                        num_mtp_layers, is_enabled=True)
        else:
            self.decision = MtpDecision("profiling", self._profiling_reason(), num_mtp_layers)

    def draft(self, seq: Sequence, num_running: int, room: int) -> tuple[int, ...]:
        now = self._clock()  # a step runs from here to the next call: drafting, verifying, sampling
        self._measure(seq.request_id, num_running, now)
        draft = super().draft(seq, num_running, room) if num_running == 1 and self._wants_draft() else ()
        self._last = _LastStep(seq.request_id, now, bool(draft)) if num_running == 1 else None
        return draft

    def record(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        super().record(request_id, num_drafted, num_accepted)
        self._round_tokens[request_id] = num_accepted + 1

    def free(self, request_id: str) -> None:
        super().free(request_id)
        self._round_tokens.pop(request_id, None)
        if self._last is not None and self._last.request_id == request_id:
            self._last = None

    def _wants_draft(self) -> bool:
        state = self.decision.state
        if state == "profiling":
            self._num_profiled += 1
            return (self._num_profiled - 1) // self._profile_block % 2 == 0
        return self.decision.is_enabled

    def _measure(self, request_id: str, num_running: int, now: float) -> None:
        """The previous step, if it was this lone request's decode step: its time and tokens."""
        last = self._last
        if last is None or last.request_id != request_id or num_running != 1:
            return
        tokens = self._round_tokens.pop(request_id, 1) if last.is_drafted else 1
        if self.decision.state == "profiling":
            self._arms[last.is_drafted].add(tokens, now - last.started)
            self._settle_if_measured()

    def _settle_if_measured(self) -> None:
        on, off = self._arms[True], self._arms[False]
        if min(on.num_steps, off.num_steps) < self._profile_steps:
            self.decision = MtpDecision("profiling", self._profiling_reason(), self.num_mtp_layers,
                                        profile=self._profile())
            return
        is_faster = on.tokens_per_second > off.tokens_per_second
        reason = (f"measured at batch 1: {on.tokens_per_second:.1f} tokens/s with MTP drafts, "
                  f"{off.tokens_per_second:.1f} without: MTP drafting is {'on' if is_faster else 'off'}")
        self.decision = MtpDecision("settled", reason, self.num_mtp_layers, is_enabled=is_faster,
                                    profile=self._profile())
        log.info("MTP policy settled: %s", reason)

    def _profile(self) -> MtpProfile:
        on, off = self._arms[True], self._arms[False]
        return MtpProfile(num_steps_on=on.num_steps, num_steps_off=off.num_steps,
                          tokens_per_second_on=round(on.tokens_per_second, 2),
                          tokens_per_second_off=round(off.tokens_per_second, 2))

    def _profiling_reason(self) -> str:
        return (f"--mtp auto: measuring batch-1 decode steps with and without MTP drafts, {self._profile_steps} "
                "of each, then keeping the faster")
