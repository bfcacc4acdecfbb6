"""The recurrent-state pool of a hybrid model, beside the paged KV blocks (issue 41).

A recurrent layer keeps one conv state and one recurrent state per sequence (layers/recurrent.py);
`StatePool` holds them in one `StateTensors` of slots:

    0                         scratch: always zero; a fresh sequence reads it, padding rows write it
    1 .. S                    live: scheduler slot i's running sequence keeps its state in slot i + 1
    S + 1 .. S + S * W        verify: W = draft_max + 1 per scheduler slot, the state after each row of a
                              verify step (a rejected draft rolls back to the last accepted row's)
    the rest                  snapshots: the state at a block boundary, keyed by that block's chain hash
                              (the prefix cache's), LRU and bounded

Which slot a step reads is decided from what each slot holds (`_holds`: slot -> (request, position)),
never from a flag that could go stale: a sequence reads its live slot when that slot holds its state
at exactly its `num_computed_tokens`, a verify slot when it rolled back to one of those positions, a
snapshot after a prefix-cache hit, and the scratch slot when it starts from zero. A finished, aborted
or preempted sequence's slots are simply not read again (the next holder overwrites them): nothing
can leak, and a preempted sequence recomputes (or resumes from a snapshot) like any other.

`SnapshotPrefixCache` wraps the prefix cache (engine/kv/prefix.py) so that a hit never reaches past
the longest cached prefix whose state has a snapshot: attention layers resume from their cached
blocks and recurrent layers from the snapshot at the same position.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from mlxcel.engine.kv.disk import SIDECAR_SUFFIX
from mlxcel.engine.kv.prefix import KVCacheManager, hash_block_tokens
from mlxcel.layers.recurrent import SCRATCH_SLOT, StateSpec, StateTensors
from mlxcel.types import RecurrentStateStats

log = logging.getLogger(__name__)

STATE_SUFFIX = SIDECAR_SUFFIX  # a snapshot's file (safetensors) beside its block's in the disk tier


class StatePool:
    """Slots of recurrent state for the running sequences, their verify rows and prefix snapshots."""

    def __init__(self, specs: dict[int, StateSpec], *, num_seqs: int, num_snapshots: int, verify_width: int,
                 block_size: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.num_seqs, self.verify_width, self.block_size = num_seqs, verify_width, block_size
        self.first_verify = 1 + num_seqs
        self.first_snapshot = self.first_verify + num_seqs * verify_width
        self.num_snapshots = num_snapshots
        self.tensors = StateTensors(specs, self.first_snapshot + num_snapshots, dtype, device)
        self._holds: dict[int, tuple[str, int]] = {}  # slot -> (request id, positions computed into it)
        self._snapshots: OrderedDict[int, int] = OrderedDict()  # block chain hash -> snapshot slot (LRU order)
        self._free_snapshots = list(range(self.first_snapshot, self.first_snapshot + num_snapshots))
        self._hashes: dict[str, list[int]] = {}  # request -> chain hashes of its full blocks so far
        self._rolling: dict[str, int] = {}  # request -> the key of its latest decode-step snapshot
        self.num_resumed = 0  # sequences that started from a snapshot
        self.folder: Path | None = None  # the disk tier's folder, when there is one (`attach_disk`)
        self.spill: Callable[[int, dict[str, torch.Tensor]], None] | None = None  # the disk tier's, for evictions

    @property
    def bytes_per_slot(self) -> int:
        return self.tensors.bytes_per_slot

    @property
    def num_bytes(self) -> int:
        return self.bytes_per_slot * self.tensors.num_slots

    @property
    def num_snapshots_held(self) -> int:
        return len(self._snapshots)

    def stats(self) -> RecurrentStateStats:
        return RecurrentStateStats(self.bytes_per_slot, self.tensors.num_slots, self.num_bytes, len(self._snapshots),
                                   self.num_snapshots, self.num_resumed)

    def slot_bytes(self) -> int:
        """What one scheduler slot holds: its live slot and its verify slots."""
        return self.bytes_per_slot * (1 + self.verify_width)

    def num_snapshots_of(self, request_id: str) -> int:
        """Snapshots held of `request_id`'s prefix (its whole blocks so far)."""
        return sum(h in self._snapshots for h in self._hashes.get(request_id, ()))

    # ---- which slot a step reads and writes ----

    def live_slot(self, slot_id: int) -> int:
        return 1 + slot_id

    def verify_slots(self, slot_id: int, num_rows: int) -> list[int]:
        first = self.first_verify + slot_id * self.verify_width
        return list(range(first, first + num_rows))

    def read_slot(self, request_id: str, slot_id: int, position: int, token_ids: Seq[int], extra: object) -> int:
        """The slot holding `request_id`'s state after `position` tokens (scratch when `position` is 0)."""
        if position == 0:
            return SCRATCH_SLOT
        live = self.live_slot(slot_id)
        if self._holds.get(live) == (request_id, position):
            return live
        for slot in self.verify_slots(slot_id, self.verify_width):
            if self._holds.get(slot) == (request_id, position):
                return slot
        snapshot = self._snapshot_at(token_ids, position, extra)
        if snapshot is None:
            raise RuntimeError(f"request {request_id}: no recurrent state for its first {position} tokens")
        self.num_resumed += 1
        return snapshot

    def wrote(self, slot: int, request_id: str, position: int) -> None:
        """`slot` now holds `request_id`'s state after `position` tokens."""
        self._holds[slot] = (request_id, position)

    # ---- snapshots at block boundaries ----

    def snapshot(self, request_id: str, slot: int, token_ids: Seq[int], position: int, extra: object, *,
                 is_rolling: bool = False) -> None:
        """Keep a copy of `slot` (the state after `position` tokens, a whole number of blocks) under the
        chain hash of its last block, evicting the least recently used snapshot when full.

        `is_rolling` (decode steps): the request's previous rolling snapshot is dropped, so a long
        generation keeps one (its latest block: what a follow-up turn resumes from), not one per block."""
        if position == 0 or position % self.block_size or self.num_snapshots == 0:
            return
        key = self._hash_at(request_id, token_ids, position, extra)
        if key in self._snapshots:
            self._snapshots.move_to_end(key)
            return
        if is_rolling and (previous := self._rolling.pop(request_id, None)) in self._snapshots:
            self._free_snapshots.append(self._snapshots.pop(previous))
        target = self._free_snapshot_slot()
        self.tensors.copy([slot], [target])
        self._snapshots[key] = target
        if is_rolling:
            self._rolling[request_id] = key

    def _free_snapshot_slot(self) -> int:
        """A free snapshot slot, else the least recently used one's (its snapshot spilled to disk when the disk
        tier is on, so it is found again, and a killed server's successor finds it too)."""
        if self._free_snapshots:
            return self._free_snapshots.pop()
        block_hash, slot = self._snapshots.popitem(last=False)
        if self.spill is not None:
            self.spill(block_hash, self.tensors.export(slot))
        return slot

    def has_snapshot(self, block_hash: int) -> bool:
        """In RAM, or on disk (a previous run's, read back into a snapshot slot now)."""
        if block_hash in self._snapshots:
            return True
        path = self._file(block_hash)
        if path is None or not path.is_file():
            return False
        try:
            saved = load_file(str(path))
            self.import_snapshot(block_hash, saved)
        except Exception as exc:  # noqa: BLE001 - a bad file is dropped, never used
            log.warning("recurrent state snapshot %s cannot be used (%s); deleting it", path.name, exc)
            path.unlink(missing_ok=True)
            return False
        return True

    # ---- the disk tier: snapshots beside the KV block files, so a restarted server resumes ----

    def attach_disk(self, folder: Path) -> None:
        """Keep snapshots as files in `folder` (the disk tier's, named by the model's KV identity)."""
        self.folder = folder

    def _file(self, block_hash: int) -> Path | None:
        return None if self.folder is None else self.folder / f"{block_hash:064x}{STATE_SUFFIX}"

    def save_all(self) -> int:
        """Write every snapshot held to disk (a graceful stop, with the KV blocks); how many were written."""
        if self.folder is None:
            return 0
        written = 0
        for block_hash, slot in self._snapshots.items():
            path = self._file(block_hash)
            assert path is not None
            if path.is_file():
                continue
            temp = path.with_suffix(f".{os.getpid()}.tmp")
            try:
                save_file(self.tensors.export(slot), str(temp))
                temp.replace(path)
            except OSError as exc:
                log.warning("recurrent state snapshots: writing %s failed (%s)", path, exc)
                temp.unlink(missing_ok=True)
                return written
            written += 1
        return written

    def delete_files(self) -> int:
        if self.folder is None or not self.folder.is_dir():
            return 0
        files = list(self.folder.glob(f"*{STATE_SUFFIX}"))
        for path in files:
            path.unlink(missing_ok=True)
        return len(files)

    def _snapshot_at(self, token_ids: Seq[int], position: int, extra: object) -> int | None:
        if position % self.block_size:
            return None
        key = _chain_hash(token_ids, position, self.block_size, extra)
        slot = self._snapshots.get(key)
        if slot is not None:
            self._snapshots.move_to_end(key)
        return slot

    def _hash_at(self, request_id: str, token_ids: Seq[int], position: int, extra: object) -> int:
        """The chain hash of the block ending at `position`, extending the request's hashes as it goes."""
        hashes = self._hashes.setdefault(request_id, [])
        size = self.block_size
        while len(hashes) * size < position:
            start = len(hashes) * size
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, token_ids[start:start + size], extra))
        return hashes[position // size - 1]

    def forget(self, request_id: str) -> None:
        """The request left (finished, aborted, preempted): drop its hashes; its slots are not read again."""
        self._hashes.pop(request_id, None)
        self._rolling.pop(request_id, None)  # its last rolling snapshot stays, as any other
        for slot in [s for s, (rid, _) in self._holds.items() if rid == request_id]:
            del self._holds[slot]

    def reset(self) -> int:
        """Drop every snapshot (a prefix-cache reset), on disk too; returns how many were in RAM."""
        self.delete_files()
        count = len(self._snapshots)
        self._free_snapshots += list(self._snapshots.values())
        self._snapshots.clear()
        return count

    def export_snapshot(self, block_hash: int) -> dict[str, torch.Tensor] | None:
        slot = self._snapshots.get(block_hash)
        return None if slot is None else self.tensors.export(slot)

    def import_snapshot(self, block_hash: int, saved: dict[str, torch.Tensor]) -> None:
        """A snapshot read back from disk or a slot file, under `block_hash`."""
        if block_hash in self._snapshots:
            return
        target = self._free_snapshot_slot()
        self.tensors.load(target, saved)
        self._snapshots[block_hash] = target


def _chain_hash(token_ids: Seq[int], position: int, block_size: int, extra: object) -> int:
    parent: int | None = None
    for start in range(0, position, block_size):
        parent = hash_block_tokens(parent, token_ids[start:start + block_size], extra)
    assert parent is not None
    return parent


class SnapshotPrefixCache:
    """The prefix cache of a hybrid model: `KVCacheManager`'s, its hits cut back to the longest prefix
    whose recurrent state has a snapshot, and each request's pool entries dropped when it frees."""

    def __init__(self, inner: KVCacheManager, pool: StatePool) -> None:
        self.inner, self.states = inner, pool

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def find_cached_prefix(self, token_ids: Seq[int], *, cache_prompt: bool, extra: object = None,
                           include_last_block: bool = False) -> tuple[list[int], int]:
        """The inner cache's hit, cut to whole blocks ending where a snapshot exists, short of the last token.

        NOTE: never the whole prompt (the recurrent layers must see the last token to give its logits)."""
        blocks, _ = self.inner.find_cached_prefix(token_ids, cache_prompt=cache_prompt, extra=extra,
                                                  include_last_block=include_last_block)
        size = self.inner.block_size
        hashes: list[int] = []
        for index in range(min(len(blocks), (len(token_ids) - 1) // size)):
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, token_ids[index * size:(index + 1) * size],
                                            extra))
        best = next((n for n in range(len(hashes), 0, -1) if self.states.has_snapshot(hashes[n - 1])), 0)
        return blocks[:best], best * size

    def free(self, request_id: str, *, num_computed_tokens: int | None = None) -> None:
        self.states.forget(request_id)
        self.inner.free(request_id, num_computed_tokens=num_computed_tokens)

    def reset(self) -> bool:
        self.states.reset()
        return self.inner.reset()
