"""Lazy weights (A6, `MLXCEL_WEIGHT_MATERIALIZATION=lazy`): map the checkpoint, read each tensor on first use.

The model is built with its parameters on the meta device and a forward pre-hook on every
module that owns parameters; the first call of such a module reads its tensors from the
mapped checkpoint (safetensors `safe_open`, the GGUF reader's numpy memmap), converts them
as the eager path does (GGUF dequantization and layout fixes) and removes the hook. Code that
reads weights outside a forward (the CPU decode rewrite, the compiled decode step) calls
`materialize_all` first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn

from mlxcel.loading.errors import ModelLoadError

Reader = Callable[[str], torch.Tensor]  # HF parameter name -> its tensor, as eager loading gives it


class LazyWeights:
    """The pending parameters of one model and where to read each; attached as `model.lazy_weights`."""

    def __init__(self, model: nn.Module, readers: dict[str, Reader], device: torch.device | str,
                 dtype: torch.dtype) -> None:
        self.readers = readers
        self.device, self.dtype = torch.device(device), dtype
        self._handles: dict[str, torch.utils.hooks.RemovableHandle] = {}
        for prefix, module in model.named_modules():
            if any(True for _ in module.parameters(recurse=False)):
                self._handles[prefix] = module.register_forward_pre_hook(self._hook(prefix))
        self._modules = {prefix: module for prefix, module in model.named_modules() if prefix in self._handles}

    @property
    def num_pending(self) -> int:
        return len(self._handles)

    def _hook(self, prefix: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: object) -> None:
            self.materialize(prefix)
        return hook

    def materialize(self, prefix: str) -> None:
        """Read the direct parameters of the module at `prefix` and drop its hook."""
        handle = self._handles.pop(prefix, None)
        if handle is None:
            return
        handle.remove()
        module = self._modules.pop(prefix)
        for name, param in list(module.named_parameters(recurse=False)):
            full = f"{prefix}.{name}" if prefix else name
            module._parameters[name] = nn.Parameter(self._read(full, param), requires_grad=False)

    def read(self, name: str) -> torch.Tensor:
        """Parameter `name` of a pending module, read and converted but not installed: for code that
        replaces the module (the CPU decode rewrite packs each linear as it reads it)."""
        prefix, _, attr = name.rpartition(".")
        return self._read(name, getattr(self._modules[prefix], attr))

    def forget(self, prefix: str) -> None:
        """The module at `prefix` was replaced: never read it."""
        handle = self._handles.pop(prefix, None)
        if handle is not None:
            handle.remove()
            del self._modules[prefix]

    def _read(self, name: str, param: torch.Tensor) -> torch.Tensor:
        value = self.readers[name](name)
        if tuple(value.shape) != tuple(param.shape):
            raise ModelLoadError(f"{name}: checkpoint shape {tuple(value.shape)} != model {tuple(param.shape)}")
        return value.to(self.device, self.dtype)

    def materialize_all(self) -> None:
        for prefix in list(self._handles):
            self.materialize(prefix)


def materialize_all(model: nn.Module) -> int:
    """Read every pending lazy weight of `model` now; returns how many modules were pending."""
    lazy: LazyWeights | None = getattr(model, "lazy_weights", None)
    if lazy is None or not lazy.num_pending:
        return 0
    count = lazy.num_pending
    lazy.materialize_all()
    return count


def safetensors_readers(model_dir: Path) -> dict[str, Reader]:
    """name -> reader over the folder's *.safetensors files, each opened once (memory-mapped)."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weights found")
    readers: dict[str, Reader] = {}
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt")
        except Exception as exc:  # noqa: BLE001 - safetensors raises several kinds
            raise ModelLoadError(f"{file}: cannot read safetensors weights ({exc})") from exc
        for key in handle.keys():
            readers[key] = _safetensors_reader(handle, key)
    return readers


class SafetensorsReader:
    """One mapped safetensors entry: called, the whole tensor; `rows(start, stop)`, only those rows
    of dimension 0 (a fused projection's part, layers/decoder.split_fused), and `shape` without reading."""

    def __init__(self, handle: object, key: str) -> None:
        self.handle, self.key = handle, key

    def __call__(self, _name: str) -> torch.Tensor:
        return self.handle.get_tensor(self.key)  # type: ignore[attr-defined]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.handle.get_slice(self.key).get_shape())  # type: ignore[attr-defined]

    def rows(self, start: int, stop: int) -> torch.Tensor:
        return self.handle.get_slice(self.key)[start:stop]  # type: ignore[attr-defined]


def _safetensors_reader(handle: object, key: str) -> Reader:
    return SafetensorsReader(handle, key)


def renamed(readers: dict[str, Reader], names: Iterable[tuple[str, str]]) -> dict[str, Reader]:
    """Readers under new names: (old, new) pairs, as a family's `sanitize` renamed the keys."""
    return {new: readers[old] for old, new in names}
