"""Slot snapshots (F12): save a slot's prompt KV to a file, restore it, erase it.

A slot's cache is the KV of the last sequence it ran. With paged prefix caching that KV
lives in cached blocks; saving writes the still-cached full blocks and their tokens,
restoring writes them back into free blocks and registers them in the prefix cache, so
the next request with that prefix hits. Every function here runs on the engine thread
(through `EngineCore.call`).

KV computed under LoRA adapters (F8) is keyed as the prefix cache keys it: the file records the
scales (and the adapters' folders) it was computed under, and a restore registers the blocks
under those scales, so only a request running under the same scales hits them; a file whose
LoRA KV came from other adapters than the server's is refused. Base-model KV (no adapters, or
every scale 0) restores anywhere and serves requests at scale 0. Likewise a prompt's images
(issue 43): the file records each image run's span and content digest, and a restore keys the
blocks by them (`ImageCacheKeys`), so only the same image with the same text hits them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from mlxcel.engine.kv.prefix import KVCacheManager, hash_prompt_blocks
from mlxcel.engine.kv.states import StatePool
from mlxcel.engine.kv.tensors import KVCache
from mlxcel.engine.scheduler import SlotContent
from mlxcel.layers import kv_quant

_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")
FORMAT_VERSION = 1


class SlotError(ValueError):
    """A slot action that cannot be done (bad id, bad file name, nothing saved); the server answers 400."""


@dataclass(frozen=True, slots=True)
class SlotFileResult:
    slot_id: int
    filename: str
    num_tokens: int
    num_bytes: int
    lora_scales: tuple[float, ...] = ()  # the adapter scales the KV was computed under; () = the base model


def slot_file(save_dir: str | None, filename: str) -> Path:
    if not save_dir:
        raise SlotError("slot save/restore is off: start the server with --slot-save-path DIR")
    if not _SAFE_NAME.match(filename) or ".." in filename:
        raise SlotError(f"invalid slot file name {filename!r}: use letters, digits, '.', '_' and '-'")
    return Path(save_dir) / filename


def save_slot(kv: KVCacheManager, cache: KVCache, content: SlotContent, adapters: tuple[str, ...], slot_id: int,
              path: Path, states: StatePool | None = None) -> SlotFileResult:
    """Write the slot's cached full blocks (tokens, per-layer K/V, the LoRA scales they were computed under)."""
    scales = content.lora_scales if any(content.lora_scales) else ()
    content = SlotContent(content.token_ids, scales, content.image_spans)
    block_ids, num_tokens = kv.find_cached_prefix(content.token_ids + [0], cache_prompt=True,
                                                  extra=content.cache_extra)
    if not block_ids:
        raise SlotError(f"slot {slot_id} has no cached prompt to save")
    slots = torch.tensor([b * cache.block_size + i for b in block_ids for i in range(cache.block_size)])
    payload = {
        "version": FORMAT_VERSION, "block_size": cache.block_size, "tokens": content.token_ids[:num_tokens],
        "element_types": [cache.k_type, cache.v_type],
        "lora_scales": list(scales), "lora_adapters": list(adapters) if scales else [],
        # issue 43: the image runs the saved blocks hold, so a restore keys them by the same images
        "image_spans": [list(span) for span in content.image_spans if span[0] < num_tokens],
        **{name: _rows(tensors, slots) for name, tensors in _cache_tensors(cache).items()},
    }
    if states is not None:  # issue 41: a hybrid model's state snapshots along the saved prefix
        payload["recurrent_states"] = _snapshots_along(states, content.token_ids[:num_tokens], cache.block_size,
                                                       content.cache_extra)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(payload, path)
    return SlotFileResult(slot_id, path.name, num_tokens, path.stat().st_size, scales)


def restore_slot(kv: KVCacheManager, cache: KVCache, slot_id: int, path: Path,
                 adapters: tuple[str, ...], states: StatePool | None = None) -> tuple[SlotFileResult, SlotContent]:
    """Load a snapshot into free blocks and register them in the prefix cache under its LoRA scales."""
    if not path.is_file():
        raise SlotError(f"no saved slot file {path.name!r}")
    payload = torch.load(path, map_location="cpu", weights_only=True)
    _check_layout(payload, cache, path)
    scales = tuple(float(s) for s in payload.get("lora_scales", ()))  # a file from before F8: base-model KV
    _check_adapters(path.name, scales, tuple(payload.get("lora_adapters", ())), adapters)
    tokens: list[int] = payload["tokens"]
    content = SlotContent(tokens, scales, _image_spans(path.name, payload.get("image_spans", []), len(tokens)))
    num_blocks = len(tokens) // cache.block_size
    if not kv.can_allocate(num_blocks):
        raise SlotError("not enough free KV blocks to restore the slot now; try again when idle")
    block_ids = kv.pool.allocate(num_blocks)
    kv.pool.flush_evictions()  # the lower tiers gather what that evicted before it is overwritten
    _write_blocks(cache, block_ids, payload)
    _register(kv, block_ids, tokens, cache.block_size, content.cache_extra)
    if states is not None:
        _restore_snapshots(states, payload.get("recurrent_states", {}), tokens, cache.block_size,
                           content.cache_extra)
    kv.pool.free(list(reversed(block_ids)))  # unused now, but cached until evicted
    result = SlotFileResult(slot_id, path.name, len(tokens), path.stat().st_size, scales)
    return result, content


def _check_layout(payload: dict, cache: KVCache, path: Path) -> None:
    if payload.get("version") != FORMAT_VERSION or payload.get("block_size") != cache.block_size:
        raise SlotError(f"{path.name}: saved with another format or block size")
    saved = {name: [t.shape[1:] for t in payload.get(name, ())] for name in cache.named_tensors() if name[0] == "k"}
    if saved != {name: [t.shape[1:] for t in tensors] for name, tensors in cache.named_tensors().items()
                 if name[0] == "k"}:
        raise SlotError(f"{path.name}: saved from a model with another KV shape")
    saved_types = list(payload.get("element_types", ["dense", "dense"]))  # dense values convert on restore
    running = [cache.k_type, cache.v_type]
    if set(saved_types + running) & set(kv_quant.QUANTIZED_TYPES) and saved_types != running:
        raise SlotError(f"{path.name}: saved with KV cache types {'/'.join(saved_types)}, "
                        f"the server runs {'/'.join(running)}")


def _image_spans(name: str, saved: list, num_tokens: int) -> tuple[tuple[int, int, str], ...]:
    """The file's image runs as ImageCacheKeys spans; a malformed entry refuses the file (a block keyed
    without its image would serve another image's KV)."""
    spans = []
    for span in saved:
        if not (isinstance(span, (list, tuple)) and len(span) == 3 and isinstance(span[0], int)
                and isinstance(span[1], int) and isinstance(span[2], str) and 0 <= span[0] < span[1]
                and span[0] < num_tokens):
            raise SlotError(f"{name}: malformed image_spans entry {span!r}")
        spans.append((span[0], span[1], span[2]))
    return tuple(spans)


def _check_adapters(name: str, scales: tuple[float, ...], saved: tuple[str, ...], running: tuple[str, ...]) -> None:
    """LoRA KV restores only where the same adapters (by id) are loaded: other weights give other KV."""
    if any(scales) and saved != running:
        has = ", ".join(f"{i}: {p}" for i, p in enumerate(running)) or "none"
        raise SlotError(f"{name}: its KV was computed under LoRA adapters {_describe(saved, scales)}, but this "
                        f"server's adapters are {has}; restore it into a server started with the same --lora "
                        "adapters in the same order")


def _describe(adapters: tuple[str, ...], scales: tuple[float, ...]) -> str:
    return ", ".join(f"{i}: {adapters[i] if i < len(adapters) else '?'} at scale {s:g}"
                     for i, s in enumerate(scales) if s)


def _write_blocks(cache: KVCache, block_ids: list[int], payload: dict) -> None:
    slots = torch.tensor([b * cache.block_size + i for b in block_ids for i in range(cache.block_size)])
    for name, tensors in _cache_tensors(cache).items():
        for layer, saved in zip(tensors, payload[name]):
            layer.index_copy_(0, slots.to(layer.device), saved.to(layer))


def _cache_tensors(cache: KVCache) -> dict[str, list[torch.Tensor]]:
    """Every per-layer tensor a slot file holds: values (or codes), and scales where quantized."""
    return cache.named_tensors()


def _rows(tensors: list[torch.Tensor], slots: torch.Tensor) -> list[torch.Tensor]:
    return [layer.index_select(0, slots.to(layer.device)).cpu() for layer in tensors]


def _snapshots_along(states: StatePool, tokens: list[int], block_size: int,
                     extra: object) -> dict[int, dict[str, torch.Tensor]]:
    """{position: the recurrent state after it} for each block boundary of `tokens` with a snapshot."""
    hashes = hash_prompt_blocks(tokens, block_size, extra)
    saved = {(i + 1) * block_size: states.export_snapshot(h) for i, h in enumerate(hashes)}
    return {position: tensors for position, tensors in saved.items() if tensors is not None}


def _restore_snapshots(states: StatePool, saved: dict[int, dict[str, torch.Tensor]], tokens: list[int],
                       block_size: int, extra: object) -> None:
    hashes = hash_prompt_blocks(tokens, block_size, extra)
    for position, tensors in saved.items():
        if 0 < position <= len(hashes) * block_size and position % block_size == 0:
            states.import_snapshot(hashes[position // block_size - 1], tensors)


def _register(kv: KVCacheManager, block_ids: list[int], tokens: list[int], block_size: int, extra: object) -> None:
    for block_id, block_hash in zip(block_ids, hash_prompt_blocks(tokens, block_size, extra)):
        kv.pool.cache_block(block_id, block_hash)


def erase_slot(kv: KVCacheManager, content: SlotContent) -> int:
    """Drop the slot's cached blocks from the prefix cache; returns how many tokens were erased."""
    block_ids, num_tokens = kv.find_cached_prefix(content.token_ids + [0], cache_prompt=True,
                                                  extra=content.cache_extra)
    for block_id in block_ids:
        if kv.pool.blocks[block_id].ref_count == 0:
            kv.pool.uncache_block(block_id)
    return num_tokens
