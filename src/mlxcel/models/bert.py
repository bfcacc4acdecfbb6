"""BERT encoder (HF model_type "bert"): absolute positions, token types, post-norm layers.

`Model` is HF's BertModel and `ModelForSequenceClassification` its
BertForSequenceClassification (cross-encoder rerankers); parameter names equal the
checkpoint's, so a safetensors file loads with `load_state_dict` and no renaming table.
Batches are right-padded; `attention_mask` marks real tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


@dataclass(frozen=True, slots=True)
class ModelArgs:
    """The config.json fields the encoder uses; unknown fields are ignored."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    hidden_act: str = "gelu"
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    position_embedding_type: str = "absolute"
    num_labels: int = 2  # only the classification head reads it

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelArgs:
        known = {f.name for f in fields(cls)}
        values = {key: value for key, value in config.items() if key in known}
        if "id2label" in config:  # transformers 5 writes id2label, not num_labels
            values["num_labels"] = len(config["id2label"])
        args = cls(**values)
        args.validate()
        return args

    def validate(self) -> None:
        if self.position_embedding_type != "absolute":
            raise ValueError(
                f"bert: position_embedding_type {self.position_embedding_type!r} is not supported "
                "(only 'absolute')"
            )
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"bert: hidden_act {self.hidden_act!r} is not supported")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("bert: hidden_size is not a multiple of num_attention_heads")


class Embeddings(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.position_embeddings = nn.Embedding(args.max_position_embeddings, args.hidden_size)
        self.token_type_embeddings = nn.Embedding(args.type_vocab_size, args.hidden_size)
        self.LayerNorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        hidden = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(hidden + self.position_embeddings(positions))


class SelfAttention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.num_heads = args.num_attention_heads
        self.query = nn.Linear(args.hidden_size, args.hidden_size)
        self.key = nn.Linear(args.hidden_size, args.hidden_size)
        self.value = nn.Linear(args.hidden_size, args.hidden_size)

    def forward(self, hidden: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        batch, seq_len, width = hidden.shape
        q, k, v = (self._heads(proj(hidden)) for proj in (self.query, self.key, self.value))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        return out.transpose(1, 2).reshape(batch, seq_len, width)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        # [batch, seq, hidden] -> [batch, heads, seq, head_dim]
        batch, seq_len, width = x.shape
        return x.view(batch, seq_len, self.num_heads, width // self.num_heads).transpose(1, 2)


class DenseAddNorm(nn.Module):
    """LayerNorm(dense(x) + residual): BERT's `attention.output` and `output` blocks (HF names)."""

    def __init__(self, in_features: int, args: ModelArgs) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, args.hidden_size)
        self.LayerNorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.self = SelfAttention(args)
        self.output = DenseAddNorm(args.hidden_size, args)

    def forward(self, hidden: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(hidden, key_mask), hidden)


class Intermediate(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.dense = nn.Linear(args.hidden_size, args.intermediate_size)
        self.activation = _ACTIVATIONS[args.hidden_act]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.activation(self.dense(hidden))


class Layer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.intermediate = Intermediate(args)
        self.output = DenseAddNorm(args.intermediate_size, args)

    def forward(self, hidden: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        attended = self.attention(hidden, key_mask)
        return self.output(self.intermediate(attended), attended)


class Encoder(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.layer = nn.ModuleList(Layer(args) for _ in range(args.num_hidden_layers))

    def forward(self, hidden: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            hidden = layer(hidden, key_mask)
        return hidden


class Pooler(nn.Module):
    """tanh(dense(first token)): what the classification head reads."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.dense = nn.Linear(args.hidden_size, args.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(hidden[:, 0]))


class Model(nn.Module):
    """BertModel: token ids -> last hidden states [batch, seq, hidden]."""

    def __init__(self, args: ModelArgs, add_pooling_layer: bool = True) -> None:
        super().__init__()
        self.args = args
        self.embeddings = Embeddings(args)
        self.encoder = Encoder(args)
        self.pooler = Pooler(args) if add_pooling_layer else None

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        # [batch, 1, 1, seq]: True where a key is a real token; padded keys get no weight.
        key_mask = attention_mask.bool()[:, None, None, :]
        return self.encoder(self.embeddings(input_ids, token_type_ids), key_mask)

    @staticmethod
    def sanitize(state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
        """Encoder weights only: a Bert*For* checkpoint's `bert.` prefix, pretraining heads
        (`cls.*`) and the position_ids buffer are dropped."""
        if any(name.startswith("bert.") for name in state):
            state = {name[5:]: t for name, t in state.items() if name.startswith("bert.")}
        return {name: t for name, t in state.items() if not name.endswith("position_ids")}


class ModelForSequenceClassification(nn.Module):
    """BertForSequenceClassification: logits [batch, num_labels] from the pooled [CLS]."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.bert = Model(args, add_pooling_layer=True)
        self.classifier = nn.Linear(args.hidden_size, args.num_labels)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = self.bert(input_ids, attention_mask, token_type_ids)
        assert self.bert.pooler is not None
        return self.classifier(self.bert.pooler(hidden))

    @staticmethod
    def sanitize(state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
        """The checkpoint without the position_ids buffer."""
        return {name: t for name, t in state.items() if not name.endswith("position_ids")}


def encoder(args: ModelArgs, state: dict[str, torch.Tensor]) -> tuple[Model, dict[str, torch.Tensor]]:
    """The encoder for a checkpoint's `state` (with a pooler when it has one) and the state it loads."""
    weights = Model.sanitize(state, args)
    return Model(args, add_pooling_layer="pooler.dense.weight" in weights), weights


def classifier(
    args: ModelArgs, state: dict[str, torch.Tensor]
) -> tuple[ModelForSequenceClassification, dict[str, torch.Tensor]]:
    """The cross-encoder for a BertForSequenceClassification `state` and the state it loads."""
    return ModelForSequenceClassification(args), ModelForSequenceClassification.sanitize(state, args)
