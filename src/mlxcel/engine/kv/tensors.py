"""The paged KV tensors: keys and values of every layer, indexed by cache slot
(`block_id * block_size + offset`, the block ids of engine/kv/prefix.py).

The engine allocates one `KVCache` and hands it to the attention of each step: the prefill
path's `AttentionContext` reads and writes it through `write` / `read`, and the decode step
gives each layer a `DecodeAttention` over that layer's tensors (`decode_attention`).
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence

import torch

from mlxcel.layers import kv_quant
from mlxcel.layers.attention import DecodeAttention


class KVCache:
    """Key and value tensors for every layer: [(num_blocks + 1) * block_size, num_kv_heads, head_dim].

    The last block belongs to no sequence: the decode step's padding rows and warmup write
    their keys there (from `scratch_slot` on), so they never touch a real sequence's cache.
    Keys and values each have an element type (layers/kv_quant.py): a dense dtype, or codes plus
    one float16 scale per block of 32 (`k_scales` / `v_scales`, None when dense); turbo4 stores
    head vectors turned by `rotation`, which attention applies to the query and undoes on the output.

    `values_are_keys`: the model attends with its keys as its values (MLA's latent, layers/mla.py),
    so only keys are stored: `v` is `k` (and the V element type K's), half the memory a token.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str,
                 v_dtype: torch.dtype | None = None, *, k_type: str | None = None, v_type: str | None = None,
                 values_are_keys: bool = False, layer_shapes: Sequence[tuple[int, int]] | None = None) -> None:
        """`layer_shapes`: (num_kv_heads, head_dim) of each layer where they differ (Gemma 4's global layers);
        None: every layer has `num_kv_heads` x `head_dim`."""
        self.k_type = k_type or _dense_name(dtype)
        self.v_type = self.k_type if values_are_keys else v_type or _dense_name(v_dtype or dtype)
        self.values_are_keys = values_are_keys
        num_slots = (num_blocks + 1) * block_size
        shapes = list(layer_shapes) if layer_shapes is not None else [(num_kv_heads, head_dim)] * num_layers
        self.layer_shapes = shapes
        # The layers of one shape are views of one [layers, num_slots, ...] tensor (all of them, when the shapes
        # agree): evicted blocks of those layers are then gathered with one index_select (engine/kv/evict.py).
        # In the order k, v, k_scales, v_scales (the disk tier's rows follow it); a second shape's tensors are
        # named "k.1", "v.1", ...
        self._stacked: dict[str, torch.Tensor] = {}
        per_layer: dict[str, list[torch.Tensor | None]] = {name: [None] * len(shapes)
                                                            for name in ("k", "v", "k_scales", "v_scales")}
        for group, shape in enumerate(dict.fromkeys(shapes)):
            layers = [i for i, s in enumerate(shapes) if s == shape]
            suffix = f".{group}" if group else ""
            for name, tensor in self._allocate_group(len(layers), num_slots, *shape, device).items():
                self._stacked[name + suffix] = tensor
                for layer, view in zip(layers, tensor.unbind(0)):
                    per_layer[name][layer] = view
        self.k = per_layer["k"]
        self.k_scales = per_layer["k_scales"] if per_layer["k_scales"][0] is not None else None
        # values are keys: `v` is the very same list of tensors (DecodeAttention then writes them once)
        self.v, self.v_scales = self.k, self.k_scales
        if not values_are_keys:
            self.v = per_layer["v"]
            self.v_scales = per_layer["v_scales"] if per_layer["v_scales"][0] is not None else None
        turbo = "turbo4" in (self.k_type, self.v_type)
        self.rotations = {dim: kv_quant.Rotation(dim, device) for _, dim in shapes} if turbo else {}
        self.rotation = self.rotations.get(head_dim) if turbo else None
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.scratch_slot = num_blocks * block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim

    def _allocate_group(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                        device: torch.device | str) -> dict[str, torch.Tensor]:
        tensors: dict[str, torch.Tensor] = {}
        tensors["k"], k_scales = _allocate(self.k_type, num_layers, num_slots, num_kv_heads, head_dim, device)
        v_scales = None
        if not self.values_are_keys:
            tensors["v"], v_scales = _allocate(self.v_type, num_layers, num_slots, num_kv_heads, head_dim, device)
        for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
            if scales is not None:
                tensors[name] = scales
        return tensors

    @property
    def bytes_per_token(self) -> int:
        return sum(kv_quant.bytes_per_token(1, heads, dim, self.k_type, None if self.values_are_keys else self.v_type)
                   for heads, dim in self.layer_shapes)

    def named_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Every per-layer tensor the cache stores, by the names of `stacked_tensors`: values (or codes), and
        scales where quantized (no "v" entries where values are keys)."""
        return {name: list(stacked.unbind(0)) for name, stacked in self._stacked.items()}

    def stacked_tensors(self) -> dict[str, torch.Tensor]:
        """`named_tensors` as one [layers, num_slots, ...] tensor each (the layers are views of it)."""
        return dict(self._stacked)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new keys and values [T, Hkv, D] at cache `slots` [T]."""
        _store(self.k_type, self.k[layer], _side(self.k_scales, layer), slots, self._turned(self.k_type, k))
        if not self.values_are_keys:
            _store(self.v_type, self.v[layer], _side(self.v_scales, layer), slots, self._turned(self.v_type, v))

    def read(self, layer: int, index: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at cache slots `index` (any shape) -> [*index.shape, Hkv, D] in `dtype`
        (turbo4 sides still turned: see `turn_query` / `turn_back_output`)."""
        keys = kv_quant.decode(self.k_type, _rows(self.k[layer], index), _gather(self.k_scales, layer, index), dtype)
        if self.values_are_keys:
            return keys, keys
        values = kv_quant.decode(self.v_type, _rows(self.v[layer], index), _gather(self.v_scales, layer, index), dtype)
        return keys, values

    def turn_query(self, q: torch.Tensor) -> torch.Tensor:
        return self.rotations[q.shape[-1]].turn(q) if self.k_type == "turbo4" else q

    def turn_back_output(self, out: torch.Tensor) -> torch.Tensor:
        return self.rotations[out.shape[-1]].turn_back(out) if self.v_type == "turbo4" else out

    def _turned(self, element: str, x: torch.Tensor) -> torch.Tensor:
        return self.rotations[x.shape[-1]].turn(x) if element == "turbo4" else x

    def decode_attention(self, layer: int, slot_mapping: torch.Tensor, key_slots: torch.Tensor,
                         key_pos: torch.Tensor, q_pos: torch.Tensor) -> DecodeAttention:
        """The decode step's attention over layer `layer`'s tensors (see `DecodeAttention`)."""
        return DecodeAttention(self.k[layer], self.v[layer], slot_mapping, key_slots, key_pos, q_pos,
                               k_scales=_side(self.k_scales, layer), v_scales=_side(self.v_scales, layer),
                               k_type=self.k_type, v_type=self.v_type,
                               rotation=self.rotations.get(self.layer_shapes[layer][1]))


def _dense_name(dtype: torch.dtype) -> str:
    return next(name for name, d in kv_quant.DENSE_TYPES.items() if d == dtype)


def _allocate(element: str, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
              device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor | None]:
    if not kv_quant.supports(element, head_dim):
        raise ValueError(f"KV cache type {element} needs a head size divisible by {kv_quant.QBLOCK}, not {head_dim}")
    shape = (num_slots, num_kv_heads, kv_quant.storage_dim(element, head_dim))
    codes = _zeros(num_layers, shape, kv_quant.storage_dtype(element), device)
    if element in kv_quant.DENSE_TYPES:
        return codes, None
    scale_shape = (num_slots, num_kv_heads, head_dim // kv_quant.QBLOCK)
    return codes, _zeros(num_layers, scale_shape, torch.float16, device)


def _zeros(num_layers: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zeroed [num_layers, *shape] tensor (one `shape` a layer).

    NOTE: on the CPU all layers are views of one anonymous memory map, whose pages the OS zeroes
    on first touch: resident memory then grows with the blocks the pool has handed out (as
    llama-server's does), not with the pool's size. `torch.zeros` writes every page up front.
    """
    if torch.device(device).type != "cpu":
        return torch.zeros((num_layers, *shape), dtype=dtype, device=device)
    count = num_layers * math.prod(shape)
    region = mmap.mmap(-1, max(count * dtype.itemsize, 1))
    flat = torch.frombuffer(region, dtype=dtype, count=count)  # holds a reference to the map
    return flat.view(num_layers, *shape)


def _side(scales: list[torch.Tensor] | None, layer: int) -> torch.Tensor | None:
    return None if scales is None else scales[layer]


def _gather(scales: list[torch.Tensor] | None, layer: int, index: torch.Tensor) -> torch.Tensor | None:
    return None if scales is None else _rows(scales[layer], index)


def _rows(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """tensor[index] (slots of any shape), through index_select: the same values, but on the CPU a
    prefill over 2,000 cached keys gathered them ~4x faster than advanced indexing (issue 25 point 3:
    a partial prefix hit reads every cached key in every layer)."""
    return tensor.index_select(0, index.reshape(-1)).view(*index.shape, *tensor.shape[1:])


def _store(element: str, cache: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor,
           x: torch.Tensor) -> None:
    codes, new_scales = kv_quant.encode(element, x)
    cache.index_copy_(0, slots, codes)
    if scales is not None:
        scales.index_copy_(0, slots, new_scales)
