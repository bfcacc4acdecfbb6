"""What a family's GGUF hooks (`gguf_config`) may read of a GGUF file: loading/gguf.py's
`GGUFFile` satisfies it, so a family module never imports loading/ (loading -> models only)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np


class GGUFTensors(Protocol):
    """A GGUF file's tensor table and dequantizer."""

    @property
    def tensors(self) -> Mapping[str, Any]: ...

    def dequantize(self, name: str) -> np.ndarray: ...
