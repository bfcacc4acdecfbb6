"""Recurrent state for the mixers of hybrid models (Gated DeltaNet, Mamba-2, short convolutions, RG-LRU).

An attention layer's memory grows with the sequence (the paged KV cache); a recurrent layer's is
a fixed-size state per sequence: a conv state (the last `kernel - 1` inputs of its causal
convolution) and a recurrent state (the SSM / delta-rule matrix, or the LRU's hidden vector).
This module is the one interface between such a mixer and whoever owns the states (the engine's
state pool, engine/kv/states.py, or a test). It is kept small and stable: other mixers build on it.

1. Sizing. A mixer module declares its per-sequence state with a `StateSpec` attribute
   `state_spec` (and its decoder index `layer_idx`); `state_specs(model)` collects them as
   {layer_idx: spec}. A spec gives two shapes without the batch dimension (either may be `()`:
   no such state, e.g. LFM2 has no recurrent state) and their dtypes (`None`: the model's dtype;
   recurrent states default to float32, as the reference kernels accumulate them).

2. Storage. `StateTensors(specs, num_slots, dtype, device)` holds, per recurrent layer, a conv
   tensor [num_slots, *conv_shape] and a recurrent tensor [num_slots, *recurrent_shape]. Slot 0 is
   the scratch slot: always zero, read by padding rows and fresh sequences, written by padding rows.
   Which sequence owns which slot is the owner's business; a freshly allocated slot is zeroed with
   `StateTensors.clear(slots)` (a new sequence starts from a zero state).

3. A step. The owner describes the step's sequences as a `RecurrentStates`, in the order of the
   step's flat token batch (the same order as `AttentionContext.seqs` / the decode step's rows):
   each sequence's rows `[q_start, q_start + q_len)`, the slot its state is read from and the slot
   its state after the step's last row is written to (usually the same; a speculative verify or a
   prefix-cache resume read one slot and write another). It hangs it on the step's attention
   context as `ctx.states` (`AttentionContext(..., states=...)`, `DecodeAttention.states`); a
   context without it is a plain forward (`states_of(ctx, x)` then treats the rows as one sequence
   starting from zero, and keeps nothing).

4. A mixer's forward, given x [T, hidden] for the step's rows:

       states = states_of(ctx, x)                  # a plain forward: one sequence from zero
       conv0, rec0 = states.read(self.layer_idx)  # [S, *shape] each; None where a plain forward
       ... prefill form over the sequences (`states.to_batch` pads rows to [S, L, ...]; padded
           positions must leave the state unchanged), or the one-token decode form when
           `states.is_decode` (every sequence one row, rows 0..S-1 in order) ...
       states.write(self.layer_idx, conv1, rec1)  # [S, *shape] each; a plain forward keeps nothing

   When `states.token_slots` is set (speculative verify rows), the mixer also writes the state after
   each row t to slot `token_slots[t]` (`write_tokens`), so a rejected draft can be rolled back by
   reading the state of the last accepted position. `causal_conv` and `conv_tail` below are the
   causal depthwise convolution every family's mixer shares.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

SCRATCH_SLOT = 0


@dataclass(frozen=True, slots=True)
class StateSpec:
    """One recurrent layer's per-sequence state: shapes without the batch dimension (`()`: none)."""

    conv_shape: tuple[int, ...] = ()
    recurrent_shape: tuple[int, ...] = ()
    conv_dtype: torch.dtype | None = None  # None: the model's dtype
    recurrent_dtype: torch.dtype | None = torch.float32

    def num_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one sequence's state of this layer, with `dtype` for the fields that follow the model."""
        total = 0
        for shape, own in ((self.conv_shape, self.conv_dtype), (self.recurrent_shape, self.recurrent_dtype)):
            if shape:
                total += _numel(shape) * (own or dtype).itemsize
        return total


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def state_specs(model: torch.nn.Module) -> dict[int, StateSpec]:
    """{decoder layer index: spec} of every recurrent mixer in `model` (empty for a pure attention model)."""
    return {m.layer_idx: m.state_spec for m in model.modules() if isinstance(getattr(m, "state_spec", None), StateSpec)}


def bytes_per_sequence(specs: dict[int, StateSpec], dtype: torch.dtype) -> int:
    """One sequence's state over every recurrent layer (what one state slot costs)."""
    return sum(spec.num_bytes(dtype) for spec in specs.values())


class StateTensors:
    """Every recurrent layer's conv and recurrent state tensors, indexed by slot (slot 0: scratch)."""

    def __init__(self, specs: dict[int, StateSpec], num_slots: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.specs, self.num_slots, self.dtype = dict(specs), num_slots, dtype
        self.device = torch.device(device)
        self.conv: dict[int, torch.Tensor] = {}
        self.recurrent: dict[int, torch.Tensor] = {}
        for layer, spec in self.specs.items():
            if spec.conv_shape:
                self.conv[layer] = torch.zeros(num_slots, *spec.conv_shape, dtype=spec.conv_dtype or dtype,
                                               device=self.device)
            if spec.recurrent_shape:
                self.recurrent[layer] = torch.zeros(num_slots, *spec.recurrent_shape,
                                                    dtype=spec.recurrent_dtype or dtype, device=self.device)

    @property
    def bytes_per_slot(self) -> int:
        return bytes_per_sequence(self.specs, self.dtype)

    def clear(self, slots: torch.Tensor | list[int]) -> None:
        """Zero the states at `slots` (a new sequence starts from zero)."""
        index = torch.as_tensor(slots, dtype=torch.long, device=self.device)
        for tensor in (*self.conv.values(), *self.recurrent.values()):
            tensor.index_fill_(0, index, 0)

    def copy(self, src: torch.Tensor | list[int], dst: torch.Tensor | list[int]) -> None:
        """Copy every layer's states from slots `src` to slots `dst` (snapshots, rollbacks)."""
        src_t = torch.as_tensor(src, dtype=torch.long, device=self.device)
        dst_t = torch.as_tensor(dst, dtype=torch.long, device=self.device)
        for tensor in (*self.conv.values(), *self.recurrent.values()):
            tensor.index_copy_(0, dst_t, tensor.index_select(0, src_t))

    def export(self, slot: int) -> dict[str, torch.Tensor]:
        """One slot's states on the host, by name (`conv.{layer}`, `recurrent.{layer}`): disk and slot files."""
        out = {f"conv.{k}": v[slot].cpu().clone() for k, v in self.conv.items()}
        out.update({f"recurrent.{k}": v[slot].cpu().clone() for k, v in self.recurrent.items()})
        return out

    def load(self, slot: int, saved: dict[str, torch.Tensor]) -> None:
        """Put `export`'s tensors back into `slot`; a name this pool does not hold raises KeyError."""
        for name, value in saved.items():
            kind, layer = name.split(".")
            target = (self.conv if kind == "conv" else self.recurrent)[int(layer)]
            target[slot].copy_(value.to(target.device, target.dtype))


class RecurrentStates:
    """One step's view of the states: the sequences in flat-batch order, where each reads and writes."""

    def __init__(self, store: StateTensors | None, q_starts: list[int], q_lens: list[int],
                 read_slots: list[int] | torch.Tensor, write_slots: list[int] | torch.Tensor, *,
                 token_slots: list[int] | torch.Tensor | None = None, device: torch.device | str | None = None) -> None:
        """`store` None: a plain forward (every sequence starts from zero; `read` gives None, `write` keeps nothing)."""
        self.store = store
        device = self.device = torch.device(device) if device is not None else store.device
        self.q_starts, self.q_lens = list(q_starts), list(q_lens)
        self.num_seqs, self.num_tokens = len(self.q_lens), sum(self.q_lens)
        as_index = lambda xs: torch.as_tensor(xs, dtype=torch.long, device=device)  # noqa: E731
        self.read_slots, self.write_slots = as_index(read_slots), as_index(write_slots)  # [S]
        self.token_slots = as_index(token_slots) if token_slots is not None else None  # [T]
        # Every sequence one row, rows 0..S-1 in order: the one-token decode form applies.
        self.is_decode = all(n == 1 for n in self.q_lens) and self.q_starts == list(range(self.num_seqs))
        self.max_len = max(self.q_lens, default=0)
        self._batch_index: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def decode(cls, store: StateTensors, read_slots: list[int] | torch.Tensor,
               write_slots: list[int] | torch.Tensor) -> RecurrentStates:
        """A decode step over B rows, row b reading slot `read_slots[b]` and writing `write_slots[b]`
        (padding rows: the scratch slot)."""
        n = len(read_slots)
        return cls(store, list(range(n)), [1] * n, read_slots, write_slots)

    @classmethod
    def plain(cls, num_tokens: int, device: torch.device | str) -> RecurrentStates:
        """A plain forward's view: the rows are one sequence from a zero state, nothing kept."""
        return cls(None, [0], [num_tokens], [SCRATCH_SLOT], [SCRATCH_SLOT], device=device)

    def read(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The step's starting states of `layer`: conv [S, *conv_shape] and recurrent [S, *recurrent_shape]."""
        if self.store is None:
            return None, None
        conv, rec = self.store.conv.get(layer), self.store.recurrent.get(layer)
        return (conv.index_select(0, self.read_slots) if conv is not None else None,
                rec.index_select(0, self.read_slots) if rec is not None else None)

    def write(self, layer: int, conv: torch.Tensor | None, recurrent: torch.Tensor | None) -> None:
        """The states after each sequence's last row of this step: [S, *shape] each (None: not held)."""
        if self.store is None:
            return
        for target, value in ((self.store.conv.get(layer), conv), (self.store.recurrent.get(layer), recurrent)):
            if target is not None and value is not None:
                target.index_copy_(0, self.write_slots, value.to(target.dtype))
        self._keep_scratch_zero(layer)

    def write_tokens(self, layer: int, conv: torch.Tensor | None, recurrent: torch.Tensor | None) -> None:
        """The states after every row of the step: [T, *shape] each, to `token_slots` (verify rows)."""
        assert self.token_slots is not None
        for target, value in ((self.store.conv.get(layer), conv), (self.store.recurrent.get(layer), recurrent)):
            if target is not None and value is not None:
                target.index_copy_(0, self.token_slots, value.to(target.dtype))
        self._keep_scratch_zero(layer)

    def _keep_scratch_zero(self, layer: int) -> None:
        # Padding rows write the scratch slot; it must read as zero for the next fresh sequence.
        for target in (self.store.conv.get(layer), self.store.recurrent.get(layer)):
            if target is not None:
                target[SCRATCH_SLOT].zero_()

    # ---- rows <-> a padded [S, L, ...] batch (the prefill form's layout) ----

    def _index(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._batch_index is None:
            device = self.device
            pos = torch.arange(self.max_len, device=device)
            starts = torch.tensor(self.q_starts, dtype=torch.long, device=device)
            lens = torch.tensor(self.q_lens, dtype=torch.long, device=device)
            valid = pos.unsqueeze(0) < lens.unsqueeze(1)  # [S, L]
            rows = torch.where(valid, starts.unsqueeze(1) + pos.unsqueeze(0), 0)
            self._batch_index = (rows, valid)
        return self._batch_index

    @property
    def valid(self) -> torch.Tensor:
        """[S, L] bool: which positions of the padded batch are real rows (right padding)."""
        return self._index()[1]

    @property
    def lengths(self) -> torch.Tensor:
        return self._index()[1].sum(1)

    def to_batch(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, ...] (the step's rows) -> [S, L, ...], padded positions zero."""
        rows, valid = self._index()
        out = x.index_select(0, rows.reshape(-1)).view(*rows.shape, *x.shape[1:])
        return out * valid.view(*valid.shape, *([1] * (x.dim() - 1))).to(out.dtype)

    def from_batch(self, y: torch.Tensor) -> torch.Tensor:
        """y [S, L, ...] -> [T, ...] (the real positions, in row order)."""
        rows, valid = self._index()
        out = y.new_empty(self.num_tokens, *y.shape[2:])
        out[rows[valid]] = y[valid]
        return out


def states_of(ctx: object, x: torch.Tensor) -> RecurrentStates:
    """The step's recurrent states (`ctx.states`), or for a plain forward (none: a context of no
    engine) each of the context's sequences (`ctx.seqs`, else all rows x [T, ...] as one) from zero."""
    states = getattr(ctx, "states", None)
    if states is not None:
        return states
    seqs = getattr(ctx, "seqs", None)
    if not seqs:
        return RecurrentStates.plain(x.shape[0], x.device)
    zeros = [SCRATCH_SLOT] * len(seqs)
    return RecurrentStates(None, [s.q_start for s in seqs], [s.q_len for s in seqs], zeros, zeros, device=x.device)


# ---- the causal depthwise convolution every mixer shares ----

def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor | None,
                valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over a padded batch: x [S, L, C], weight [C, K], state [S, C, K - 1] (the
    inputs before the step; None: zeros) -> (out [S, L, C] before any activation, new state
    [S, C, K - 1]: the last K - 1 real inputs of each sequence, `valid` [S, L] marking them)."""
    s, length, channels = x.shape
    k = weight.shape[-1]
    if state is None:
        state = x.new_zeros(s, channels, k - 1)
    full = torch.cat((state.to(x.dtype), x.transpose(1, 2)), dim=2)  # [S, C, K - 1 + L]
    out = F.conv1d(full, weight.unsqueeze(1).to(x.dtype), bias, groups=channels)  # [S, C, L]
    return out.transpose(1, 2), conv_tail(full, k, valid)


def conv_tail(full: torch.Tensor, k: int, valid: torch.Tensor | None) -> torch.Tensor:
    """The last K - 1 columns of each sequence's [C, K - 1 + L] inputs, ending at its own length."""
    if valid is None or bool(valid.all()):
        return full[:, :, full.shape[2] - (k - 1):].clone()
    lengths = valid.sum(1)  # [S]
    offsets = lengths.unsqueeze(1) + torch.arange(k - 1, device=full.device).unsqueeze(0)  # [S, K - 1]
    return full.gather(2, offsets.unsqueeze(1).expand(-1, full.shape[1], -1))
