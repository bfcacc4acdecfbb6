"""Mixture-of-experts feed-forward block: a router, stacked expert weights, optional shared experts.

One `MoE` module replaces a layer's dense MLP. A step's tokens are routed (`route`), then each
selected expert runs once over all the rows that chose it: the (token, expert) pairs are sorted by
expert, their rows gathered, multiplied by each expert's weights as one grouped matmul (or a loop of
one matmul per hit expert where `torch.nn.functional.grouped_mm` cannot run), weighted, and summed
back per token. The grouped path never reads the per-expert counts on the host, so a CUDA graph can
capture it.

Router kinds (`RouterSpec.kind`), after transformers 5.25's modeling files:
  "softmax"          mixtral, qwen2_moe, qwen3_moe, olmoe: softmax over all experts, top-k,
                     renormalised when `normalize` (mixtral always; the others' norm_topk_prob)
  "topk_softmax"     granitemoe, gpt_oss: top-k of the logits (gpt-oss's carry a router bias),
                     then softmax over the selected logits alone
  "sparsemixer"      phimoe: its top-2 sparsemixer at inference (each pick a softmax over the
                     logits within 2*jitter_eps of the best, relative to |logit|)
  "sigmoid_grouped"  deepseek_v3, glm4_moe: sigmoid scores; `e_score_correction_bias` added for
                     the choice only; experts chosen within the best `topk_groups` of `num_groups`
                     groups (a group scored by its best two); renormalised when `normalize`, then
                     times `scaling` (routed_scaling_factor)
  "softmax_grouped"  deepseek_v2: softmax scores over all experts (float32 logits); experts chosen
                     within the best `topk_groups` of `num_groups` groups, a group scored by its best
                     expert (DeepSeek-V2's "group_limited_greedy"; one group: "greedy"); not
                     renormalised (transformers ignores norm_topk_prob there), times `scaling`

Expert activation (`MoESpec.activation`): "silu" / "gelu" / "gelu_pytorch_tanh" / "relu" / "relu2" gate,
times up; "swiglu_clamped" is gpt-oss's: gate.clamp(max=limit), up.clamp(-limit, limit),
(up + 1) * gate * sigmoid(gate * alpha). `MoESpec.gated` False (Nemotron-H): no gate, the experts and
the shared expert are act(up(x)) then down; `experts.gate_up_proj` then holds the up rows alone [E, I, H].
`MoESpec.latent_size` (Nemotron-H's `moe_latent_size`): the routed experts run in a smaller space,
`fc1_latent_proj` [L, H] before them and `fc2_latent_proj` [H, L] after (the router and shared expert
see the hidden state itself).

Parameters of one `MoE` (the module sits where the checkpoint's block sits: `mlp` or
`block_sparse_moe`) and the checkpoint names `sanitize_moe` makes them from, per `layout`:
  gate.weight [E, H]          "per_expert"/"mixtral"/"stacked": gate.weight as stored;
                              "granite": router.layer.weight; "gpt_oss": router.weight
  gate.bias [E]               "gpt_oss": router.bias
  gate.e_score_correction_bias [E]   as stored (deepseek_v3, glm4_moe)
  experts.gate_up_proj [E, 2I, H]    gate rows then up rows:
                              "per_expert": experts.{e}.gate_proj.weight ; experts.{e}.up_proj.weight
                              "mixtral":    experts.{e}.w1.weight ; experts.{e}.w3.weight
                              "granite":    input_linear.weight (already [E, 2I, H], gate first)
                              "gpt_oss":    experts.gate_up_proj [E, H, 2I] transposed, its
                                            interleaved columns (gate 0::2, up 1::2) split
                              "stacked":    experts.gate_up_proj as stored (transformers 5's own names)
                              any layout:   GGUF's experts.gate_proj.weight ; experts.up_proj.weight [E, I, H]
  experts.down_proj [E, H, I] "per_expert": experts.{e}.down_proj.weight; "mixtral": experts.{e}.w2.weight;
                              "granite": output_linear.weight; "gpt_oss": experts.down_proj [E, I, H]
                              transposed
  experts.gate_up_proj_bias [E, 2I], experts.down_proj_bias [E, H]   "gpt_oss": the same names, the
                              first de-interleaved
  {shared_name}.gate_proj/up_proj/down_proj.weight   as stored (qwen2_moe's `shared_expert`,
                              deepseek_v3's / glm4_moe's `shared_experts`); `{shared_name}_gate.weight`
                              [1, H] as stored (qwen2_moe's sigmoid gate on the shared expert)
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from mlxcel.layers import paged_attention
from mlxcel.layers.decoder import combined
from mlxcel.layers.quant import GATE_UP, Int4Levels, Int8Levels, QuantLinear, Step, StoredSource, linear, project

RouterKind = Literal["softmax", "topk_softmax", "sparsemixer", "sigmoid_grouped", "softmax_grouped"]
ROUTER_KINDS: tuple[str, ...] = ("softmax", "topk_softmax", "sparsemixer", "sigmoid_grouped", "softmax_grouped")
_FLOAT32_ROUTERS = ("sigmoid_grouped", "softmax_grouped")  # DeepSeek's: logits in float32 whatever the dtype
Layout = Literal["per_expert", "mixtral", "granite", "gpt_oss", "stacked"]

_GATED_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "relu2": lambda x: F.relu(x).square(),
}


@dataclass(frozen=True)
class RouterSpec:
    """How a layer picks its experts; see the module docstring for each kind's reference."""

    kind: RouterKind
    num_experts: int
    top_k: int
    normalize: bool = False  # renormalise the selected weights to sum to 1
    has_bias: bool = False  # gpt-oss's router bias on the logits
    num_groups: int = 1  # sigmoid_grouped / softmax_grouped: n_group
    topk_groups: int = 1  # sigmoid_grouped / softmax_grouped: topk_group
    scaling: float = 1.0  # sigmoid_grouped / softmax_grouped: routed_scaling_factor
    jitter_eps: float = 0.01  # sparsemixer: router_jitter_noise

    def __post_init__(self) -> None:
        if self.kind not in ROUTER_KINDS:
            raise ValueError(f"router kind must be one of {', '.join(ROUTER_KINDS)}, not {self.kind!r}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be between 1 and num_experts {self.num_experts}")
        if self.kind == "sparsemixer" and self.top_k != 2:
            raise ValueError("the sparsemixer router picks exactly 2 experts")
        if self.num_experts % self.num_groups or self.topk_groups > self.num_groups:
            raise ValueError(f"{self.num_experts} experts do not split into {self.num_groups} groups "
                             f"of which {self.topk_groups} are kept")


@dataclass(frozen=True)
class MoESpec:
    """One MoE layer's shape: its router, its experts, and its shared experts (0 wide: none)."""

    router: RouterSpec
    hidden_size: int
    intermediate_size: int  # each routed expert's width
    activation: str = "silu"  # a `_GATED_ACTIVATIONS` name or "swiglu_clamped"
    has_expert_bias: bool = False
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    shared_intermediate_size: int = 0
    shared_name: str = "shared_experts"
    is_shared_gated: bool = False  # qwen2_moe: sigmoid(`{shared_name}_gate`(x)) times the shared output
    gated: bool = True  # False: act(up) experts and shared expert, no gate projection (Nemotron-H)
    latent_size: int = 0  # Nemotron-H's moe_latent_size: the routed experts' input / output width (0: hidden)

    def __post_init__(self) -> None:
        if self.activation not in _GATED_ACTIVATIONS and self.activation != "swiglu_clamped":
            raise ValueError(f"unsupported expert activation {self.activation!r}")
        if not self.gated and self.activation == "swiglu_clamped":
            raise ValueError("swiglu_clamped is a gated activation")

    @property
    def expert_width(self) -> int:
        """The rows of `experts.gate_up_proj` an expert: gate and up, or up alone."""
        return (2 if self.gated else 1) * self.intermediate_size

    @property
    def expert_input(self) -> int:
        return self.latent_size or self.hidden_size

    @property
    def num_experts(self) -> int:
        return self.router.num_experts


def moe_spec_from_config(config: dict[str, Any], kind: RouterKind, **overrides: Any) -> MoESpec:
    """An MoESpec from an HF config's usual MoE keys; a family passes its router kind and anything
    its config names differently (e.g. `normalize=True` for mixtral, `shared_name=...`)."""
    num_experts = _first(config, "num_experts", "num_local_experts", "n_routed_experts")
    width = _first(config, "moe_intermediate_size", "intermediate_size")
    router = RouterSpec(
        kind=kind, num_experts=num_experts, top_k=config["num_experts_per_tok"],
        normalize=bool(config.get("norm_topk_prob", False)),
        num_groups=config.get("n_group") or 1, topk_groups=config.get("topk_group") or 1,
        scaling=float(config.get("routed_scaling_factor") or 1.0),
        jitter_eps=float(config.get("router_jitter_noise") or 0.0),
    )
    fields: dict[str, Any] = dict(
        router=router, hidden_size=config["hidden_size"], intermediate_size=width,
        activation=config.get("hidden_act", "silu"),
        shared_intermediate_size=config.get("shared_expert_intermediate_size")
        or width * (config.get("n_shared_experts") or 0),
        swiglu_limit=float(config.get("swiglu_limit", 7.0)), swiglu_alpha=float(config.get("swiglu_alpha", 1.702)),
    )
    router_fields = {k: overrides.pop(k) for k in list(overrides) if k in RouterSpec.__dataclass_fields__}
    if router_fields:
        fields["router"] = RouterSpec(**{**router.__dict__, **router_fields})
    return MoESpec(**{**fields, **overrides})


def _first(config: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    raise KeyError(f"the config has none of {', '.join(keys)}")


# ---------------------------------------------------------------------------------------------
# Routing


def route(logits: torch.Tensor, spec: RouterSpec,
          correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64)."""
    scores = logits.float()
    if spec.kind == "softmax":
        weights, ids = torch.topk(torch.softmax(scores, dim=-1), spec.top_k, dim=-1)
    elif spec.kind == "topk_softmax":
        top, ids = torch.topk(scores, spec.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1)
    elif spec.kind == "sparsemixer":
        return _sparsemixer(scores, spec.jitter_eps)
    elif spec.kind == "softmax_grouped":
        return _softmax_grouped(scores, spec)
    else:
        return _sigmoid_grouped(scores, spec, correction_bias)
    if spec.normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _sparsemixer(scores: torch.Tensor, jitter_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    # Phi-MoE's inference path: the best expert, then the best of the rest, each weighted by a
    # softmax over the logits close enough to that pick's (transformers' `sparsemixer`).
    first_weight, first = _sparsemixer_pick(scores, scores, jitter_eps)
    second_weight, second = _sparsemixer_pick(scores.scatter(-1, first, float("-inf")), scores, jitter_eps)
    return torch.cat((first_weight, second_weight), dim=-1), torch.cat((first, second), dim=-1)


def _sparsemixer_pick(candidates: torch.Tensor, scores: torch.Tensor,
                      jitter_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    best, index = candidates.max(dim=-1, keepdim=True)
    factor = scores.abs().clamp(min=best)
    gates = candidates.masked_fill((best - scores) / factor > 2 * jitter_eps, float("-inf"))
    return torch.softmax(gates, dim=-1).gather(-1, index), index


def _sigmoid_grouped(scores: torch.Tensor, spec: RouterSpec,
                     correction_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    scores = scores.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if spec.topk_groups < spec.num_groups:  # keeping every group masks nothing
        choice = _mask_groups(choice, spec)
    ids = torch.topk(choice, spec.top_k, dim=-1).indices
    weights = scores.gather(-1, ids)  # the uncorrected scores weigh the experts
    if spec.normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * spec.scaling, ids


def _softmax_grouped(scores: torch.Tensor, spec: RouterSpec) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.softmax(scores, dim=-1)
    choice = _mask_groups(scores, spec, best_of=1) if spec.topk_groups < spec.num_groups else scores
    ids = torch.topk(choice, spec.top_k, dim=-1).indices
    return scores.gather(-1, ids) * spec.scaling, ids


def _mask_groups(choice: torch.Tensor, spec: RouterSpec, best_of: int = 2) -> torch.Tensor:
    """-inf outside each row's best `topk_groups` groups, a group scored by the sum of its `best_of`
    best experts (DeepSeek-V3: two; DeepSeek-V2: one)."""
    grouped = choice.view(choice.shape[0], spec.num_groups, -1)  # [T, groups, experts per group]
    group_scores = grouped.topk(min(best_of, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
    kept = torch.topk(group_scores, spec.topk_groups, dim=-1).indices
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
    return grouped.masked_fill(~mask.unsqueeze(-1), float("-inf")).view_as(choice)


class Router(nn.Module):
    """The routing linear (a raw parameter, so that weight rewrites leave its precision alone)."""

    def __init__(self, spec: RouterSpec, hidden_size: int) -> None:
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(torch.empty(spec.num_experts, hidden_size))
        self.bias = nn.Parameter(torch.zeros(spec.num_experts)) if spec.has_bias else None
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(spec.num_experts)) if spec.kind == "sigmoid_grouped" else None)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        # DeepSeek-style routers score in float32 whatever the model's dtype, as transformers does.
        if self.spec.kind in _FLOAT32_ROUTERS:
            return F.linear(x.float(), self.weight.float())
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] float32, expert ids [T, k])."""
        return route(self.logits(x), self.spec, self.e_score_correction_bias)


# ---------------------------------------------------------------------------------------------
# Experts


class Experts(nn.Module):
    """Every routed expert's weights stacked: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]."""

    def __init__(self, spec: MoESpec) -> None:
        super().__init__()
        num, hidden, width = spec.num_experts, spec.expert_input, spec.intermediate_size
        self.spec = spec
        self.gate_up_proj = nn.Parameter(torch.empty(num, spec.expert_width, hidden))
        self.down_proj = nn.Parameter(torch.empty(num, hidden, width))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(num, spec.expert_width)) if spec.has_expert_bias else None
        self.down_proj_bias = nn.Parameter(torch.zeros(num, hidden)) if spec.has_expert_bias else None

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, path: str = "auto") -> torch.Tensor:
        """x [T, H], ids / weights [T, k] -> the weighted sum of each row's experts [T, H].

        `path`: "auto", or one of `EXPERT_PATHS` to force it (tests compare them)."""
        spec = self.spec
        return torch.ops.mlxcel.moe_experts(
            x, ids, weights.float(), self.gate_up_proj, self.down_proj, self.gate_up_proj_bias,
            self.down_proj_bias, _activation_name(spec), spec.swiglu_limit, spec.swiglu_alpha, path)

    def packed(self, source: StoredSource) -> QuantExperts:
        """These experts as weight-only quantized linears (the CPU decode rewrite, layers/quant.py
        `quantize`): from the levels or codes a GGUF stores its expert stacks in (ffn_*_exps, as
        `sanitize_moe` names them: `gate_proj.weight`, `up_proj.weight`, `down_proj.weight`; a gpt-oss
        MXFP4 folder offers its codes under the same names), never rounded again; else from the float
        stacks, as the dense path packs a float linear."""
        num = self.spec.num_experts
        gate, up, down = (source.stored(f"{n}.weight") for n in ("gate_proj", "up_proj", "down_proj"))
        gate_up_float = down_float = None
        if not self.spec.gated:  # the up stack alone: as stored, or the float stack
            gate, up = (None, None) if up is None else (up, None)
            gate_up_float = source.param("gate_up_proj") if gate is None else None
        elif gate is None or up is None:
            gate_up_float = source.param("gate_up_proj")
        if down is None:
            down_float = source.param("down_proj")
        gate_up_bias, down_bias = source.param("gate_up_proj_bias"), source.param("down_proj_bias")
        gate_ups, downs = [], []
        for e in range(num):
            first = (None if gate_up_float is not None else
                     tuple(_expert_part(t, num, e) for t in (gate, up) if t is not None))
            gate_ups.append(source.pack([*first] if first else [gate_up_float[e]],
                                        None if gate_up_bias is None else gate_up_bias[e]))
            downs.append(source.pack([_expert_part(down, num, e) if down_float is None else down_float[e]],
                                     None if down_bias is None else down_bias[e]))
        return QuantExperts(self.spec, gate_ups, downs)


def _expert_part(stack: Int4Levels | Int8Levels, num_experts: int, expert: int) -> Int4Levels | Int8Levels:
    """Expert `expert`'s rows of a stored stack (every field [E * rows, ...]: `GGUFFile.int4_levels`)."""
    return type(stack)(*(None if t is None else t.view(num_experts, -1, *t.shape[1:])[expert] for t in stack))


class QuantExperts(nn.Module):
    """`Experts` packed for the CPU kernels (issue 40): per expert its gate|up and down `QuantLinear`
    (4-bit levels, a GGUF's int8 / 6-bit codes, or per-channel int8), no bfloat16 copy. A step's
    (token, slot) pairs are grouped by expert and each chosen expert runs once over all its rows,
    decode and prefill rows alike, through one C++ call a layer (kernels/decode_layers.cpp
    `quant_experts`); where the CPU kernels do not build, the same loop in Python."""

    def __init__(self, spec: MoESpec, gate_ups: list[QuantLinear], downs: list[QuantLinear]) -> None:
        super().__init__()
        self.spec = spec
        self.gate_up = nn.ModuleList(gate_ups)
        self.down = nn.ModuleList(downs)
        self.register_buffer("no_bias", torch.empty(0), persistent=False)
        self._flat: list[torch.Tensor] | None = None
        self._on_kernels = paged_attention.available()

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, path: str = "auto") -> torch.Tensor:
        spec = self.spec
        if x.device.type == "cpu" and self._on_kernels and spec.gated:
            out = torch.ops.mlxcel.quant_experts(x.float().contiguous(), ids.long().contiguous(),
                                                 weights.float().contiguous(), self._linears(), spec.activation,
                                                 spec.swiglu_limit, spec.swiglu_alpha)
            return out.to(x.dtype)
        stack = _ExpertStack(None, None, None, None, _activation_name(spec), spec.swiglu_limit, spec.swiglu_alpha)
        return _per_expert(lambda e, rows: self.down[e].packed_rows(stack.activate(self.gate_up[e].packed_rows(rows))),
                           len(self.gate_up), x, ids, weights)

    def _linears(self) -> list[torch.Tensor]:
        """The op's flat list, six tensors an expert: read from the buffers when traced (the compiled
        decode step, one layer's code for every layer: they are its inputs), else kept once."""
        if self._flat is not None and not torch.compiler.is_compiling():
            return self._flat
        flat = [t for pair in zip(self.gate_up, self.down) for lin in pair
                for t in (lin.qweight, lin.scale, lin.bias if lin.bias is not None else self.no_bias)]
        if not torch.compiler.is_compiling():
            self._flat = flat
        return flat


EXPERT_PATHS = ("grouped", "per_expert", "gathered")
UNGATED = "ungated:"  # the op's activation string for `MoESpec.gated` False (one op signature for both forms)


def _activation_name(spec: MoESpec) -> str:
    return spec.activation if spec.gated else UNGATED + spec.activation


@torch.library.custom_op("mlxcel::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None,
                activation: str, limit: float, alpha: float, path: str) -> torch.Tensor:
    """The routed experts' weighted sum, as one opaque op.

    NOTE: opaque to the compiled decode step (inductor has no float32 grouped matmul, and the
    per-expert loop reads counts on the host, which a full-graph trace refuses)."""
    stack = _ExpertStack(gate_up, down, gate_up_bias, down_bias, activation, limit, alpha)
    path = _pick_path(x) if path == "auto" else path
    run = {"grouped": _run_grouped, "per_expert": _run_per_expert, "gathered": _run_gathered}[path]
    return run(stack, x, ids, weights)


@moe_experts.register_fake
def _moe_experts_fake(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                      down: torch.Tensor, gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None,
                      activation: str, limit: float, alpha: float, path: str) -> torch.Tensor:
    return torch.empty_like(x)


@dataclass(frozen=True)
class _ExpertStack:
    gate_up: torch.Tensor | None  # [E, 2I, H] (None: QuantExperts, which runs only `activate`)
    down: torch.Tensor | None  # [E, H, I]
    gate_up_bias: torch.Tensor | None  # [E, 2I]
    down_bias: torch.Tensor | None  # [E, H]
    activation: str
    limit: float
    alpha: float

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[rows, 2I] -> [rows, I]: the gated activation of the experts' first projection (an
        "ungated:" activation: [rows, I] -> act(up), no gate)."""
        if self.activation.startswith(UNGATED):
            return _GATED_ACTIVATIONS[self.activation[len(UNGATED):]](gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        if self.activation == "swiglu_clamped":
            gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
            return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        return _GATED_ACTIVATIONS[self.activation](gate) * up


def _pick_path(x: torch.Tensor) -> str:
    """The grouped matmul where torch has it for this device and dtype (CUDA: bfloat16 on sm80+);
    else one matmul per expert, or, inside a CUDA graph capture (no host reads), per-pair gathers."""
    if hasattr(F, "grouped_mm"):
        if x.device.type == "cpu":
            return "grouped"
        if x.device.type == "cuda" and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 0):
            return "grouped"
    if x.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return "gathered"
    return "per_expert"


def _run_grouped(stack: _ExpertStack, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    num_tokens, top_k = ids.shape
    expert_of_pair, order = ids.reshape(-1).sort(stable=True)  # (token, slot) pairs sorted by expert
    # each expert's end in the sorted pairs; searchsorted, unlike bincount, never reads a size on the host,
    # so the step stays capturable as a CUDA graph
    experts = torch.arange(stack.gate_up.shape[0], device=ids.device, dtype=expert_of_pair.dtype)
    offsets = torch.searchsorted(expert_of_pair, experts, right=True).to(torch.int32)
    hidden = F.grouped_mm(x[order // top_k], stack.gate_up.transpose(1, 2), offs=offsets)
    if stack.gate_up_bias is not None:
        hidden = hidden + stack.gate_up_bias[expert_of_pair]
    out = F.grouped_mm(stack.activate(hidden), stack.down.transpose(1, 2), offs=offsets)
    if stack.down_bias is not None:
        out = out + stack.down_bias[expert_of_pair]
    out = (out * weights.reshape(-1)[order, None]).to(x.dtype)
    pairs = torch.empty_like(out).index_copy_(0, order, out)  # back in (token, slot) order
    return pairs.view(num_tokens, top_k, -1).sum(dim=1)


def _run_per_expert(stack: _ExpertStack, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return _per_expert(lambda e, rows: _run_one(stack, e, rows), stack.gate_up.shape[0], x, ids, weights)


def _per_expert(run_one: Callable[[int, torch.Tensor], torch.Tensor], num_experts: int, x: torch.Tensor,
                ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each expert some row chose, once over all those rows (`run_one(expert, rows)`), weighted and summed."""
    top_k = ids.shape[1]
    expert_of_pair, order = ids.reshape(-1).sort(stable=True)
    counts = torch.bincount(expert_of_pair, minlength=num_experts).tolist()
    pair_weights = weights.reshape(-1)[order]
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            span = slice(start, start + count)
            token_rows = order[span] // top_k
            y = run_one(expert, x.index_select(0, token_rows))
            out.index_add_(0, token_rows, (y * pair_weights[span, None]).to(x.dtype))
            start += count
    return out


def _run_one(stack: _ExpertStack, expert: int, rows: torch.Tensor) -> torch.Tensor:
    """Expert `expert` over rows [n, H] -> [n, H], unweighted."""
    bias = None if stack.gate_up_bias is None else stack.gate_up_bias[expert]
    hidden = F.linear(rows, stack.gate_up[expert], bias)
    bias = None if stack.down_bias is None else stack.down_bias[expert]
    return F.linear(stack.activate(hidden), stack.down[expert], bias)


def _run_gathered(stack: _ExpertStack, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    # Each (token, slot) pair's expert weights gathered and batch-multiplied: no host read, so a
    # CUDA graph captures it; its copies make it a small-batch (decode) path only.
    num_tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    rows = x.repeat_interleave(top_k, dim=0).unsqueeze(-1)  # [pairs, H, 1]
    hidden = torch.bmm(stack.gate_up[flat], rows).squeeze(-1)
    if stack.gate_up_bias is not None:
        hidden = hidden + stack.gate_up_bias[flat]
    out = torch.bmm(stack.down[flat], stack.activate(hidden).unsqueeze(-1)).squeeze(-1)
    if stack.down_bias is not None:
        out = out + stack.down_bias[flat]
    out = (out * weights.reshape(-1, 1)).to(x.dtype)
    return out.view(num_tokens, top_k, -1).sum(dim=1)


class SharedExpert(nn.Module):
    """A dense gated MLP every token runs beside the routed experts (HF names gate/up/down_proj; no
    gate_proj where the spec is not gated)."""

    def __init__(self, spec: MoESpec) -> None:
        super().__init__()
        hidden, width = spec.hidden_size, spec.shared_intermediate_size
        self.gated = spec.gated
        if spec.gated:
            self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)
        self.act = _GATED_ACTIVATIONS[spec.activation]

    def forward(self, x: torch.Tensor, step: Step | None = None) -> torch.Tensor:
        if not self.gated:
            return linear(self.down_proj, self.act(linear(self.up_proj, x, step)), step)
        gate, up = project(self, x, GATE_UP, step)
        return linear(self.down_proj, self.act(gate) * up, step)


class MoE(nn.Module):
    """A layer's MoE feed-forward: routed experts, plus shared experts when the spec has them."""

    def __init__(self, spec: MoESpec) -> None:
        super().__init__()
        self.spec = spec
        self.gate = Router(spec.router, spec.hidden_size)
        self.experts = Experts(spec)
        if spec.latent_size:
            self.fc1_latent_proj = nn.Linear(spec.hidden_size, spec.latent_size, bias=False)
            self.fc2_latent_proj = nn.Linear(spec.latent_size, spec.hidden_size, bias=False)
        if spec.shared_intermediate_size:
            self.add_module(spec.shared_name, SharedExpert(spec))
            if spec.is_shared_gated:
                self.add_module(f"{spec.shared_name}_gate", nn.Linear(spec.hidden_size, 1, bias=False))

    def forward(self, x: torch.Tensor, step: Step | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]; `step` is the engine step the shared experts' projections take."""
        weights, ids = self.gate(x)
        if self.spec.latent_size:
            out = linear(self.fc2_latent_proj, self.experts(linear(self.fc1_latent_proj, x, step), ids, weights), step)
        else:
            out = self.experts(x, ids, weights)
        if self.spec.shared_intermediate_size:
            out = out + self._shared(x, step)
        return out

    def _shared(self, x: torch.Tensor, step: Step | None) -> torch.Tensor:
        shared = getattr(self, self.spec.shared_name)(x, step)
        if self.spec.is_shared_gated:
            shared = torch.sigmoid(linear(getattr(self, f"{self.spec.shared_name}_gate"), x, step)) * shared
        return shared


# ---------------------------------------------------------------------------------------------
# Checkpoint layouts -> stacked parameters

Value = Any  # a tensor, or (lazy loading) a reader: a callable of the tensor's name that returns it

_PER_EXPERT_NAMES = {
    "per_expert": {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
    "mixtral": {"gate": "w1", "up": "w3", "down": "w2"},
}


def sanitize_moe(weights: dict[str, Value], layout: Layout) -> dict[str, Value]:
    """The checkpoint's MoE entries (every layer's) renamed and stacked into `MoE`'s parameters;
    other entries pass through. Values may be tensors or lazy readers (`loading/lazy.py`).

    Every layout also takes llama.cpp's GGUF form, as loading/ names its tensors: `experts.gate_proj.weight`,
    `experts.up_proj.weight` [E, I, H] and `experts.down_proj.weight` [E, H, I] (ffn_*_exps), with their
    biases `experts.{gate,up}_proj.bias` [E, I] and `experts.down_proj.bias` [E, H] (gpt-oss); such a
    file's names are already ours, so the layout's own renames and transposes do not apply."""
    if any(_is_gguf_stack(k) for k in weights):
        return _merge_gguf_stacks(weights)
    if layout in _PER_EXPERT_NAMES:
        return _stack_per_expert(weights, _PER_EXPERT_NAMES[layout])
    if layout == "granite":
        return _renamed(weights, {r"(^|\.)router\.layer\.weight$": r"\1gate.weight",
                                  r"(^|\.)input_linear\.weight$": r"\1experts.gate_up_proj",
                                  r"(^|\.)output_linear\.weight$": r"\1experts.down_proj"})
    if layout == "gpt_oss":
        return _gpt_oss(weights)
    if layout == "stacked":
        return dict(weights)
    raise ValueError(f"unknown MoE checkpoint layout {layout!r}")


def _is_gguf_stack(name: str) -> bool:
    """A GGUF expert stack: gate (or, for ungated experts such as Nemotron-H's, up) projections of every expert."""
    return any(name == f"experts.{part}_proj.weight" or name.endswith(f".experts.{part}_proj.weight")
               for part in ("gate", "up"))


def _merge_gguf_stacks(weights: dict[str, Value]) -> dict[str, Value]:
    kept = dict(weights)
    for up in [k for k in weights if k == "experts.up_proj.weight" or k.endswith(".experts.up_proj.weight")]:
        prefix = up[:-len("up_proj.weight")]
        if f"{prefix}gate_proj.weight" not in weights:  # ungated experts (Nemotron-H): the up stack alone
            kept[f"{prefix}gate_up_proj"] = kept.pop(up)
            kept[f"{prefix}down_proj"] = kept.pop(f"{prefix}down_proj.weight")
    for gate in [k for k in weights if k == "experts.gate_proj.weight" or k.endswith(".experts.gate_proj.weight")]:
        prefix = gate[:-len("gate_proj.weight")]
        for kind, suffix in (("weight", ""), ("bias", "_bias")):
            gate, up, down = (f"{prefix}{part}_proj.{kind}" for part in ("gate", "up", "down"))
            if gate not in weights:
                continue
            kept[f"{prefix}gate_up_proj{suffix}"] = combined(weights, [gate, up], lambda ts: torch.cat(ts, dim=1))
            kept[f"{prefix}down_proj{suffix}"] = kept.pop(down)
            del kept[gate], kept[up]
    return kept


def _stack_per_expert(weights: dict[str, Value], names: dict[str, str]) -> dict[str, Value]:
    pattern = re.compile(rf"^(.*\.)?experts\.(\d+)\.({'|'.join(names.values())})\.weight$")
    role_of = {stored: role for role, stored in names.items()}
    found: dict[str, dict[str, dict[int, str]]] = {}  # block prefix -> role -> expert -> key
    kept: dict[str, Value] = {}
    for key, value in weights.items():
        if m := pattern.match(key):
            found.setdefault(m.group(1) or "", {}).setdefault(role_of[m.group(3)], {})[int(m.group(2))] = key
        else:
            kept[key] = value
    for prefix, roles in found.items():
        # no gate projections: ungated experts (Nemotron-H), whose stack is the up rows alone
        gate = _expert_keys(roles, "gate", prefix) if "gate" in roles else []
        up, down = (_expert_keys(roles, role, prefix) for role in ("up", "down"))
        kept[f"{prefix}experts.gate_up_proj"] = combined(
            weights, gate + up, lambda ts, n=len(gate): torch.cat((torch.stack(ts[:n]), torch.stack(ts[n:])), 1)
            if n else torch.stack(ts))
        kept[f"{prefix}experts.down_proj"] = combined(weights, down, torch.stack)
    return kept


def _expert_keys(roles: dict[str, dict[int, str]], role: str, prefix: str) -> list[str]:
    by_expert = roles.get(role, {})
    if sorted(by_expert) != list(range(len(by_expert))) or not by_expert:
        raise ValueError(f"{prefix}experts: the checkpoint's {role} projections do not cover experts 0..N-1")
    return [by_expert[e] for e in range(len(by_expert))]


def _gpt_oss(weights: dict[str, Value]) -> dict[str, Value]:
    # gpt-oss stores x @ W ([E, H, 2I]) with gate and up columns interleaved (gate 0::2, up 1::2).
    def split(t: torch.Tensor) -> torch.Tensor:
        return torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)

    fixes: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "experts.gate_up_proj": lambda t: split(t).transpose(1, 2).contiguous(),
        "experts.gate_up_proj_bias": split,
        "experts.down_proj": lambda t: t.transpose(1, 2).contiguous(),
    }
    out: dict[str, Value] = {}
    for key, value in _renamed(weights, {r"(^|\.)router\.(weight|bias)$": r"\1gate.\2"}).items():
        fix = next((f for suffix, f in fixes.items() if key == suffix or key.endswith("." + suffix)), None)
        out[key] = value if fix is None else combined({key: value}, [key], lambda ts, f=fix: f(ts[0]))
    return out


def _renamed(weights: dict[str, Value], rules: dict[str, str]) -> dict[str, Value]:
    out: dict[str, Value] = {}
    for key, value in weights.items():
        for pattern, replacement in rules.items():
            key = re.sub(pattern, replacement, key)
        out[key] = value
    return out
