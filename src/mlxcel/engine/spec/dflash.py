"""DFlash drafting (B3): a block-diffusion drafter proposes a whole block in one forward pass.

A DFlash drafter (z-lab's checkpoint layout: `config.json` with a `dflash_config`, and
safetensors) is a few Qwen3-style decoder layers that read two things:
- the target's hidden states at `target_layer_ids` for the context, concatenated, projected by
  `fc` and normed by `hidden_norm`: in every draft layer they become extra keys and values;
- a block of the known next token followed by `mask_token_id` placeholders, embedded by the
  target's own embedding.
Attention inside the block is bidirectional (unless the config says `is_causal`); the draft's
final `norm` feeds the target's output head, and the argmax at block positions 1..B-1 is the
draft, verified like any other (engine/spec/__init__.py), so the stream stays the target's.

The engine hands the drafter the target's features of every position it computes: prefill
chunks, decode rows and verify rows (engine/runner.py, the decode step's `taps`). The drafter
keeps each request's context keys and values per draft layer (they depend on the features
only, not on the block) and takes in only positions the target has accepted: features of a
rejected draft position are dropped and recomputed with the right token. A prompt prefix served
from the prefix cache brings no features; the context then starts where this request's own
computation did. The context keys are plain per-request tensors, freed with the request.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from mlxcel.engine.spec import weights_misfit
from mlxcel.layers.norm import RMSNorm
from mlxcel.layers.rope import RotaryEmbedding, apply_rope, rope_settings

if TYPE_CHECKING:
    from mlxcel.engine.spec import Sequence

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
MAX_PENDING = 64  # positions of features a request may hold before they are taken into its context


class DFlashCheckpointError(ValueError):
    """The drafter checkpoint cannot draft for this target: startup is refused with exit 2."""


@dataclass(frozen=True, slots=True)
class DFlashSpec:
    """What a DFlash drafter's config.json says (flat keys, or inside `dflash_config` where z-lab puts them)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    attention_bias: bool
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int
    is_causal: bool = False
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    logit_softcap: float | None = None

    @classmethod
    def read(cls, directory: Path) -> DFlashSpec:
        path = directory / CONFIG_FILE
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise DFlashCheckpointError(f"the DFlash drafter {directory} has no readable {CONFIG_FILE}: {exc}") from exc
        architectures = config.get("architectures") or []
        if any(name != "DFlashDraftModel" for name in architectures):
            raise DFlashCheckpointError(
                f"the DFlash drafter {directory} is a {', '.join(architectures)}; this build runs DFlashDraftModel "
                "checkpoints (DFlash2's convolutions and candidate selector are not implemented)")
        draft = config.get("dflash_config") or {}
        value = lambda name, default=None: draft.get(name, config.get(name, default))  # noqa: E731
        if value("target_layer_ids") is None or value("mask_token_id") is None:
            raise DFlashCheckpointError(f"the DFlash drafter {directory}'s {CONFIG_FILE} names no "
                                        "dflash_config.target_layer_ids or mask_token_id: it is not a DFlash drafter")
        layer_types = set(config.get("layer_types") or ["full_attention"])
        if layer_types != {"full_attention"}:
            raise DFlashCheckpointError(f"the DFlash drafter {directory} has {', '.join(sorted(layer_types))} layers; "
                                        "only full-attention draft layers are supported")
        heads = int(config["num_attention_heads"])
        theta, scaling = rope_settings(config, default_theta=1_000_000.0)
        softcap = value("final_logit_softcapping")
        try:
            return cls(hidden_size=int(config["hidden_size"]), num_layers=int(config["num_hidden_layers"]),
                       num_heads=heads, num_kv_heads=int(config.get("num_key_value_heads", heads)),
                       head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
                       intermediate_size=int(config["intermediate_size"]),
                       rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
                       attention_bias=bool(config.get("attention_bias", False)),
                       target_layer_ids=tuple(int(i) for i in value("target_layer_ids")),
                       mask_token_id=int(value("mask_token_id")), block_size=int(value("block_size", 16)),
                       is_causal=bool(config.get("is_causal", False)),
                       input_embedding_scale=float(value("input_embedding_scale", 1.0)),
                       output_multiplier=float(value("output_multiplier", 1.0)),
                       logit_softcap=float(softcap) if softcap else None)
        except (KeyError, TypeError, ValueError) as exc:
            raise DFlashCheckpointError(f"the DFlash drafter {directory}'s {CONFIG_FILE} is incomplete: {exc!r}") from exc

    def to_config(self) -> dict[str, Any]:
        """The config.json this spec reads back from (z-lab's layout)."""
        return {
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "attention_bias": self.attention_bias, "is_causal": self.is_causal,
            "layer_types": ["full_attention"] * self.num_layers,
            "dflash_config": {"target_layer_ids": list(self.target_layer_ids), "mask_token_id": self.mask_token_id,
                              "block_size": self.block_size},
        }


class DraftLayer(nn.Module):
    """A Qwen3 decoder layer whose attention also reads the context's keys and values."""

    def __init__(self, spec: DFlashSpec) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        hidden, bias = spec.hidden_size, spec.attention_bias
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(hidden, spec.num_heads * spec.head_dim, bias=bias)
        self.self_attn.k_proj = nn.Linear(hidden, spec.num_kv_heads * spec.head_dim, bias=bias)
        self.self_attn.v_proj = nn.Linear(hidden, spec.num_kv_heads * spec.head_dim, bias=bias)
        self.self_attn.o_proj = nn.Linear(spec.num_heads * spec.head_dim, hidden, bias=bias)
        self.self_attn.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.self_attn.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(hidden, spec.intermediate_size, bias=False)
        self.mlp.up_proj = nn.Linear(hidden, spec.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(spec.intermediate_size, hidden, bias=False)
        self.input_layernorm = RMSNorm(hidden, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, spec.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Roped, normed keys and values [T, kv_heads, head_dim] of rows x [T, hidden]."""
        attn = self.self_attn
        k = attn.k_norm(attn.k_proj(x).view(len(x), self.num_kv_heads, self.head_dim))
        return apply_rope(k, cos, sin), attn.v_proj(x).view(len(x), self.num_kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, context: tuple[torch.Tensor, torch.Tensor], cos: torch.Tensor,
                sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        attn, h = self.self_attn, self.input_layernorm(x)
        q = apply_rope(attn.q_norm(attn.q_proj(h).view(len(h), self.num_heads, self.head_dim)), cos, sin)
        k, v = self.keys_values(h, cos, sin)
        keys, values = torch.cat((context[0], k)), torch.cat((context[1], v))
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                             attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads)
        x = x + attn.o_proj(out.transpose(0, 1).reshape(len(x), -1))
        h = self.post_attention_layernorm(x)
        return x + self.mlp.down_proj(F.silu(self.mlp.gate_proj(h)) * self.mlp.up_proj(h))


class DFlashModel(nn.Module):
    """The drafter's own weights (its embedding and output head are the target's)."""

    def __init__(self, spec: DFlashSpec) -> None:
        super().__init__()
        self.spec = spec
        self.layers = nn.ModuleList(DraftLayer(spec) for _ in range(spec.num_layers))
        self.fc = nn.Linear(len(spec.target_layer_ids) * spec.hidden_size, spec.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.rotary = RotaryEmbedding(spec.head_dim, spec.rope_theta, spec.rope_scaling)

    def context_keys_values(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        """Each draft layer's keys and values of context rows (target features [T, taps x hidden])."""
        context = self.hidden_norm(self.fc(features))
        cos, sin = self.rotary.cos_sin(positions, context.dtype)
        return [layer.keys_values(context, cos, sin) for layer in self.layers]

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                context: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The block's hidden states [B, hidden] (embedded tokens x at `positions`), after the final norm."""
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        mask = None
        if self.spec.is_causal:  # each block row sees the whole context and the block up to itself
            num_context = context[0][0].shape[0] if context else 0
            mask = torch.ones(len(x), num_context + len(x), dtype=torch.bool, device=x.device)
            mask[:, num_context:] = torch.ones(len(x), len(x), dtype=torch.bool, device=x.device).tril()
        for layer, kv in zip(self.layers, context):
            x = layer(x, kv, cos, sin, mask)
        return self.norm(x)


def load_dflash(directory: Path, target: nn.Module, *, device: torch.device | str, dtype: torch.dtype,
                target_name: str = "the model") -> DFlashModel:
    """The drafter at `directory`, checked against the target it drafts for (refusals name both)."""
    from safetensors.torch import load_file

    spec = DFlashSpec.read(directory)
    args = target.args
    problems = []
    if spec.hidden_size != args.hidden_size:
        problems.append(f"its hidden size is {spec.hidden_size}, the target's {args.hidden_size}")
    if not all(0 <= i < args.num_hidden_layers for i in spec.target_layer_ids):
        problems.append(f"it reads target layers {list(spec.target_layer_ids)}, the target has "
                        f"{args.num_hidden_layers}")
    if not 0 <= spec.mask_token_id < args.vocab_size:
        problems.append(f"its mask token {spec.mask_token_id} is outside the target's {args.vocab_size}-token "
                        "embedding")
    if problems:
        raise DFlashCheckpointError(f"the DFlash drafter {directory} cannot draft for {target_name}: "
                                    + "; ".join(problems))
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise DFlashCheckpointError(f"the DFlash drafter {directory} holds no .safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(str(file)))
    model = DFlashModel(spec)
    weights = {name.removeprefix("model."): tensor for name, tensor in weights.items()
               if not name.endswith("rotary_emb.inv_freq")}
    misfit = weights_misfit(model, weights)
    if misfit:
        raise DFlashCheckpointError(f"the DFlash drafter {directory}'s weights do not fit its config: {misfit}")
    return model.to(device=device, dtype=dtype).eval()


@dataclass(slots=True)
class _Context:
    """One request's draft context: the keys and values of the positions taken in, and features waiting."""

    keys_values: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    num_positions: int = 0  # positions below this were taken in (or had no features)
    pending: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> target features


class DFlashDrafter:
    """Block drafts from a DFlash model over the target's features; owns each request's draft context."""

    kind = "dflash"

    def __init__(self, model: DFlashModel, target: nn.Module, *, block_size: int) -> None:
        self.model = model
        self.target = target
        self.block_size = block_size
        self.feature_layers = model.spec.target_layer_ids  # the decode step and prefill tap these layers
        self._final_norm_tap = target.args.num_hidden_layers - 1  # HF's last hidden state is normed
        self._states: dict[str, _Context] = {}
        self._dtype = next(model.parameters()).dtype

    @property
    def num_requests(self) -> int:
        return len(self._states)

    def record(self, request_id: str, first_position: int, features: torch.Tensor) -> None:
        """The target's tapped outputs [n, taps x hidden] at positions first_position.. (runner.py calls it)."""
        hidden = self.target.args.hidden_size
        if self._final_norm_tap in self.feature_layers:
            at = self.feature_layers.index(self._final_norm_tap) * hidden
            features = features.clone()
            features[:, at:at + hidden] = self.target.model.norm(features[:, at:at + hidden])
        state = self._states.setdefault(request_id, _Context())
        if len(state.pending) >= MAX_PENDING:  # a row that does not speculate (a long prompt, a full batch)
            self._take_in(state, first_position)  # the target computing `first_position` accepted all before it
        for i, row in enumerate(features.to(self._dtype)):
            state.pending[first_position + i] = row

    @torch.inference_mode()
    def propose(self, seq: Sequence, max_len: int) -> tuple[int, ...]:
        state = self._states.get(seq.request_id)
        if state is None or max_len < 1:
            return ()
        known = seq.num_computed_tokens  # the next token (at this position) has no target features yet
        self._take_in(state, known)
        if state.keys_values is None:
            return ()
        size = min(self.block_size, max_len + 1)
        spec, device = self.model.spec, self.model.fc.weight.device
        tokens = torch.tensor([seq.token_ids[known]] + [spec.mask_token_id] * (size - 1), device=device)
        x = self.target.model.embed(tokens).to(self._dtype) * spec.input_embedding_scale
        hidden = self.model(x, torch.arange(known, known + size, device=device), state.keys_values)
        logits = self.target.compute_logits(hidden[1:]).float() * spec.output_multiplier
        if spec.logit_softcap:
            logits = torch.tanh(logits / spec.logit_softcap) * spec.logit_softcap
        return tuple(logits.argmax(-1).tolist())

    def free(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def _take_in(self, state: _Context, num_accepted: int) -> None:
        """Project the features of accepted positions not yet in the context; drop the rest (rejected drafts)."""
        positions = [p for p in range(state.num_positions, num_accepted) if p in state.pending]
        if positions:
            features = torch.stack([state.pending[p] for p in positions])
            new = self.model.context_keys_values(features, torch.tensor(positions, device=features.device))
            old = state.keys_values
            state.keys_values = new if old is None else [
                (torch.cat((k0, k1)), torch.cat((v0, v1))) for (k0, v0), (k1, v1) in zip(old, new)]
        state.num_positions = max(state.num_positions, num_accepted)
        state.pending.clear()
