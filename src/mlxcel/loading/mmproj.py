"""`--mmproj FILE` (llama-server's flag, `LLAMA_ARG_MMPROJ`; issue 43): llama.cpp's projector GGUF, the
vision tower and projector its converter writes apart from the text GGUF (general.architecture "clip").

The file's `clip.projector_type` names the family; that family module's `attach_mmproj(model, mmproj,
tokenizer)` (for the text models its `MMPROJ_TEXT_MODELS` names, by default its own Model) reads the tower's settings from the `clip.vision.*` keys, maps llama.cpp's tensor names
(`v.blk.N.attn_q`, `mm.input_projection`, ...; tools/mtmd/clip-impl.h) to its own and attaches the
vision side to the loaded text model, which then serves images as a Hugging Face checkpoint's would.
"""

from __future__ import annotations

from pathlib import Path
import torch

from mlxcel.loading.errors import ModelLoadError
from mlxcel.loading.gguf import GGUFFile
from mlxcel.models._vision import PromptTokenizer

# clip.projector_type -> the family module that reads it
PROJECTOR_FAMILIES = {"gemma3": "gemma3", "idefics3": "idefics3", "mlp": "llava"}  # mlp: LLaVA 1.5's


def attach_mmproj(model: torch.nn.Module, path: Path, tokenizer: PromptTokenizer) -> None:
    """Give `model` the vision side in the projector file at `path`; raises ModelLoadError naming the file."""
    import importlib

    try:
        mmproj = GGUFFile(path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"--mmproj {path}: cannot read the GGUF file ({exc})") from exc
    projector = str(mmproj.metadata.get("clip.projector_type") or mmproj.metadata.get("clip.vision.projector_type"))
    family = PROJECTOR_FAMILIES.get(projector)
    if family is None:
        raise ModelLoadError(f"--mmproj {path}: projector type {projector!r} is not supported "
                             f"(supported: {', '.join(PROJECTOR_FAMILIES)})")
    module = importlib.import_module(f"mlxcel.models.{family}")
    if not isinstance(model, getattr(module, "MMPROJ_TEXT_MODELS", (module.Model,))):
        raise ModelLoadError(f"--mmproj {path}: a {projector} projector needs a {family} text model, "
                             f"not {type(model).__module__}")
    try:
        module.attach_mmproj(model, mmproj, tokenizer)
    except (KeyError, ValueError) as exc:
        raise ModelLoadError(f"--mmproj {path}: {exc}") from exc

