"""The fallback family: any decoder transformers knows, run by transformers' own modeling code.

A model_type with no module of its own under `mlxcel.models` loads here (loading/checkpoint.py's
`family_module`) when `AutoModelForCausalLM` knows it, as vLLM's Transformers backend does: our paged
attention is plugged into transformers' modules through its attention interface
(`AttentionInterface.register`, `attn_implementation`), so continuous batching, the paged KV cache and
prefix caching work unchanged. Exact (transformers' own math around our attention), and slower than a
native family: the model runs whole and eagerly, one step at a time (`Model.can_step_layers` is False, so
the decode step neither compiles nor captures it: engine/decode_step.py).

The step's tokens go to transformers' inner model as one [1, T] batch with their positions; each
layer's attention call (q/k/v as [1, H, T, D]) goes to `step.attend` with the module's layer index, its
scaling and its sliding window. What `attend` cannot compute (soft-capped scores, attention sinks,
non-causal or non-attention layers, heads of another shape than the KV cache's) is refused at load by a
probe forward on the meta device, never computed wrongly.

Parameter names are transformers' own, which are the checkpoint's: the CausalLM's children (`model.`,
`lm_head.`, or `transformer.`, `embed_out.`...) become this module's children.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

IMPLEMENTATION = "transformers"  # what the log and /props say of a model loaded here (native families: "native")
ATTN_IMPLEMENTATION = "mlxcel_paged"  # our name in transformers' AttentionInterface

# The CausalLM forward's logit transforms after the head, by config key, that compute_logits repeats; the
# keys in _REFUSED_LOGIT_KEYS name transforms it does not (a checkpoint with one set is refused).
_REFUSED_LOGIT_KEYS = ("output_multiplier", "logits_soft_cap", "output_logit_soft_cap", "unpadded_vocab_size")
# Attention keyword arguments whose non-None value changes the scores in a way `attend` cannot follow.
_REFUSED_ATTENTION_KWARGS = {"softcap": "soft-capped attention scores", "s_aux": "attention sinks",
                             "sinks": "attention sinks", "position_bias": "a position bias (ALiBi/relative)"}


class Step(Protocol):
    """What a step hands the model (layers/attention.py's `AttentionContext`, the decode step's attention)."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               scale: float, window: int | None = None) -> torch.Tensor: ...


# The step the running forward attends through: set by `Model.forward` for its duration on this thread
# (a context variable: two engines over one model on two threads each see their own).
_STEP: contextvars.ContextVar[Step] = contextvars.ContextVar("mlxcel_transformers_step")


def knows(model_type: str) -> bool:
    """Whether transformers has a causal-LM class for `model_type` (its own code, no remote code)."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:  # transformers missing or broken: no fallback
        return False
    return model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


@dataclass(frozen=True)
class ModelArgs:
    """What the engine sizes the KV cache from, read through transformers' own config class."""

    model_type: str
    num_hidden_layers: int
    num_attention_heads: int
    kv_heads: int
    dim_per_head: int
    hidden_size: int
    max_position_embeddings: int
    vocab_size: int
    tie_word_embeddings: bool
    sliding_window: int | None  # set where some layer attends over a window (served_model reads it)
    hf_config: Any = field(repr=False, compare=False)  # transformers' config object
    # Transformers' checkpoint-key renames for this model (GPT-NeoX's embed_out -> lm_head, ...): filled when
    # the Model is built, as transformers derives them from the built model; `sanitize` applies them.
    weight_transforms: list[Any] = field(default_factory=list, repr=False, compare=False)

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelArgs:
        """ValueError names what the fallback cannot run (build_model turns it into one ModelLoadError line)."""
        hf = _hf_config(config)
        text = hf.get_text_config()
        heads = int(text.num_attention_heads)
        _refuse_unsupported_config(text)
        return cls(
            model_type=str(config["model_type"]),
            num_hidden_layers=int(text.num_hidden_layers),
            num_attention_heads=heads,
            kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
            dim_per_head=int(getattr(text, "head_dim", None) or text.hidden_size // heads),
            hidden_size=int(text.hidden_size),
            max_position_embeddings=int(getattr(text, "max_position_embeddings", None) or 4096),
            vocab_size=int(text.vocab_size),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            sliding_window=_sliding_window(text),
            hf_config=hf,
        )


def _hf_config(config: dict[str, Any]) -> Any:
    from transformers import CONFIG_MAPPING

    model_type = config["model_type"]
    if not knows(model_type):
        raise ValueError(f"transformers {_transformers_version()} has no causal-LM model for {model_type!r}")
    return CONFIG_MAPPING[model_type].from_dict(dict(config))


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _refuse_unsupported_config(text: Any) -> None:
    _refuse_heterogeneous_layers(text)
    if getattr(text, "attn_logit_softcapping", None) is not None:
        raise ValueError("its attention scores are soft-capped (attn_logit_softcapping), which the paged "
                         "attention of the transformers fallback cannot compute")
    for key in _REFUSED_LOGIT_KEYS:
        if getattr(text, key, None) is not None:
            raise ValueError(f"its logits are transformed after the output head ({key}), which the transformers "
                             f"fallback does not repeat")


def _refuse_heterogeneous_layers(text: Any) -> None:
    """Gemma 4's layers differ in head size and KV heads, and later layers reuse earlier layers' KV:
    the engine's KV cache holds one width for every layer and a cache of its own for each."""
    per_layer = getattr(text, "per_layer_config", None)
    if per_layer is None:
        return
    shapes = {(getattr(per_layer[i], "head_dim", None), getattr(per_layer[i], "num_key_value_heads", None))
              for i in range(text.num_hidden_layers)}
    if len(shapes) > 1:
        raise ValueError(f"its layers differ in head size / KV heads {sorted(shapes)}, which the engine's KV cache "
                         "(one width for every layer) cannot hold")
    if "reuse" in (getattr(text, "kv_sharing_modes", None) or ()):
        raise ValueError("its later layers reuse earlier layers' keys and values (num_kv_shared_layers), which the "
                         "transformers fallback cannot do over the paged cache")


def _sliding_window(text: Any) -> int | None:
    window = getattr(text, "sliding_window", None)
    layer_types = getattr(text, "layer_types", None)
    if not window or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    return int(window)


class Model(nn.Module):
    """Transformers' CausalLM for `args`, its children held as ours; `forward` runs its inner model over a
    step's flat token batch, each attention call going to the step's paged attention."""

    # engine/decode_step.py: no decoder layers of the (x, positions, step) form to compile or capture one
    # by one; the decode step runs `forward` whole, eagerly.
    can_step_layers = False

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        register_attention()
        causal_lm, buffers = _build_causal_lm(args)
        self._causal_lm = [causal_lm]  # a list keeps it out of our children: we hold its children ourselves
        self._buffers_built = buffers  # name -> the value it was built with (rebuild_buffers restores them)
        head = causal_lm.get_output_embeddings()
        self.head_name = next((n for n, m in causal_lm.named_children() if m is head), None)
        for name, child in causal_lm.named_children():
            if not (args.tie_word_embeddings and name == self.head_name):  # a tied head reads the embedding
                self.add_module(name, child)
        self.base_name = causal_lm.base_model_prefix
        args.weight_transforms[:] = _weight_renames(causal_lm)
        _probe(self, args)

    @property
    def inner(self) -> nn.Module:
        """Transformers' inner model (embedding, decoder layers, final norm)."""
        return getattr(self, self.base_name)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: Step) -> torch.Tensor:
        """input_ids, positions: [T] for the whole step's flat token batch -> [T, hidden]."""
        with attending(ctx):
            out = self.inner(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0), use_cache=False)
        return out[0][0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output head, then what transformers' CausalLM forward does to the logits after it."""
        logits = self._head(hidden)
        config = self.args.hf_config.get_text_config()
        if (scale := getattr(config, "logit_scale", None)) is not None:  # Cohere
            logits = logits * scale
        if (scaling := getattr(config, "logits_scaling", None)) is not None:  # Granite
            logits = logits / scaling
        if (cap := getattr(config, "final_logit_softcapping", None)) is not None:  # Gemma 2/3
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        # A rewrite (e.g. the CPU quantization) may add an `lm_head` to a tied model.
        for name in (self.head_name, "lm_head"):
            head = getattr(self, name, None) if name else None
            if head is not None:
                return head(hidden)
        return F.linear(hidden, self._causal_lm[0].get_input_embeddings().weight)

    def rebuild_buffers(self, device: torch.device | str) -> None:
        """Buffers (rotary tables, embedding scales) as transformers built them, on `device` (the loader
        calls this after filling the parameters: the buffers were left on the meta device)."""
        for name, value in self._buffers_built.items():
            owner, _, attr = name.rpartition(".")
            module = self.get_submodule(owner) if owner else self
            module._buffers[attr] = value.to(device)

    @staticmethod
    def sanitize(weights: dict[str, Any], args: ModelArgs) -> dict[str, Any]:
        """Checkpoint keys renamed as transformers renames them when it loads (its conversion mapping),
        less the entries this module does not hold as parameters (a tied head, rotary tables)."""
        from transformers.core_model_loading import apply_renamings

        dropped = ("rotary_emb.inv_freq",)
        kept = {apply_renamings(k, args.weight_transforms): v for k, v in weights.items() if not k.endswith(dropped)}
        if args.tie_word_embeddings:
            kept.pop("lm_head.weight", None)
        return kept


def _build_causal_lm(args: ModelArgs) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """Transformers' CausalLM with its parameters on the meta device and its buffers computed on the
    host; returns it and a copy of those buffers (then moved to meta too, as the loader expects)."""
    from transformers import AutoModelForCausalLM

    with torch.device("cpu"), _parameters_on_meta():
        # Experts (MoE) as plain per-expert matmuls: grouped_mm takes bfloat16 only.
        causal_lm = AutoModelForCausalLM.from_config(args.hf_config, attn_implementation=ATTN_IMPLEMENTATION,
                                                     experts_implementation="eager", dtype=torch.float32)
    buffers = {name: b.clone() for name, b in causal_lm.named_buffers() if not b.is_meta}
    causal_lm.to("meta")
    return causal_lm.eval(), buffers


def _weight_renames(causal_lm: nn.Module) -> list[Any]:
    """Transformers' checkpoint-key renames for this model; ValueError where its conversion mapping also
    converts tensors (MoE experts merged into one tensor), which loading by name cannot do."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    transforms = list(get_model_conversion_mapping(causal_lm))
    converted = [t.source_patterns for t in transforms if not isinstance(t, WeightRenaming)]
    if converted:
        raise ValueError(f"transformers converts its checkpoint tensors when it loads them ({converted[0]}: e.g. "
                         f"experts merged into one tensor), which the fallback does not do")
    return transforms


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered meanwhile goes to the meta device at once (before its module's init
    touches it); buffers are computed for real. (accelerate's `init_empty_weights(include_buffers=False)`.)"""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=False)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


# ---- attention ----

@contextlib.contextmanager
def attending(step: Step) -> Iterator[None]:
    """Attention calls made meanwhile on this thread go to `step`."""
    token = _STEP.set(step)
    try:
        yield
    finally:
        _STEP.reset(token)


def paged_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    sliding_window: int | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Transformers' attention-function signature over our step: query [1, Hq, T, D], key/value
    [1, Hkv, T, D] of the step's new tokens -> ([1, T, Hq, D], no weights).

    The mask transformers would build is not built (our name has no mask function): the step's own
    causal, per-sequence and window masks apply instead."""
    step = _STEP.get()
    if isinstance(step, _ProbeStep):  # the load-time probe also notes what the arguments ask for
        step.note_arguments(module, kwargs)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = step.attend(module.layer_idx, q, k, v, scale=scale, window=sliding_window or None)
    return out.unsqueeze(0), None


def register_attention() -> None:
    """Make `ATTN_IMPLEMENTATION` a name transformers' attention interface knows (idempotent)."""
    from transformers import AttentionInterface

    if ATTN_IMPLEMENTATION not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)


# ---- the load-time probe ----

@dataclass
class _ProbeStep:
    """A step on the meta device that records each attention call and checks `attend` can compute it."""

    args: ModelArgs
    layers: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               scale: float, window: int | None = None) -> torch.Tensor:
        self.layers.append(layer)
        want = (self.args.kv_heads, self.args.dim_per_head)
        for name, t in (("keys", k), ("values", v)):
            if tuple(t.shape[1:]) != want:
                self.problems.append(f"layer {layer}'s {name} are {tuple(t.shape[1:])} heads x dim, not the "
                                     f"{want} the KV cache holds")
        return torch.empty_like(q)

    def note_arguments(self, module: nn.Module, kwargs: dict[str, Any]) -> None:
        """The keyword arguments of an attention call that `attend` cannot honour (soft-capping, sinks, ...)."""
        for name, what in _REFUSED_ATTENTION_KWARGS.items():
            if kwargs.get(name) is not None:
                self.problems.append(f"layer {module.layer_idx} has {what}")
        if getattr(module, "is_causal", True) is False or kwargs.get("is_causal") is False:
            self.problems.append(f"layer {module.layer_idx} is not causal")


def _probe(model: Model, args: ModelArgs) -> None:
    """Run the inner model once on the meta device (no numbers, only shapes) to see every attention call:
    ValueError if one is something `attend` cannot compute or some layer attends otherwise."""
    probe = _ProbeStep(args)
    ids = torch.zeros(1, 2, dtype=torch.long, device="meta")
    try:
        with attending(probe), torch.no_grad(), _nonzero_on_meta():
            model.inner(input_ids=ids, position_ids=torch.zeros_like(ids), use_cache=False)
    except Exception as exc:  # noqa: BLE001 - transformers' code may fail on meta tensors in many ways
        raise ValueError(f"its transformers modeling code could not be checked for the fallback ({exc})") from exc
    expected = list(range(args.num_hidden_layers))
    if sorted(probe.layers) != expected:
        probe.problems.append(f"its attention calls name layers {sorted(probe.layers)}, not each of the "
                              f"{args.num_hidden_layers} layers once (layers without attention are not supported)")
    if probe.problems:
        raise ValueError("the transformers fallback cannot run it: " + "; ".join(probe.problems))


@contextlib.contextmanager
def _nonzero_on_meta() -> Iterator[None]:
    """`nonzero` on the meta device as if every element were non-zero (MoE routing picks its experts so)."""
    import torch.fx.experimental._config as fx_config

    with fx_config.patch(meta_nonzero_assume_all_nonzero=True):
        yield
