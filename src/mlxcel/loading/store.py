"""The model store the web UI manages (A5): list what is there, download a repo into it, delete from it.

The store is `--models-dir` in the Hugging Face cache layout (`models--owner--name/snapshots/SHA`),
which is where `resolve_model` downloads to; plain folders and GGUF files placed there by hand
are listed too. Packaged checkpoints (the embedded SmolLM2, all-minilm-l6-v2) are listed beside
the store and can be loaded but not deleted. Nothing here knows about HTTP.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from mlxcel.loading.errors import ModelLoadError

log = logging.getLogger(__name__)

_HF_PREFIX = "models--"


@dataclass(frozen=True, slots=True)
class StoreEntry:
    """One model the UI can load: `id` is what load takes (a repo id, a path or a packaged name)."""

    id: str
    name: str
    source: str  # store | packaged
    kind: str  # chat | embedding | rerank
    path: str
    size_bytes: int
    family: str | None
    quantization: str | None
    context: int | None
    is_deletable: bool

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class DownloadCancelled(Exception):
    """The job asked to stop between two files."""


def list_store(models_dir: Path | None) -> list[StoreEntry]:
    """Every model under `models_dir` (HF cache repos, plain folders, GGUF files), then the packaged ones."""
    entries: list[StoreEntry] = []
    if models_dir is not None and models_dir.is_dir():
        for child in sorted(models_dir.iterdir()):
            entry = _store_entry(child)
            if entry is not None:
                entries.append(entry)
    return entries + _packaged_entries()


def _store_entry(child: Path) -> StoreEntry | None:
    if child.name.startswith(_HF_PREFIX) and child.is_dir():
        snapshot = _latest_snapshot(child)
        if snapshot is None:
            return None
        repo_id = child.name.removeprefix(_HF_PREFIX).replace("--", "/", 1)
        return _describe(repo_id, repo_id, "store", snapshot, child, is_deletable=True)
    if child.is_file() and child.suffix.lower() == ".gguf":
        return _describe(str(child), child.stem, "store", child, child, is_deletable=True)
    if child.is_dir() and ((child / "config.json").is_file() or any(child.glob("*.gguf"))):
        return _describe(str(child), child.name, "store", child, child, is_deletable=True)
    return None


def _latest_snapshot(repo_dir: Path) -> Path | None:
    snapshots = [p for p in (repo_dir / "snapshots").glob("*") if p.is_dir() and any(p.iterdir())]
    return max(snapshots, key=lambda p: p.stat().st_mtime) if snapshots else None


def _packaged_entries() -> list[StoreEntry]:
    from mlxcel.loading.packaged import PACKAGED_CHECKPOINTS
    from mlxcel.loading.resolve import DEFAULT_MODEL_NAME, default_model_path

    entries = []
    try:
        path = default_model_path()
        entries.append(_describe("", DEFAULT_MODEL_NAME, "packaged", path, path, is_deletable=False))
    except ModelLoadError:
        pass
    for name, checkpoint in PACKAGED_CHECKPOINTS.items():
        import importlib.util

        spec = importlib.util.find_spec(checkpoint.module)
        if spec is not None and spec.submodule_search_locations:
            zipped = Path(next(iter(spec.submodule_search_locations))) / checkpoint.member
            entries.append(StoreEntry(name, name, "packaged", "embedding", str(zipped), _size(zipped),
                                      "bert", None, 256, is_deletable=False))
    return entries


def _describe(entry_id: str, name: str, source: str, model_path: Path, root: Path, *,
              is_deletable: bool) -> StoreEntry:
    facts = _facts(str(model_path), model_path.stat().st_mtime)
    return StoreEntry(entry_id, name, source, facts["kind"], str(model_path), _size(root), facts["family"],
                      facts["quantization"], facts["context"], is_deletable)


@lru_cache(maxsize=256)
def _facts(path_text: str, mtime: float) -> dict[str, Any]:
    """Family, quantization, context and kind, read once per (path, mtime)."""
    path = Path(path_text)
    try:
        gguf_path = path if path.is_file() else next(iter(sorted(path.glob("*.gguf"))), None)
        if gguf_path is not None and not (path / "config.json").is_file():
            return _gguf_facts(gguf_path)
        return _hf_facts(path)
    except Exception as exc:  # noqa: BLE001 - a broken entry is listed with what is known
        log.warning("cannot read %s: %s", path, exc)
        return {"kind": "chat", "family": None, "quantization": None, "context": None}


def _gguf_facts(path: Path) -> dict[str, Any]:
    import gguf

    from mlxcel.loading.gguf import read_header

    value = read_header(path)[0].get
    arch = value("general.architecture")
    file_type = value("general.file_type")
    try:
        quantization = gguf.LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_") if file_type is not None \
            else None
    except ValueError:
        quantization = f"type {file_type}"
    context = value(f"{arch}.context_length") if arch else None
    return {"kind": "chat", "family": arch, "quantization": quantization,
            "context": int(context) if context is not None else None}


def _hf_facts(folder: Path) -> dict[str, Any]:
    from mlxcel.loading.encoder import is_embedding_checkpoint, is_rerank_checkpoint

    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    quant = config.get("quantization") or config.get("quantization_config")
    quantization = f"{quant.get('bits', '?')}-bit" if isinstance(quant, dict) else config.get("torch_dtype")
    kind = "rerank" if is_rerank_checkpoint(folder) else "embedding" if is_embedding_checkpoint(folder) else "chat"
    context = config.get("max_position_embeddings")
    return {"kind": kind, "family": config.get("model_type"), "quantization": quantization,
            "context": int(context) if context else None}


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    # HF cache snapshots are symlinks into blobs/: count each blob once, by its real file.
    seen = {p.resolve() for p in path.rglob("*") if p.is_file()}
    return sum(p.stat().st_size for p in seen)


# ---- download and delete ----

Progress = Callable[[int, int, str], None]  # (bytes done, bytes total, current file)


def download_repo(repo_id: str, models_dir: Path | None, progress: Progress,
                  is_cancelled: Callable[[], bool]) -> Path:
    """Download `repo_id` file by file into the store, reporting bytes after each file; the
    snapshot folder. Raises ModelLoadError (one line) or DownloadCancelled."""
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    from mlxcel.loading.resolve import _REPO_ID, _first_line, _hub_endpoint

    if not _REPO_ID.match(repo_id):
        raise ModelLoadError(f"{repo_id!r} is not a Hugging Face repo id (owner/name)")
    cache_dir = str(models_dir) if models_dir else None
    hub = _hub_endpoint()
    try:
        api = HfApi(endpoint=hub)
        revision = api.model_info(repo_id).sha
        files = [(f.path, int(f.size or 0)) for f in api.list_repo_tree(repo_id, revision=revision, recursive=True)
                 if hasattr(f, "size")]
        total, done = sum(size for _, size in files), 0
        progress(0, total, "")
        for name, size in files:
            if is_cancelled():
                raise DownloadCancelled(repo_id)
            hf_hub_download(repo_id, name, cache_dir=cache_dir, endpoint=hub)  # main: records refs/main
            done += size
            progress(done, total, name)
        return Path(snapshot_download(repo_id, cache_dir=cache_dir, local_files_only=True))
    except RepositoryNotFoundError:
        raise ModelLoadError(f"repository {repo_id} was not found on {hub}") from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise ModelLoadError(f"downloading {repo_id} from {hub} failed ({_first_line(exc)})") from None


def delete_entry(entry: StoreEntry, models_dir: Path | None) -> None:
    """Remove a store entry's files; refuses anything outside the models dir or packaged."""
    if not entry.is_deletable or models_dir is None:
        raise ModelLoadError(f"{entry.name} is not in the store and cannot be deleted")
    root = models_dir.resolve()
    target = Path(entry.path).resolve()
    if entry.id and not Path(entry.id).exists():  # a repo id: its whole models--owner--name folder
        target = root / (_HF_PREFIX + entry.id.replace("/", "--"))
    if root not in target.parents:
        raise ModelLoadError(f"{entry.name}: {target} is outside the models dir {root}")
    if target.is_dir():
        shutil.rmtree(target)
    else:
        target.unlink()
    _facts.cache_clear()
