"""The loaded LoRA adapters' ids, paths and global scales (F8), shared by the API and the server.

Pure Python (no torch): the API layer resolves a request's `lora` field against it into one
scale per adapter (`types.Request.lora_scales`); `POST /lora-adapters` changes the global
scales that requests without a `lora` field get. The weights live in `layers/lora.py`.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class AdapterEntry:
    id: int
    path: str
    scale: float


class LoraRegistry:
    """The loaded adapters and their global scales (GET/POST /lora-adapters), thread-safe."""

    def __init__(self, adapters: Sequence[tuple[str, float]] = ()) -> None:
        """`adapters`: (path, startup scale) in id order."""
        self._lock = threading.Lock()
        self._entries = [AdapterEntry(i, path, float(scale)) for i, (path, scale) in enumerate(adapters)]

    @property
    def num_adapters(self) -> int:
        return len(self._entries)

    def list(self) -> list[dict[str, Any]]:
        with self._lock:
            return [{"id": e.id, "path": e.path, "scale": e.scale} for e in self._entries]

    def global_scales(self) -> tuple[float, ...]:
        with self._lock:
            return tuple(e.scale for e in self._entries)

    def resolve(self, entries: Sequence[tuple[int, float]]) -> tuple[float, ...]:
        """Scales for a `[{id, scale}]` list as llama-server reads it: adapters not named get 0.

        Raises ValueError naming a bad adapter id or scale."""
        scales = [0.0] * len(self._entries)
        for adapter_id, scale in entries:
            if not 0 <= adapter_id < len(self._entries):
                known = f"0..{len(self._entries) - 1}" if self._entries else "none are loaded"
                raise ValueError(f"lora: adapter id {adapter_id} does not exist (adapters: {known})")
            if not math.isfinite(scale):
                raise ValueError(f"lora: adapter id {adapter_id} has a non-finite scale")
            scales[adapter_id] = float(scale)
        return tuple(scales)

    def set_global(self, entries: Sequence[tuple[int, float]]) -> None:
        """POST /lora-adapters: new global scales (validated first; nothing changes on error)."""
        scales = self.resolve(entries)
        with self._lock:
            for entry, scale in zip(self._entries, scales):
                entry.scale = scale
